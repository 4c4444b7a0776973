"""`kestrel_bench planner-hf`: Hugging Face VLM checkpoints on our decode engine vs transformers,
random weights at published shapes (nothing downloaded).

Shapes (--shapes; configs from the published dimensions):
  qwen2.5-vl-3b   Qwen2.5-VL-3B: decoder 36 layers, dim 2048, 16/2 heads, FFN 11008, vocab
                  151936, tied embeddings, M-RoPE [16, 24, 24]; vision 32 blocks of 1280
  smolvlm-256m    SmolVLM-256M: decoder (SmolLM2-135M) 30 layers, dim 576, 9/3 heads, FFN 1536,
                  vocab 49280, tied; vision SigLIP base patch 16 at 512 px, pixel shuffle 4
  --quick: tiny shapes of both families on the CPU (seconds).
Request: one --image-hw image (448) + --prompt-tokens (64) prompt tokens, --new-tokens (128)
greedy tokens, no <eos>. Rows per shape (each isolated: a failure is a row, the run goes on):
  <shape>_hf          transformers generate(): static cache (compiled decode on CUDA) where it
                      runs, else the dynamic cache (the row's config says which and why)
  <shape>_engine      our engine: CUDA-graph decode (+ --compile: the compiled step)
  <shape>_hf_c<N>, <shape>_engine_c<N>   N (--concurrent, 16) requests at once (transformers:
                      one batched generate()): aggregate tok/s, TTFT p50/p99
  <shape>_engine_x<M> (--multi M > 1) one stream, M decode steps per graph replay
TTFT includes the vision tower (submit -> first token on the host). metrics.floor_ms: the
weight-bandwidth floor of one decode step = bytes of weights a step reads / measured
device-to-device copy bandwidth (bytes read + written per second); floor_fraction = floor /
measured time per output token. Roles: baseline = the first shape's hf row, optimized = its
engine row; ratios engine_vs_hf_tok_s_<shape>, engine_vs_hf_ttft_<shape>, and for N streams.

  python -m kestrel_bench planner-hf --quick
  python -m kestrel_bench planner-hf --compile      # GPU: bf16, both shapes
  python -m kestrel_bench planner-hf --compile --budget-s 300   # under a time limit
  python -m kestrel_bench planner-hf --compile --shapes smolvlm-256m --merge   # one more shape
"""

from __future__ import annotations

import argparse
import statistics
import time
import traceback
from typing import Any

from kestrel_bench import record as rec_mod
from kestrel_bench.repo import ensure_paths

NO_EOS = -1
SHAPES = ("qwen2.5-vl-3b", "smolvlm-256m")
QUICK = ("qwen2.5-vl-tiny", "smolvlm-tiny")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--quick", action="store_true",
                    help="tiny shapes on the CPU, 16 new tokens, 4 concurrent requests")
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES),
                    help=f"model shapes: {', '.join(SHAPES + QUICK)}")
    ap.add_argument("--device", default="", help="cpu | cuda (default: cuda where available)")
    ap.add_argument("--image-hw", type=int, default=448)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--concurrent", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--compile", action="store_true",
                    help="engine: the whole decode step compiled (inductor) in the CUDA graph")
    ap.add_argument("--cdt", action="store_true", help="inductor coordinate-descent tuning")
    ap.add_argument("--multi", type=int, default=1,
                    help="N > 1: also <shape>_engine_x<N>, one stream with N decode steps per "
                         "graph replay (no host decision in between: no grammar)")
    ap.add_argument("--only", nargs="*", default=None,
                    help="row kinds to run: hf, engine, hf_c, engine_c, engine_x")
    ap.add_argument("--budget-s", type=float, default=0.0,
                    help="wall s for the sections: one that starts later is recorded as "
                         "skipped, so a run under a time limit still writes its record "
                         "(0 = none)")
    ap.add_argument("--merge", action="store_true",
                    help="keep the rows and ratios of the shapes this run does not measure "
                         "from the record already at the output path (each kept row names "
                         "its run): one record for shapes measured in separate runs")
    rec_mod.add_common_arguments(ap)


