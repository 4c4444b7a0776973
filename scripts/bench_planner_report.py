"""Reporting of scripts/bench_planner.py: the Markdown table, the headline ratios (best engine
row vs HF static, speculative speed-ups; per device call for merged files), the JSON + .md
writer and the merge of a second device call's rows. No torch: also used by `--render`."""

from __future__ import annotations

import json
from pathlib import Path


def table(res: dict) -> str:
    rows = ["| variant | streams | TTFT ms | TPOT ms | tok/s (1 stream) | agg tok/s | "
            "peak MB | notes |", "|---|---|---|---|---|---|---|---|"]

    def f(v: object, nd: int = 2) -> str:
        return "-" if v is None else (f"{v:.{nd}f}" if isinstance(v, float) else str(v))

    for name, r in res["results"].items():
        if "error" in r:
            rows.append(f"| {name} | - | - | - | - | - | - | ERROR: {r['error'][:80]} |")
            continue
        tag = f"[call {r['call']}] " if "call" in r else ""
        if "skipped" in r:
            rows.append(f"| {name} | - | - | - | - | - | - | {tag}not run: {r['skipped']} |")
            continue
        note = ""
        if r.get("distinct_tokens") is not None and name == "engine_eager":
            note = f"{r['distinct_tokens']} distinct tokens in the greedy text; "
        if "kernels_per_step" in r:
            top = r["top"][0]["name"] if r.get("top") else "-"
            rows.append(f"| {name} | - | - | {r['gpu_us_per_step'] / 1e3:.3f} (GPU) | - | - | - |"
                        f" {tag}{r['kernels_per_step']:.0f} kernels/step; top: {top[:40]} |")
            continue
        if "acceptance_rate" in r:
            note = (f"accept {r['acceptance_rate']:.2f}, {r['tokens_per_round']:.2f} tok/round,"
                    f" k={r['k']}, draft {r['draft_layers']} layers"
                    f"{' (agreeing target: ceiling)' if r.get('agree_target') else ''}"
                    f", graph {'on' if r.get('cuda_graph') else 'off'}")
        elif "warmup_s" in r:
            note += f"warm-up {r['warmup_s']:.1f} s"
            if "cuda_graph" in r:
                note += (f", CUDA graph {'on' if r['cuda_graph'] else 'off (eager)'}"
                         f"{', compiled step' if r['compile'] else ''}")
                if r.get("steps_per_replay", 1) > 1:
                    note += f", {r['steps_per_replay']} steps/replay"
                if r.get("attention", "dense") != "dense":
                    note += f", {r['attention']}"
                if r.get("options"):
                    note += ", " + " ".join(f"{k}={o}" for k, o in r["options"].items())
                if r.get("agree_vs_eager") is not None and r["cuda_graph"] is not None:
                    note += (f", tokens = {r.get('agree_ref', 'eager dense')}: "
                             f"{r['agree_vs_eager']:.2f}"
                             f" (first diff {r.get('first_diff')})")
        rows.append(f"| {name} | {r.get('streams', 1)} | {f(r.get('ttft_ms'))} | "
                    f"{f(r.get('tpot_ms'), 3)} | {f(r.get('tok_s'), 1)} | "
                    f"{f(r.get('agg_tok_s'), 1)} | {f(r.get('peak_mb'), 0)} | {tag}{note} |")
    return "\n".join(rows)


def summarize(res: dict, per_call: bool = True) -> None:
    """Adds the headline ratios to res (best single-stream engine row vs HF static, spec);
    for a merged JSON also per call (each call's engine rows against its own HF static)."""
    calls = sorted({v["call"] for v in res["results"].values() if "call" in v})
    for c in calls if per_call else ():
        sub = {n.split("@")[0]: v for n, v in res["results"].items() if v.get("call") == c}
        part: dict = {"results": sub}
        summarize(part, per_call=False)
        res[f"call{c}"] = {k: part[k] for k in part if k != "results"}
    if calls and per_call:  # merged: ratios only within a call (no cross-call ratios)
        for k in [k for k in res if "speedup" in k or k.startswith("best")]:
            del res[k]
        return
    r = res["results"]
    single = {n: v for n, v in r.items() if n.startswith(("engine_graph", "engine_step"))
              and v.get("streams") == 1 and v.get("attention", "dense") == "dense"}
    best = max(single, key=lambda n: single[n].get("tok_s") or 0, default=None)
    ours = single[best].get("tok_s") if best else None
    res["best_single_stream"], res["best_single_stream_tok_s"] = best, ours
    hs = r.get("hf_static", {}).get("tok_s")
    if ours and hs:
        res["speedup_vs_hf_static"] = ours / hs
    for base in ("engine_graph", best):
        plain = r.get(base, {}).get("tok_s") if base else None
        for name in ("spec_graph_random", "spec_graph_agree"):
            spec = r.get(name, {}).get("tok_s")
            if spec and plain:
                res[f"{name}_speedup_vs_{base}"] = spec / plain


def write(res: dict, out: Path) -> None:
    """JSON + Markdown table (also used by --render to redo the files from a JSON)."""
    summarize(res)
    md = table(res)
    summary = {k: v for k, v in res.items()
               if "speedup" in k or k.startswith("best") or k[4:].isdigit() and k[:4] == "call"}
    hw = res["image_hw"]
    text = (f"# Planner decoding benchmark ({res['config']}, {res['dtype']}, "
            f"{res['machine'].get('gpu', 'cpu')})\n\n"
            + (f"Rows of {len(res['calls'])} device calls, tagged [call N] (commands below).  \n"
               if res.get("calls") else
               f"Command: `{res['command']}`  \ncommit {res['git_commit']}, machine "
               f"{json.dumps(res['machine'])}  \n")
            + f"params {res['params']:,}; one request = "
            f"{hw}x{hw} image ({res['image_tokens']} image tokens) + "
            f"{res['prompt_tokens']} prompt tokens, {res['new_tokens']} new tokens, greedy; HF "
            f"prompt = {res['image_tokens'] + res['prompt_tokens']} text tokens.\n\n{md}\n\n"
            f"{json.dumps(summary)}\n")
    for c, meta in res.get("calls", {}).items():
        text += (f"\nCall {c}: `{meta['command']}`  \ncommit {meta['git_commit']}, machine "
                 f"{json.dumps(meta['machine'])}\n")
    out.with_suffix(".json").write_text(json.dumps(res, indent=1))
    out.with_suffix(".md").write_text(text)
    print(text)


def merge(base: dict, new: dict) -> None:
    """In place: base's rows are tagged call 1 (if untagged), new's rows call N+1; a new row
    whose name exists already is stored as 'name@callN'. Both calls' metadata kept."""
    calls = base.setdefault("calls", {})
    if not calls:
        calls["1"] = {k: base[k] for k in ("command", "git_commit", "machine")}
        for v in base["results"].values():
            v.setdefault("call", 1)
    c = max(int(k) for k in calls) + 1
    calls[str(c)] = {k: new[k] for k in ("command", "git_commit", "machine")}
    for name, v in new["results"].items():
        v["call"] = c
        base["results"][name if name not in base["results"] else f"{name}@call{c}"] = v
