"""Shared by every test under models/tests: one torch intra-op thread (the CI machine has two
cores, shared with the DDS tests' processes), and `cpu_graphs`, the CUDA-graph code paths on
the CPU."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import pytest
import torch
from cpu_graphs import cpu_capture


@pytest.fixture(autouse=True)
def _one_torch_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture
def cpu_graphs(monkeypatch: pytest.MonkeyPatch) -> Callable[[ModuleType], None]:
    """cpu_graphs(module): that module's `capture` (graphs.capture) becomes tests/cpu_graphs.py's
    cpu_capture, so a decoder switched to its CUDA-graph path runs it on the CPU."""
    def patch(module: ModuleType) -> None:
        monkeypatch.setattr(module, "capture", cpu_capture)
    return patch
