"""Shared by every test under models/tests: one torch intra-op thread (the CI machine has two
cores, shared with the DDS tests' processes), and `cpu_graphs` (tests/cpu_graphs.py), the
CUDA-graph code paths on the CPU."""

from __future__ import annotations

import pytest
import torch
from cpu_graphs import cpu_graphs  # noqa: F401 - the fixture, for the tests here


@pytest.fixture(autouse=True)
def _one_torch_thread() -> None:
    torch.set_num_threads(1)
