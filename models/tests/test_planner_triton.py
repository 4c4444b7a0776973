"""Triton decode ops (triton_decode.py, triton_mlp.py) and the engine options that use them
(decode_attention='triton' | 'triton_split' | 'triton_fused' | 'auto', mlp='triton_down' |
'triton' | 'auto').

CPU (no triton, no GPU): each op's torch path against the engine's own math (values), the ops
as valid custom ops, and the engine with each option against the default engine (identical
greedy tokens, fp32). GPU (marked gpu): the Triton kernels against the torch reference (bf16
and fp32 tolerances stated per test) and the compiled, CUDA-graphed engine with the options
against the default compiled engine (identical tokens, fp32, tiny config)."""

from __future__ import annotations

import pytest
import torch
import tiny_planner as tp
import torch.nn.functional as F

from kestrel_models.planner import VisionLanguageModel
from kestrel_models.planner import triton_common as tc
from kestrel_models.planner import triton_decode as td
from kestrel_models.planner import triton_mlp as tm
from kestrel_models.planner.engine import DecodeEngine
from kestrel_models.planner.kvmodel import (AUTO_CUDA, KVModel, _attn_grouped, _rope_real,
                                            resolve_auto)

torch.set_num_threads(1)
EOS = 257
TORCH = dict(decode_attention="grouped", mlp="inductor")  # the torch paths ('auto' on CPU)
OPTIONS = [dict(decode_attention="triton"), dict(decode_attention="triton_split"),
           dict(mlp="triton_down"), dict(mlp="triton"), dict(decode_attention="triton_fused"),
           dict(decode_attention="triton_fused_split", mlp="triton_down_residual"),
           dict(decode_attention="triton_fused", mlp="triton_down", steps_per_replay=4),
           dict(decode_attention="auto", mlp="auto"),
           dict(decode_attention="triton", mlp="triton", gemv="cublas:qkv,o,lm_head",
                steps_per_replay=4)]
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def model() -> VisionLanguageModel:
    return tp.sharp_tiny()


def _attn_case(b: int, h: int, hkv: int, hd: int, L: int, dtype: torch.dtype, device: str,
               seed: int = 0) -> tuple:
    """q [B, H, hd], cache views k, v [B, Hkv, L, hd] (sliced from a longer cache, as the
    engine passes them), pos [B] with row 0 at position 0 and the last row at L - 1."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, hd, generator=g).to(device, dtype)
    k = torch.randn(b, hkv, L + 16, hd, generator=g).to(device, dtype)[:, :, :L]
    v = torch.randn(b, hkv, L + 16, hd, generator=g).to(device, dtype)[:, :, :L]
    pos = torch.randint(0, L, (b,), generator=g)
    pos[0], pos[-1] = 0, L - 1
    return q, k, v, pos.to(device)


def _grouped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor):  # noqa: ANN202
    """kvmodel's grouped decode attention (the engine's default path) with pos's mask."""
    L = k.shape[2]
    allowed = torch.arange(L, device=q.device)[None, None] <= pos[:, None, None]  # [B, 1, L]
    return _attn_grouped(q[:, None], k, v, torch.where(allowed, 0.0, float("-inf")))[:, 0]


