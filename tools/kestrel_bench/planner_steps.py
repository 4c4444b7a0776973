"""`kestrel_bench planner-steps`: the engine's one-token decode step per kernel option, at the
planner-hf shapes (random weights, nothing downloaded), in one run.

Each row is one DecodeEngine configuration on the same decoder: the compiled step captured as
a CUDA graph (batch 1), replayed with the row at position image + prompt + 64 of the
planner-hf request (one 448x448 image, 64 prompt tokens). latency_ms: one replay each, timed
by CUDA events (GPU time of the step, no host work), after --warmup replays. Options:
  fused                   decode_attention 'triton_fused' (one program per row and kv head),
                          mlp 'triton_down' (split-K w_down + a reduction kernel), greedy
                          'argmax', pdl off (so are the rows built on it unless named *_pdl)
  default                 DecodeEngine's defaults, what the planner node runs
  whole_rows              fused + attn_proj 'triton' + mlp 'triton_fused': per layer RMSNorm +
                          qkv, the attention, o + residual, RMSNorm + w13 + SiLU*up, w_down +
                          residual, one kernel each (whole-row GEMVs, triton_gemv.py)
  whole_rows_pdl          whole_rows + pdl: the five kernels launched with programmatic
                          dependent launch (each reads its weights while the one before it
                          finishes; Hopper or later)
  attn_proj               fused + attn_proj 'triton' only
  attn_proj_pdl           attn_proj + pdl
  mlp_fused               fused + mlp 'triton_fused' only
  two_stage               fused + greedy 'auto' (two-stage argmax for large vocabularies)
  fused_residual          fused + mlp 'triton_down_residual' (w_down's last split adds up the
                          splits and the residual: no reduction kernel)
  fused_split             fused_residual + decode_attention 'triton_fused_split' (keys split
                          over programs, one kernel)
  cdt                     the defaults + inductor coordinate-descent tuning (engine_compile's
                          setting): inductor writes the batch-1 GEMVs itself, fused with the
                          norms
  cdt_whole_rows          whole_rows + coordinate-descent tuning
Metrics: floor_fraction (weight-bandwidth floor / p50, planner_hf's definition), agreement (the
greedy 128 tokens equal to the first row's, position by position), compile_s. Roles: the first
shape's first row is the baseline, its `default` row the optimized one; ratios
<option>_vs_<first option>_<shape> (p50 step times).

  python -m kestrel_bench planner-steps            # GPU: both shapes, every option
  python -m kestrel_bench planner-steps --quick    # tiny shapes on the CPU (eager, seconds)
  python -m kestrel_bench planner-steps --kernels  # GPU: and each row's longest kernels
"""

from __future__ import annotations

import argparse
import gc
import time
import traceback
from typing import Any

from kestrel_bench import record as rec_mod
from kestrel_bench.repo import ensure_paths

FUSED = dict(decode_attention="triton_fused", mlp="triton_down", greedy="argmax", pdl=False)
OPTIONS: dict[str, dict] = {  # row -> DecodeEngine keyword arguments
    "fused": FUSED,
    "default": {},
    "whole_rows": dict(FUSED, attn_proj="triton", mlp="triton_fused"),
    "whole_rows_pdl": dict(FUSED, attn_proj="triton", mlp="triton_fused", pdl=True),
    "attn_proj": dict(FUSED, attn_proj="triton"),
    "attn_proj_pdl": dict(FUSED, attn_proj="triton", pdl=True),
    "mlp_fused": dict(FUSED, mlp="triton_fused"),
    "two_stage": dict(FUSED, greedy="auto"),
    "fused_residual": dict(FUSED, mlp="triton_down_residual"),
    "fused_split": dict(FUSED, decode_attention="triton_fused_split",
                        mlp="triton_down_residual"),
    "cdt": dict(coordinate_descent=True),
    "cdt_whole_rows": dict(FUSED, attn_proj="triton", mlp="triton_fused",
                           coordinate_descent=True),
}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    from kestrel_bench.planner_hf import QUICK, SHAPES
    ap.add_argument("--quick", action="store_true", help="tiny shapes on the CPU, eager")
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES),
                    help=f"model shapes: {', '.join(SHAPES + QUICK)}")
    ap.add_argument("--options", nargs="*", default=list(OPTIONS),
                    help=f"rows, in this order: {', '.join(OPTIONS)}")
    ap.add_argument("--reps", type=int, default=500, help="timed replays per row")
    ap.add_argument("--warmup", type=int, default=50, help="untimed replays per row first")
    ap.add_argument("--kernels", action="store_true",
                    help="GPU: a table per row of its longest kernels per step (torch.profiler "
                         "over 20 replays; kernels overlapped by PDL count their whole span)")
    ap.add_argument("--budget-s", type=float, default=0.0,
                    help="wall s per shape: a row that starts later is recorded as "
                         "skipped (0 = none)")
    rec_mod.add_common_arguments(ap)


