"""Timing helpers shared by the subcommands: host clocks around calls, CUDA events, and CUDA
graph replays. torch is imported only by the functions that need it."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np


def time_calls(fn: Callable[[], object], iters: int, warmup: int = 0) -> np.ndarray:
    """Seconds per call of `fn()` (perf_counter_ns around each call), shape [iters], after
    `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    times = np.empty(iters)
    clock = time.perf_counter_ns
    for i in range(iters):
        a = clock()
        fn()
        times[i] = (clock() - a) * 1e-9
    return times


def device_times_ms(fn: Callable[[], object], iters: int, warmup: int, cuda: bool,
                    gap_ms: float = 0.0) -> np.ndarray:
    """Milliseconds per call of `fn()`: CUDA events around each call on a GPU (device time),
    perf_counter on the CPU. gap_ms > 0: the device idles that long before each call
    (synchronize + sleep), as a node does between frames."""
    for _ in range(warmup):
        fn()
    if not cuda:
        out = np.empty(iters)
        for i in range(iters):
            if gap_ms > 0:
                time.sleep(gap_ms * 1e-3)
            t0 = time.perf_counter()
            fn()
            out[i] = (time.perf_counter() - t0) * 1e3
        return out
    import torch

    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
          for _ in range(iters)]
    for s, e in ev:
        if gap_ms > 0:
            torch.cuda.synchronize()
            time.sleep(gap_ms * 1e-3)
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return np.array([s.elapsed_time(e) for s, e in ev])


def cuda_graph_ms(fn: Callable[[], object], iters: int, warmup: int,
                  eager_fallback: bool = False) -> tuple[np.ndarray, object, bool]:
    """Device time (ms) of `fn()` replayed as a CUDA graph: one eager call (compiles, lazy
    init), one on a side stream, the capture, `warmup` untimed replays, then `iters` replays
    each between two CUDA events. Returns (ms [iters], the captured call's output, captured).
    eager_fallback: time eager calls (captured False) when the capture raises."""
    import torch

    out = fn()
    run, captured = fn, False
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn()
        run, captured = graph.replay, True
    except Exception:  # noqa: BLE001 (not capturable)
        if not eager_fallback:
            raise
        torch.cuda.synchronize()
    return device_times_ms(run, iters, warmup, cuda=True), out, captured