@pytest.mark.parametrize("heads", [(6, 2), (14, 2), (4, 4)], ids=lambda h: f"H{h[0]}/Hkv{h[1]}")
def test_attention_op_cpu_equals_grouped(heads: tuple[int, int]) -> None:
    h, hkv = heads
    q, k, v, pos = _attn_case(3, h, hkv, 32, 96, torch.float32, "cpu")
    want = _grouped(q, k, v, pos)
    for chunk in (0, 32):  # the chunking changes the kernel launch only, never the result
        got = td.decode_attention(q, k, v, pos, chunk)
        assert got.shape == (3, h * 32)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # keys past pos[b] are masked: garbage there changes nothing (the GPU test uses NaN)
    k2, v2 = k.clone(), v.clone()
    for i, p in enumerate(pos.tolist()):
        k2[i, :, p + 1:] = 1e4
        v2[i, :, p + 1:] = -1e4
    torch.testing.assert_close(td.decode_attention(q, k2, v2, pos, 0), want,
                               rtol=1e-5, atol=1e-5)
    # row 0 at position 0 sees one key: its output is that key's value
    torch.testing.assert_close(want[0].view(hkv, h // hkv, 32),
                               v[0, :, 0][:, None].expand(hkv, h // hkv, 32))


def test_fused_op_cpu_equals_rope_write_then_grouped() -> None:
    """The fused op's torch path = the engine's RoPE (real-arithmetic form), the cache write at
    pos and the grouped attention; rows past B and positions other than pos stay untouched."""
    b, h, hkv, hd, L = 3, 6, 2, 32, 96
    qkv, cis, kc, vc, pos = tp.fused_case(b, h, hkv, hd, L, torch.float32, "cpu", mb=4)
    k0, v0 = kc.clone(), vc.clone()
    out = td.decode_attention_fused(qkv, cis, kc, vc, pos, L, 0)
    x = qkv.view(b, 1, h + 2 * hkv, hd)
    qk = _rope_real(x[:, :, :h + hkv], cis[:, None])[:, 0]  # [B, H + Hkv, hd]
    want_k, want_v = k0.clone(), v0.clone()
    for i, p in enumerate(pos.tolist()):
        want_k[i, :, p] = qk[i, h:]
        want_v[i, :, p] = x[i, 0, h + hkv:]
    torch.testing.assert_close(kc, want_k, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(vc, want_v, rtol=0, atol=0)
    torch.testing.assert_close(out, _grouped(qk[:, :h], want_k[:b, :, :L], want_v[:b, :, :L],
                                             pos), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(qk[:, h:], x[:, 0, h:h + hkv])  # RoPE did rotate
    with pytest.raises(ValueError, match="chunk = 0 must be > 0"):
        td.decode_attention_fused_split(qkv, cis, kc, vc, pos, td.attn_sem(4, hkv, "cpu"), L, 0)


@pytest.mark.slow
def test_ops_are_valid_custom_ops() -> None:
    q, k, v, pos = _attn_case(2, 6, 2, 32, 48, torch.float32, "cpu")
    torch.library.opcheck(td.decode_attention, (q, k, v, pos, 0))
    qkv, cis, kc, vc, pos = tp.fused_case(2, 6, 2, 32, 48, torch.float32, "cpu", mb=3)
    torch.library.opcheck(td.decode_attention_fused, (qkv, cis, kc, vc, pos, 48, 0))
    x, w = torch.randn(2, 2 * 40), torch.randn(24, 40)
    torch.library.opcheck(tm.silu_gemv, (x, w, 4, True))
    torch.library.opcheck(td.decode_attention_fused_split,
                          (qkv, cis, kc, vc, pos, td.attn_sem(3, 2, "cpu"), 48, 16, 0))
    torch.library.opcheck(tm.silu_gemv_add, (x, w, torch.randn(2, 24), torch.zeros(4, dtype=
                                             torch.int32), 4, True))
    torch.library.opcheck(tm.rms_w13_silu, (torch.randn(2, 24), torch.rand(24), 1e-5,
                                            torch.randn(80, 24)))


def test_gemv_ops_cpu_values() -> None:
    g = torch.Generator().manual_seed(0)
    f, n = 300, 56
    x, w = torch.randn(3, 2 * f, generator=g), torch.randn(n, f, generator=g)
    a = F.silu(x[:, :f]) * x[:, f:]
    part = tm.silu_gemv(x, w, 4, True)
    assert part.shape == (4, 3, n) and part.dtype == torch.float32
    torch.testing.assert_close(part.sum(0), F.linear(a, w), rtol=1e-4, atol=1e-3)
    kc = tm._chunks(f, 4, tm.GEMV_CFG["down"][1])  # split s = K-range [s kc, (s+1) kc)
    torch.testing.assert_close(part[0], F.linear(a[:, :kc], w[:, :kc]), rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(tm.silu_gemv(a, w, 2, False).sum(0), F.linear(a, w),
                               rtol=1e-4, atol=1e-3)
    res = torch.randn(3, n, generator=g)
    sem = tm.gemv_sem(3, n, "cpu")
    torch.testing.assert_close(tm.silu_gemv_add(x, w, res, sem, 4, True), res + F.linear(a, w),
                               rtol=1e-4, atol=1e-3)
    assert not sem.any()
    with pytest.raises(ValueError, match="n_split 3 must be a power of 2"):
        tm.silu_gemv_add(x, w, res, sem, 3, True)
    with pytest.raises(ValueError, match="must hold 6 counters"):
        tm.silu_gemv_add(x, w, res, sem[:5], 4, True)
    xn, nw, w13 = torch.randn(3, 40, generator=g), torch.rand(40, generator=g), torch.randn(
        2 * f, 40, generator=g)
    h = F.rms_norm(xn, (40,), nw, 1e-6)
    want = F.silu(F.linear(h, w13[:f])) * F.linear(h, w13[f:])
    torch.testing.assert_close(tm.rms_w13_silu(xn, nw, 1e-6, w13), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kw", OPTIONS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_option_gives_the_default_engines_tokens(model: VisionLanguageModel, kw: dict) -> None:
    prompts, imgs = tp.prompts(), [tp.image(), None, None]
    want = DecodeEngine(model, 4, 256, EOS, cuda_graph=False, **TORCH).generate(
        prompts, 24, images=imgs)
    got = DecodeEngine(model, 4, 256, EOS, **kw).generate(prompts, 24, images=imgs)
    assert got.tokens == want.tokens
    assert got.stop_reasons == want.stop_reasons
    assert len(set(want.tokens[0])) > 5  # varied text: the equality means something


@pytest.mark.slow
def test_decode_step_traces_as_one_graph_with_the_triton_ops(model: VisionLanguageModel) -> None:
    """torch.compile(fullgraph) of KVModel.decode with the Triton options (CPU: the ops' torch
    path) equals the eager default step: no graph break, the ops trace. Under inference_mode,
    as the engine runs it (the ops have no autograd formula: decode-only kernels)."""
    toks = torch.tensor([tp.prompts()[1][:9]] * 2)
    pos = torch.tensor([9, 5])
    ref = KVModel(model, 2, 128)
    kvs = [KVModel(model, 2, 128, decode_attention="triton_split", mlp="triton"),
           KVModel(model, 2, 128, decode_attention="triton_fused", mlp="triton_down"),
           KVModel(model, 2, 128, decode_attention="triton_fused_split",
                   mlp="triton_down_residual")]
    for m in (ref, *kvs):
        m.forward(m.embed_tokens(toks), torch.zeros(2, dtype=torch.long), slice(0, 2), 9)
    steps = [torch.compile(kv.decode, fullgraph=True, dynamic=False, backend="aot_eager")
             for kv in kvs]
    with torch.inference_mode():
        for t in range(3):
            want = ref.decode(toks[:, t], pos + t, 128)
            for step in steps:
                torch.testing.assert_close(step(toks[:, t], pos + t, 128), want,
                                           rtol=1e-4, atol=1e-4)
    for kv in kvs:  # the fused op wrote k/v in place inside the compiled step
        torch.testing.assert_close(kv.k[3][:, :, :12], ref.k[3][:, :, :12], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(kv.v[3][:, :, :12], ref.v[3][:, :, :12], rtol=1e-4, atol=1e-4)
        assert kv.k[3][0, :, 9:12].abs().sum(-1).min() > 0  # row 0's new positions: written


def test_mlp_kernels_run_only_in_single_row_steps(model: VisionLanguageModel,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """mlp='triton_down' reads the weights once per row: a step of more than MLP_KERNEL_ROWS
    rows takes the torch MLP instead (same values), a one-row step the kernel."""
    calls: list[int] = []
    real = tm.silu_gemv
    monkeypatch.setattr(tm, "silu_gemv", lambda x, *a: calls.append(x.shape[0]) or real(x, *a))
    tp.check_kernel_rows(model, calls, [1], mlp="triton_down")  # one call per layer, 1 row


def test_auto_resolution(model: VisionLanguageModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """'auto' (the default) = the torch paths on CPU; AUTO_CUDA on CUDA with triton (mlp
    'triton_fused'); the torch paths on CUDA without triton; mlp
    'inductor' when cuBLAS takes w2, attn_proj 'inductor' when it takes o or the attention is
    not a fused one; explicit values kept."""
    kv = KVModel(model, 1, 64)
    assert (kv.decode_attention, kv.mlp, kv.attn_proj) == ("grouped", "inductor", "inductor")
    cuda = torch.device("cuda")
    monkeypatch.setattr(tc, "HAVE_TRITON", True)
    monkeypatch.setattr(tc, "OP", object())
    assert resolve_auto("auto", "auto", cuda) == ("triton_fused", "triton_fused", "triton")
    assert AUTO_CUDA == {"decode_attention": "triton_fused", "mlp": "triton_fused",
                         "attn_proj": "triton"}
    assert resolve_auto("auto", "auto", cuda, frozenset({"w2"}))[1] == "inductor"
    assert resolve_auto("auto", "auto", cuda, frozenset({"o"}))[2] == "inductor"
    assert resolve_auto("triton", "auto", cuda)[2] == "inductor"
    assert resolve_auto("sdpa", "triton", cuda, attn_proj="inductor") == ("sdpa", "triton",
                                                                         "inductor")
    assert resolve_auto("auto", "auto", torch.device("cpu")) == ("grouped", "inductor",
                                                                 "inductor")
    monkeypatch.setattr(tc, "HAVE_TRITON", False)
    assert resolve_auto("auto", "auto", cuda) == ("grouped", "inductor", "inductor")


def test_option_errors(model: VisionLanguageModel, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="parameter 'mlp' = 'cuda'"):
        DecodeEngine(model, 1, 64, EOS, mlp="cuda")
    with pytest.raises(ValueError, match="parameter 'mlp' = 'triton'.*'gemv'"):
        DecodeEngine(model, 1, 64, EOS, mlp="triton", gemv="cublas")
    monkeypatch.setattr(tc, "HAVE_TRITON", False)
    with pytest.raises(RuntimeError, match="needs triton.*missing"):
        tc.need_triton("decode_attention='triton'")


# ---- GPU -------------------------------------------------------------------------------------
@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_triton_attention_matches_reference_on_gpu(dtype: torch.dtype) -> None:
    """Kernel vs the torch reference on CUDA. bf16: |diff| <= 2e-2 + 2e-2 |ref| (P is rounded
    to bf16 unnormalised in the kernel, normalised in the reference; outputs are O(1));
    fp32 (IEEE dots): 2e-5."""
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-5
    for b, h, hkv, hd, L in ((1, 14, 2, 64, 512), (4, 14, 2, 64, 1024), (3, 6, 2, 32, 128)):
        q, k, v, pos = _attn_case(b, h, hkv, hd, L, dtype, "cuda", seed=L)
        want = td.attention_ref(q.float(), k.float(), v.float(), pos)
        k2, v2 = k.clone(), v.clone()  # the kernel never reads keys past pos[b]
        for i, p in enumerate(pos.tolist()):
            k2[i, :, p + 1:] = float("nan")
            v2[i, :, p + 1:] = float("nan")
        for chunk in (0, 32, 64, 128):
            got = td.decode_attention(q, k2, v2, pos, chunk)
            assert got.dtype == dtype and got.shape == (b, h * hd)
            torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_fused_attention_matches_reference_on_gpu(dtype: torch.dtype) -> None:
    """The fused kernel (RoPE + cache write + attention) vs torch: the caches after the call
    (k at pos = the roped key, 1e-2 relative in bf16 (one rounding), 1e-6 in fp32; v at pos
    exact; every other entry, rows >= B included, untouched), and the output vs the grouped
    attention in fp32 over the written caches (bf16: 2e-2, fp32: 2e-5). The cache holds NaN at
    pos and beyond before the call: the kernel takes the new key from registers and never
    reads past it."""
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-5
    for b, h, hkv, hd, L, mb in ((1, 14, 2, 64, 512, 1), (4, 14, 2, 64, 1024, 4),
                                 (3, 6, 2, 32, 128, 4)):
        qkv, cis, kc, vc, pos = tp.fused_case(b, h, hkv, hd, L, dtype, "cuda", mb, seed=L)
        qkv[:, :h * hd] *= hd ** -0.5  # q pre-scaled, as the engine's wqkv
        for i, p in enumerate(pos.tolist()):
            kc[i, :, p:] = float("nan")
            vc[i, :, p:] = float("nan")
        x = qkv.view(b, 1, h + 2 * hkv, hd)
        qk = _rope_real(x[:, :, :h + hkv], cis[:, None])[:, 0]  # [B, H + Hkv, hd] in dtype
        want_k, want_v = kc.clone(), vc.clone()
        for i, p in enumerate(pos.tolist()):
            want_k[i, :, p] = qk[i, h:]
            want_v[i, :, p] = x[i, 0, h + hkv:]
        want = td.attention_ref(qk[:, :h].float(), want_k[:b, :, :L].float().nan_to_num(),
                                want_v[:b, :, :L].float().nan_to_num(), pos)
        sem = td.attn_sem(mb, hkv, "cuda")
        for chunk, one in ((0, None), (32, None), (128, None), (32, sem), (64, sem), (64, sem)):
            k2, v2 = kc.clone(), vc.clone()
            got = (td.decode_attention_fused(qkv, cis, k2, v2, pos, L, chunk) if one is None
                   else td.decode_attention_fused_split(qkv, cis, k2, v2, pos, one, L, chunk))
            assert got.dtype == dtype and got.shape == (b, h * hd)
            assert not sem.any()  # every counter back to zero (reused by the next call)
            torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
            ktol = 1e-2 if dtype == torch.bfloat16 else 1e-6
            torch.testing.assert_close(k2, want_k, rtol=ktol, atol=ktol, equal_nan=True)
            torch.testing.assert_close(v2, want_v, rtol=0, atol=0, equal_nan=True)


@pytest.mark.gpu
@gpu
def test_triton_gemvs_match_reference_on_gpu() -> None:
    """0.5b shapes (D 896, F 4864), bf16 in, fp32 accumulation: w_down partials vs an fp32
    matmul, rel. error <= 1e-3 of the output's max; fused RMSNorm+w13+SiLU*up vs the bf16
    torch path (which rounds h and gate/up to bf16), rel. error <= 2e-2."""
    g = torch.Generator().manual_seed(0)
    d, f = 896, 4864
    for m in (1, 4):
        x = torch.randn(m, 2 * f, generator=g).cuda().bfloat16()
        w2 = (torch.randn(d, f, generator=g) / f ** 0.5).cuda().bfloat16()
        a = F.silu(x[:, :f].float()) * x[:, f:].float()
        want = a @ w2.float().T
        got = tm.silu_gemv(x, w2, tm.GEMV_CFG["down"][2], True).sum(0)
        assert (got - want).abs().max() <= 1e-3 * want.abs().max()
        # one kernel: the last split of each block of outputs sums them and adds the residual
        # (the same roundings as the two-kernel path: fp32 sum -> bf16, + res -> bf16)
        res = torch.randn(m, d, generator=g).cuda().bfloat16()
        sem = tm.gemv_sem(m, d, "cuda")
        two = res + tm.silu_gemv(x, w2, tm.GEMV_CFG["down"][2], True).sum(0).bfloat16()
        for _ in range(3):  # the counters return to zero: calls repeat
            one = tm.silu_gemv_add(x, w2, res, sem, tm.GEMV_CFG["down"][2], True)
            assert one.dtype == torch.bfloat16 and not sem.any()
            assert (one.float() - two.float()).abs().max() <= 1e-2 * two.float().abs().max()
        xn = torch.randn(m, d, generator=g).cuda().bfloat16()
        nw = torch.rand(d, generator=g).cuda().bfloat16()
        w13 = (torch.randn(2 * f, d, generator=g) / d ** 0.5).cuda().bfloat16()
        ref = tm._rms_w13_ref(xn, nw, 1e-6, w13).float()
        out = tm.rms_w13_silu(xn, nw, 1e-6, w13).float()
        assert (out - ref).abs().max() <= 2e-2 * ref.abs().max()


@pytest.mark.gpu
@gpu
def test_compiled_triton_engine_equals_eager_on_gpu() -> None:
    """fp32, tiny config: the defaults on CUDA ('auto': the fused attention kernel, the
    whole-row projections and the two-kernel MLP), graphed without compile
    and compiled with 4 steps per replay, and the compiled step with Triton attention (split)
    + the Triton MLP, give the eager torch-path engine's tokens."""
    m = tp.sharp_tiny("cuda")
    prompts, imgs = tp.prompts(), [tp.image(device="cuda"), None, None]
    eager = DecodeEngine(m, 4, 256, EOS, cuda_graph=False, **TORCH).generate(prompts, 24,
                                                                             images=imgs)
    auto = DecodeEngine(m, 4, 256, EOS)
    assert (auto.kv.decode_attention, auto.kv.mlp, auto.kv.attn_proj) == (
        AUTO_CUDA["decode_attention"], "triton_fused", AUTO_CUDA["attn_proj"])
    assert auto.generate(prompts, 24, images=imgs).tokens == eager.tokens
    for kw in (dict(), dict(decode_attention="triton_split", mlp="triton"),
               dict(decode_attention="triton_fused_split", mlp="triton_down_residual",
                    greedy="auto")):
        eng = DecodeEngine(m, 4, 256, EOS, compile_step=True, steps_per_replay=4, **kw)
        got = eng.generate(prompts, 24, images=imgs)
        assert got.tokens == eager.tokens, kw
