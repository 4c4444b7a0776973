#!/usr/bin/env python3
"""Planner decoding benchmark, baselines and ours in ONE run, JSON + Markdown table.

Sections (each isolated: a failure is recorded in the JSON and the run goes on):
  hf_eager    HF transformers Qwen2ForCausalLM (same decoder shape as our config, random init)
              generate() greedy with the default dynamic cache, text-only prompt of the same
              length as ours (image tokens + prompt tokens).
  hf_static   the same with cache_implementation="static" (auto-compiled decode on CUDA).
  engine_eager / engine_graph   our DecodeEngine (kvmodel.py) without / with CUDA graphs
              (decode step AND batched prefill; on CPU both are eager: no graphs there): one
              request = one 448x448 uint8 image + 64 prompt tokens.
  engine_step_compiled        (--compile) the WHOLE decode step (all layers, final norm,
              lm_head, sampling) compiled as one inductor graph (fullgraph; --cdt: coordinate-
              descent tuning, batch-1 GEMVs as Triton reductions), captured in a CUDA graph.
  engine_step_compiled_xN     the same engine, N = --multi decode steps per graph replay.
  engine_step_compiled_<v>(_xN)  the compiled step with decode-kernel options (--variants):
              cublas = gemv='cublas' (all linears stay cuBLAS calls through the opaque custom
              op, so coordinate descent tunes only the norms/RoPE/softmax/SiLU kernels),
              cublas_w2 = 'cublas:w2,lm_head', sdpa = + decode_attention='sdpa',
              argmax2 = + greedy='two_stage', fast = all three; triton = decode_attention=
              'triton' (one flash-decoding Triton kernel per layer, triton_decode.py),
              triton_split = 'triton_split', triton_mlp = mlp='triton' (RMSNorm+w13+SiLU*up
              kernel + split-K w_down), triton_down = mlp='triton_down', triton_all(_split)
              = attention + MLP, triton_attn_down = 'triton' + 'triton_down', triton_fused =
              'triton_fused' (RoPE + k/v cache write + attention in one kernel) + 'triton_down'
              (= what 'auto', the default, picks on CUDA), triton_fused_mlp = + mlp 'triton',
              torch = 'grouped' + 'inductor' (the default before 'auto'; "" is now 'auto');
              each with its kernel census. The uncompiled engine rows use the defaults
              ('auto': Triton ops on CUDA).
  (the compiled sections run last: their compile time cannot starve the baselines)
  engine_graph_c4 / _c16        4 / 16 concurrent requests (continuous batching; one batched,
              graphed prefill for the simultaneous joins).
  engine_prefix               TTFT with a 48-token system prefix cached + 16 task tokens.
  engine_local_global / engine_h2o   decode attention policies (attention_policy.py) in the
              graphed engine; agree_vs_dense = share of generated tokens equal to the dense
              engine's (same prompt, greedy), first_diff = index of the first difference.
  spec_graph_random           SpeculativeDecoder, rounds captured as CUDA graphs, draft = the
              target's first --draft-layers layers (random weights: acceptance ~0).
  spec_graph_agree            the mechanism's CEILING, honestly labelled: a target whose layers
              past --draft-layers are zeroed residual blocks (wo = w_down = 0, same cost per
              pass), so the first-layers draft agrees on every token (acceptance 1.0).
TTFT: submit -> first token on the host (vision encode, prefill, sampling, sync). TPOT: mean
interval between the first and the last token of one stream (median over streams and reps).
tok/s: 1 / TPOT for one stream; for N streams, tokens decoded after the last first-token /
that time span. Greedy, no <eos>.

  # H200 (bf16, the 0.5b config; --compile adds the compiled whole-step sections, last):
  python scripts/bench_planner.py --config 0.5b --device cuda --new-tokens 128 --reps 2 \
      --compile --cdt --out docs/benchmarks/planner_h200
  # CPU (tiny config, fp32, weights scaled so the greedy text varies; tight policy budgets):
  python scripts/bench_planner.py --config tiny --device cpu --new-tokens 64 --reps 3 \
      --draft-layers 1 --n-global 16 --window 32 --budget 48 --recent 16 --sharpen 30 \
      --out docs/benchmarks/planner_cpu
  # One short device call: HF static + graph + every compiled variant, under a time budget
  # (a section whose estimated cost would pass --budget-s is recorded as skipped):
  python scripts/bench_planner.py --config 0.5b --device cuda --new-tokens 128 --reps 2 \
      --compile --cdt --only engine_graph hf_static --variants cublas fast "" --budget-s 130 \
      --compile-cost-s 40 --out $OUT/planner_h200_call2
  # Kernel microbenchmark (CUDA): scripts/bench_planner_kernels.py (was --kernels here).
  # Merge such a call's rows into an earlier run's JSON (rows tagged by call, then rendered):
  python scripts/bench_planner.py --merge NEW.json --render OLD.json --out docs/...
  # Re-render the .md (and headline ratios) from a JSON:
  python scripts/bench_planner.py --render planner_h200.json --out docs/benchmarks/planner_h200
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "models"))

import bench_common  # noqa: E402 (scripts/ is on sys.path: this file's folder)
from bench_planner_report import merge, write  # noqa: E402
from kestrel_models.planner import VisionLanguageModel, get_config  # noqa: E402
from kestrel_models.planner.attention_policy import AttentionPolicy  # noqa: E402
from kestrel_models.planner.engine import DecodeEngine  # noqa: E402
from kestrel_models.planner.speculative import SpeculativeDecoder  # noqa: E402

NO_EOS = -1  # never sampled: every request decodes exactly new_tokens tokens
TOKENS: dict[str, list[int]] = {}
T_START = time.perf_counter()
# Compiled-step variants: name suffix -> DecodeEngine options ("" = the default compiled step).
VARIANTS: dict[str, dict] = {
    "": {},
    "cublas": dict(gemv="cublas"),
    "cublas_w2": dict(gemv="cublas:w2,lm_head"),
    "sdpa": dict(gemv="cublas", decode_attention="sdpa"),
    "argmax2": dict(gemv="cublas", greedy="two_stage"),
    "fast": dict(gemv="cublas", decode_attention="sdpa", greedy="two_stage"),
    "triton": dict(decode_attention="triton"),
    "triton_split": dict(decode_attention="triton_split"),
    "triton_mlp": dict(mlp="triton"),
    "triton_down": dict(mlp="triton_down"),
    "triton_all": dict(decode_attention="triton", mlp="triton"),
    "triton_all_split": dict(decode_attention="triton_split", mlp="triton"),
    "triton_attn_down": dict(decode_attention="triton", mlp="triton_down"),
    "triton_fused": dict(decode_attention="triton_fused", mlp="triton_down"),  # = auto on CUDA
    "triton_fused_mlp": dict(decode_attention="triton_fused", mlp="triton"),
    "torch": dict(decode_attention="grouped", mlp="inductor"),  # the pre-'auto' default
}


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
    # Per stream: mean interval over its whole decode (multi-step replays deliver tokens in
    # bursts, so the median gap between callbacks would be meaningless).
    tpot = [(s[-1] - s[0]) / (len(s) - 1) for s in stamps if len(s) > 1]
    return dict(ttft_ms=[1e3 * r.ttft_s for r in reqs], tpot_ms=1e3 * statistics.median(tpot),
                agg_tok_s=after / (last - first) if last > first else None)


def bench_engine(model, n: int, prompt: list[int], image: torch.Tensor,  # noqa: ANN001
                 new_tokens: int, reps: int, dev: torch.device, graph: bool,
                 compile: bool = False, prefix: list[int] | None = None,
                 eng: DecodeEngine | None = None, keep: dict | None = None,
                 **kw: object) -> dict:
    t0 = time.perf_counter()
    if eng is None:
        eng = DecodeEngine(model, max_batch=max(n, 1), max_len=args.max_len, eos_id=NO_EOS,
                           cuda_graph=graph, system_prefix=prefix or (), **kw)
    if keep is not None:
        keep["eng"] = eng
    run_streams(eng, n, prompt, image, new_tokens)  # warm-up: captures the graphs used
    warm = time.perf_counter() - t0
    reset_peak(dev)
    runs = [run_streams(eng, n, prompt, image, new_tokens) for _ in range(reps)]
    toks = eng.generate([prompt], new_tokens, images=[image]).tokens[0]
    if not TOKENS:  # the first engine row run (engine_eager unless --only skips it)
        TOKENS["eager"], TOKENS["prompt"] = toks, prompt
        TOKENS["ref"] = ("eager dense" if not eng.cuda_graph and not compile
                         else "first row's")
    same = ([a == b for a, b in zip(toks, TOKENS["eager"], strict=False)]
            if prompt == TOKENS["prompt"] else [])
    tpot = statistics.median(r["tpot_ms"] for r in runs)
    ttfts = sorted(t for r in runs for t in r["ttft_ms"])
    out = dict(streams=n, ttft_ms=statistics.median(ttfts), ttft_ms_max=ttfts[-1],
               tpot_ms=tpot, tok_s=1e3 / tpot, warmup_s=warm, peak_mb=peak_mb(dev),
               graphs=len(eng._graphs), cuda_graph=eng.cuda_graph, compile=compile,
               steps_per_replay=eng.steps_per_replay, attention=eng.kv.policy.mode,
               agree_vs_eager=sum(same) / len(same) if same else None,
               first_diff=same.index(False) if False in same else None,
               distinct_tokens=len(set(toks)), agree_ref=TOKENS["ref"])
    if n > 1:
        out["agg_tok_s"] = statistics.median(r["agg_tok_s"] for r in runs)
    return out


def first_layers(model, n_layers: int):  # noqa: ANN001, ANN201
    """A VisionLanguageModel made of the model's first n_layers (shares its tensors)."""
    cfg = model.cfg.with_overrides(n_layers=n_layers)
    with torch.device("meta"):
        draft = VisionLanguageModel(cfg)
    state = {k2: v for k2, v in model.state_dict().items()
             if not k2.startswith("layers.") or int(k2.split(".")[1]) < n_layers}
    draft.load_state_dict(state, assign=True)  # shares the target's tensors (no copy)
    draft.rope_cos, draft.rope_sin = model.rope_cos, model.rope_sin
    if cfg.tie_embeddings:
        draft.lm_head.weight = draft.tok_emb.weight
    return draft.eval()


