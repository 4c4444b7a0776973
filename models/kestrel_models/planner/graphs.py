"""Manual CUDA-graph capture of a static-buffer function (decode steps, prefill, spec rounds).

`capture(fn, pool, state)` warms `fn` up twice on a side stream (cuBLAS/cuDNN set-up and, for a
torch.compile'd fn, its compilation happen outside the capture), captures one call into a
torch.cuda.CUDAGraph sharing the memory pool `pool`, and restores the tensors in `state`
(buffers that fn updates in place, e.g. positions) to their values before the warm-up, so
capturing has no visible effect beyond scratch writes. Returns (graph, fn's output): the
output tensors are static, refreshed by every replay. Replays of graphs that share a pool
must not overlap, and an output must be read before another graph of the pool replays.
`replay(graphs, key, fn, pool, state)`: the graph kept in `graphs` under `key` (captured from
fn on first use) replayed; returns its static output.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["capture", "replay"]


def capture(fn: Callable[[], Any], pool: Any, state: Sequence[Tensor] = ()
            ) -> tuple[torch.cuda.CUDAGraph, Any]:
    saved = [t.clone() for t in state]

    def restore() -> None:
        for t, s in zip(state, saved, strict=True):
            t.copy_(s)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
            restore()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool):
        out = fn()
    restore()
    return g, out


def replay(graphs: dict[Any, tuple[torch.cuda.CUDAGraph, Any]], key: Any,
           fn: Callable[[], Any], pool: Any, state: Sequence[Tensor] = ()) -> Any:
    if key not in graphs:
        graphs[key] = capture(fn, pool, state)
    g, out = graphs[key]
    g.replay()
    return out
