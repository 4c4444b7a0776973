"""Shared by every test under models/tests: one torch intra-op thread (the CI machine has two
cores, shared with the DDS tests' processes)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread() -> None:
    torch.set_num_threads(1)
