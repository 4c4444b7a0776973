"""Qwen2-VL and Qwen2.5-VL (model_type 'qwen2_vl', 'qwen2_5_vl') on the decode engine: a Qwen2
text decoder (qkv bias, M-RoPE) after the checkpoint's own vision transformer and patch merger.

Image: resized (bilinear, antialias) to the size the processor picks (smart_resize: both sides
multiples of patch_size * spatial_merge_size, pixel count within min_pixels..max_pixels of the
directory's preprocessor_config.json), normalised (its mean/std, CLIP's when absent) and cut
into patches as Qwen2VLImageProcessor does (one frame repeated temporal_patch_size times).
Block: N = (h / 28) * (w / 28) image_pad tokens (image_token_id; the chat template's
<|vision_start|> ... <|vision_end|> stay prompt text). M-RoPE: the block's tokens get the
positions (t, h, w) = start + (0, row, col) of the merged grid; the text after it continues at
start + max(rows, cols), so every later position is shifted by max(rows, cols) - N (the row's
rope offset in decode).
Vision tower: qwen_vision.py's static-shape forward of the checkpoint's own modules (so the
engine captures the whole prefill as a CUDA graph) where it matches transformers' forward on two
check grids at load; else transformers' eager forward (the reason is in describe()).
"""

from __future__ import annotations

import inspect
import math
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from kestrel_models.planner.hf_engine.common import (HFDecoder, check_close, features_of,
                                                     normalize)
from kestrel_models.planner.hf_engine.qwen_vision import QwenVision

__all__ = ["Qwen2VLDecoder", "MODEL_TYPES", "smart_resize"]

MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")
MIN_PIXELS, MAX_PIXELS = 56 * 56, 28 * 28 * 1280


def smart_resize(h: int, w: int, factor: int, min_pixels: int, max_pixels: int
                 ) -> tuple[int, int]:
    """transformers' Qwen2-VL smart_resize: (h, w) -> multiples of factor, aspect kept, pixel
    count within [min_pixels, max_pixels]."""
    if max(h, w) / min(h, w) > 200:
        raise ValueError(f"image of {h}x{w}: aspect ratio over 200")
    hb, wb = round(h / factor) * factor, round(w / factor) * factor
    if hb * wb > max_pixels:
        beta = math.sqrt(h * w / max_pixels)
        hb = max(factor, math.floor(h / beta / factor) * factor)
        wb = max(factor, math.floor(w / beta / factor) * factor)
    elif hb * wb < min_pixels:
        beta = math.sqrt(min_pixels / (h * w))
        hb, wb = math.ceil(h * beta / factor) * factor, math.ceil(w * beta / factor) * factor
    return hb, wb


