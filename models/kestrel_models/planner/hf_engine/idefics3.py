"""Idefics3 and SmolVLM (model_type 'idefics3', 'smolvlm'; Llama decoders, SigLIP-style
vision tower, pixel-shuffle connector) on the decode engine.

Image: one view, resized to the vision tower's square input (S = vision_config.image_size; no
splitting into tiles) and normalised with the directory's mean/std (0.5, 0.5 when absent); the
checkpoint's own vision model and connector (pixel shuffle by scale_factor, projection) run it
with a full pixel_attention_mask. Block, as the processor writes a single image:
    <fake_token_around_image> <global-img> <image> x N <fake_token_around_image>
N = (S / patch)^2 / scale_factor^2. The two framing tokens' ids come from the directory's
tokenizer (the config has only image_token_id).
Vision tower: for a full square image transformers' per-image position bucketing and mask
checks (host syncs) reduce to positions 0..N-1 and no mask, so the checkpoint's patch
embedding, encoder, post-layernorm and connector run here with static shapes (the engine
captures the prefill as a CUDA graph), where that matches transformers' own forward on check
images at load; else transformers' eager forward (the reason is in describe()).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from kestrel_models.planner.hf_engine.common import (PARAM, HFDecoder, HFLoadError,
                                                     check_close, features_of, normalize)

__all__ = ["Idefics3Decoder", "MODEL_TYPES", "FAKE", "GLOBAL"]

MODEL_TYPES = ("idefics3", "smolvlm")
FAKE, GLOBAL = "<fake_token_around_image>", "<global-img>"


def special_id(tokenizer: Any, token: str, path: str) -> int:
    tid = tokenizer.convert_tokens_to_ids(token) if tokenizer is not None else None
    unk = getattr(tokenizer, "unk_token_id", None)
    if not isinstance(tid, int) or tid < 0 or tid == unk:
        raise HFLoadError(f"parameter '{PARAM}' = {path!r}: the tokenizer has no {token} token "
                          "(the image block of Idefics3 / SmolVLM needs it)")
    return tid


class Idefics3Decoder(HFDecoder):
    default_mean = (0.5, 0.5, 0.5)
    default_std = (0.5, 0.5, 0.5)

    def __init__(self, hf: Any, path: str | Path | None, packed: dict,
                 tokenizer: Any = None) -> None:
        super().__init__(hf, path, packed)
        cfg = hf.config
        vc = cfg.vision_config
        self.family = cfg.model_type
        self.size = int(vc.image_size)
        scale = int(getattr(cfg, "scale_factor", 1) or 1)
        self.n_feat = (self.size // int(vc.patch_size)) ** 2 // (scale * scale)
        self.image_marker = int(cfg.image_token_id)
        if tokenizer is None and path:
            from transformers import AutoTokenizer
            try:
                tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
            except Exception as exc:  # noqa: BLE001 - say why, naming the parameter
                raise HFLoadError(f"parameter '{PARAM}' = {str(path)!r}: no loadable tokenizer "
                                  f"there ({type(exc).__name__}: {exc}); Idefics3 / SmolVLM "
                                  "need it for their image tokens") from exc
        fake, glob = special_id(tokenizer, FAKE, str(path)), special_id(tokenizer, GLOBAL,
                                                                         str(path))
        block = [fake, glob, *([self.image_marker] * self.n_feat), fake]
        self.block = torch.tensor(block, dtype=torch.long, device=self.device)
        self.image_prompt_ids = [self.image_marker]
        self._static = self.static_vision(self._check_static) is not None

    def _check_static(self) -> bool:
        """The static-shape tower's modules exist and it matches transformers' tower on two
        check images (ValueError otherwise)."""
        m = self.hf.model
        for obj, name in ((m, "vision_model"), (m, "connector")):
            if not hasattr(obj, name):
                raise ValueError(f"the model has no {name}")
        vm = m.vision_model
        for name in ("embeddings", "encoder", "post_layernorm"):
            if not hasattr(vm, name):
                raise ValueError(f"the vision model has no {name}")
        g = torch.Generator().manual_seed(0)
        img = torch.randint(0, 256, (2, 3, self.size, self.size), dtype=torch.uint8,
                            generator=g).to(self.device)
        with torch.inference_mode():
            check_close(self._features_static(img), self._features_hf(img),
                        self.vision_dtype, "two check images")
        return True

    def image_tokens(self, shape: tuple[int, ...]) -> int:
        return self.n_feat + 3

    def block_ids(self, shape: tuple[int, ...]) -> list[int]:
        return [int(t) for t in self.block.tolist()]

    def pixel_kwargs(self, images: Tensor) -> dict:
        n, s = images.shape[0], self.size
        x = normalize(images, (s, s), self.mean, self.std, self.vision_dtype)
        return {"pixel_values": x[:, None],
                "pixel_attention_mask": torch.ones(n, 1, s, s, dtype=torch.bool,
                                                   device=x.device)}

    def _features_hf(self, images: Tensor) -> Tensor:
        out = self.hf.model.get_image_features(**self.pixel_kwargs(images.to(self.device)))
        return features_of(out, images.shape[0])

    def _features_static(self, images: Tensor) -> Tensor:
        """uint8 [n, 3, H, W] -> connector features [n, N, D]: the full-image case of
        transformers' forward (positions 0..P-1, no attention mask), static shapes."""
        s, m = self.size, self.hf.model
        vm = m.vision_model
        x = normalize(images.to(self.device), (s, s), self.mean, self.std, self.vision_dtype)
        h = vm.embeddings.patch_embedding(x).flatten(2).transpose(1, 2)  # [n, P, C]
        h = h + vm.embeddings.position_embedding.weight[None, :h.shape[1]]
        out = vm.encoder(inputs_embeds=h, attention_mask=None)
        h = vm.post_layernorm(out[0] if isinstance(out, tuple) else out.last_hidden_state)
        return m.connector(h)

    def embed_image(self, images: Tensor) -> Tensor:
        n = images.shape[0]
        feats = (self._features_static(images) if self._static
                 else self._features_hf(images)).to(self.dtype)  # [n, N, D]
        frame = F.embedding(self.block, self.embed)  # [N + 3, D]
        return torch.cat([frame[None, :2].expand(n, -1, -1), feats,
                          frame[None, -1:].expand(n, -1, -1)], dim=1)
