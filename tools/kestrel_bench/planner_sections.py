"""The measured paths of `kestrel_bench planner`: HF transformers generate() baselines, our
DecodeEngine (eager, CUDA graph, compiled step, multi-step replays, concurrent streams, cached
prefix, attention policies), speculative decoding, and a kernel census of a warm engine.

Each returns a dict: "tpot_ms" (a stats.summary of the intervals between consecutive tokens of
one stream, ms), "tok_s" (1 / median time per output token for one stream), "ttft_ms" (submit
-> first token on the host: vision encode, prefill, sampling, sync), "power" (NVML over the
timed repetitions, J per token), and path-specific metrics.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kestrel_bench import memory, stats
from kestrel_bench.power import PowerMeter

NO_EOS = -1  # never sampled: every request decodes exactly new_tokens tokens
# compiled-step variants: name suffix -> DecodeEngine options ("" = the default compiled step)
STEP_VARIANTS: dict[str, dict] = {
    "": {},
    "cublas": dict(gemv="cublas"),
    "sdpa": dict(gemv="cublas", decode_attention="sdpa"),
    "fast": dict(gemv="cublas", decode_attention="sdpa", greedy="two_stage"),
    "triton": dict(decode_attention="triton"),
    "triton_mlp": dict(mlp="triton"),
    "triton_fused": dict(decode_attention="triton_fused", mlp="triton_down"),
    "torch": dict(decode_attention="grouped", mlp="inductor"),
}


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _meter(dev: torch.device) -> PowerMeter | None:
    return PowerMeter() if dev.type == "cuda" else None


def _power(meter: PowerMeter | None, tokens: int) -> dict:
    return meter.result(tokens, "token") if meter else {"skipped": "runs on the CPU"}


def hf_model(cfg: Any, dev: torch.device, dtype: torch.dtype) -> Any:
    """HF Qwen2ForCausalLM with our decoder's shape (random init), SDPA attention."""
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


def bench_hf(model: Any, prompt_len: int, new_tokens: int, static: bool, reps: int,
             dev: torch.device) -> dict:
    """generate() greedy, text-only prompt as long as ours (image + prompt tokens); static:
    cache_implementation='static' (auto-compiled decode on CUDA)."""
    ids = torch.randint(0, 256, (1, prompt_len), device=dev)
    kw = dict(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
              pad_token_id=0, attention_mask=torch.ones_like(ids))
    if static:
        kw["cache_implementation"] = "static"
    t0 = time.perf_counter()
    for _ in range(2):  # warm-up (compiles the static-cache decode on CUDA)
        model.generate(ids, **kw)
    warm = time.perf_counter() - t0
    memory.reset_peak(dev.type == "cuda")
    ttft, gaps, meter = [], [], _meter(dev)
    if meter:
        meter.start()
    for _ in range(reps):
        st = _Stamps(dev)
        sync(dev)
        t0 = time.perf_counter()
        model.generate(ids, streamer=st, **kw)
        ttft.append((st.t[0] - t0) * 1e3)
        gaps += list(np.diff(st.t))
    if meter:
        meter.stop()
    tpot = stats.summary(gaps, 1e3)
    return dict(tpot_ms=tpot, tok_s=1e3 / tpot["p50"], ttft_ms=statistics.median(ttft),
                warmup_s=warm, peak_mb=memory.peak_mb(dev.type == "cuda"),
                power=_power(meter, reps * (new_tokens - 1)))


def run_streams(eng: Any, n: int, prompt: list[int], image: torch.Tensor,
                new_tokens: int) -> dict:
    stamps: list[list[float]] = [[] for _ in range(n)]
    reqs = [eng.submit(prompt, new_tokens, image,
                       on_token=lambda _t, i=i: stamps[i].append(time.perf_counter()))
            for i in range(n)]
    eng.run()
    first, last = max(s[0] for s in stamps), max(s[-1] for s in stamps)
    after = sum(sum(1 for t in s if t > first) for s in stamps)
    # per stream: mean interval over its whole decode (multi-step replays deliver tokens in
    # bursts, so single gaps between callbacks are not the step time)
    per_stream = [(s[-1] - s[0]) / (len(s) - 1) for s in stamps if len(s) > 1]
    return dict(ttft_ms=[1e3 * r.ttft_s for r in reqs], per_stream_s=per_stream,
                agg_tok_s=after / (last - first) if last > first else None)


