"""PackedDecoder: a decoder-only transformer in the layout the decode engine runs (kvmodel.py),
plus the input side the engine needs (token embedding, the image block of a request).

Layout per layer (dict of tensors, model dtype, on the model's device):
    attn_norm [D], ffn_norm [D]                         RMSNorm weights
    wqkv [(H + 2 Hkv) * hd, D]                          wq|wk|wv, 1/sqrt(hd) folded into wq, and
                                                        q/k features permuted so that RoPE pairs
                                                        (i, i + hd/2) are adjacent (2i, 2i+1)
    bqkv [(H + 2 Hkv) * hd] or None                     the same for the q/k/v biases (Qwen2)
    wo [D, H * hd], w13 [2F, D] (gate|up), w2 [D, F]    SwiGLU MLP
Whole model: embed [V, D], norm [D], lm_head [V, D] (the SAME tensor as embed when the
checkpoint ties them: no copy), RoPE tables (rope(n) -> cos, sin [n, hd/2]), `window` per layer
(sliding-window attention: a query at p attends keys in (p - w, p]; 0 = all keys <= p) and
`mrope_section` (M-RoPE: frequency j of a head rotates by position component comp[j] of a
3-D position (t, h, w); None = 1-D positions).

Image side (overridden per model): image_tokens(shape) positions one image takes, embed_image
(images) -> their embeddings, image_positions(shape) -> M-RoPE positions of those tokens
relative to the block's first position (None = sequential), image_marker: the token id that
marks where the image goes in a prompt (None: the image goes before the prompt).

`VLMDecoder` is Kestrel's own VisionLanguageModel in this layout (the model is not changed; its
packed copies are made once). HF checkpoints: hf_engine/.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["DecoderShape", "PackedDecoder", "VLMDecoder", "pack_layer", "rope_pair_perm"]


@dataclass(frozen=True)
class DecoderShape:
    """Sizes in elements. max_seq_len: positions the decoder was built for."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    norm_eps: float
    max_seq_len: int


def rope_pair_perm(hd: int, device: torch.device | str | None = None) -> Tensor:
    """Feature order that makes rotate-half RoPE pairs (i, i + hd/2) adjacent: [hd] long."""
    half = hd // 2
    return torch.stack([torch.arange(half), torch.arange(half) + half], 1).flatten().to(device)


def pack_layer(wq: Tensor, wk: Tensor, wv: Tensor, wo: Tensor, w_gate: Tensor, w_up: Tensor,
               w_down: Tensor, attn_norm: Tensor, ffn_norm: Tensor, n_heads: int, n_kv: int,
               hd: int, bq: Tensor | None = None, bk: Tensor | None = None,
               bv: Tensor | None = None) -> dict[str, Tensor | None]:
    """One layer's weights (nn.Linear layout [out, in]) -> the packed dict (module doc).
    New tensors: wqkv, bqkv, w13; the others are the given tensors themselves."""
    perm = rope_pair_perm(hd, wq.device)
    scale = 1.0 / math.sqrt(hd)

    def heads(t: Tensor, n: int) -> Tensor:  # [n * hd, ...] rows permuted within each head
        return t.view(n, hd, -1)[:, perm].reshape(n * hd, *t.shape[1:])

    with torch.no_grad():
        wqkv = torch.cat([heads(wq, n_heads) * scale, heads(wk, n_kv), wv])
        bqkv = None
        if bq is not None or bk is not None or bv is not None:
            z = wq.new_zeros
            bqkv = torch.cat([heads(bq if bq is not None else z(n_heads * hd), n_heads)
                              .flatten() * scale,
                              heads(bk if bk is not None else z(n_kv * hd), n_kv).flatten(),
                              bv if bv is not None else z(n_kv * hd)])
        w13 = torch.cat([w_gate, w_up])
    return dict(attn_norm=attn_norm, ffn_norm=ffn_norm, wqkv=wqkv, bqkv=bqkv, wo=wo, w13=w13,
                w2=w_down)


