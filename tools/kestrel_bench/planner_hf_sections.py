"""The measured paths of `kestrel_bench planner-hf` (planner_hf.py): transformers' generate()
and our decode engine on the same random-weight checkpoint and the same request.

Each returns a dict: tpot_ms (stats.summary of one stream's time per output token, ms), tok_s
(1 / median TPOT), ttft_ms / ttft_p99_ms (submit -> first token on the host, vision tower
included), agg_tok_s (N streams: tokens decoded after the last stream's first token / the
time until the last token), floor_ms and floor_fraction (planner_hf's module doc), peak_mb.
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any

import numpy as np
import torch

from kestrel_bench import memory, stats
from kestrel_bench.planner_sections import run_streams, sync

NO_EOS = -1


def build(cfg: Any, dev: torch.device, dtype: torch.dtype) -> Any:
    """Random weights of the config on the device (transformers' own initialisation)."""
    from transformers import AutoModelForImageTextToText
    torch.manual_seed(0)
    with torch.device(dev):
        m = AutoModelForImageTextToText.from_config(cfg, dtype=dtype)
    m.generation_config.eos_token_id = None  # every request decodes exactly new_tokens
    return m.eval()


class Context:
    """One shape: the transformers model, the engine decoder mapped from it (kept alongside
    until to_engine(), which drops the transformers decoder layers), the request."""

    def __init__(self, model: Any, cfg: Any, dev: torch.device, dtype: torch.dtype,
                 prompt: list[int], image: torch.Tensor, args: Any, bandwidth: float,
                 tokenizer: Any) -> None:
        from kestrel_models.planner.hf_engine import from_model
        self.m, self.cfg, self.dev, self.dtype = model, cfg, dev, dtype
        self.prompt, self.image, self.args, self.bw = prompt, image, args, bandwidth
        self.dec = from_model(model, None, dev, tokenizer, consume=False)
        self.floor_ms = self.dec.weight_bytes() / bandwidth * 1e3
        self.n_img = self.dec.image_tokens(tuple(image.shape))
        self.eng: Any = None

    def to_engine(self) -> None:
        """Drop transformers' decoder layers (the engine holds the packed ones) and build the
        engine: max_batch = --concurrent slots, CUDA graphs on CUDA, --compile's step."""
        from kestrel_models.planner.engine import DecodeEngine
        text = getattr(self.m.model, "language_model", None) or self.m.model.text_model
        text.layers = torch.nn.ModuleList()
        gc.collect()
        if self.dev.type == "cuda":
            torch.cuda.empty_cache()
        a = self.args
        need = self.n_img + len(self.prompt) + a.new_tokens + 8
        max_len = 1 << (need - 1).bit_length()
        fast = a.compile and self.dev.type == "cuda"
        self.eng = DecodeEngine(self.dec, max(a.concurrent, 1), max_len, NO_EOS,
                                compile_step=fast, coordinate_descent=fast and a.cdt)

    def release(self) -> None:
        self.eng = self.dec = self.m = None
        gc.collect()
        if self.dev.type == "cuda":
            torch.cuda.empty_cache()


class _Stamps:
    """transformers streamer: host time of every generated step (after a device sync)."""

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


def _batched(kw: dict, n: int) -> dict:
    """One request's generate() inputs -> n copies in one batch (image inputs concatenated)."""
    return {k: v.repeat(n, *([1] * (v.ndim - 1))) if torch.is_tensor(v) else v
            for k, v in kw.items()}


def bench_hf(ctx: Context, n: int) -> dict:
    """transformers generate() of n copies of the request as one batch: static cache where it
    runs (transformers compiles its decode step on CUDA), else the dynamic cache."""
    a, dev = ctx.args, ctx.dev
    kw = _batched(ctx.dec.hf_inputs(ctx.prompt, ctx.image), n)
    gen = dict(max_new_tokens=a.new_tokens, do_sample=False, pad_token_id=0)
    cache, why = "static", ""
    t0 = time.perf_counter()
    with torch.inference_mode():
        try:
            for _ in range(2):  # warm-up (compiles the static-cache decode on CUDA)
                ctx.m.generate(**kw, cache_implementation="static", **gen)
        except Exception as exc:  # noqa: BLE001 - recorded: the dynamic cache runs instead
            cache, why = "dynamic", f"static cache failed: {type(exc).__name__}: {exc}"[:300]
            for _ in range(2):
                ctx.m.generate(**kw, **gen)
        warm = time.perf_counter() - t0
        memory.reset_peak(dev.type == "cuda")
        ttft, gaps, agg = [], [], []
        for _ in range(a.reps):
            st = _Stamps(dev)
            sync(dev)
            t0 = time.perf_counter()
            extra = {"cache_implementation": "static"} if cache == "static" else {}
            ctx.m.generate(**kw, streamer=st, **extra, **gen)
            ttft += [(st.t[0] - t0) * 1e3] * n
            gaps += list(np.diff(st.t))
            if n > 1 and len(st.t) > 1:
                agg.append(n * (len(st.t) - 1) / (st.t[-1] - st.t[0]))
    tpot = stats.summary(gaps, 1e3)
    out = dict(streams=n, tpot_ms=tpot, tok_s=1e3 / tpot["p50"],
               ttft_ms=statistics.median(ttft), ttft_p99_ms=float(np.percentile(ttft, 99)),
               warmup_s=warm, peak_mb=memory.peak_mb(dev.type == "cuda"), cache=cache,
               floor_ms=ctx.floor_ms, floor_fraction=ctx.floor_ms / tpot["p50"])
    if why:
        out["cache_note"] = why
    if agg:
        out["agg_tok_s"] = statistics.median(agg)
    return out


def bench_engine(ctx: Context, n: int) -> dict:
    """Our engine, n concurrent requests (continuous batching; the first run captures the
    graphs it uses and is not timed)."""
    a, dev, eng = ctx.args, ctx.dev, ctx.eng
    t0 = time.perf_counter()
    with torch.inference_mode():
        run_streams(eng, n, ctx.prompt, ctx.image, a.new_tokens)
        warm = time.perf_counter() - t0
        memory.reset_peak(dev.type == "cuda")
        runs = [run_streams(eng, n, ctx.prompt, ctx.image, a.new_tokens) for _ in range(a.reps)]
    per = [t for r in runs for t in r["per_stream_s"]]
    tpot = stats.summary(per, 1e3)
    ttfts = [t for r in runs for t in r["ttft_ms"]]
    out = dict(streams=n, tpot_ms=tpot, tok_s=1e3 / tpot["p50"],
               ttft_ms=statistics.median(ttfts), ttft_p99_ms=float(np.percentile(ttfts, 99)),
               warmup_s=warm, peak_mb=memory.peak_mb(dev.type == "cuda"),
               cuda_graph=eng.cuda_graph, prefill_graph=eng.prefill_graph,
               steps_per_replay=eng.steps_per_replay,
               decoder=ctx.dec.describe(),
               compiled_step=bool(a.compile and dev.type == "cuda"),
               image_tokens=ctx.n_img, floor_ms=ctx.floor_ms,
               floor_fraction=ctx.floor_ms / tpot["p50"])
    if n > 1:
        out["agg_tok_s"] = statistics.median(r["agg_tok_s"] for r in runs if r["agg_tok_s"])
    return out


def ratio_tag(shape: str) -> str:
    """A shape's name as it ends the record's ratio names ('qwen2.5-vl-3b' -> qwen2_5_vl_3b)."""
    return shape.replace(".", "_").replace("-", "_")


def to_record(record: Any, rows: dict[str, dict], shapes: list[str], n: int) -> None:
    """Rows -> the record: the first shape's hf row is the baseline, its engine row the
    optimized one; ratios engine_vs_hf_* per shape."""
    base = f"{shapes[0]}_hf" if shapes else ""
    for name, r in rows.items():
        role = ("baseline" if name == base else
                "optimized" if name == base.replace("_hf", "_engine") else "variant")
        if "error" in r or "tok_s" not in r:
            record.add(name, role, **{k: r[k] for k in ("skipped", "error") if k in r})
            continue
        metrics = {k: r[k] for k in ("ttft_ms", "ttft_p99_ms", "agg_tok_s", "streams",
                                     "floor_ms", "floor_fraction", "warmup_s", "image_tokens",
                                     "section_s") if r.get(k) is not None}
        cfg = {k: r[k] for k in ("cache", "cache_note", "cuda_graph", "prefill_graph",
                                 "steps_per_replay", "compiled_step", "decoder")
               if k in r}
        record.add(name, role, latency_ms=r["tpot_ms"], throughput=r["tok_s"], unit="tok/s",
                   peak_memory_mb=r.get("peak_mb"), metrics=metrics,
                   config={**cfg, "measure": "time per output token, one stream"})
    for shape in shapes:
        for suffix, key in (("", ""), (f"_c{n}", f"_c{n}")):
            h, e = rows.get(f"{shape}_hf{suffix}", {}), rows.get(f"{shape}_engine{suffix}", {})
            tag = ratio_tag(f"{shape}{key}")
            if "tok_s" in h and "tok_s" in e:
                speed = "agg_tok_s" if suffix and "agg_tok_s" in h and "agg_tok_s" in e \
                    else "tok_s"
                record.ratio(f"engine_vs_hf_tok_s_{tag}", e[speed] / h[speed])
                record.ratio(f"engine_vs_hf_ttft_{tag}", h["ttft_ms"] / e["ttft_ms"])
        h = rows.get(f"{shape}_hf", {})
        for name, r in rows.items():
            if name.startswith(f"{shape}_engine_x") and "tok_s" in r and "tok_s" in h:
                record.ratio(f"{name[len(shape) + 1:]}_vs_hf_tok_s_{ratio_tag(shape)}",
                             r["tok_s"] / h["tok_s"])