def _request(shape: str, dev: Any, dtype: Any) -> tuple[Any, list[int], Any, int]:
    """(engine decoder, prompt, image, image tokens) of planner-hf's request at this shape."""
    from kestrel_bench import planner_hf as ph
    from kestrel_bench import planner_hf_sections as hs
    from kestrel_models.planner.hf_engine import from_model
    cfg = ph.shape_config(shape)
    big = not shape.endswith("tiny")
    hw, n_prompt = (448, 64) if big else (56, 16)
    m = hs.build(cfg, dev, dtype)
    tok = ph._Tokens(big) if shape.startswith("smolvlm") else None
    dec = from_model(m, None, dev, tok, consume=True)
    del m
    gc.collect()
    prompt, image = ph.request(cfg, hw, n_prompt, dev)
    return dec, prompt, image, dec.image_tokens(tuple(image.shape))


def _step_graph(eng: Any) -> Any:
    """The captured batch-1 greedy decode step of the largest kv bucket."""
    key = max(k for k in eng._graphs if k[0] == 1 and k[2] == 1 and not k[3])
    return eng._graphs[key][0]


def _census(eng: Any) -> dict:
    """planner_sections.profile_kernels over 20 replays of the step graph (its slot as
    _step_times left it)."""
    import torch

    from kestrel_bench.planner_sections import profile_kernels
    graph = _step_graph(eng)

    def run() -> int:
        for _ in range(20):
            graph.replay()
        torch.cuda.synchronize()
        return 20
    return profile_kernels(run)


def _step_times(eng: Any, pos: int, reps: int, warmup: int) -> list[float]:
    """Seconds per replay of the batch-1 greedy step graph with slot 0 held at `pos` (CUDA),
    or per eager step (CPU)."""
    import torch
    eng.pos_buf[0] = pos
    eng.active_buf.zero_()  # pos stays put: every replay is the same step
    if not eng.cuda_graph:
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            eng._body(1, eng.max_len, 1, False)
            out.append(time.perf_counter() - t0)
        return out
    graph = _step_graph(eng)
    for _ in range(warmup):
        graph.replay()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
          for _ in range(reps)]
    for a, b in ev:
        a.record()
        graph.replay()
        b.record()
    torch.cuda.synchronize()
    return [a.elapsed_time(b) * 1e-3 for a, b in ev]


def _row(dec: Any, prompt: list[int], image: Any, n_img: int, name: str, args: Any,
         ref: list[int] | None) -> dict:
    import torch._inductor.config as ic

    from kestrel_bench import stats
    from kestrel_models.planner.engine import DecodeEngine
    kw = dict(OPTIONS[name])
    ic.coordinate_descent_tuning = False  # process-wide: only the rows that ask turn it on
    need = n_img + len(prompt) + 128 + 8
    max_len = 1 << (need - 1).bit_length()
    t0 = time.perf_counter()
    eng = DecodeEngine(dec, 1, max_len, -1, compile_step=dec.device.type == "cuda", **kw)
    toks = eng.generate([prompt], 128, images=[image]).tokens[0]  # compiles and captures
    compile_s = time.perf_counter() - t0
    times = _step_times(eng, n_img + len(prompt) + 64, args.reps, args.warmup)
    census = _census(eng) if args.kernels and eng.cuda_graph else None
    agree = 1.0 if ref is None else sum(a == b for a, b in zip(toks, ref, strict=True)) / len(ref)
    out = dict(summary=stats.summary(times, 1e3), tokens=toks, compile_s=compile_s,
               agreement=agree, options=kw,
               decode_attention=eng.kv.decode_attention, mlp=eng.kv.mlp,
               attn_proj=eng.kv.attn_proj, pdl=eng.kv.pdl, kernels=census)
    del eng
    gc.collect()
    return out


