"""The tiny planner VLM and inputs the decode-engine tests share (not a test module)."""

from __future__ import annotations

import torch

from kestrel_models.planner import VisionLanguageModel, get_config


def sharp_tiny(device: str = "cpu") -> VisionLanguageModel:
    """The tiny config, seed-0 weights scaled x30 so that greedy text varies token to token."""
    torch.manual_seed(0)
    m = VisionLanguageModel(get_config("tiny")).to(device).eval()
    with torch.no_grad():
        for p in m.parameters():
            if p.ndim >= 2:
                p.mul_(30.0)
    return m


def prompts(seed: int = 3, lens: tuple[int, ...] = (7, 12, 3)) -> list[list[int]]:
    """Random byte-token prompts of the given lengths."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lens]


def image(seed: int = 1, device: str = "cpu") -> torch.Tensor:
    """A random uint8 [3, 32, 32] image."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (3, 32, 32), dtype=torch.uint8, generator=g).to(device)
