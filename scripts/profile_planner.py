#!/usr/bin/env python3
"""Where the planner's time goes: torch.profiler over one request (image + prompt, N tokens)
through DecodeEngine in eager mode (so every op is visible; the CUDA-graph replay runs the
same kernels), split into labelled ranges: vision encode, prefill (text+image decoder pass),
decode steps, and inside them attention and sampling. Prints a table of device (or CPU) time
per range and the top kernels; writes JSON.

  python scripts/profile_planner.py --config 0.5b --device cuda \
      --out docs/benchmarks/planner_profile_h200
  python scripts/profile_planner.py --config tiny --device cpu --out /tmp/planner_profile
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "models"))

from kestrel_models.planner import VisionLanguageModel, get_config  # noqa: E402
from kestrel_models.planner import engine as engine_mod  # noqa: E402
from kestrel_models.planner import kvmodel as kv_mod  # noqa: E402

LABELS = ["vision_encode", "prefill", "decode", "attention", "sampling"]


def labelled(name: str, fn):  # noqa: ANN001, ANN201
    @functools.wraps(fn)
    def wrap(*a, **k):  # noqa: ANN002, ANN003, ANN202
        with record_function(name):
            return fn(*a, **k)
    return wrap


def main() -> None:
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(dev):
        model = VisionLanguageModel(get_config(args.config))
    model = model.to(dtype).eval()
    # Label the pieces (module-level names are looked up at call time).
    kv_mod._attn_grouped = labelled("attention", kv_mod._attn_grouped)
    engine_mod.sample_on_device = labelled("sampling", engine_mod.sample_on_device)
    engine_mod.greedy_pick = labelled("sampling", engine_mod.greedy_pick)
    kv_mod.KVModel.embed_image = labelled("vision_encode", kv_mod.KVModel.embed_image)
    eng = engine_mod.DecodeEngine(model, 1, 1024, eos_id=-1, cuda_graph=False,
                                  prefill_graph=False)
    eng._prefill_body = labelled("prefill", eng._prefill_body)  # includes vision_encode
    body = eng._body
    eng._body = labelled("decode", body)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 256, (64,), generator=g).tolist()
    image = torch.randint(0, 256, (3, 448, 448), dtype=torch.uint8, generator=g).to(dev)
    for _ in range(2):  # warm-up
        eng.submit(prompt, args.new_tokens, image)
        eng.run()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        eng.submit(prompt, args.new_tokens, image)
        eng.run()
        if dev.type == "cuda":
            torch.cuda.synchronize()
    ev = prof.key_averages()
    key = "device_time_total" if dev.type == "cuda" else "cpu_time_total"
    by = {e.key: e for e in ev}
    res = {n: getattr(by[n], key) / 1e3 if n in by else None for n in LABELS}  # ms
    res["decode_steps"] = by["decode"].count if "decode" in by else 0
    if res.get("decode") and res.get("attention") is not None:
        res["attention_share_of_decode"] = res["attention"] / (res["decode"] + 1e-9)
    if res.get("decode") and res.get("sampling") is not None:
        res["sampling_share_of_decode"] = res["sampling"] / (res["decode"] + 1e-9)
    try:
        top = ev.table(sort_by="self_device_time_total" if dev.type == "cuda"
                       else "self_cpu_time_total", row_limit=15)
    except Exception as exc:  # noqa: BLE001 - the ranges above are the result; this is extra
        top = f"(no kernel table: {exc})"
    out = dict(config=args.config, device=args.device, time_kind=key,
               new_tokens=args.new_tokens, ranges_ms=res, torch=torch.__version__)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).with_suffix(".json").write_text(json.dumps(out, indent=1))
    lines = [f"| range | {key} ms |", "|---|---|"] + [
        f"| {n} | {res[n]:.3f} |" if isinstance(res[n], float) else f"| {n} | {res[n]} |"
        for n in res]
    md = "\n".join(lines)
    Path(args.out).with_suffix(".md").write_text(
        f"# Planner profile ({args.config}, {args.device}, eager engine)\n\n{md}\n\n"
        f"```\n{top}\n```\n")
    print(md)
    print(top)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="tiny", choices=["tiny", "0.5b"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--out", default="/tmp/planner_profile")
    args = ap.parse_args()
    main()
