"""The decode step's kernel options: their values, what 'auto' picks, their checks, and the
opaque cuBLAS linear op (KVModel runs them; DecodeEngine passes them through).

Decode-step kernel choices (only what KVModel.decode runs; prefill is unchanged):
- `gemv`: 'inductor' (default) lets torch.compile lower the linear layers itself (with
  coordinate-descent tuning inductor decomposes every M = 1 matmul into a multiply + reduction
  Triton kernel); 'cublas' routes all of them (qkv, o, w13, w2, lm_head) through the opaque
  custom op `kestrel::linear` (= F.linear), which inductor keeps as an extern cuBLAS call;
  'cublas:w2,lm_head' (any subset of LINEARS) does so for the named ones only.
- `decode_attention`: 'grouped' (explicit grouped matmuls + additive mask) or 'sdpa'
  (F.scaled_dot_product_attention with the bucket's boolean mask, K/V expanded to the query
  heads, so the fused memory-efficient kernel is eligible on CUDA: PyTorch's GQA path is
  Flash/math only and Flash takes no mask), 'triton' (ONE flash-decoding Triton kernel per
  layer, the op kestrel::decode_attention of triton_decode.py: per (row, kv head) the group's
  query heads together, online softmax over positions <= pos only) or 'triton_split' (the
  same split over chunks of ATTN_SPLIT_CHUNK keys + a combine kernel), 'triton_fused' (one
  kernel per layer from the raw qkv projection: RoPE of q/k, the k/v cache write at pos and
  the attention, kestrel::decode_attention_fused), 'triton_fused_split' (the same kernel split
  over chunks of ATTN_SPLIT_CHUNK keys, still one kernel: the last chunk of a (row, kv head) to
  finish combines them; more programs for models with few kv heads) or 'auto' (the default).
  These apply to the dense policy; the gathered policies keep their own attention.
- `mlp`: 'inductor' (torch code, inductor's GEMVs), 'triton_down' (SiLU*up fused
  into a split-K Triton w_down GEMV, kestrel::silu_gemv, then a reduction kernel adds up the
  splits and the residual; inductor keeps RMSNorm + w13), 'triton_down_residual' (the same
  GEMV whose last split per block of outputs adds up the splits and the residual itself,
  kestrel::silu_gemv_add: no reduction kernel), 'triton' (also RMSNorm + w13 + SiLU*up as
  one Triton kernel, kestrel::rms_w13_silu; w_down as 'triton_down') or 'triton_fused'
  (kestrel::rms_w13_silu, then w_down + residual over whole rows, kestrel::gemv_add: the block
  in two kernels, no split-K; for models with short rows).
  Those GEMV kernels read the weights once per row, so they run only in steps of at most
  MLP_KERNEL_ROWS rows; a larger batch bucket takes the torch MLP (one GEMM reads them once).
  The Triton ops have torch CPU paths, so every option runs (and is tested) on CPU too.
- `attn_proj`: 'inductor' (RMSNorm, the qkv GEMV, the output GEMV and the residual add as
  torch code), 'triton' (RMSNorm + qkv (+ bias) as one kernel, kestrel::rms_gemv, and
  the output projection + residual as one, kestrel::gemv_add; triton_gemv.py). It needs a
  fused decode attention ('triton_fused' or 'triton_fused_split'), which takes the raw qkv.
  Like the MLP kernels, it runs in steps of at most MLP_KERNEL_ROWS rows.
- `pdl` (None = auto, True, False): launch those Triton kernels (qkv, the fused attention
  'triton_fused', o, w13, w_down of the whole-row options) with programmatic dependent launch
  (triton_common.py): each kernel starts while the one before it finishes and reads its
  weights meanwhile (the attention, at head dim <= 64: its first block of cached keys).
  Needs compute capability >= 9.0 (Hopper); auto: on where supported (planner_steps_h100.md
  measures it).
- 'auto' (the defaults of all three): the fastest measured Triton options when the model is on
  CUDA and triton is importable, else the torch paths (resolve_auto has the rules).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kestrel_models.planner import triton_common

__all__ = ["LINEARS", "DECODE_ATTENTION", "MLP", "ATTN_PROJ", "AUTO_CUDA",
           "ATTN_SPLIT_CHUNK", "MLP_KERNEL_ROWS", "cublas_linear", "parse_gemv", "resolve_auto",
           "resolve_options", "resolve_pdl"]

LINEARS = ("qkv", "o", "w13", "w2", "lm_head")  # the decode step's linear layers
DECODE_ATTENTION = ("auto", "grouped", "sdpa", "triton", "triton_split", "triton_fused",
                    "triton_fused_split")
MLP = ("auto", "inductor", "triton_down", "triton_down_residual", "triton", "triton_fused")
ATTN_PROJ = ("auto", "inductor", "triton")
# What 'auto' picks on CUDA with triton (best measured: docs/benchmarks/planner_h200.md,
# planner_steps_h100.md: the two-kernel MLP is the faster one at both SmolVLM-256M's FFN
# width (1536) and Qwen2.5-VL-3B's (11008)).
AUTO_CUDA = {"decode_attention": "triton_fused", "mlp": "triton_fused", "attn_proj": "triton"}
ATTN_SPLIT_CHUNK = 64  # keys per program of decode_attention='triton_split' | 'triton_fused_split'
MLP_KERNEL_ROWS = 1  # most rows of a decode step that the Triton MLP options run


@torch.library.custom_op("kestrel::linear", mutates_args=())
def cublas_linear(x: Tensor, w: Tensor) -> Tensor:
    """F.linear(x, w) as an opaque op: x [..., K], w [N, K] -> [..., N]. torch.compile cannot
    look inside, so inductor emits an extern call (cuBLAS on CUDA, its split-K GEMV for M = 1)
    instead of decomposing it; on CPU it is the same F.linear."""
    return F.linear(x, w)


@cublas_linear.register_fake
def _cublas_linear_fake(x: Tensor, w: Tensor) -> Tensor:
    return x.new_empty((*x.shape[:-1], w.shape[0]))


def _cublas_linear_setup(ctx, inputs: tuple[Tensor, Tensor], output: Tensor) -> None:  # noqa: ANN001
    ctx.save_for_backward(*inputs)


def _cublas_linear_backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:  # noqa: ANN001
    """Gradients of x [..., K] and w [N, K] from grad [..., N] (so traced graphs with
    requires_grad parameters work too; the engine itself runs under inference_mode)."""
    x, w = ctx.saved_tensors
    gx = grad @ w if ctx.needs_input_grad[0] else None
    gw = (grad.reshape(-1, grad.shape[-1]).T @ x.reshape(-1, x.shape[-1])
          if ctx.needs_input_grad[1] else None)
    return gx, gw


cublas_linear.register_autograd(_cublas_linear_backward, setup_context=_cublas_linear_setup)


def parse_gemv(gemv: str) -> frozenset[str]:
    """'inductor' -> {}, 'cublas' -> all LINEARS, 'cublas:w2,lm_head' -> those; else
    ValueError naming the parameter."""
    if gemv == "inductor":
        return frozenset()
    if gemv == "cublas":
        return frozenset(LINEARS)
    names = gemv.split(":", 1)[1].split(",") if gemv.startswith("cublas:") else []
    if not names or any(n not in LINEARS for n in names):
        raise ValueError(f"parameter 'gemv' = {gemv!r}: must be 'inductor', 'cublas' or "
                         f"'cublas:<names>' with names from {LINEARS}")
    return frozenset(names)


def resolve_auto(decode_attention: str, mlp: str, device: torch.device,
                 cublas: frozenset[str] = frozenset(), attn_proj: str = "auto"
                 ) -> tuple[str, str, str]:
    """'auto' -> AUTO_CUDA's choice on CUDA when triton is importable, else the torch paths
    ('grouped', 'inductor', 'inductor'). On CUDA: mlp 'auto' -> 'inductor' when cuBLAS takes
    w13 or w2; attn_proj 'auto' -> 'inductor' unless the attention is a fused one and cuBLAS
    takes neither qkv nor o. Explicit values pass through."""
    fast = device.type == "cuda" and triton_common.HAVE_TRITON and triton_common.OP is not None
    if decode_attention == "auto":
        decode_attention = AUTO_CUDA["decode_attention"] if fast else "grouped"
    if mlp == "auto":
        mlp = "inductor" if not fast or {"w13", "w2"} & cublas else AUTO_CUDA["mlp"]
    if attn_proj == "auto":
        ok = fast and decode_attention.startswith("triton_fused") and not {"qkv", "o"} & cublas
        attn_proj = AUTO_CUDA["attn_proj"] if ok else "inductor"
    return decode_attention, mlp, attn_proj


def resolve_options(gemv: str, decode_attention: str, mlp: str, attn_proj: str,
                    device: torch.device) -> tuple[frozenset[str], str, str, str]:
    """Check the decode-step options (a bad one: ValueError naming the parameter and value)
    and resolve 'auto': -> (the linears on cuBLAS, decode_attention, mlp, attn_proj)."""
    cub = parse_gemv(gemv)
    if decode_attention not in DECODE_ATTENTION:
        raise ValueError(f"parameter 'decode_attention' = {decode_attention!r}: must be "
                         f"one of {DECODE_ATTENTION}")
    if mlp not in MLP:
        raise ValueError(f"parameter 'mlp' = {mlp!r}: must be one of {MLP}")
    if attn_proj not in ATTN_PROJ:
        raise ValueError(f"parameter 'attn_proj' = {attn_proj!r}: must be one of "
                         f"{ATTN_PROJ}")
    decode_attention, mlp, attn_proj = resolve_auto(
        decode_attention, mlp, device, cub, attn_proj)
    if attn_proj == "triton" and not decode_attention.startswith("triton_fused"):
        raise ValueError(f"parameter 'attn_proj' = 'triton': needs decode_attention "
                         f"'triton_fused' or 'triton_fused_split' (the fused kernel takes "
                         f"the raw qkv), got {decode_attention!r}")
    if attn_proj == "triton" and ("qkv" in cub or "o" in cub):
        raise ValueError(f"parameter 'attn_proj' = 'triton': replaces the qkv/o GEMVs, so "
                         f"'gemv' = {gemv!r} must not name qkv or o")
    if mlp != "inductor" and ("w13" in cub or "w2" in cub):
        raise ValueError(f"parameter 'mlp' = {mlp!r}: replaces the w13/w2 GEMVs, so "
                         f"'gemv' = {gemv!r} must not name w13 or w2")
    return cub, decode_attention, mlp, attn_proj


def resolve_pdl(pdl: bool | None, device: torch.device, decode_attention: str, mlp: str,
                attn_proj: str) -> bool:
    """Whether the decode step's Triton kernels launch with PDL: pdl None (auto) -> where the
    device supports it and a kernel it applies to runs; True where that is not so ->
    ValueError naming the parameter and why."""
    applies = (decode_attention == "triton_fused" or attn_proj == "triton"
               or mlp == "triton_fused")
    why = triton_common.pdl_unsupported(device)
    if pdl is None:
        return applies and why is None
    if pdl and why is not None:
        raise ValueError(f"parameter 'pdl' = True: {why}")
    if pdl and not applies:
        raise ValueError(f"parameter 'pdl' = True: applies to decode_attention 'triton_fused', "
                         f"attn_proj 'triton' or mlp 'triton_fused'; got {decode_attention!r}, "
                         f"{attn_proj!r}, {mlp!r}")
    return bool(pdl)
