"""Programmatic dependent launch of the decode step's Triton kernels (engine option `pdl`).

CPU (no triton, no GPU): the 'auto' rule and the errors of resolve_pdl; the PDL variants of
the ops (opaque custom ops) against the plain ops and as valid custom ops; a step with pdl
forced on (the device check patched) calls the PDL variants, traces as one graph and gives
the default engine's tokens. GPU (marked gpu; Hopper or later): the PDL kernels inside a
CUDA graph give the plain kernels' outputs bit for bit at the planner-hf shapes, and the
compiled, CUDA-graphed engine with pdl gives the eager engine's tokens."""

from __future__ import annotations

import pytest
import torch
import tiny_planner as tp

from kestrel_models.planner import VisionLanguageModel, triton_common
from kestrel_models.planner import triton_decode as td
from kestrel_models.planner import triton_gemv as tg
from kestrel_models.planner import triton_mlp as tm
from kestrel_models.planner.decode_options import resolve_pdl
from kestrel_models.planner.engine import DecodeEngine

torch.set_num_threads(1)
EOS = 257
TORCH = dict(decode_attention="grouped", mlp="inductor")  # the torch paths ('auto' on CPU)
WHOLE = dict(decode_attention="triton_fused", mlp="triton_fused", attn_proj="triton")
CUDA = torch.device("cuda")
hopper = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
    reason="needs a CUDA GPU of compute capability >= 9.0 (PDL)")


@pytest.fixture(scope="module")
def model() -> VisionLanguageModel:
    return tp.sharp_tiny()


