#!/usr/bin/env python3
"""Planner decoding benchmark, baselines and ours in ONE run, JSON + Markdown table.

Sections (each isolated: a failure is recorded in the JSON and the run goes on):
  hf_eager    HF transformers Qwen2ForCausalLM (same decoder shape as our config, random init)
              generate() greedy with the default dynamic cache, text-only prompt of the same
              length as ours (image tokens + prompt tokens).
  hf_static   the same with cache_implementation="static" (auto-compiled decode on CUDA).
  engine_eager / engine_graph   our DecodeEngine (kvmodel.py) without / with the CUDA-graph
              decode step (on CPU both are eager: no graphs there): one request = one
              448x448 uint8 image + 64 prompt tokens.
  engine_graph_c4 / _c16        4 / 16 concurrent requests (continuous batching).
  engine_prefix               TTFT with a 48-token system prefix cached + 16 task tokens.
  speculative                 SpeculativeDecoder (eager), draft = the target's first
              --draft-layers layers (shared embeddings/vision: a self-speculative draft).
  engine_graph_compiled       (--compile) + torch.compile'd layer pieces (kvmodel.py), captured
              in the CUDA graph; with --compile the c4/c16 runs use it too.
TTFT: submit -> first token on the host (vision encode, prefill, sampling, sync). TPOT: median
interval between consecutive tokens of one stream. tok/s: 1 / TPOT for one stream; for N
streams, tokens decoded after the last first-token / that time span. Greedy, no <eos>.

  # H200 (bf16, the 0.5b config):
  python scripts/bench_planner.py --config 0.5b --device cuda --out docs/benchmarks/planner_h200
  # CPU (tiny config, fp32):
  python scripts/bench_planner.py --config tiny --device cpu --new-tokens 48 \
      --out docs/benchmarks/planner_cpu
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "models"))

from kestrel_models.planner import VisionLanguageModel, get_config  # noqa: E402
from kestrel_models.planner.engine import DecodeEngine  # noqa: E402
from kestrel_models.planner.speculative import SpeculativeDecoder  # noqa: E402

NO_EOS = -1  # never sampled: every request decodes exactly new_tokens tokens


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def peak_mb(dev: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**20 if dev.type == "cuda" else None


def reset_peak(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()


# ---- HF baselines -------------------------------------------------------------------------
def hf_model(cfg, dev: torch.device, dtype: torch.dtype):  # noqa: ANN001, ANN201
    from transformers import Qwen2Config, Qwen2ForCausalLM
    hcfg = Qwen2Config(hidden_size=cfg.dim, intermediate_size=cfg.ffn_hidden,
                       num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
                       num_key_value_heads=cfg.n_kv_heads, vocab_size=cfg.vocab_size,
                       max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps,
                       rope_theta=cfg.rope_theta, tie_word_embeddings=True)
    hcfg._attn_implementation = "sdpa"
    with torch.device(dev):
        m = Qwen2ForCausalLM(hcfg)
    return m.to(dtype).eval()


class _Stamps:
    """transformers streamer: host time of every generated token (after a device sync)."""

    def __init__(self, dev: torch.device) -> None:
        self.dev, self.t, self.first = dev, [], True

    def put(self, value: torch.Tensor) -> None:
        if self.first:  # the prompt
            self.first = False
            return
        sync(self.dev)
        self.t.append(time.perf_counter())

    def end(self) -> None:
        pass


def bench_hf(model, prompt_len: int, new_tokens: int, static: bool, reps: int,  # noqa: ANN001
             dev: torch.device) -> dict:
    ids = torch.randint(0, 256, (1, prompt_len), device=dev)
    kw = dict(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
              pad_token_id=0, attention_mask=torch.ones_like(ids))
    if static:
        kw["cache_implementation"] = "static"
    t0 = time.perf_counter()
    for _ in range(2):  # warm-up (compiles the static-cache decode on CUDA)
        model.generate(ids, **kw)
    warm = time.perf_counter() - t0
    reset_peak(dev)
    ttft, tpot = [], []
    for _ in range(reps):
        st = _Stamps(dev)
        sync(dev)
        t0 = time.perf_counter()
        model.generate(ids, streamer=st, **kw)
        ttft.append(st.t[0] - t0)
        tpot.append(statistics.median(b - a for a, b in zip(st.t, st.t[1:], strict=False)))
    med = statistics.median(tpot)
    return dict(ttft_ms=1e3 * statistics.median(ttft), tpot_ms=1e3 * med, tok_s=1.0 / med,
                warmup_s=warm, peak_mb=peak_mb(dev), prompt_len=prompt_len)


# ---- ours ---------------------------------------------------------------------------------
def run_streams(eng: DecodeEngine, n: int, prompt: list[int], image: torch.Tensor,
                new_tokens: int) -> dict:
    stamps: list[list[float]] = [[] for _ in range(n)]
    reqs = []
    for i in range(n):
        reqs.append(eng.submit(prompt, new_tokens, image,
                               on_token=lambda _t, i=i: stamps[i].append(time.perf_counter())))
    eng.run()
    first = max(s[0] for s in stamps)
    last = max(s[-1] for s in stamps)
    after = sum(sum(1 for t in s if t > first) for s in stamps)
    gaps = [b - a for s in stamps for a, b in zip(s, s[1:], strict=False)]
    return dict(ttft_ms=[1e3 * r.ttft_s for r in reqs], tpot_ms=1e3 * statistics.median(gaps),
                agg_tok_s=after / (last - first) if last > first else None)


def bench_engine(model, n: int, prompt: list[int], image: torch.Tensor,  # noqa: ANN001
                 new_tokens: int, reps: int, dev: torch.device, graph: bool,
                 compile: bool = False, prefix: list[int] | None = None) -> dict:
    t0 = time.perf_counter()
    eng = DecodeEngine(model, max_batch=max(n, 1), max_len=args.max_len, eos_id=NO_EOS,
                       cuda_graph=graph, compile=compile, system_prefix=prefix or ())
    run_streams(eng, n, prompt, image, new_tokens)  # warm-up: captures the graphs used
    warm = time.perf_counter() - t0
    reset_peak(dev)
    runs = [run_streams(eng, n, prompt, image, new_tokens) for _ in range(reps)]
    tpot = statistics.median(r["tpot_ms"] for r in runs)
    ttfts = sorted(t for r in runs for t in r["ttft_ms"])
    out = dict(streams=n, ttft_ms=statistics.median(ttfts), ttft_ms_max=ttfts[-1],
               tpot_ms=tpot, tok_s=1e3 / tpot, warmup_s=warm, peak_mb=peak_mb(dev),
               graphs=len(eng._graphs), cuda_graph=eng.cuda_graph, compile=compile)
    if n > 1:
        out["agg_tok_s"] = statistics.median(r["agg_tok_s"] for r in runs)
    return out


def bench_spec(model, draft_layers: int, k: int, prompt: list[int],  # noqa: ANN001
               image: torch.Tensor, new_tokens: int, reps: int, dev: torch.device) -> dict:
    cfg = model.cfg.with_overrides(n_layers=draft_layers)
    with torch.device("meta"):
        draft = VisionLanguageModel(cfg)
    state = {k2: v for k2, v in model.state_dict().items()
             if not k2.startswith("layers.") or int(k2.split(".")[1]) < draft_layers}
    draft.load_state_dict(state, assign=True)  # shares the target's tensors (no copy)
    draft.rope_cos, draft.rope_sin = model.rope_cos, model.rope_sin
    if cfg.tie_embeddings:
        draft.lm_head.weight = draft.tok_emb.weight
    spec = SpeculativeDecoder(model, draft.eval(), k, 1, args.max_len, NO_EOS)
    spec.generate([prompt], new_tokens, images=[image])
    reset_peak(dev)
    tps, rates, rounds, ttft = [], [], [], []
    for _ in range(reps):
        sync(dev)
        r = spec.generate([prompt], new_tokens, images=[image])
        tps.append((len(r.tokens[0]) - 1) / (r.total_s - r.ttft_s))
        rates.append(r.acceptance_rate)
        rounds.append(r.rounds)
        ttft.append(r.ttft_s * 1e3)
    return dict(k=k, draft_layers=draft_layers, tok_s=statistics.median(tps),
                acceptance_rate=statistics.median(rates),
                tokens_per_round=new_tokens / statistics.median(rounds),
                ttft_ms=statistics.median(ttft), peak_mb=peak_mb(dev))


def machine(dev: torch.device) -> dict:
    info = dict(python=platform.python_version(), torch=torch.__version__,
                cpu=platform.processor() or platform.machine(), threads=torch.get_num_threads())
    try:
        import transformers
        info["transformers"] = transformers.__version__
    except ImportError:
        info["transformers"] = None
    if dev.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    return info


def git_commit() -> str:
    if args.git_commit:
        return args.git_commit
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=ROOT,
                                       text=True, stderr=subprocess.DEVNULL).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def table(res: dict) -> str:
    rows = ["| variant | streams | TTFT ms | TPOT ms | tok/s (1 stream) | agg tok/s | "
            "peak MB | notes |", "|---|---|---|---|---|---|---|---|"]

    def f(v: object, nd: int = 2) -> str:
        return "-" if v is None else (f"{v:.{nd}f}" if isinstance(v, float) else str(v))

    for name, r in res["results"].items():
        if "error" in r:
            rows.append(f"| {name} | - | - | - | - | - | - | ERROR: {r['error'][:80]} |")
            continue
        note = ""
        if "acceptance_rate" in r:
            note = (f"accept {r['acceptance_rate']:.2f}, {r['tokens_per_round']:.2f} tok/round,"
                    f" k={r['k']}, draft {r['draft_layers']} layers")
        elif "warmup_s" in r:
            note = f"warm-up {r['warmup_s']:.1f} s"
            if "cuda_graph" in r:
                note += (f", CUDA graph {'on' if r['cuda_graph'] else 'off (eager)'}"
                         f"{', compiled' if r['compile'] else ''}")
        rows.append(f"| {name} | {r.get('streams', 1)} | {f(r.get('ttft_ms'))} | "
                    f"{f(r.get('tpot_ms'), 3)} | {f(r.get('tok_s'), 1)} | "
                    f"{f(r.get('agg_tok_s'), 1)} | {f(r.get('peak_mb'), 0)} | {note} |")
    return "\n".join(rows)


def main() -> None:
    dev = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    if dev.type == "cpu":
        torch.set_num_threads(args.threads)
    cfg = get_config(args.config)
    torch.manual_seed(0)
    with torch.device(dev):
        model = VisionLanguageModel(cfg)
    model = model.to(dtype).eval()
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 256, (args.prompt_tokens,), generator=g).tolist()
    image = torch.randint(0, 256, (3, args.image_hw, args.image_hw), dtype=torch.uint8,
                          generator=g).to(dev)
    seq_len = cfg.num_image_tokens + args.prompt_tokens
    res = dict(command=" ".join(sys.argv), git_commit=git_commit(), machine=machine(dev),
               config=args.config, dtype=args.dtype, params=model.num_params(),
               image_hw=args.image_hw, image_tokens=cfg.num_image_tokens,
               prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens,
               reps=args.reps, results={})
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def section(name: str, fn) -> None:  # noqa: ANN001
        if args.only and name not in args.only:
            return
        t0 = time.perf_counter()
        try:
            res["results"][name] = fn()
        except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
            traceback.print_exc()
            res["results"][name] = dict(error=f"{type(exc).__name__}: {exc}")
        res["results"][name]["section_s"] = round(time.perf_counter() - t0, 2)
        print(f"[bench] {name}: {res['results'][name]}", flush=True)
        out.with_suffix(".json").write_text(json.dumps(res, indent=1))

    nt, reps = args.new_tokens, args.reps
    section("engine_eager", lambda: bench_engine(model, 1, prompt, image, nt, reps, dev, False))
    graph = dev.type == "cuda"
    section("engine_graph", lambda: bench_engine(model, 1, prompt, image, nt, reps, dev, graph))
    cc = args.compile
    if cc:
        torch._dynamo.config.cache_size_limit = 64
        section("engine_graph_compiled", lambda: bench_engine(model, 1, prompt, image, nt, reps,
                                                              dev, graph, compile=True))
    section("engine_graph_c4", lambda: bench_engine(model, 4, prompt, image, nt, reps, dev,
                                                    graph, compile=cc))
    section("engine_graph_c16", lambda: bench_engine(model, 16, prompt, image, nt, reps, dev,
                                                     graph, compile=cc))
    sys_prefix = prompt[:48]
    section("engine_prefix", lambda: bench_engine(model, 1, prompt[48:], image, 8, reps, dev,
                                                  graph, prefix=sys_prefix))
    section("speculative", lambda: bench_spec(model, args.draft_layers, args.k, prompt, image,
                                              nt, reps, dev))
    hf = {}

    def hf_section(static: bool) -> dict:
        if "m" not in hf:
            hf["m"] = hf_model(cfg, dev, dtype)
        return bench_hf(hf["m"], seq_len, nt, static, reps, dev)

    section("hf_eager", lambda: hf_section(False))
    section("hf_static", lambda: hf_section(True))
    hf.clear()
    r = res["results"]
    ours = max((r.get(n, {}).get("tok_s") or 0) for n in ("engine_graph",
                                                         "engine_graph_compiled")) or None
    hs = r.get("hf_static", {}).get("tok_s")
    if ours and hs:
        res["speedup_vs_hf_static"] = ours / hs
    spec = r.get("speculative", {}).get("tok_s")
    if spec and r.get("engine_eager", {}).get("tok_s"):
        res["spec_speedup_vs_engine_eager"] = spec / r["engine_eager"]["tok_s"]
        if ours:
            res["spec_speedup_vs_engine_graph"] = spec / ours
    md = table(res)
    summary = {k: v for k, v in res.items() if k.startswith(("speedup", "spec_speedup"))}
    text = (f"# Planner decoding benchmark ({args.config}, {args.dtype}, {args.device})\n\n"
            f"Command: `{res['command']}`  \ncommit {res['git_commit']}, machine "
            f"{json.dumps(res['machine'])}  \nparams {res['params']:,}; one request = "
            f"{args.image_hw}x{args.image_hw} image ({cfg.num_image_tokens} image tokens) + "
            f"{args.prompt_tokens} prompt tokens, {nt} new tokens, greedy; HF prompt = "
            f"{seq_len} text tokens.\n\n{md}\n\n{json.dumps(summary)}\n")
    out.with_suffix(".json").write_text(json.dumps(res, indent=1))
    out.with_suffix(".md").write_text(text)
    print(text)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="tiny", choices=["tiny", "0.5b"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, choices=["bf16", "fp32"])
    ap.add_argument("--image-hw", type=int, default=448)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--draft-layers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--only", nargs="*", default=None, help="run only these sections")
    ap.add_argument("--git-commit", default="")
    ap.add_argument("--out", default="docs/benchmarks/planner_cpu")
    args = ap.parse_args()
    if args.dtype is None:
        args.dtype = "bf16" if args.device.startswith("cuda") else "fp32"
    main()
