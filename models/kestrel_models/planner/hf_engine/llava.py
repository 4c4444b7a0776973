"""LLaVA-1.5 and LLaVA-NeXT (model_type 'llava', 'llava_next'; Llama or Mistral decoders) on
the decode engine.

Image: resized to the vision tower's square input (S = vision_config.image_size) and
normalised with the directory's preprocessor_config.json mean/std (CLIP's when absent); the
checkpoint's own vision tower and projector run it (get_image_features: the configured feature
layer and select strategy). Block: N image tokens (image_token_id), N = (S / patch)^2 (+1 for
the 'full' strategy). LLaVA-NeXT: the image is treated as an S x S picture (image_sizes =
(S, S)): the base view plus the any-resolution grid that transformers picks for that size
(select_best_resolution over image_grid_pinpoints; the view placed in that canvas and cut into
S x S patches), packed with the checkpoint's image_newline (unpadding included), so N is the
length transformers computes for an S x S image.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from kestrel_models.planner.hf_engine.common import (HFDecoder, Unsupported, features_of,
                                                     normalize)

__all__ = ["LlavaDecoder", "MODEL_TYPES"]

MODEL_TYPES = ("llava", "llava_next")


def best_resolution(size: tuple[int, int], pinpoints: list) -> tuple[int, int]:
    """transformers' select_best_resolution: the (h, w) of `pinpoints` that keeps most of an
    image of `size` (h, w) and wastes least."""
    h0, w0 = size
    best, best_eff, best_waste = (h0, w0), 0, float("inf")
    for h, w in pinpoints:
        scale = min(w / w0, h / h0)
        eff = min(int(w0 * scale) * int(h0 * scale), w0 * h0)
        waste = w * h - eff
        if eff > best_eff or (eff == best_eff and waste < best_waste):
            best, best_eff, best_waste = (int(h), int(w)), eff, waste
    return best


class LlavaDecoder(HFDecoder):
    family = "llava"

    def __init__(self, hf: Any, path: str | Path | None, packed: dict) -> None:
        super().__init__(hf, path, packed)
        cfg = hf.config
        vc = cfg.vision_config
        self.family = cfg.model_type
        self.next = cfg.model_type == "llava_next"
        tok = getattr(cfg, "image_token_id", None)
        if tok is None:
            tok = getattr(cfg, "image_token_index", None)
        if tok is None or not getattr(vc, "image_size", None) or not getattr(vc, "patch_size",
                                                                              None):
            raise Unsupported(f"{type(hf).__name__}: no image_token_id or vision image_size/"
                              "patch_size in its config")
        self.image_marker = int(tok)
        self.image_prompt_ids = [self.image_marker]
        self.size = int(vc.image_size)
        self.strategy = getattr(cfg, "vision_feature_select_strategy", "default")
        self.layer = getattr(cfg, "vision_feature_layer", -1)
        self.pinpoints = [tuple(p) for p in getattr(cfg, "image_grid_pinpoints", None) or []]
        if self.next and not self.pinpoints:
            raise Unsupported("llava_next config without image_grid_pinpoints")
        side = self.size // int(vc.patch_size)
        self._n_base = side * side + int(self.strategy == "full")
        self._n: int | None = None if self.next else self._n_base

    def image_tokens(self, shape: tuple[int, ...]) -> int:
        if self._n is None:  # LLaVA-NeXT: the length transformers packs for an S x S image
            with torch.inference_mode():
                img = torch.zeros(1, 3, self.size, self.size, dtype=torch.uint8,
                                  device=self.device)
                self._n = int(self._features(img).shape[1])
        return self._n

    def _patches(self, x: Tensor) -> Tensor:
        """Normalised views [n, 3, S, S] -> [n, 1 + gh * gw, 3, S, S]: the base view, then the
        view placed in the best-fit canvas (aspect kept, centred, black padding) cut into S x S
        tiles in row-major order."""
        s = self.size
        ch, cw = best_resolution((s, s), self.pinpoints)
        scale = min(cw / s, ch / s)
        nh, nw = int(s * scale), int(s * scale)
        big = F.interpolate(x.float(), size=(nh, nw), mode="bilinear", align_corners=False,
                            antialias=True)
        black = (-self.mean / self.std).view(1, 3, 1, 1)  # the processor pads with black pixels
        canvas = black.expand(x.shape[0], 3, ch, cw).clone()
        top, left = (ch - nh) // 2, (cw - nw) // 2
        canvas[:, :, top:top + nh, left:left + nw] = big
        tiles = canvas.unfold(2, s, s).unfold(3, s, s)  # [n, 3, gh, gw, S, S]
        tiles = tiles.permute(0, 2, 3, 1, 4, 5).reshape(x.shape[0], -1, 3, s, s)
        return torch.cat([x[:, None].float(), tiles], dim=1).to(x.dtype)

    def _features(self, images: Tensor) -> Tensor:
        n, s = images.shape[0], self.size
        x = normalize(images.to(self.device), (s, s), self.mean, self.std, self.vision_dtype)
        kw: dict[str, Any] = dict(vision_feature_layer=self.layer,
                                  vision_feature_select_strategy=self.strategy)
        if not self.next:
            return features_of(self.hf.model.get_image_features(pixel_values=x, **kw), n)
        sizes = torch.tensor([[s, s]] * n, device=self.device)
        out = self.hf.model.get_image_features(pixel_values=self._patches(x), image_sizes=sizes,
                                               **kw)
        feats = getattr(out, "pooler_output", out)
        if isinstance(feats, (list, tuple)) and feats and feats[0].ndim == 3:
            # versions whose get_image_features leaves the packing to forward()
            feats, _ = self.hf.model.pack_image_features(
                list(feats), sizes, vision_feature_select_strategy=self.strategy,
                image_newline=self.hf.model.image_newline)
        return features_of(feats, n)

    def embed_image(self, images: Tensor) -> Tensor:
        return self._features(images).to(self.dtype)

    def pixel_kwargs(self, images: Tensor) -> dict:
        s = self.size
        x = normalize(images, (s, s), self.mean, self.std, self.vision_dtype)
        if not self.next:
            return {"pixel_values": x}
        sizes = torch.tensor([[s, s]] * x.shape[0], device=x.device)
        return {"pixel_values": self._patches(x), "image_sizes": sizes}
