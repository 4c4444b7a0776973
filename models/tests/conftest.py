"""Shared by every test under models/tests: one torch intra-op thread (the CI machine has two
cores, shared with the DDS tests' processes), and `cpu_graphs`, the CUDA-graph code paths on
the CPU."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread() -> None:
    torch.set_num_threads(1)


class _Replay:
    """A CUDA graph's stand-in on the CPU: replay() runs the captured function again and
    writes into the output of the first call, as a replay refreshes a graph's static output."""

    def __init__(self, fn: Callable, out: object) -> None:
        self.fn, self.out = fn, out

    def replay(self) -> None:
        new = self.fn()  # a tensor, a tuple of them, or None (it writes its own buffers)
        if isinstance(self.out, torch.Tensor):
            self.out.copy_(new)
        elif isinstance(self.out, tuple):
            for o, n in zip(self.out, new, strict=True):
                o.copy_(n)


def _capture(fn: Callable, pool: object, state: tuple = ()) -> tuple[_Replay, object]:
    """graphs.capture's contract: the warm-up runs fn, the state it changed is put back."""
    saved = [t.clone() for t in state]
    out = fn()
    for t, s in zip(state, saved, strict=True):
        t.copy_(s)
    return _Replay(fn, out), out


@pytest.fixture
def cpu_graphs(monkeypatch: pytest.MonkeyPatch) -> Callable[[ModuleType], None]:
    """cpu_graphs(module): that module's `capture` (graphs.capture) makes _Replay graphs, so a
    decoder switched to its CUDA-graph path runs it on the CPU. Replays recompute, so this
    checks that every input a graph reads is refreshed in its static buffer before a replay,
    not what a real capture freezes."""
    def patch(module: ModuleType) -> None:
        monkeypatch.setattr(module, "capture", _capture)
    return patch
