"""Sliding-window decode attention (window > 0: keys in (pos - window, pos]) in the engine's
attention ops (triton_decode.py): the torch paths equal the grouped attention under the window
mask, and on CUDA the Triton kernels (one pass, split, fused) match the reference without
reading a key outside the window (NaN there)."""

from __future__ import annotations

import pytest
import torch

from kestrel_models.planner import triton_decode as td
from kestrel_models.planner.kvmodel import _attn_grouped

gpu = pytest.mark.skipif(not (torch.cuda.is_available() and td.HAVE_TRITON),
                         reason="needs a CUDA GPU and triton")


def _case(b: int, h: int, hkv: int, hd: int, L: int, dtype: torch.dtype, device: str,
          seed: int = 0) -> tuple:
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(b, h, hd, generator=g) * hd ** -0.5).to(device, dtype)
    k = torch.randn(b, hkv, L, hd, generator=g).to(device, dtype)
    v = torch.randn(b, hkv, L, hd, generator=g).to(device, dtype)
    pos = torch.randint(0, L, (b,), generator=g)
    pos[0], pos[-1] = 0, L - 1
    return q, k, v, pos.to(device)


def _windowed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
              w: int) -> torch.Tensor:
    ar = torch.arange(k.shape[2], device=q.device)[None, None]
    ok = (ar <= pos[:, None, None]) & (ar > pos[:, None, None] - w)
    return _attn_grouped(q[:, None], k, v, torch.where(ok, 0.0, float("-inf")))[:, 0]


def _poison(k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, w: int,
            value: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values outside each row's window (before it and past pos) set to `value`."""
    k2, v2 = k.clone(), v.clone()
    for i, p in enumerate(pos.tolist()):
        lo = max(0, p - w + 1)
        k2[i, :, :lo] = value
        v2[i, :, :lo] = value
        k2[i, :, p + 1:] = value
        v2[i, :, p + 1:] = value
    return k2, v2


@pytest.mark.parametrize("w", [1, 5, 40])
def test_window_op_cpu_equals_masked_grouped(w: int) -> None:
    q, k, v, pos = _case(4, 6, 2, 32, 96, torch.float32, "cpu")
    want = _windowed(q, k, v, pos, w)
    k2, v2 = _poison(k, v, pos, w, 1e4)  # outside the window: no effect
    for chunk in (0, 32):
        torch.testing.assert_close(td.decode_attention(q, k2, v2, pos, chunk, w), want,
                                   rtol=1e-5, atol=1e-5)
    assert not torch.allclose(want, td.decode_attention(q, k, v, pos, 0))  # it mattered
    if w == 1:  # one key: its value
        torch.testing.assert_close(want[1].view(2, 3, 32),
                                   v[1, :, pos[1]][:, None].expand(2, 3, 32))


def test_attention_key_blocks_fit_shared_memory() -> None:
    """fp32 at head dim 128 asked more shared memory than a Hopper block has at 128 keys per
    iteration (Triton OutOfResources on the H100): its blocks are halved, bf16's are not."""
    assert td.attn_block_l(4, 128) == 64
    assert td.attn_block_l(2, 128) == td.ATTN_BLOCK_L == td.attn_block_l(4, 64)
    most = td.ATTN_PREFETCH_BLOCK_L  # the PDL launch's larger blocks, within the same bytes
    assert td.attn_block_l(2, 64, most=most) == most == 256
    assert td.attn_block_l(2, 128, most=most) == 128 and td.attn_block_l(4, 128, most=most) == 64
    assert td.attn_block_l(4, 128, chunk=32) == 32 and td.attn_block_l(4, 256, chunk=128) == 32


def test_fused_kernel_reads_keys_early_only_when_launched_with_pdl_at_small_head_dims() -> None:
    """The fused kernel's early key read and its larger blocks: PDL launches at head dim <= 64
    only (without PDL, or at head dim 128, both measured slower: planner_steps_h100's notes)."""
    assert td.fused_blocks(True, 2, 64) == (True, td.ATTN_PREFETCH_BLOCK_L)
    assert td.fused_blocks(True, 2, 64, chunk=64) == (True, 64)  # a split's chunk bounds it
    assert td.fused_blocks(True, 4, 64) == (True, 128)  # fp32: within ATTN_BLOCK_BYTES
    assert td.fused_blocks(False, 2, 64) == (False, td.ATTN_BLOCK_L)
    assert td.fused_blocks(True, 2, 128) == (False, td.ATTN_BLOCK_L)
    assert td.fused_blocks(False, 4, 128) == (False, 64)
    for elem, hd in ((2, 64), (2, 128), (4, 64), (4, 128), (4, 256)):
        assert td.attn_block_l(elem, hd) * hd * elem <= td.ATTN_BLOCK_BYTES


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_window_kernels_match_reference_on_gpu(dtype: torch.dtype) -> None:
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-5
    for b, h, hkv, hd, L, w in ((1, 14, 2, 64, 512, 100), (4, 16, 2, 128, 1024, 300),
                                (3, 9, 3, 64, 256, 1)):
        q, k, v, pos = _case(b, h, hkv, hd, L, dtype, "cuda", seed=L)
        want = td.attention_ref(q.float(), k.float(), v.float(), pos, w)
        k2, v2 = _poison(k, v, pos, w, float("nan"))
        for chunk in (0, 32, 128):
            got = td.decode_attention(q, k2, v2, pos, chunk, w)
            torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
        # the fused op: q, k, v from a raw projection (RoPE by angle 0: identity)
        kc, vc = k2.clone(), v2.clone()
        bi = torch.arange(b, device="cuda")
        qkv = torch.cat([q.reshape(b, -1), k[bi, :, pos].reshape(b, -1),
                         v[bi, :, pos].reshape(b, -1)], dim=1)
        cis = torch.stack([torch.ones(b, hd // 2), torch.zeros(b, hd // 2)], -1).cuda()
        sem = td.attn_sem(b, hkv, "cuda")
        for chunk, one in ((0, None), (32, None), (32, sem)):
            args = (qkv, cis, kc.clone(), vc.clone(), pos)
            got = (td.decode_attention_fused(*args, L, chunk, w) if one is None
                   else td.decode_attention_fused_split(*args, one, L, chunk, w))
            torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