class PackedDecoder:
    """Weights in the engine's layout (module doc). Subclasses give the image side."""

    image_marker: int | None = None
    # whether the batched prefill (vision tower included) may be captured as a CUDA graph
    graphable_prefill: bool = True

    def __init__(self, cfg: DecoderShape, embed: Tensor, layers: list[dict], norm: Tensor,
                 lm_head: Tensor, inv_freq: Tensor | None = None, rope_scale: float = 1.0,
                 window: tuple[int, ...] | None = None,
                 mrope_section: tuple[int, ...] | None = None) -> None:
        if len(layers) != cfg.n_layers:
            raise ValueError(f"{len(layers)} packed layers for n_layers = {cfg.n_layers}")
        self.cfg = cfg
        self.embed, self.layers, self.norm, self.lm_head = embed, layers, norm, lm_head
        self.inv_freq, self.rope_scale = inv_freq, rope_scale
        self.window = tuple(window) if window is not None else (0,) * cfg.n_layers
        if len(self.window) != cfg.n_layers or any(w < 0 for w in self.window):
            raise ValueError(f"window = {self.window}: one value >= 0 per layer")
        if mrope_section is not None and sum(mrope_section) != cfg.head_dim // 2:
            raise ValueError(f"mrope_section {mrope_section} must sum to head_dim / 2 "
                             f"({cfg.head_dim // 2})")
        self.mrope_section = tuple(mrope_section) if mrope_section is not None else None

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def tied(self) -> bool:
        """lm_head is the embedding matrix itself (tied embeddings: one tensor in memory)."""
        return self.lm_head is self.embed

    def rope(self, n: int) -> tuple[Tensor, Tensor]:
        """cos, sin [n, hd/2] for positions 0..n-1 (float32 angles, stored in the model dtype as
        transformers applies them)."""
        if self.inv_freq is None:
            raise NotImplementedError("a PackedDecoder needs inv_freq or its own rope()")
        ang = torch.outer(torch.arange(n, device=self.device, dtype=torch.float32),
                          self.inv_freq.to(self.device, torch.float32))
        return ((ang.cos() * self.rope_scale).to(self.dtype),
                (ang.sin() * self.rope_scale).to(self.dtype))

    def mrope_comp(self) -> Tensor | None:
        """Position component (0 = t, 1 = h, 2 = w) of each of the hd/2 frequencies, or None."""
        if self.mrope_section is None:
            return None
        return torch.cat([torch.full((n,), i % 3, dtype=torch.long)
                          for i, n in enumerate(self.mrope_section)]).to(self.device)

    def weight_bytes(self) -> int:
        """Bytes of weights one decode step reads whatever the batch: every layer, the final
        norm and lm_head (the embedding matrix is lm_head when tied; otherwise a step reads
        only its B rows, not counted)."""
        seen: dict[int, int] = {}
        for t in [self.norm, self.lm_head,
                  *(v for ly in self.layers for v in ly.values() if v is not None)]:
            seen[id(t)] = t.numel() * t.element_size()
        return sum(seen.values())

    # ---- image side ------------------------------------------------------------------------
    def image_tokens(self, shape: tuple[int, ...]) -> int:
        """Positions the image block of an image of `shape` ([3, H, W]) takes."""
        raise ValueError("this model takes no image")

    def embed_image(self, images: Tensor) -> Tensor:
        """images [n, 3, H, W] uint8 (one shape) -> the image block's embeddings [n, N, D]."""
        raise ValueError("this model takes no image")

    def prepare_image(self, shape: tuple[int, ...]) -> None:
        """Set up what embed_image needs for images of `shape` (device tensors made once per
        shape); the engine calls it before a prefill that may be captured as a CUDA graph."""

    def image_positions(self, shape: tuple[int, ...]) -> Tensor | None:
        """M-RoPE (t, h, w) positions [N, 3] long of the block's tokens, relative to its first
        position (the text after the block continues at max + 1); None: sequential."""
        return None


class VLMDecoder(PackedDecoder):
    """Kestrel's VisionLanguageModel: its image tokens go before the prompt."""

    def __init__(self, model: torch.nn.Module) -> None:
        cfg = model.cfg
        layers = [pack_layer(ly.attn.wq.weight, ly.attn.wk.weight, ly.attn.wv.weight,
                             ly.attn.wo.weight, ly.w_gate.weight, ly.w_up.weight,
                             ly.w_down.weight, ly.attn_norm.weight, ly.ffn_norm.weight,
                             cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) for ly in model.layers]
        shape = DecoderShape(cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                             cfg.vocab_size, cfg.norm_eps, cfg.max_seq_len)
        super().__init__(shape, model.tok_emb.weight, layers, model.norm.weight,
                         model.lm_head.weight)
        self.model = model
        self.num_image_tokens = cfg.num_image_tokens

    def rope(self, n: int) -> tuple[Tensor, Tensor]:
        return self.model.rope_cos[:n], self.model.rope_sin[:n]

    def image_tokens(self, shape: tuple[int, ...]) -> int:
        return self.num_image_tokens

    def embed_image(self, images: Tensor) -> Tensor:
        return self.model.projector(self.model.vision(images.to(self.device)))