@pytest.fixture
def pdl_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every device counts as PDL-capable (the ops' CPU path still runs)."""
    monkeypatch.setattr(triton_common, "pdl_unsupported", lambda device: None)


def test_auto_rule_and_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    assert resolve_pdl(None, cpu, "triton_fused", "triton_fused", "triton") is False
    assert resolve_pdl(False, cpu, "triton_fused", "triton_fused", "triton") is False
    with pytest.raises(ValueError, match="parameter 'pdl' = True: the model is on cpu"):
        resolve_pdl(True, cpu, "triton_fused", "inductor", "inductor")
    monkeypatch.setattr(triton_common, "HAVE_TRITON", True)  # a triton without gdc_wait
    monkeypatch.setattr(triton_common, "tl", None)
    assert "grid dependency control" in triton_common.pdl_unsupported(CUDA)


def test_auto_rule_on_a_pdl_device(pdl_device: None) -> None:
    """On: a kernel it applies to runs (fused attention, whole-row attention projections or
    MLP). Off otherwise; asking for it then names what it applies to."""
    for opts in (("triton_fused", "inductor", "inductor"), ("grouped", "triton_fused",
                                                            "inductor"),
                 ("triton_fused_split", "triton_down", "triton")):
        assert resolve_pdl(None, CUDA, *opts) is True, opts
    assert resolve_pdl(None, CUDA, "triton_fused_split", "triton_down", "inductor") is False
    with pytest.raises(ValueError, match="'pdl' = True: applies to decode_attention "
                                         "'triton_fused'.*got 'grouped', 'inductor'"):
        resolve_pdl(True, CUDA, "grouped", "triton", "inductor")
    with pytest.raises(ValueError, match="parameter 'pdl' = True"):
        DecodeEngine(tp.sharp_tiny(), 1, 64, EOS, pdl=True, **TORCH)


def _cases() -> tuple:
    g = torch.Generator().manual_seed(0)
    x, nw, w = torch.randn(2, 24, generator=g), torch.rand(24, generator=g) + 0.5, \
        torch.randn(40, 24, generator=g)
    return (x, nw, w, torch.randn(40, generator=g), torch.randn(2, 40, generator=g),
            torch.randn(80, 24, generator=g)), (
        *tp.fused_case(2, 6, 2, 32, 48, torch.float32, "cpu", mb=3), 48)


def test_pdl_ops_equal_the_plain_ops_on_cpu() -> None:
    (x, nw, w, bias, res, w13), (qkv, cis, kc, vc, pos, L) = _cases()
    assert torch.equal(tg.rms_gemv_pdl(x, nw, 1e-6, w, bias), tg.rms_gemv(x, nw, 1e-6, w, bias))
    assert torch.equal(tg.gemv_add_pdl(x, w, res), tg.gemv_add(x, w, res))
    assert torch.equal(tm.rms_w13_silu_pdl(x, nw, 1e-6, w13), tm.rms_w13_silu(x, nw, 1e-6, w13))
    k2, v2 = kc.clone(), vc.clone()
    got = td.decode_attention_fused_pdl(qkv, cis, k2, v2, pos, L, 0)
    assert torch.equal(got, td.decode_attention_fused(qkv, cis, kc, vc, pos, L, 0))
    assert torch.equal(k2, kc) and torch.equal(v2, vc)  # the cache write happened in both


@pytest.mark.slow
def test_pdl_ops_are_valid_custom_ops() -> None:
    (x, nw, w, bias, res, w13), (qkv, cis, kc, vc, pos, L) = _cases()
    torch.library.opcheck(tg.rms_gemv_pdl, (x, nw, 1e-5, w, bias))
    torch.library.opcheck(tg.rms_gemv_pdl, (x, nw, 1e-5, w, None))
    torch.library.opcheck(tg.gemv_add_pdl, (x, w, res))
    torch.library.opcheck(tm.rms_w13_silu_pdl, (x, nw, 1e-5, w13))
    torch.library.opcheck(td.decode_attention_fused_pdl, (qkv, cis, kc, vc, pos, L, 0))


def test_step_with_pdl_calls_the_pdl_ops(model: VisionLanguageModel, pdl_device: None,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """pdl on: a one-row step runs the PDL variants (qkv, o, w13, w_down per layer), a wider
    step the torch code for the projections, both with the default step's logits."""
    from kestrel_models.planner import kvmodel
    calls: list[str] = []
    for module, attr, name in ((kvmodel, "rms_gemv_pdl", "qkv"), (kvmodel, "gemv_add_pdl", "o"),
                               (tm, "rms_w13_silu_pdl", "w13"), (tm, "gemv_add_pdl", "w2"),
                               (kvmodel, "rms_gemv", "plain"), (kvmodel, "gemv_add", "plain")):
        tp.spy(monkeypatch, calls, module, attr, name)
    tp.check_kernel_rows(model, calls, ["qkv", "o", "w13", "w2"], pdl=True, **WHOLE)


def test_engine_with_pdl_gives_the_default_tokens(model: VisionLanguageModel,
                                                  pdl_device: None) -> None:
    prompts, imgs = tp.prompts(), [tp.image(), None, None]
    want = DecodeEngine(model, 4, 256, EOS, cuda_graph=False, **TORCH).generate(
        prompts, 24, images=imgs)
    eng = DecodeEngine(model, 4, 256, EOS, **WHOLE)
    assert eng.kv.pdl is True  # 'auto' on a PDL-capable device
    got = eng.generate(prompts, 24, images=imgs)
    assert got.tokens == want.tokens and len(set(want.tokens[0])) > 5


def test_step_with_pdl_traces_as_one_graph(model: VisionLanguageModel, pdl_device: None) -> None:
    """The opaque PDL ops stay in one fullgraph trace (no graph break) with the default
    step's values."""
    tp.check_step_traces(model, pdl=True, **WHOLE)


# ---- GPU -------------------------------------------------------------------------------------
def _chain(pdl: bool, x: torch.Tensor, lw: dict, k: torch.Tensor, v: torch.Tensor,
           cis: torch.Tensor, pos: torch.Tensor, kv_len: int) -> torch.Tensor:
    """Two decode layers of the whole-row kernels (qkv, attention, o, w13, w_down)."""
    rg, ga = (tg.rms_gemv_pdl, tg.gemv_add_pdl) if pdl else (tg.rms_gemv, tg.gemv_add)
    w13 = tm.rms_w13_silu_pdl if pdl else tm.rms_w13_silu
    att = td.decode_attention_fused_pdl if pdl else td.decode_attention_fused
    for _ in range(2):
        qkv = rg(x, lw["n1"], 1e-6, lw["wqkv"], lw["b"])
        x = ga(att(qkv, cis, k, v, pos, kv_len, 0), lw["wo"], x)
        x = ga(w13(x, lw["n2"], 1e-6, lw["w13"]), lw["w2"], x)
    return x


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("dims", [(576, 9, 3, 1536), (2048, 16, 2, 11008)],
                         ids=["smolvlm-256m", "qwen2.5-vl-3b"])
def test_pdl_kernels_in_a_graph_equal_the_plain_ones(dims: tuple[int, int, int, int]) -> None:
    """bf16, the planner-hf shapes (D, heads, kv heads, F; head dim 64/128): a CUDA graph of
    the PDL chain replayed gives the plain chain's output and cache writes bit for bit."""
    d, h, hkv, f = dims
    hd = d // h
    g = torch.Generator().manual_seed(0)

    def r(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).cuda().bfloat16()

    lw = dict(n1=r(d).abs() + 0.5, n2=r(d).abs() + 0.5, wqkv=r((h + 2 * hkv) * hd, d,
              scale=d ** -0.5), b=r((h + 2 * hkv) * hd), wo=r(d, h * hd, scale=d ** -0.5),
              w13=r(2 * f, d, scale=d ** -0.5), w2=r(d, f, scale=f ** -0.5))
    x = r(1, d)
    ang = torch.rand(1, hd // 2, generator=g).cuda() * 6
    cis = torch.stack([ang.cos(), ang.sin()], -1)
    kv_len, pos = 256, torch.tensor([200], device="cuda")
    k0, v0 = r(1, hkv, kv_len, hd), r(1, hkv, kv_len, hd)
    outs = []
    for pdl in (False, True):
        k, v = k0.clone(), v0.clone()
        _chain(pdl, x, lw, k, v, cis, pos, kv_len)  # compile the kernels outside the capture
        k.copy_(k0)
        v.copy_(v0)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = _chain(pdl, x, lw, k, v, cis, pos, kv_len)
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        outs.append((y.clone(), k.clone(), v.clone()))
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)


@pytest.mark.gpu
@hopper
def test_compiled_engine_with_pdl_equals_eager_on_gpu() -> None:
    """fp32, tiny config: the compiled, CUDA-graphed step with pdl (auto on Hopper) and the
    whole-row kernels gives the eager torch-path engine's tokens."""
    m = tp.sharp_tiny("cuda")
    prompts, imgs = tp.prompts(), [tp.image(device="cuda"), None, None]
    eager = DecodeEngine(m, 4, 256, EOS, cuda_graph=False, **TORCH).generate(prompts, 24,
                                                                             images=imgs)
    eng = DecodeEngine(m, 4, 256, EOS, compile_step=True, steps_per_replay=4, **WHOLE)
    assert eng.kv.pdl is True
    assert eng.generate(prompts, 24, images=imgs).tokens == eager.tokens