def run(args: argparse.Namespace) -> int:
    ensure_paths("kestrel_models")
    import torch

    from kestrel_bench import planner_hf as ph
    from kestrel_bench.planner_hf_sections import ratio_tag
    from kestrel_bench.planner_sections import kernel_table

    if args.quick:
        if args.shapes == list(ph.SHAPES):
            args.shapes = list(ph.QUICK)
        args.reps, args.warmup = 5, 1
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    bad = [o for o in args.options if o not in OPTIONS]
    if bad:
        raise SystemExit(f"--options {bad}: each one of {', '.join(OPTIONS)}")
    bw = ph.copy_bandwidth(dev, (1 << 30) if dev.type == "cuda" else (64 << 20))
    config = {"quick": args.quick, "shapes": args.shapes, "options": args.options,
              "reps": args.reps, "warmup": args.warmup, "device": dev.type,
              "dtype": str(dtype).split(".")[-1], "batch": 1, "new_tokens": 128,
              "copy_bandwidth_gb_s": round(bw / 1e9, 1)}
    record = rec_mod.Record("planner-steps", config, getattr(args, "argv", None), args.commit)
    first = args.options[0]
    tables: list[dict] = []
    for si, shape in enumerate(args.shapes):
        t_start = time.perf_counter()
        try:
            dec, prompt, image, n_img = _request(shape, dev, dtype)
        except Exception as exc:  # noqa: BLE001 (recorded, the run goes on)
            traceback.print_exc()
            for o in args.options:
                record.add(f"{shape}_{o}", error=f"building: {type(exc).__name__}: {exc}"[:300])
            continue
        floor_ms = dec.weight_bytes() / bw * 1e3
        ref, base_p50 = None, None
        for o in args.options:
            name = f"{shape}_{o}"
            role = ("baseline" if si == 0 and o == first else
                    "optimized" if si == 0 and o == "default" else "variant")
            spent = time.perf_counter() - t_start
            if args.budget_s and spent >= args.budget_s:
                record.add(name, role, skipped=f"budget: {spent:.0f} s >= --budget-s")
                continue
            try:
                r = _row(dec, prompt, image, n_img, o, args, ref)
            except Exception as exc:  # noqa: BLE001 (recorded, the run goes on)
                traceback.print_exc()
                record.add(name, role, error=f"{type(exc).__name__}: {exc}"[:300])
                continue
            ref = ref or r["tokens"]
            p50 = r["summary"]["p50"]
            base_p50 = base_p50 or (p50 if o == first else None)
            record.add(name, role, latency_ms=r["summary"], throughput=1e3 / p50,
                       unit="steps/s", config={**r["options"],
                                               "decode_attention": r["decode_attention"],
                                               "mlp": r["mlp"],
                                               "attn_proj": r["attn_proj"],
                                               "pdl": r["pdl"],
                                               "measure": "one decode step, graph replay"},
                       metrics=dict(floor_ms=floor_ms, floor_fraction=floor_ms / p50,
                                    agreement=r["agreement"], compile_s=r["compile_s"],
                                    image_tokens=n_img))
            if r["kernels"]:
                tables.append(kernel_table(name, r["kernels"]))
            if base_p50 and o != first:
                record.ratio(f"{o}_vs_{first}_{ratio_tag(shape)}", base_p50 / p50)
            print(f"[planner-steps] {name}: p50 {p50 * 1e3:.1f} us "
                  f"({floor_ms / p50:.1%} of the floor), agreement {r['agreement']:.3f}",
                  flush=True)
        del dec
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    if tables:
        record["tables"] = tables
    elif args.kernels:
        record.note("--kernels: no kernel tables: they need the CUDA-graph step on a GPU")
    record.note("floor_ms: bytes of weights one decode step reads / device-to-device copy "
                f"bandwidth ({bw / 1e9:.0f} GB/s, bytes read + written per second)")
    rec_mod.finish(record, args)
    return 0
