"""CUDA graphs' stand-in on the CPU, for tests of the decoders' graph code paths: `cpu_capture`
keeps graphs.capture's contract (the warm-up runs the function, the state it changed is put
back; returns (graph, output)), and its graphs' replay() runs the function again and writes
into the first call's output, as a replay refreshes a graph's static output. Replays
recompute, so a test on them checks that every input a graph reads is refreshed in its static
buffer before a replay; not what a real capture freezes (Python values, allocations).

The `cpu_graphs` fixture (conftest.py of models/tests and of kestrel_planner's tests import
it) puts cpu_capture in place of the planner's graphs.capture for one test."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch

__all__ = ["CpuGraph", "cpu_capture", "cpu_graphs"]


class CpuGraph:
    def __init__(self, fn: Callable[[], object], out: object) -> None:
        self.fn, self.out = fn, out

    def replay(self) -> None:
        new = self.fn()  # a tensor, a tuple of them, or None (it writes its own buffers)
        if isinstance(self.out, torch.Tensor):
            self.out.copy_(new)
        elif isinstance(self.out, tuple):
            for o, n in zip(self.out, new, strict=True):
                o.copy_(n)


def cpu_capture(fn: Callable[[], object], pool: object = None,
                state: Sequence[torch.Tensor] = ()) -> tuple[CpuGraph, object]:
    saved = [t.clone() for t in state]
    out = fn()
    for t, s in zip(state, saved, strict=True):
        t.copy_(s)
    return CpuGraph(fn, out), out


@pytest.fixture
def cpu_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The planner's CUDA-graph code paths on the CPU: `capture` in graphs.py and in the engine
    (which imports it) is cpu_capture for the test."""
    import kestrel_models.planner.engine as engine_mod
    import kestrel_models.planner.graphs as graphs_mod

    for module in (engine_mod, graphs_mod):
        monkeypatch.setattr(module, "capture", cpu_capture)