def shape_config(name: str) -> Any:
    """The transformers config of a shape (published dimensions; tiny ones for --quick)."""
    import transformers as tf
    if name.startswith("qwen2.5-vl"):
        big = name == "qwen2.5-vl-3b"
        text = (dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                     num_attention_heads=16, num_key_value_heads=2, vocab_size=151936,
                     max_position_embeddings=128000, rms_norm_eps=1e-6,
                     rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                      "mrope_section": [16, 24, 24]})
                if big else dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                 max_position_embeddings=4096, rms_norm_eps=1e-6,
                                 rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                  "mrope_section": [2, 3, 3]}))
        vision = (dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16,
                       out_hidden_size=2048, patch_size=14, spatial_merge_size=2,
                       temporal_patch_size=2, window_size=112, fullatt_block_indexes=[7, 15,
                                                                                     23, 31])
                  if big else dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                                   out_hidden_size=64, patch_size=14, spatial_merge_size=2,
                                   temporal_patch_size=2, window_size=56,
                                   fullatt_block_indexes=[1]))
        ids = (151655, 151656, 151652, 151653) if big else (500, 501, 502, 503)
        return tf.Qwen2_5_VLConfig(text_config=dict(text, tie_word_embeddings=True),
                                   vision_config=vision, image_token_id=ids[0],
                                   video_token_id=ids[1], vision_start_token_id=ids[2],
                                   vision_end_token_id=ids[3], tie_word_embeddings=True)
    if name.startswith("smolvlm"):
        big = name == "smolvlm-256m"
        text = (dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, vocab_size=49280,
                     max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0)
                if big else dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                 max_position_embeddings=4096, rms_norm_eps=1e-5))
        vision = (dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                       num_attention_heads=12, image_size=512, patch_size=16)
                  if big else dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, image_size=32, patch_size=8))
        return tf.SmolVLMConfig(text_config=dict(text, model_type="llama",
                                                 tie_word_embeddings=True),
                                vision_config=vision, scale_factor=4 if big else 2,
                                image_token_id=49190 if big else 500, tie_word_embeddings=True)
    raise SystemExit(f"--shapes {name!r}: one of {', '.join(SHAPES + QUICK)}")


class _Tokens:
    """The two framing tokens SmolVLM's image block needs (what its tokenizer would give)."""

    def __init__(self, big: bool) -> None:
        self.ids = ({"<fake_token_around_image>": 49189, "<global-img>": 49152} if big else
                    {"<fake_token_around_image>": 501, "<global-img>": 502})
        self.unk_token_id = None

    def convert_tokens_to_ids(self, token: str) -> int | None:
        return self.ids.get(token)


def request(cfg: Any, image_hw: int, prompt_tokens: int, dev: Any) -> tuple[list[int], Any]:
    """The benchmark request (seeded): prompt_tokens random ids with the config's image marker
    second, and one random image_hw x image_hw uint8 image on dev."""
    import torch
    g = torch.Generator().manual_seed(1)
    image = torch.randint(0, 256, (3, image_hw, image_hw), dtype=torch.uint8,
                          generator=g).to(dev)
    prompt = torch.randint(10, 400, (prompt_tokens,), generator=g).tolist()
    return [prompt[0], int(cfg.image_token_id), *prompt[1:]], image


def copy_bandwidth(dev: Any, nbytes: int) -> float:
    """Device-to-device copy: bytes read + written per second (median of 5 copies)."""
    import torch
    a = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    times = []
    for i in range(7):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        b.copy_(a)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return 2 * nbytes / statistics.median(times)