class Qwen2VLDecoder(HFDecoder):
    def __init__(self, hf: Any, path: str | Path | None, packed: dict) -> None:
        super().__init__(hf, path, packed)
        cfg = hf.config
        vc = cfg.vision_config
        self.family = cfg.model_type
        self.patch = int(vc.patch_size)
        self.merge = int(getattr(vc, "spatial_merge_size", 2))
        self.tps = int(getattr(vc, "temporal_patch_size", 2))
        pc = self.preprocess_cfg
        size = pc.get("size") if isinstance(pc.get("size"), dict) else {}
        self.min_pixels = int(pc.get("min_pixels") or size.get("shortest_edge") or MIN_PIXELS)
        self.max_pixels = int(pc.get("max_pixels") or size.get("longest_edge") or MAX_PIXELS)
        self.image_marker = int(cfg.image_token_id)
        start = getattr(cfg, "vision_start_token_id", None)
        end = getattr(cfg, "vision_end_token_id", None)
        self.image_prompt_ids = ([start] if start is not None else []) + [self.image_marker] + (
            [end] if end is not None else [])
        self._vision = self.static_vision(lambda: self._checked_tower(vc))

    def _checked_tower(self, vc: Any) -> QwenVision:
        """qwen_vision's static-shape tower, after it matched transformers' on two check grids
        (unequal windows, then equal ones); ValueError otherwise."""
        visual = getattr(self.hf.model, "visual", None) or getattr(self.hf, "visual", None)
        vis = QwenVision(visual, vc)
        m = self.merge
        win = max(1, vis.window // m // self.patch) if vis.window else 2
        g = torch.Generator().manual_seed(0)
        for gh, gw in ((3 * m, 5 * m), (win * m, 2 * win * m)):
            pv = torch.randn(gh * gw, 3 * self.tps * self.patch ** 2, generator=g)
            pv = pv.to(self.device, self.vision_dtype)
            thw = torch.tensor([[1, gh, gw]], device=self.device)
            with torch.inference_mode():
                want = features_of(self.hf.model.get_image_features(
                    pixel_values=pv, image_grid_thw=thw), 1)
                got = vis(pv, 1, gh, gw)
            check_close(got, want, self.vision_dtype, f"a {gh}x{gw} patch grid")
        return vis

    def _grid(self, shape: tuple[int, ...]) -> tuple[int, int, int, int]:
        """[3, H, W] -> (resized h, w, merged rows, merged cols)."""
        f = self.patch * self.merge
        h, w = smart_resize(int(shape[-2]), int(shape[-1]), f, self.min_pixels,
                            self.max_pixels)
        return h, w, h // f, w // f

    def image_tokens(self, shape: tuple[int, ...]) -> int:
        _, _, gh, gw = self._grid(shape)
        return gh * gw

    def image_positions(self, shape: tuple[int, ...]) -> Tensor:
        _, _, gh, gw = self._grid(shape)
        rows = torch.arange(gh).repeat_interleave(gw)
        cols = torch.arange(gw).repeat(gh)
        return torch.stack([torch.zeros_like(rows), rows, cols], dim=1)  # [N, 3]

    def _patches(self, images: Tensor) -> tuple[Tensor, int, int]:
        """uint8 [n, 3, H, W] -> (pixel_values [n * gh * gw, 3 * tps * p * p] as
        Qwen2VLImageProcessor lays them out, gh, gw: the unmerged patch grid)."""
        n = images.shape[0]
        h, w, _, _ = self._grid(tuple(images.shape[1:]))
        x = normalize(images.to(self.device), (h, w), self.mean, self.std, torch.float32)
        p, m = self.patch, self.merge
        gh, gw = h // p, w // p
        x = x.reshape(n, 3, gh // m, m, p, gw // m, m, p).permute(0, 2, 5, 3, 6, 1, 4, 7)
        x = x.unsqueeze(6).expand(-1, -1, -1, -1, -1, -1, self.tps, -1, -1)
        return x.reshape(n * gh * gw, 3 * self.tps * p * p).to(self.vision_dtype), gh, gw

    def pixel_inputs(self, images: Tensor) -> tuple[Tensor, Tensor]:
        """uint8 [n, 3, H, W] -> (pixel_values, image_grid_thw [n, 3]): transformers' inputs."""
        pv, gh, gw = self._patches(images)
        thw = torch.tensor([[1, gh, gw]] * images.shape[0], dtype=torch.long,
                           device=self.device)
        return pv, thw

    def prepare_image(self, shape: tuple[int, ...]) -> None:
        if self._vision is not None:
            h, w, _, _ = self._grid(shape)
            self._vision.plan(h // self.patch, w // self.patch)

    def pixel_kwargs(self, images: Tensor) -> dict:
        pv, thw = self.pixel_inputs(images)
        return {"pixel_values": pv, "image_grid_thw": thw}

    def hf_inputs(self, prompt: list[int], image: Tensor | None) -> dict:
        kw = super().hf_inputs(prompt, image)
        params = inspect.signature(self.hf.forward).parameters
        if image is not None and "mm_token_type_ids" in params:  # newer transformers
            kw["mm_token_type_ids"] = (kw["input_ids"] == self.image_marker).int()
        return kw

    def embed_image(self, images: Tensor) -> Tensor:
        if self._vision is not None:
            pv, gh, gw = self._patches(images)
            return self._vision(pv, images.shape[0], gh, gw).to(self.dtype)
        pv, thw = self.pixel_inputs(images)
        out = self.hf.model.get_image_features(pixel_values=pv, image_grid_thw=thw)
        return features_of(out, images.shape[0]).to(self.dtype)
