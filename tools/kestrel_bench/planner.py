"""`kestrel_bench planner`: planner decoding, HF transformers baselines and our engine in ONE
run (planner_sections.py has each measured path).

Sections (each isolated: a failure is recorded as a row, the run goes on):
  hf_eager / hf_static    HF Qwen2ForCausalLM of our decoder's shape (random init) generate()
                          greedy, dynamic / static cache, text prompt as long as ours
  engine_eager / engine_graph / engine_graph_x<M>   our DecodeEngine without / with CUDA
                          graphs (decode step and batched prefill; M decode steps per replay);
                          one request = one 448x448 uint8 image + 64 prompt tokens
  engine_graph_c4 / _c16  4 / 16 concurrent requests (continuous batching)
  engine_prefix           TTFT with a 48-token system prefix cached + the rest of the prompt
  engine_local_global / engine_h2o   decode attention policies
  spec_graph_random / spec_graph_agree   speculative decoding (draft = the first layers;
                          agree = the mechanism's ceiling, see planner_sections.bench_spec)
  engine_step_compiled[_<v>][_x<M>]  (--compile) the whole decode step compiled as one
                          inductor graph in a CUDA graph, per --step-variants, with a kernel
                          census of the warm engine in the record's tables
  prefix_cache            TTFT with and without prefix reuse: a fixed system prefix, and the
                          node's frame + scene line (planner_decode.py; in --quick too)
  spec_trained            (--target-weights, --draft-weights) speculative decoding of trained
                          weights under the plan grammar on held-out goals vs the engine:
                          plan time, acceptance, agreement (planner_decode.py)
Rows: latency_ms = time per output token of one stream; throughput tok/s (1 / median TPOT;
aggregate for concurrent rows in metrics); TTFT, peak memory, power and J per token.
Roles: baseline = hf_static (hf_eager where static did not run); optimized = the fastest
single-stream dense engine row. ratios: optimized_vs_baseline_tok_s, and
engine_graph_vs_baseline_tok_s.
--quick: tiny config on the CPU, 16 new tokens, HF eager vs engine eager, prefix_cache.

  python -m kestrel_bench planner --quick
  python -m kestrel_bench planner --only spec_trained --device cpu \
      --target-weights ros2_ws/src/kestrel_planner/weights/planner_small.pt \
      --draft-weights ros2_ws/src/kestrel_planner/weights/planner_draft.pt --k 4
  python -m kestrel_bench planner --config 0.5b --compile --cdt   # GPU: 128 tokens, bf16
  python -m kestrel_bench planner --config 0.5b --compile --cdt \
      --only hf_static engine_graph --budget-s 200
"""

from __future__ import annotations

import argparse
import time
import traceback

from kestrel_bench import record as rec_mod
from kestrel_bench.repo import ensure_paths

SINGLE = ("engine_eager", "engine_graph", "engine_graph_x", "engine_step_compiled")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--quick", action="store_true",
                    help="tiny config on the CPU, 16 new tokens, HF eager vs engine eager")
    ap.add_argument("--config", default="tiny", choices=["tiny", "0.5b"])
    ap.add_argument("--device", default="", help="cpu | cuda (default: cuda where available)")
    ap.add_argument("--dtype", default=None, choices=["bf16", "fp32"],
                    help="default bf16 on CUDA, fp32 on the CPU")
    ap.add_argument("--image-hw", type=int, default=448)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--k", type=int, default=4, help="speculative tokens per round")
    ap.add_argument("--draft-layers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--compile", action="store_true", help="the compiled whole-step sections")
    ap.add_argument("--cdt", action="store_true", help="inductor coordinate-descent tuning")
    ap.add_argument("--multi", type=int, default=8, help="decode steps per graph replay")
    ap.add_argument("--step-variants", nargs="*", default=[""],
                    help="compiled-step options with --compile ('' = the default step)")
    ap.add_argument("--sharpen", type=float, default=1.0,
                    help="scale the random weight matrices (30 on the CPU: varied greedy text)")
    ap.add_argument("--n-global", type=int, default=64)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--budget", type=int, default=192, help="H2O cache budget, tokens")
    ap.add_argument("--recent", type=int, default=64)
    ap.add_argument("--only", nargs="*", default=None, help="run only these sections")
    ap.add_argument("--budget-s", type=float, default=0.0,
                    help="skip a section whose estimated cost would pass this many seconds")
    ap.add_argument("--compile-cost-s", type=float, default=60.0)
    ap.add_argument("--target-weights", default="", help="spec_trained: target state dict")
    ap.add_argument("--target-config", default="small", help="spec_trained: target preset")
    ap.add_argument("--draft-weights", default="", help="spec_trained: draft state dict")
    ap.add_argument("--draft-config", default="draft", help="spec_trained: draft preset")
    ap.add_argument("--goals", type=int, default=32, help="spec_trained: held-out goals")
    ap.add_argument("--merge", action="store_true",
                    help="keep the rows and ratios this run does not measure from the record "
                         "at the output path (each row names its run)")
    rec_mod.add_common_arguments(ap)


