"""The seeded tiny perception model the runtime and export tests share (not a test module)."""

from __future__ import annotations

import torch

from kestrel_models.perception import MultiTaskPerceptionModel, PerceptionConfig


def tiny_model(**kw: object) -> MultiTaskPerceptionModel:
    """PerceptionConfig.tiny(**kw) with seed-0 weights, in eval mode."""
    torch.manual_seed(0)
    return MultiTaskPerceptionModel(PerceptionConfig.tiny(**kw)).eval()