def bench_spec(model, draft_layers: int, k: int, prompt: list[int],  # noqa: ANN001
               image: torch.Tensor, new_tokens: int, reps: int, dev: torch.device,
               agree: bool) -> dict:
    target = model
    if agree:  # zero the residual blocks past draft_layers: the target == its first layers
        import copy
        target = copy.deepcopy(model)
        with torch.no_grad():
            for ly in target.layers[draft_layers:]:
                ly.attn.wo.weight.zero_()
                ly.w_down.weight.zero_()
    t0 = time.perf_counter()
    spec = SpeculativeDecoder(target, first_layers(target, draft_layers), k, 1, args.max_len,
                              NO_EOS)
    spec.generate([prompt], new_tokens, images=[image])
    warm = time.perf_counter() - t0
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
                ttft_ms=statistics.median(ttft), peak_mb=peak_mb(dev), warmup_s=warm,
                cuda_graph=spec.cuda_graph, agree_target=agree)


def kernel_census(eng: DecodeEngine, prompt: list[int], image: torch.Tensor) -> dict:
    """torch.profiler over 16 decode steps of a warm engine: kernels and GPU time per step."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    r = eng.submit(prompt, 160, image)
    eng.step()  # admit + first steps outside the window
    s0 = eng.steps
    with profile(activities=acts) as prof:
        for _ in range(16):
            eng.step()
        sync(eng.device)
    steps = eng.steps - s0
    eng.run()
    assert r.stop_reason
    ev = prof.key_averages()
    kern = [e for e in ev if e.device_type.name == "CUDA" and e.self_device_time_total > 0]
    total_us = sum(e.self_device_time_total for e in kern)
    top = sorted(kern, key=lambda e: -e.self_device_time_total)[:16]
    return dict(steps=steps, kernels_per_step=sum(e.count for e in kern) / steps,
                gpu_us_per_step=total_us / steps,
                top=[dict(name=e.key[:90], us_per_step=e.self_device_time_total / steps,
                          calls_per_step=e.count / steps) for e in top])


def machine(dev: torch.device) -> dict:
    try:
        import transformers
        tf = transformers.__version__
    except ImportError:
        tf = None
    return bench_common.machine_info(
        torch.cuda.get_device_name() if dev.type == "cuda" else None,
        cpu=platform.processor() or platform.machine(), transformers=tf)


def git_commit() -> str:
    return bench_common.git_commit(args.git_commit)


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
    if args.sharpen != 1.0:  # varied greedy text, so token agreement means something
        with torch.no_grad():
            for p in model.parameters():
                if p.ndim >= 2:
                    p.mul_(args.sharpen)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 256, (args.prompt_tokens,), generator=g).tolist()
    image = torch.randint(0, 256, (3, args.image_hw, args.image_hw), dtype=torch.uint8,
                          generator=g).to(dev)
    seq_len = cfg.num_image_tokens + args.prompt_tokens
    res = dict(command=" ".join(sys.argv), git_commit=git_commit(), machine=machine(dev),
               config=args.config, dtype=args.dtype, params=model.num_params(),
               sharpen=args.sharpen,
               image_hw=args.image_hw, image_tokens=cfg.num_image_tokens,
               prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens,
               reps=args.reps, results={})
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def section(name: str, fn, cost_s: float = 5.0) -> None:  # noqa: ANN001
        if args.only and name not in args.only and not (
                name.startswith(("engine_step_compiled", "kernel_census")) and args.compile):
            return
        spent = time.perf_counter() - T_START
        if args.budget_s and spent + cost_s > args.budget_s:
            res["results"][name] = dict(skipped=f"budget: {spent:.0f} s spent + ~{cost_s:.0f} s"
                                        f" > --budget-s {args.budget_s:.0f}")
            print(f"[bench] {name}: {res['results'][name]}", flush=True)
            out.with_suffix(".json").write_text(json.dumps(res, indent=1))
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
    graph = dev.type == "cuda"
    section("engine_eager", lambda: bench_engine(model, 1, prompt, image, nt, reps, dev, False,
                                                 prefill_graph=False))
    section("engine_graph", lambda: bench_engine(model, 1, prompt, image, nt, reps, dev, graph))
    section(f"engine_graph_x{args.multi}", lambda: bench_engine(
        model, 1, prompt, image, nt, reps, dev, graph, steps_per_replay=args.multi))
    section("engine_graph_c4", lambda: bench_engine(model, 4, prompt, image, nt, reps, dev,
                                                    graph))
    section("engine_graph_c16", lambda: bench_engine(model, 16, prompt, image, nt, reps, dev,
                                                     graph))
    sys_prefix = prompt[:48]
    section("engine_prefix", lambda: bench_engine(model, 1, prompt[48:], image, 8, reps, dev,
                                                  graph, prefix=sys_prefix))
    lg = AttentionPolicy("local_global", n_global=args.n_global, window=args.window)
    section("engine_local_global", lambda: bench_engine(model, 1, prompt, image, nt, reps, dev,
                                                        graph, attention=lg))
    h2o = AttentionPolicy("h2o", budget=args.budget, recent=args.recent)
    section("engine_h2o", lambda: bench_engine(model, 1, prompt, image, nt, reps, dev, graph,
                                               attention=h2o))
    for agree in (False, True):
        section(f"spec_graph_{'agree' if agree else 'random'}", lambda agree=agree: bench_spec(
            model, args.draft_layers, args.k, prompt, image, nt, reps, dev, agree))
    hf = {}

    def hf_section(static: bool) -> dict:
        if "m" not in hf:
            hf["m"] = hf_model(cfg, dev, dtype)
        return bench_hf(hf["m"], seq_len, nt, static, reps, dev)

    section("hf_eager", lambda: hf_section(False), 30.0)
    section("hf_static", lambda: hf_section(True), 45.0)
    hf.clear()
    if args.compile:
        import torch._inductor.config as ic
        cdt0 = ic.coordinate_descent_tuning
        for v in args.variants:
            compiled_sections(section, v, model, prompt, image, dev, graph)
        ic.coordinate_descent_tuning = cdt0
    write(res, out)


def compiled_sections(section, v: str, model, prompt: list[int],  # noqa: ANN001
                      image: torch.Tensor, dev: torch.device, graph: bool) -> None:
    """engine_step_compiled[_v], its _x{multi} row (same engine: no new compile) and its
    kernel census (CUDA)."""
    if v not in VARIANTS:
        raise SystemExit(f"--variants: {v!r} is not one of {sorted(VARIANTS)}")
    name = "engine_step_compiled" + (f"_{v}" if v else "")
    keep: dict = {}
    nt, reps = args.new_tokens, args.reps
    section(name, lambda: dict(bench_engine(
        model, 1, prompt, image, nt, reps, dev, graph, compile=True, keep=keep,
        compile_step=True, coordinate_descent=args.cdt, **VARIANTS[v]), options=VARIANTS[v]),
        args.compile_cost_s)
    if "eng" not in keep:
        return

    def multi() -> dict:
        keep["eng"].set_steps_per_replay(args.multi)
        return dict(bench_engine(model, 1, prompt, image, nt, reps, dev, graph, compile=True,
                                 eng=keep["eng"]), options=VARIANTS[v])
    section(f"{name}_x{args.multi}", multi, 3.0)
    if graph:
        section(f"kernel_census_{v or 'compiled'}",
                lambda: kernel_census(keep["eng"], prompt, image), 3.0)
    keep.clear()


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
    ap.add_argument("--compile", action="store_true", help="the compiled whole-step sections")
    ap.add_argument("--cdt", action="store_true", help="inductor coordinate-descent tuning")
    ap.add_argument("--multi", type=int, default=8, help="decode steps per graph replay")
    ap.add_argument("--sharpen", type=float, default=1.0,
                    help="scale the random weight matrices (CPU tests use 30: varied text)")
    ap.add_argument("--n-global", type=int, default=64)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--budget", type=int, default=192)
    ap.add_argument("--recent", type=int, default=64)
    ap.add_argument("--only", nargs="*", default=None, help="run only these sections")
    ap.add_argument("--git-commit", default="")
    ap.add_argument("--out", default="docs/benchmarks/planner_cpu")
    ap.add_argument("--variants", nargs="*", default=["", "cublas"],
                    help=f"compiled-step variants with --compile ('' = default), in order; "
                         f"from {sorted(VARIANTS)}")
    ap.add_argument("--budget-s", type=float, default=0.0,
                    help="skip a section whose estimated cost would pass this many seconds "
                         "since the start (0: no budget)")
    ap.add_argument("--compile-cost-s", type=float, default=60.0,
                    help="estimated seconds of one compiled-step section (budget guard)")
    ap.add_argument("--render", default="", help="only redo --out's .md/.json from this JSON")
    ap.add_argument("--merge", default="",
                    help="with --render: add this JSON's rows (tagged as a new call) first")
    args = ap.parse_args()
    if args.render:
        base = json.loads(Path(args.render).read_text())
        if args.merge:
            merge(base, json.loads(Path(args.merge).read_text()))
        write(base, Path(args.out))
        sys.exit(0)
    if args.dtype is None:
        args.dtype = "bf16" if args.device.startswith("cuda") else "fp32"
    main()
