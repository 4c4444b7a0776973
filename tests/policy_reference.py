"""The fp32 eager policy reference the control backend tests share (not a test module)."""

from __future__ import annotations

import torch


def eager_rollout(model, xs: list[torch.Tensor]) -> tuple[list[torch.Tensor], tuple]:
    """ActorCritic.step over xs (each [B, obs_dim]) on the CPU from the zero state, no grad.
    Returns (actions per step, each [B, A]; the final (h, c), each [1, B, H])."""
    h, c = model.initial_state(xs[0].shape[0], "cpu")
    out = []
    with torch.no_grad():
        for x in xs:
            a, _, h, c = model.step(x, h, c)
            out.append(a)
    return out, (h, c)
