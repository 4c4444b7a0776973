"""Configuration of the planner VLM, validated up front, and the named presets.

Presets:
- "tiny": ~1.7M parameters, 32x32 images -> 16 image tokens; runs on one CPU thread in tests.
- "small": ~0.9M parameters, 32x32 images -> 4 image tokens; the size of the planner weights
  trained on generated scenes (kestrel_planner.training, scripts/train_planner.py).
- "draft": ~0.1M parameters, the speculative-decoding draft of "small": the same tokenizer,
  vocabulary, image size and sequence length, a 1-layer decoder of width 64 (trained on the
  same task: scripts/train_planner.py --preset draft).
- "0.5b": the reference size (~0.58B: a ViT-B/16 vision tower, Qwen2-0.5B-shaped decoder with
  GQA 14/2 heads, vocab 151936). Expressible and countable (on the meta device), not run here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

__all__ = ["VLMConfig", "PRESETS", "get_config"]


def _check(name: str, value: object, ok: bool, rule: str) -> None:
    if not ok:
        raise ValueError(f"parameter '{name}' = {value!r}: {rule}")


@dataclass(frozen=True)
class VLMConfig:
    """Vision encoder -> MLP projector -> decoder-only transformer. Sizes in elements."""

    # Vision tower (ViT, pre-LN): image [B, 3, image_size, image_size] -> patches.
    image_size: int = 32
    patch_size: int = 8
    vision_dim: int = 64
    vision_depth: int = 2
    vision_heads: int = 4
    vision_mlp_ratio: float = 4.0
    # Projector: vision_dim -> projector_hidden -> dim (GELU MLP).
    projector_hidden: int = 128
    # Decoder (RMSNorm, RoPE, GQA, SwiGLU).
    dim: int = 192
    n_layers: int = 4
    n_heads: int = 6
    n_kv_heads: int = 2
    ffn_hidden: int = 512
    rope_theta: float = 10000.0
    vocab_size: int = 260
    max_seq_len: int = 1024
    norm_eps: float = 1e-5
    tie_embeddings: bool = True

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.type in ("int", int) and not isinstance(v, bool):
                _check(f.name, v, isinstance(v, int) and v > 0, "must be a positive integer")
        _check("image_size", self.image_size, self.image_size % self.patch_size == 0,
               f"must be a multiple of patch_size ({self.patch_size})")
        _check("vision_dim", self.vision_dim, self.vision_dim % self.vision_heads == 0,
               f"must be divisible by vision_heads ({self.vision_heads})")
        _check("vision_mlp_ratio", self.vision_mlp_ratio, self.vision_mlp_ratio > 0,
               "must be > 0")
        _check("dim", self.dim, self.dim % self.n_heads == 0,
               f"must be divisible by n_heads ({self.n_heads})")
        _check("n_heads", self.n_heads, self.n_heads % self.n_kv_heads == 0,
               f"must be a multiple of n_kv_heads ({self.n_kv_heads})")
        _check("dim", self.dim, (self.dim // self.n_heads) % 2 == 0,
               "dim / n_heads (head_dim) must be even for RoPE")
        _check("rope_theta", self.rope_theta, self.rope_theta > 0, "must be > 0")
        _check("norm_eps", self.norm_eps, 0 < self.norm_eps < 1, "must be in (0, 1)")
        _check("max_seq_len", self.max_seq_len, self.max_seq_len > self.num_image_tokens,
               f"must exceed the number of image tokens ({self.num_image_tokens})")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def num_image_tokens(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    def to_dict(self) -> dict:
        return asdict(self)

    def with_overrides(self, **kwargs: object) -> VLMConfig:
        return replace(self, **kwargs)


PRESETS: dict[str, VLMConfig] = {
    "tiny": VLMConfig(),
    # the size trained on generated scenes (kestrel_planner.training): 4 image tokens, a
    # 4-layer decoder; trains in minutes on one GPU (scripts/train_planner.py --device cuda)
    "small": VLMConfig(patch_size=16, vision_dim=32, vision_depth=1, vision_heads=2,
                       projector_hidden=64, dim=128, n_layers=4, n_heads=4, n_kv_heads=2,
                       ffn_hidden=384, max_seq_len=512),
    # the draft of "small" for speculative decoding: what the target decodes must be in its
    # vocabulary and reach (same tokenizer, vocab_size, image_size, max_seq_len), fewer and
    # narrower layers so that k draft passes cost less than one target pass
    "draft": VLMConfig(patch_size=16, vision_dim=32, vision_depth=1, vision_heads=2,
                       projector_hidden=64, dim=64, n_layers=1, n_heads=2, n_kv_heads=1,
                       ffn_hidden=128, max_seq_len=512),
    "0.5b": VLMConfig(
        image_size=224, patch_size=16, vision_dim=768, vision_depth=12, vision_heads=12,
        vision_mlp_ratio=4.0, projector_hidden=3584, dim=896, n_layers=24, n_heads=14,
        n_kv_heads=2, ffn_hidden=4864, rope_theta=1_000_000.0, vocab_size=151_936,
        max_seq_len=32_768, norm_eps=1e-6, tie_embeddings=True,
    ),
}


def get_config(name: str) -> VLMConfig:
    """A preset by name (PRESETS); ValueError naming the parameter otherwise."""
    if name not in PRESETS:
        raise ValueError(f"parameter 'model_config' = {name!r}: must be one of {sorted(PRESETS)}")
    return PRESETS[name]