def run(args: argparse.Namespace) -> int:
    ensure_paths("kestrel_models")
    import torch

    from kestrel_bench import planner_hf_sections as hs

    if args.quick:
        if args.shapes == list(SHAPES):  # the default: the tiny ones instead
            args.shapes = list(QUICK)
        args.device, args.new_tokens, args.reps = "cpu", 16, 1
        args.image_hw, args.prompt_tokens, args.concurrent = 56, 16, 4
        args.compile = False
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    if dev.type == "cpu":
        torch.set_num_threads(args.threads)
    try:
        import transformers
        tf_version = transformers.__version__
    except ImportError:
        tf_version = None
    bw = copy_bandwidth(dev, (1 << 30) if dev.type == "cuda" else (64 << 20))
    config = {"quick": args.quick, "shapes": args.shapes, "multi": args.multi,
              "dtype": str(dtype).split(".")[-1], "device": dev.type, "image_hw": args.image_hw,
              "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
              "concurrent": args.concurrent, "reps": args.reps, "compile": args.compile,
              "cdt": args.cdt, "transformers": tf_version,
              "copy_bandwidth_gb_s": round(bw / 1e9, 1)}
    record = rec_mod.Record("planner-hf", config, getattr(args, "argv", None), args.commit)
    rows: dict[str, dict] = {}

    t_start = time.perf_counter()

    def over_budget() -> str:
        spent = time.perf_counter() - t_start
        return (f"budget: {spent:.0f} s spent >= --budget-s {args.budget_s:.0f}"
                if args.budget_s and spent >= args.budget_s else "")

    def section(name: str, kind: str, fn, *fargs: Any) -> None:  # noqa: ANN001
        if args.only and kind not in args.only:
            return
        skipped = over_budget()
        if skipped:
            rows[name] = {"skipped": skipped}
            print(f"[planner-hf] {name}: {skipped}", flush=True)
            return
        t0 = time.perf_counter()
        try:
            rows[name] = fn(*fargs)
        except Exception as exc:  # noqa: BLE001 (recorded, the run goes on)
            traceback.print_exc()
            rows[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        rows[name]["section_s"] = round(time.perf_counter() - t0, 2)
        r = rows[name]
        print(f"[planner-hf] {name}: " + (f"{r['tok_s']:.1f} tok/s, TTFT {r['ttft_ms']:.1f} ms"
                                          if "tok_s" in r else str(r)[:200]), flush=True)

    for shape in args.shapes:
        torch.manual_seed(0)
        cfg = shape_config(shape)
        prompt, image = request(cfg, args.image_hw, args.prompt_tokens, dev)
        big = not shape.endswith("tiny")
        n = args.concurrent
        names = [f"{shape}_hf", f"{shape}_hf_c{n}", f"{shape}_engine", f"{shape}_engine_c{n}"]
        skipped = over_budget()
        if skipped:  # not even the model is built
            rows.update({k: {"skipped": skipped} for k in names})
            continue
        try:
            ctx = hs.Context(hs.build(cfg, dev, dtype), cfg, dev, dtype, prompt, image, args,
                             bw, _Tokens(big) if shape.startswith("smolvlm") else None)
        except Exception as exc:  # noqa: BLE001 (recorded, the run goes on)
            traceback.print_exc()
            rows.update({k: {"error": f"building the model: {type(exc).__name__}: {exc}"[:300]}
                         for k in names})
            continue
        section(names[0], "hf", hs.bench_hf, ctx, 1)
        section(names[1], "hf_c", hs.bench_hf, ctx, n)
        try:
            ctx.to_engine()  # transformers' decoder layers go: the engine's are packed
        except Exception as exc:  # noqa: BLE001 (recorded, the run goes on)
            traceback.print_exc()
            rows.update({k: {"error": f"engine: {type(exc).__name__}: {exc}"[:300]}
                         for k in names[2:]})
        else:
            section(names[2], "engine", hs.bench_engine, ctx, 1)
            section(names[3], "engine_c", hs.bench_engine, ctx, n)
            if args.multi > 1:
                ctx.eng.set_steps_per_replay(args.multi)
                section(f"{shape}_engine_x{args.multi}", "engine_x", hs.bench_engine, ctx, 1)
                ctx.eng.set_steps_per_replay(1)
        ctx.release()
    hs.to_record(record, rows, args.shapes, args.concurrent)
    if args.merge:
        merge_other_shapes(record, args)
    record.note("floor_ms: bytes of weights one decode step reads / device-to-device copy "
                f"bandwidth ({bw / 1e9:.0f} GB/s, bytes read + written per second)")
    rec_mod.finish(record, args)
    return 0


def _shape_of(name: str) -> str:
    return next((s for s in SHAPES + QUICK if name.startswith(f"{s}_")), "")


def merge_other_shapes(record: rec_mod.Record, args: argparse.Namespace) -> None:
    """--merge: record.merge_unmeasured from the record at the output path (the rows of the
    shapes not measured now, and of sections this run skipped, each naming its run), then the
    roles: the baseline is the hf row of the first shape in SHAPES order whose hf and engine
    rows come from one run, its engine row the optimized one."""
    path, _ = rec_mod.paths(rec_mod.out_stem(getattr(args, "out", None), "planner-hf",
                                             record.machine_class))
    if not path.is_file():
        return
    rec_mod.merge_unmeasured(record, rec_mod.load(path))
    shapes = {_shape_of(r["name"]) for r in record["results"]} - {""}
    order = [s for s in (*SHAPES, *QUICK) if s in shapes]
    record["config"]["shapes"] = order

    def pair(shape: str) -> bool:
        hf, eng = record.result(f"{shape}_hf"), record.result(f"{shape}_engine")
        return bool(hf and eng and rec_mod.measured(hf) and rec_mod.measured(eng)
                    and hf.get("run") == eng.get("run"))

    base = next((s for s in order if pair(s)), "")
    for r in record["results"]:
        r["role"] = ("baseline" if r["name"] == f"{base}_hf" else
                     "optimized" if r["name"] == f"{base}_engine" else "variant")