def bench_engine(model: Any, n: int, prompt: list[int], image: torch.Tensor, new_tokens: int,
                 reps: int, dev: torch.device, graph: bool, max_len: int,
                 reference: dict, prefix: list[int] | None = None, eng: Any = None,
                 keep: dict | None = None, **kw: Any) -> dict:
    """Our engine, n concurrent streams. reference: the first engine row's greedy tokens (the
    others report their agreement with it)."""
    from kestrel_models.planner.engine import DecodeEngine

    t0 = time.perf_counter()
    if eng is None:
        eng = DecodeEngine(model, max_batch=max(n, 1), max_len=max_len, eos_id=NO_EOS,
                           cuda_graph=graph, system_prefix=prefix or (), **kw)
    if keep is not None:
        keep["eng"] = eng
    run_streams(eng, n, prompt, image, new_tokens)  # warm-up: captures the graphs used
    warm = time.perf_counter() - t0
    memory.reset_peak(dev.type == "cuda")
    meter = _meter(dev)
    if meter:
        meter.start()
    runs = [run_streams(eng, n, prompt, image, new_tokens) for _ in range(reps)]
    if meter:
        meter.stop()
    toks = eng.generate([prompt], new_tokens, images=[image]).tokens[0]
    if not reference:
        reference.update(tokens=toks, prompt=prompt)
    same = ([a == b for a, b in zip(toks, reference["tokens"], strict=False)]
            if prompt == reference["prompt"] else [])
    per = [t for r in runs for t in r["per_stream_s"]]
    tpot = stats.summary(per, 1e3)
    ttfts = sorted(t for r in runs for t in r["ttft_ms"])
    out = dict(streams=n, tpot_ms=tpot, tok_s=1e3 / tpot["p50"], ttft_ms=statistics.median(ttfts),
               ttft_ms_max=ttfts[-1], warmup_s=warm, peak_mb=memory.peak_mb(dev.type == "cuda"),
               graphs=len(getattr(eng, "_graphs", ())), cuda_graph=eng.cuda_graph,
               steps_per_replay=eng.steps_per_replay, attention=eng.kv.policy.mode,
               agree_vs_first=sum(same) / len(same) if same else None,
               distinct_tokens=len(set(toks)),
               power=_power(meter, reps * n * (new_tokens - 1)))
    if n > 1:
        out["agg_tok_s"] = statistics.median(r["agg_tok_s"] for r in runs if r["agg_tok_s"])
    return out


def first_layers(model: Any, n_layers: int) -> Any:
    """A VisionLanguageModel of the model's first n_layers (shares its tensors)."""
    from kestrel_models.planner import VisionLanguageModel

    cfg = model.cfg.with_overrides(n_layers=n_layers)
    with torch.device("meta"):
        draft = VisionLanguageModel(cfg)
    state = {k: v for k, v in model.state_dict().items()
             if not k.startswith("layers.") or int(k.split(".")[1]) < n_layers}
    draft.load_state_dict(state, assign=True)
    draft.rope_cos, draft.rope_sin = model.rope_cos, model.rope_sin
    if cfg.tie_embeddings:
        draft.lm_head.weight = draft.tok_emb.weight
    return draft.eval()


def bench_spec(model: Any, draft_layers: int, k: int, prompt: list[int], image: torch.Tensor,
               new_tokens: int, reps: int, dev: torch.device, agree: bool, max_len: int) -> dict:
    """SpeculativeDecoder, draft = the target's first layers. agree: the layers past them
    zeroed (same cost per pass), so the draft agrees on every token: the mechanism's ceiling."""
    from kestrel_models.planner.speculative import SpeculativeDecoder

    target = model
    if agree:
        target = copy.deepcopy(model)
        with torch.no_grad():
            for ly in target.layers[draft_layers:]:
                ly.attn.wo.weight.zero_()
                ly.w_down.weight.zero_()
    t0 = time.perf_counter()
    spec = SpeculativeDecoder(target, first_layers(target, draft_layers), k, 1, max_len, NO_EOS)
    spec.generate([prompt], new_tokens, images=[image])
    warm = time.perf_counter() - t0
    memory.reset_peak(dev.type == "cuda")
    per_tok, rates, rounds, ttft = [], [], [], []
    for _ in range(reps):
        sync(dev)
        r = spec.generate([prompt], new_tokens, images=[image])
        per_tok.append((r.total_s - r.ttft_s) / (len(r.tokens[0]) - 1))
        rates.append(r.acceptance_rate)
        rounds.append(r.rounds)
        ttft.append(r.ttft_s * 1e3)
    tpot = stats.summary(per_tok, 1e3)
    return dict(tpot_ms=tpot, tok_s=1e3 / tpot["p50"], k=k, draft_layers=draft_layers,
                acceptance_rate=statistics.median(rates),
                tokens_per_round=new_tokens / statistics.median(rounds),
                ttft_ms=statistics.median(ttft), peak_mb=memory.peak_mb(dev.type == "cuda"),
                warmup_s=warm, agree_target=agree)


def profile_kernels(run: Callable[[], int]) -> dict:
    """torch.profiler around run() (which runs steps on the GPU, waits for them and returns
    how many): kernels and GPU us per step, and the 12 longest kernels [name, us / step,
    calls / step]. Kernels that overlap (PDL) each count their whole span."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        steps = run()
    kern = [e for e in prof.key_averages()
            if e.device_type.name == "CUDA" and e.self_device_time_total > 0]
    top = sorted(kern, key=lambda e: -e.self_device_time_total)[:12]
    return dict(kernels_per_step=sum(e.count for e in kern) / steps,
                gpu_us_per_step=sum(e.self_device_time_total for e in kern) / steps,
                top=[[e.key[:80], round(e.self_device_time_total / steps, 2),
                      round(e.count / steps, 2)] for e in top])


def kernel_table(name: str, census: dict) -> dict:
    """A record table ({"title", "columns", "rows"}) of a profile_kernels result."""
    return {"title": f"Kernels of {name} per decode step ({census['kernels_per_step']:.0f} "
                     f"kernels, {census['gpu_us_per_step']:.1f} us GPU)",
            "columns": ["kernel", "us / step", "calls / step"], "rows": census["top"]}


def kernel_census(eng: Any, prompt: list[int], image: torch.Tensor) -> dict:
    """profile_kernels over 16 decode steps of a warm engine."""
    r = eng.submit(prompt, 160, image)
    eng.step()  # admit + first steps outside the window
    s0 = eng.steps

    def run() -> int:
        for _ in range(16):
            eng.step()
        sync(eng.device)
        return eng.steps - s0

    out = profile_kernels(run)
    eng.run()
    assert r.stop_reason
    return out
