"""KVModel: a decoder as a few fused steps over a static, slot-addressed KV cache.

Shared by the decode engine (engine.py) and speculative decoding (speculative.py). It runs a
`PackedDecoder` (decoder.py: wq|wk|wv -> wqkv with 1/sqrt(head_dim) folded into wq and q/k
features permuted so RoPE pairs are adjacent (a complex product); w_gate|w_up -> w13): Kestrel's
`VisionLanguageModel` (packed once, the model itself is not changed) or a Hugging Face
checkpoint's decoder (hf_engine/). It owns its own cache, per layer
    k, v: [max_batch, n_kv_heads, max_len, head_dim]  (model dtype, on the model's device).
What a decoder may add: a qkv bias (added to the packed projection), sliding-window layers
(`window` per layer: a query at p attends keys in (p - w, p], in every attention path), tied
embeddings (lm_head is the embedding tensor), and M-RoPE: 3-D rope positions for a prefill
chunk (`rope_pos`), and per cache row a rope offset (`rope_off` [max_batch] long: the rope
position of the token at cache position p is p + rope_off[row]; set by the engine's prefill to
the shift that an image's 3-D positions leave behind).

`forward(x, pos, rows, kv_len)` runs S new positions for a contiguous block of cache rows
(`rows` = slice of slots, B rows): row b's tokens go to positions pos[b] .. pos[b] + S - 1,
and each query attends keys at positions <= its own (keys past a row's position are masked,
so stale entries left behind by a finished or rejected continuation never leak). Shapes are
static for a given (B, S, kv_len), which is what lets the engine capture the decode step as a
CUDA graph. Attention: SDPA (GQA) for long chunks (prefill), an explicit grouped matmul with
an additive mask for short ones (decode, speculative verification).

`decode(tok, pos, kv_len)` is the single-token step for slots [0, B) written as ONE function
(embedding, all layers, final norm, lm_head) so that torch.compile(fullgraph=True) sees the
whole step (the engine compiles it and captures it in a CUDA graph). Its attention follows the
`policy` (attention_policy.py): dense over the kv_len bucket, or a static-size gathered key set
(local+global sparse, H2O eviction; per-layer score/alive state lives here for H2O).

Decode-step kernel options (gemv, decode_attention, mlp, attn_proj): decode_options.py.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor

from kestrel_models.planner.attention_policy import (AttentionPolicy, attend_gathered,
                                                     column_mass, h2o_select, h2o_update,
                                                     local_global_index)
from kestrel_models.planner import triton_mlp
from kestrel_models.planner.decode_options import (ATTN_PROJ, ATTN_SPLIT_CHUNK, AUTO_CUDA,
                                                   DECODE_ATTENTION, LINEARS, MLP,
                                                   MLP_KERNEL_ROWS, cublas_linear, parse_gemv,
                                                   resolve_auto, resolve_options, resolve_pdl)
from kestrel_models.planner.decoder import PackedDecoder, VLMDecoder
from kestrel_models.planner.triton_decode import decode_attention as triton_attention
from kestrel_models.planner.triton_decode import (attn_sem, decode_attention_fused,
                                                  decode_attention_fused_pdl,
                                                  decode_attention_fused_split)
from kestrel_models.planner.triton_gemv import gemv_add, gemv_add_pdl, rms_gemv, rms_gemv_pdl
from kestrel_models.planner.triton_mlp import mlp_triton
from kestrel_models.planner.vlm import VisionLanguageModel

# (the option names and helpers live in decode_options.py; re-exported here)
__all__ = ["KVModel", "LINEARS", "DECODE_ATTENTION", "MLP", "ATTN_PROJ", "AUTO_CUDA",
           "ATTN_SPLIT_CHUNK", "MLP_KERNEL_ROWS", "cublas_linear", "parse_gemv", "resolve_auto"]

SDPA_MIN_CHUNK = 32  # chunks with S >= this use F.scaled_dot_product_attention


def _rope_complex(x: Tensor, cis: Tensor) -> Tensor:
    """x [B, S, n, hd] with interleaved pairs, cis [B, S, hd/2, 2] float32 (cos, sin) ->
    rotated x (one complex product)."""
    b, s, n, hd = x.shape
    z = torch.view_as_complex(x.float().reshape(b, s, n, hd // 2, 2))
    return torch.view_as_real(z * torch.view_as_complex(cis)[:, :, None]).flatten(3).to(x.dtype)


def _rope_real(x: Tensor, cis: Tensor) -> Tensor:
    """Same as _rope_complex in real arithmetic (what torch.compile fuses best)."""
    b, s, n, hd = x.shape
    xr = x.float().reshape(b, s, n, hd // 2, 2)
    c, si = cis[:, :, None, :, 0], cis[:, :, None, :, 1]
    x0, x1 = xr[..., 0], xr[..., 1]
    return torch.stack([x0 * c - x1 * si, x1 * c + x0 * si], dim=-1).flatten(3).to(x.dtype)


def _pre(x: Tensor, norm_w: Tensor, eps: float, wqkv: Tensor, cis: Tensor, n_heads: int,
         n_kv: int, hd: int, real_rope: bool = False, lin_qkv: Callable = F.linear,
         bqkv: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """x [B, S, D] -> q [B, S, H, hd] (pre-scaled by 1/sqrt(hd)), k, v [B, S, Hkv, hd].
    bqkv: the packed qkv bias or None."""
    b, s, _ = x.shape
    h = F.rms_norm(x, (x.shape[-1],), norm_w, eps)
    qkv = lin_qkv(h, wqkv)
    if bqkv is not None:
        qkv = qkv + bqkv
    qkv = qkv.view(b, s, n_heads + 2 * n_kv, hd)
    rope = _rope_real if real_rope else _rope_complex
    qk = rope(qkv[:, :, : n_heads + n_kv], cis)
    return qk[:, :, :n_heads], qk[:, :, n_heads:], qkv[:, :, n_heads + n_kv:]


def _attn_grouped(q: Tensor, k: Tensor, v: Tensor, mask_add: Tensor) -> Tensor:
    """q [B, S, H, hd] (pre-scaled), k, v [B, Hkv, L, hd], mask_add [B, S, L] float
    (0 / -inf) -> [B, S, H * hd]. Query head h uses kv head h // (H / Hkv) (as SDPA's
    enable_gqa); for S = 1 every reshape here is a view (no copies)."""
    b, s, h, hd = q.shape
    hkv, L = k.shape[1], k.shape[2]
    g = h // hkv
    qg = q.view(b, s, hkv, g, hd).permute(0, 2, 3, 1, 4).reshape(b, hkv, g * s, hd)
    sc = torch.matmul(qg, k.transpose(-1, -2))  # [B, Hkv, G*S, L]
    sc = sc.view(b, hkv, g, s, L) + mask_add[:, None, None]  # float32
    p = torch.softmax(sc, dim=-1).to(v.dtype).view(b, hkv, g * s, L)
    out = torch.matmul(p, v).view(b, hkv, g, s, hd)
    return out.permute(0, 3, 1, 2, 4).reshape(b, s, h * hd)


def _attn_sdpa(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor) -> Tensor:
    """q [B, S, H, hd] (pre-scaled), k, v [B, Hkv, L, hd], allowed [B, S, L] bool ->
    [B, S, H * hd]. K/V are expanded to the H query heads (head h reads kv head h // G)."""
    b, s, h, hd = q.shape
    hkv, L = k.shape[1], k.shape[2]
    g = h // hkv
    ke = k[:, :, None].expand(b, hkv, g, L, hd).reshape(b, h, L, hd)
    ve = v[:, :, None].expand(b, hkv, g, L, hd).reshape(b, h, L, hd)
    a = F.scaled_dot_product_attention(q.transpose(1, 2), ke, ve, attn_mask=allowed[:, None],
                                       scale=1.0)  # [B, H, S, hd]
    return a.transpose(1, 2).reshape(b, s, h * hd)


def _post(x: Tensor, a: Tensor, wo: Tensor, norm_w: Tensor, eps: float, w13: Tensor,
          w2: Tensor, lin_o: Callable = F.linear, lin_w13: Callable = F.linear,
          lin_w2: Callable = F.linear, mlp: Callable | None = None,
          o_add: Callable | None = None) -> Tensor:
    """Residual + output projection, then the SwiGLU MLP block. x, a: [B, S, D]/[B, S, H*hd].
    mlp(x, norm_w, eps, w13, w2) -> x: a replacement of the whole MLP block (S = 1 only);
    o_add(x, a, wo) -> x + a @ wo.T: one of the residual + output projection (S = 1 only)."""
    x = o_add(x, a, wo) if o_add is not None else x + lin_o(a, wo)
    if mlp is not None:
        return mlp(x, norm_w, eps, w13, w2)
    h = F.rms_norm(x, (x.shape[-1],), norm_w, eps)
    gate, up = lin_w13(h, w13).chunk(2, dim=-1)
    return x + lin_w2(F.silu(gate) * up, w2)


def _o_add_triton(x: Tensor, a: Tensor, wo: Tensor, pdl: bool = False) -> Tensor:
    """x [B, 1, D] + a [B, 1, H*hd] @ wo.T in one kernel (kestrel::gemv_add, or its PDL
    launch)."""
    return (gemv_add_pdl if pdl else gemv_add)(a[:, 0], wo, x[:, 0])[:, None]


def _attn_post(x: Tensor, q: Tensor, k: Tensor, v: Tensor, mask_add: Tensor, wo: Tensor,
               norm_w: Tensor, eps: float, w13: Tensor, w2: Tensor,
               **lin: Callable) -> Tensor:
    return _post(x, _attn_grouped(q, k, v, mask_add), wo, norm_w, eps, w13, w2, **lin)


class KVModel:
    """Decoder runner over a static KV cache; `compile=True` wraps the per-layer pieces in
    torch.compile (one compiled graph reused by all layers, since weights are arguments).
    model: a PackedDecoder, or a VisionLanguageModel (packed here)."""

    def __init__(self, model: VisionLanguageModel | PackedDecoder, max_batch: int,
                 max_len: int, compile: bool = False, policy: AttentionPolicy | None = None,
                 gemv: str = "inductor", decode_attention: str = "auto",
                 mlp: str = "auto", attn_proj: str = "auto", pdl: bool | None = None) -> None:
        dec = model if isinstance(model, PackedDecoder) else VLMDecoder(model)
        cfg = dec.cfg
        cub, decode_attention, mlp, attn_proj = resolve_options(
            gemv, decode_attention, mlp, attn_proj, dec.device)
        self.pdl = resolve_pdl(pdl, dec.device, decode_attention, mlp, attn_proj)
        if max_batch < 1:
            raise ValueError(f"parameter 'max_batch' = {max_batch}: must be >= 1")
        if not 0 < max_len <= cfg.max_seq_len:
            raise ValueError(f"parameter 'max_len' = {max_len}: must be in "
                             f"(0, {cfg.max_seq_len}] (the model's max_seq_len)")
        self.model, self.dec, self.cfg = model, dec, cfg
        self.max_batch, self.max_len = max_batch, max_len
        dev = dec.device
        self.device, self.dtype = dev, dec.dtype
        self.layers = dec.layers
        self.rope_cos, self.rope_sin = dec.rope(max_len)  # [max_len, hd/2]
        self._comp = dec.mrope_comp()  # [hd/2] position component per frequency, or None
        # rope position = cache position + rope_off[row] (M-RoPE decoders only)
        self.rope_off = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self._use_off = self._comp is not None
        self.window = dec.window
        shape = (max_batch, cfg.n_kv_heads, max_len, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=self.dtype, device=dev) for _ in self.layers]
        self.v = [torch.zeros(shape, dtype=self.dtype, device=dev) for _ in self.layers]
        self._ar = torch.arange(max_len, device=dev)
        self.policy = policy or AttentionPolicy()
        if self.policy.mode == "local_global" and self.policy.n_global >= max_len:
            raise ValueError(f"parameter 'n_global' = {self.policy.n_global}: must be < "
                             f"max_len {max_len}")
        # H2O state per layer: accumulated attention mass and liveness of every position.
        hshape = (max_batch, cfg.n_kv_heads, max_len)
        h2o = self.policy.mode == "h2o"
        self.score = [torch.zeros(hshape, device=dev) for _ in self.layers] if h2o else []
        self.alive = ([torch.ones(hshape, dtype=torch.bool, device=dev)
                       for _ in self.layers] if h2o else [])
        self._real_rope = compile
        self.gemv, self.decode_attention, self.mlp = gemv, decode_attention, mlp
        self.attn_proj = attn_proj
        split = decode_attention in ("triton_split", "triton_fused_split")
        self._attn_chunk = ATTN_SPLIT_CHUNK if split else 0
        self._fused = decode_attention.startswith("triton_fused")
        # arrival counters of the one-kernel splits (zero between calls; shared by the layers,
        # whose kernels run one after another)
        self._attn_sem = (attn_sem(max_batch, cfg.n_kv_heads, dev)
                          if decode_attention == "triton_fused_split" else None)
        self._gemv_sem = (triton_mlp.gemv_sem(MLP_KERNEL_ROWS, cfg.dim, dev)
                          if mlp == "triton_down_residual" else None)

        def lin(name: str) -> Callable:
            return cublas_linear if name in cub else F.linear

        # Keyword arguments of the decode step's pieces (empty by default: unchanged calls).
        self._pre_kw = {"lin_qkv": lin("qkv")} if "qkv" in cub else {}
        self._post_kw: dict[str, Callable] = {f"lin_{n}": lin(n) for n in ("o", "w13", "w2")
                                              if n in cub}
        # steps of more than MLP_KERNEL_ROWS rows: the same without the MLP kernel
        self._post_kw_rows = dict(self._post_kw)
        if mlp != "inductor":
            self._post_kw["mlp"] = partial(mlp_triton, fuse_w13=mlp == "triton",
                                           sem=self._gemv_sem,
                                           whole_rows=mlp == "triton_fused", pdl=self.pdl)
        if attn_proj == "triton":
            self._post_kw["o_add"] = partial(_o_add_triton, pdl=self.pdl)
        self._rms_gemv = rms_gemv_pdl if self.pdl else rms_gemv
        self._attn_fused = decode_attention_fused_pdl if self.pdl else decode_attention_fused
        self._lin_head = lin("lm_head")
        self._pre: Callable = torch.compile(_pre, dynamic=False) if compile else _pre
        self._attn_post: Callable = (torch.compile(_attn_post, dynamic=False) if compile
                                     else _attn_post)

    # ---- embeddings ------------------------------------------------------------------------
    @torch.inference_mode()
    def embed_tokens(self, tokens: Tensor) -> Tensor:
        """tokens [B, S] long -> [B, S, D]."""
        return F.embedding(tokens, self.dec.embed)

    @torch.inference_mode()
    def embed_image(self, image: Tensor) -> Tensor:
        """image [B, 3, H, W] uint8 (or float 0..1) -> the image block [B, N, D]."""
        return self.dec.embed_image(image)

    # ---- cache helpers ---------------------------------------------------------------------
    def copy_prefix(self, src_k: list[Tensor], src_v: list[Tensor], slot: int) -> None:
        """Per layer k, v [Hkv, P, hd] -> positions [0, P) of `slot`."""
        p = src_k[0].shape[1]
        for i in range(len(self.k)):
            self.k[i][slot, :, :p].copy_(src_k[i])
            self.v[i][slot, :, :p].copy_(src_v[i])

    def reset_slots(self, rows: slice) -> None:
        """Fresh policy state for cache rows that a new sequence takes (H2O scores)."""
        for sc, al in zip(self.score, self.alive, strict=True):
            sc[rows].zero_()
            al[rows].fill_(True)

    def read_prefix(self, slot: int, length: int) -> tuple[list[Tensor], list[Tensor]]:
        return ([k[slot, :, :length].clone() for k in self.k],
                [v[slot, :, :length].clone() for v in self.v])

    # ---- positions -------------------------------------------------------------------------
    def _cis(self, rp: Tensor) -> Tensor:
        """Rope positions [...] long (1-D) or [..., 3] (t, h, w: M-RoPE) -> cis [..., hd/2, 2]
        float32 (cos, sin)."""
        if rp.shape[-1:] == (3,) and rp.ndim >= 3:
            if self._comp is None:
                rp = rp[..., 0]
            else:  # frequency j rotates by component comp[j] of the 3-D position
                p = rp[..., self._comp]  # [..., hd/2]
                j = torch.arange(p.shape[-1], device=p.device)
                return torch.stack([self.rope_cos[p, j], self.rope_sin[p, j]], dim=-1).float()
        return torch.stack([self.rope_cos[rp], self.rope_sin[rp]], dim=-1).float()

    def _windowed(self, allowed: Tensor, positions: Tensor) -> dict[int, Tensor]:
        """allowed [B, S, L] (keys <= each query) -> {window: allowed within it} for this
        decoder's windows (0: allowed itself). positions [B, S]: the queries' positions."""
        out = {0: allowed}
        for w in set(self.window) - {0}:
            L = allowed.shape[-1]
            out[w] = allowed & (self._ar[None, None, :L] > positions[:, :, None] - w)
        return out

    # ---- forward ---------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, x: Tensor, pos: Tensor, rows: slice, kv_len: int,
                last_only: bool = False, last_index: Tensor | None = None,
                rope_pos: Tensor | None = None) -> Tensor:
        """x [B, S, D] (embeddings), pos [B] long (first position of each row), rows: the
        B cache slots, kv_len: keys attended (static; >= max(pos) + S, <= max_len).
        -> logits [B, S or 1, vocab] float32 (1: last_only, or last_index [B] long = the
        chunk index whose logits each row wants: right-padded batched prefill). rope_pos:
        [B, S, 3] long 3-D rope positions of the chunk (M-RoPE), default cache position +
        rope_off. The caller guarantees pos + S <= kv_len. Attention here is always dense
        (prefill, verification) within each layer's window; with the H2O policy the chunk's
        attention mass is added to the rows' scores."""
        cfg = self.cfg
        b, s, _ = x.shape
        positions = pos[:, None] + self._ar[:s]  # [B, S]
        if rope_pos is None:
            rope_pos = positions + self.rope_off[rows, None] if self._use_off else positions
        cis = self._cis(rope_pos)  # [B, S, hd/2, 2]
        bi = torch.arange(b, device=x.device)[:, None]
        allowed = self._windowed(self._ar[None, None, :kv_len] <= positions[:, :, None],
                                 positions)  # window -> [B, S, L]
        use_sdpa = s >= SDPA_MIN_CHUNK
        masks = {}
        if not use_sdpa:
            for w, al in allowed.items():
                masks[w] = torch.zeros(al.shape, dtype=torch.float32, device=x.device)
                masks[w].masked_fill_(~al, float("-inf"))
        for i, w in enumerate(self.layers):
            win = self.window[i]
            pre = _pre if use_sdpa else self._pre  # prefill stays eager: no compile per length
            q, k, v = pre(x, w["attn_norm"], cfg.norm_eps, w["wqkv"], cis, cfg.n_heads,
                          cfg.n_kv_heads, cfg.head_dim, self._real_rope, bqkv=w["bqkv"])
            kc, vc = self.k[i][rows], self.v[i][rows]  # views [B, Hkv, max_len, hd]
            kc[bi, :, positions] = k  # k [B, S, Hkv, hd]
            vc[bi, :, positions] = v
            kk, vv = kc[:, :, :kv_len], vc[:, :, :kv_len]
            if self.score:
                self.score[i][rows, :, :kv_len] += column_mass(q, kk, allowed[win])
            if use_sdpa:
                a = F.scaled_dot_product_attention(q.transpose(1, 2), kk, vv,
                                                   attn_mask=allowed[win][:, None], scale=1.0,
                                                   enable_gqa=True)
                a = a.transpose(1, 2).reshape(b, s, cfg.n_heads * cfg.head_dim)
                x = _post(x, a, w["wo"], w["ffn_norm"], cfg.norm_eps, w["w13"], w["w2"])
            else:
                x = self._attn_post(x, q, kk, vv, masks[win], w["wo"], w["ffn_norm"],
                                    cfg.norm_eps, w["w13"], w["w2"])
        if last_index is not None:
            x = x[torch.arange(b, device=x.device), last_index][:, None]
        elif last_only:
            x = x[:, -1:]
        x = F.rms_norm(x, (x.shape[-1],), self.dec.norm, cfg.norm_eps)
        return F.linear(x, self.dec.lm_head).float()

    def decode(self, tok: Tensor, pos: Tensor, kv_len: int) -> Tensor:
        """One token per row for cache slots [0, B): tok [B] long at positions pos [B] long
        (pos < kv_len <= max_len) -> logits [B, vocab] float32. Writes k, v at pos; attends
        per `policy` (within each layer's window). Pure tensor code with static shapes for a
        given (B, kv_len): the unit that the engine compiles (fullgraph) and captures as a
        CUDA graph."""
        cfg, pol = self.cfg, self.policy
        b = tok.shape[0]
        x = F.embedding(tok, self.dec.embed)[:, None]  # [B, 1, D]
        rp = pos + self.rope_off[:b] if self._use_off else pos
        cis = self._cis(rp)[:, None]  # [B, 1, hd/2, 2]
        bi = torch.arange(b, device=tok.device)
        mask_add = allowed = idx = valid = None
        if pol.mode == "dense":
            allowed = self._windowed(self._ar[None, None, :kv_len] <= pos[:, None, None],
                                     pos[:, None])  # window -> [B, 1, L]
            mask_add = {w: torch.where(al, 0.0, float("-inf")) for w, al in allowed.items()}
        elif pol.mode == "local_global":
            idx, valid = local_global_index(pos, pol.n_global, pol.window)
            idx = idx[:, None].expand(b, cfg.n_kv_heads, -1)
            valid = valid[:, None].expand(b, cfg.n_kv_heads, -1)
        post_kw = self._post_kw if b <= MLP_KERNEL_ROWS else self._post_kw_rows
        fused = self._fused and mask_add is not None
        proj = self.attn_proj == "triton" and b <= MLP_KERNEL_ROWS
        lin_qkv = self._pre_kw.get("lin_qkv", F.linear)
        cis0 = cis[:, 0]  # one view for every layer's fused op, not a new one per layer
        for i, w in enumerate(self.layers):
            win = self.window[i]
            if fused and proj:  # RMSNorm + qkv (+ bias): one kernel
                qkv = self._rms_gemv(x[:, 0], w["attn_norm"], cfg.norm_eps, w["wqkv"],
                                     w["bqkv"])
            elif fused:
                h = F.rms_norm(x, (x.shape[-1],), w["attn_norm"], cfg.norm_eps)
                qkv = lin_qkv(h, w["wqkv"])[:, 0]
                if w["bqkv"] is not None:
                    qkv = qkv + w["bqkv"]
            if fused:  # RoPE + k/v cache write + attention: one op (kernel) per layer
                if self._attn_sem is not None:  # [B, H * hd]
                    a = decode_attention_fused_split(qkv, cis0, self.k[i], self.v[i], pos,
                                                     self._attn_sem, kv_len, self._attn_chunk,
                                                     win)
                else:
                    a = self._attn_fused(qkv, cis0, self.k[i], self.v[i], pos, kv_len,
                                         self._attn_chunk, win)
                x = _post(x, a[:, None], w["wo"], w["ffn_norm"], cfg.norm_eps, w["w13"],
                          w["w2"], **post_kw)
                continue
            q, k, v = self._pre(x, w["attn_norm"], cfg.norm_eps, w["wqkv"], cis, cfg.n_heads,
                                cfg.n_kv_heads, cfg.head_dim, self._real_rope, bqkv=w["bqkv"],
                                **self._pre_kw)
            kc, vc = self.k[i][:b], self.v[i][:b]
            kc[bi, :, pos] = k[:, 0]  # [B, Hkv, hd]
            vc[bi, :, pos] = v[:, 0]
            if mask_add is not None and self.decode_attention.startswith("triton"):
                a = triton_attention(q[:, 0], kc[:, :, :kv_len], vc[:, :, :kv_len], pos,
                                     self._attn_chunk, win)  # [B, H * hd]
                x = _post(x, a[:, None], w["wo"], w["ffn_norm"], cfg.norm_eps, w["w13"],
                          w["w2"], **post_kw)
                continue
            if mask_add is not None and self.decode_attention == "sdpa":
                a = _attn_sdpa(q, kc[:, :, :kv_len], vc[:, :, :kv_len], allowed[win])
                x = _post(x, a, w["wo"], w["ffn_norm"], cfg.norm_eps, w["w13"], w["w2"],
                          **post_kw)
                continue
            if mask_add is not None:
                x = self._attn_post(x, q, kc[:, :, :kv_len], vc[:, :, :kv_len], mask_add[win],
                                    w["wo"], w["ffn_norm"], cfg.norm_eps, w["w13"], w["w2"],
                                    **post_kw)
                continue
            if pol.mode == "h2o":
                sc, al = self.score[i][:b, :, :kv_len], self.alive[i][:b, :, :kv_len]
                idx, valid = h2o_select(sc, al, pos, pol.budget, pol.recent)
            lvalid = valid if not win else valid & (idx > (pos - win)[:, None, None])
            a, mass = attend_gathered(q, kc, vc, idx, lvalid)
            if pol.mode == "h2o":
                h2o_update(sc, al, pos, idx, lvalid, mass)
            x = _post(x, a, w["wo"], w["ffn_norm"], cfg.norm_eps, w["w13"], w["w2"],
                      **post_kw)
        x = F.rms_norm(x, (x.shape[-1],), self.dec.norm, cfg.norm_eps)
        return self._lin_head(x[:, 0], self.dec.lm_head).float()