def run(args: argparse.Namespace) -> int:
    ensure_paths("kestrel_models")
    import torch
    from kestrel_models.planner import VisionLanguageModel, get_config
    from kestrel_models.planner.attention_policy import AttentionPolicy

    from kestrel_bench import planner_decode as pd
    from kestrel_bench import planner_sections as ps

    if args.quick:
        args.config, args.device, args.new_tokens, args.reps = "tiny", "cpu", 16, 2
        args.only = args.only or ["engine_eager", "hf_eager", "prefix_cache"]
        args.compile = False
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    args.dtype = args.dtype or ("bf16" if dev.type == "cuda" else "fp32")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    if dev.type == "cpu":
        torch.set_num_threads(args.threads)
    cfg = get_config(args.config)
    torch.manual_seed(0)
    with torch.device(dev):
        model = VisionLanguageModel(cfg)
    model = model.to(dtype).eval()
    if args.sharpen != 1.0:
        with torch.no_grad():
            for p in model.parameters():
                if p.ndim >= 2:
                    p.mul_(args.sharpen)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 256, (args.prompt_tokens,), generator=g).tolist()
    image = torch.randint(0, 256, (3, args.image_hw, args.image_hw), dtype=torch.uint8,
                          generator=g).to(dev)
    seq_len = cfg.num_image_tokens + args.prompt_tokens
    try:
        import transformers
        tf_version = transformers.__version__
    except ImportError:
        tf_version = None
    config = {"quick": args.quick, "model": args.config, "dtype": args.dtype,
              "device": dev.type, "params": model.num_params(), "image_hw": args.image_hw,
              "image_tokens": cfg.num_image_tokens, "prompt_tokens": args.prompt_tokens,
              "new_tokens": args.new_tokens, "reps": args.reps, "compile": args.compile,
              "cdt": args.cdt, "multi": args.multi, "sharpen": args.sharpen,
              "only": args.only, "transformers": tf_version}
    record = rec_mod.Record("planner", config, getattr(args, "argv", None), args.commit)
    t_start = time.perf_counter()
    rows: dict[str, dict] = {}
    reference: dict = {}

    def section(name: str, fn, cost_s: float = 5.0) -> None:  # noqa: ANN001
        if args.only and name not in args.only and not (
                name.startswith(("engine_step_compiled", "kernel_census")) and args.compile):
            return
        spent = time.perf_counter() - t_start
        if args.budget_s and spent + cost_s > args.budget_s:
            rows[name] = {"skipped": f"budget: {spent:.0f} s spent + ~{cost_s:.0f} s > "
                          f"--budget-s {args.budget_s:.0f}"}
            return
        t0 = time.perf_counter()
        try:
            rows[name] = fn()
        except Exception as exc:  # noqa: BLE001 (recorded, the run goes on)
            traceback.print_exc()
            rows[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        rows[name]["section_s"] = round(time.perf_counter() - t0, 2)
        r = rows[name]
        print(f"[planner] {name}: " + (f"{r['tok_s']:.1f} tok/s, TTFT {r['ttft_ms']:.1f} ms"
                                       if "tok_s" in r else str(r)[:200]), flush=True)

    nt, reps, graph, ml = args.new_tokens, args.reps, dev.type == "cuda", args.max_len

    def eng(n: int = 1, **kw: object):  # noqa: ANN202
        p = kw.pop("prompt", prompt)
        return lambda: ps.bench_engine(model, n, p, image, kw.pop("nt", nt), reps, dev,
                                       kw.pop("graph", graph), ml, reference, **kw)

    section("engine_eager", eng(graph=False, prefill_graph=False))
    section("engine_graph", eng())
    section(f"engine_graph_x{args.multi}", eng(steps_per_replay=args.multi))
    section("engine_graph_c4", eng(4))
    section("engine_graph_c16", eng(16))
    section("engine_prefix", eng(prompt=prompt[48:], nt=8, prefix=prompt[:48]))
    section("engine_local_global", eng(attention=AttentionPolicy(
        "local_global", n_global=args.n_global, window=args.window)))
    section("engine_h2o", eng(attention=AttentionPolicy("h2o", budget=args.budget,
                                                        recent=args.recent)))
    for agree in (False, True):
        section(f"spec_graph_{'agree' if agree else 'random'}", lambda agree=agree: ps.bench_spec(
            model, args.draft_layers, args.k, prompt, image, nt, reps, dev, agree, ml))
    decode_rows: dict[str, dict] = {}  # planner_decode.py's rows (metrics of their own)

    def decode_section(name: str, fn) -> None:  # noqa: ANN001
        if args.only and name not in args.only:
            return
        try:
            decode_rows.update(fn())
        except Exception as exc:  # noqa: BLE001 (recorded, the run goes on)
            traceback.print_exc()
            decode_rows[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        print(f"[planner] {name}: {decode_rows}"[:400], flush=True)

    decode_section("prefix_cache", lambda: pd.bench_prefix(model, prompt, image, reps, ml))
    if args.target_weights and args.draft_weights:
        ensure_paths("kestrel_planner")
        decode_section("spec_trained", lambda: pd.bench_spec_trained(
            args.target_weights, args.target_config, args.draft_weights, args.draft_config,
            args.k, args.draft_layers, args.goals, dev, dtype))
    elif args.only and "spec_trained" in args.only:
        decode_rows["spec_trained"] = {"skipped": "needs --target-weights and --draft-weights"}
    hf: dict = {}

    def hf_section(static: bool) -> dict:
        if "m" not in hf:
            hf["m"] = ps.hf_model(cfg, dev, dtype)
        return ps.bench_hf(hf["m"], seq_len, nt, static, reps, dev)

    section("hf_eager", lambda: hf_section(False), 30.0)
    section("hf_static", lambda: hf_section(True), 45.0)
    hf.clear()
    tables = []
    if args.compile:
        import torch._inductor.config as ic

        cdt0 = ic.coordinate_descent_tuning
        for v in args.step_variants:
            if v not in ps.STEP_VARIANTS:
                raise SystemExit(f"--step-variants {v!r}: one of {sorted(ps.STEP_VARIANTS)}")
            name, keep = "engine_step_compiled" + (f"_{v}" if v else ""), {}
            section(name, eng(keep=keep, compile_step=True, coordinate_descent=args.cdt,
                              **ps.STEP_VARIANTS[v]), args.compile_cost_s)
            if "eng" not in keep:
                continue

            def multi(keep: dict = keep) -> dict:
                keep["eng"].set_steps_per_replay(args.multi)
                return ps.bench_engine(model, 1, prompt, image, nt, reps, dev, graph, ml,
                                       reference, eng=keep["eng"])
            section(f"{name}_x{args.multi}", multi, 3.0)
            if graph:
                try:
                    c = ps.kernel_census(keep["eng"], prompt, image)
                    tables.append(ps.kernel_table(name, c))
                except Exception as exc:  # noqa: BLE001 (the census is extra)
                    record.note(f"kernel census of {name} failed: {type(exc).__name__}: {exc}")
            keep.clear()
        ic.coordinate_descent_tuning = cdt0
    _to_record(record, rows)
    pd.to_record(record, decode_rows)
    if tables:
        record["tables"] = tables
    if args.merge:
        path, _ = rec_mod.paths(rec_mod.out_stem(args.out, "planner", record.machine_class))
        if path.is_file():
            rec_mod.merge_unmeasured(record, rec_mod.load(path))
    rec_mod.finish(record, args)
    return 0


def _to_record(record: rec_mod.Record, rows: dict[str, dict]) -> None:
    single = {n: r for n, r in rows.items() if n.startswith(SINGLE) and r.get("streams") == 1
              and r.get("attention", "dense") == "dense" and "tok_s" in r}
    best = max(single, key=lambda n: single[n]["tok_s"], default=None)
    base = "hf_static" if "tok_s" in rows.get("hf_static", {}) else "hf_eager"
    for name, r in rows.items():
        role = "baseline" if name == base else "optimized" if name == best else "variant"
        if "skipped" in r or "error" in r:
            record.add(name, role, **{k: r[k] for k in ("skipped", "error") if k in r})
            continue
        metrics = {k: r[k] for k in ("ttft_ms", "ttft_ms_max", "agg_tok_s", "warmup_s",
                                     "streams", "steps_per_replay", "agree_vs_first",
                                     "distinct_tokens", "acceptance_rate", "tokens_per_round",
                                     "section_s") if r.get(k) is not None}
        cfg = {k: r[k] for k in ("cuda_graph", "attention", "k", "draft_layers", "agree_target",
                                 "graphs") if k in r}
        record.add(name, role, latency_ms=r["tpot_ms"], throughput=r["tok_s"], unit="tok/s",
                   peak_memory_mb=r.get("peak_mb"), power=r.get("power"), metrics=metrics,
                   config={**cfg, "measure": "time per output token, one stream"})
    b = rows.get(base, {}).get("tok_s")
    if best and b:
        record.ratio("optimized_vs_baseline_tok_s", rows[best]["tok_s"] / b)
    if b and "tok_s" in rows.get("engine_graph", {}):
        record.ratio("engine_graph_vs_baseline_tok_s", rows["engine_graph"]["tok_s"] / b)
