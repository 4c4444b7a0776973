"""Whole-row GEMV ops (triton_gemv.py) and the engine options that use them: attn_proj='triton'
(RMSNorm + qkv, output projection + residual) and mlp='triton_fused' (the MLP block in two
kernels).

CPU (no triton, no GPU): each op's torch path against plain torch, the ops as valid custom
ops, the engine with the options against the default engine (identical greedy tokens, fp32),
the compiled step (fullgraph), the one-row rule and the option errors. GPU (marked gpu): the
Triton kernels against torch at the planner-hf model shapes (bf16) and the compiled,
CUDA-graphed engine against the eager one (identical tokens, fp32, tiny config)."""

from __future__ import annotations

import pytest
import torch
import tiny_planner as tp
import torch.nn.functional as F

from kestrel_models.planner import VisionLanguageModel
from kestrel_models.planner import triton_gemv as tg
from kestrel_models.planner.engine import DecodeEngine

torch.set_num_threads(1)
EOS = 257
TORCH = dict(decode_attention="grouped", mlp="inductor")  # the torch paths ('auto' on CPU)
FUSED = dict(decode_attention="triton_fused", mlp="triton_fused", attn_proj="triton")
OPTIONS = [FUSED, dict(decode_attention="triton_fused", attn_proj="triton"),
           dict(decode_attention="triton_fused", mlp="triton_fused"),
           dict(FUSED, decode_attention="triton_fused_split"),
           dict(FUSED, steps_per_replay=4, greedy="auto", gemv="cublas:lm_head")]
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def model() -> VisionLanguageModel:
    return tp.sharp_tiny()


def _rms_gemv_ref(x: torch.Tensor, nw: torch.Tensor, w: torch.Tensor,
                  b: torch.Tensor | None) -> torch.Tensor:
    y = F.linear(F.rms_norm(x, (x.shape[-1],), nw, 1e-6), w)
    return y if b is None else y + b


def test_ops_cpu_values_and_checks() -> None:
    g = torch.Generator().manual_seed(0)
    x, nw = torch.randn(3, 40, generator=g), torch.rand(40, generator=g) + 0.5
    w, b = torch.randn(24, 40, generator=g), torch.randn(24, generator=g)
    for bias in (b, None):
        torch.testing.assert_close(tg.rms_gemv(x, nw, 1e-6, w, bias),
                                   _rms_gemv_ref(x, nw, w, bias))
    res = torch.randn(3, 24, generator=g)
    torch.testing.assert_close(tg.gemv_add(x, w, res), res + F.linear(x, w))
    with pytest.raises(ValueError, match=r"rms_gemv: x \[M, K\] and w \[N, K\]"):
        tg.rms_gemv(x, nw, 1e-6, w[:, :30], None)
    with pytest.raises(ValueError, match=r"gemv_add: res must be \[M, N\] = \(3, 24\)"):
        tg.gemv_add(x, w, res[:, :5])
    # one tile covers K up to MAX_BLOCK_K; TILE_ELEMS weights per program
    assert tg.block_shape(576) == (tg.TILE_ELEMS // 1024, 1024)
    assert tg.block_shape(11008) == (tg.TILE_ELEMS // tg.MAX_BLOCK_K, tg.MAX_BLOCK_K)
    assert tg.block_shape(3) == (tg.TILE_ELEMS // 16, 16)


@pytest.mark.slow
def test_ops_are_valid_custom_ops() -> None:
    x, nw, w = torch.randn(2, 24), torch.rand(24), torch.randn(40, 24)
    torch.library.opcheck(tg.rms_gemv, (x, nw, 1e-5, w, torch.randn(40)))
    torch.library.opcheck(tg.rms_gemv, (x, nw, 1e-5, w, None))
    torch.library.opcheck(tg.gemv_add, (x, w, torch.randn(2, 40)))


@pytest.mark.parametrize("kw", OPTIONS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_option_gives_the_default_engines_tokens(model: VisionLanguageModel, kw: dict) -> None:
    prompts, imgs = tp.prompts(), [tp.image(), None, None]
    want = DecodeEngine(model, 4, 256, EOS, cuda_graph=False, **TORCH).generate(
        prompts, 24, images=imgs)
    eng = DecodeEngine(model, 4, 256, EOS, **kw)
    assert eng.kv.attn_proj == kw.get("attn_proj", "inductor")
    assert eng.kv.mlp == kw.get("mlp", "inductor")
    got = eng.generate(prompts, 24, images=imgs)
    assert got.tokens == want.tokens
    assert got.stop_reasons == want.stop_reasons
    assert len(set(want.tokens[0])) > 5  # varied text: the equality means something


def test_decode_step_traces_as_one_graph(model: VisionLanguageModel) -> None:
    """torch.compile(fullgraph) of KVModel.decode with the options (CPU: the ops' torch path)
    equals the eager default step: no graph break, the ops trace (under inference_mode, as the
    engine runs it)."""
    tp.check_step_traces(model, **FUSED)


def test_kernels_run_only_in_single_row_steps(model: VisionLanguageModel,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole-row GEMVs read the weights once per row: a step of more than MLP_KERNEL_ROWS
    rows takes the torch code (same values), a one-row step the kernels (per layer: qkv, o and
    w_down)."""
    from kestrel_models.planner import kvmodel, triton_mlp
    calls: list[str] = []
    for module, attr, name in ((kvmodel, "rms_gemv", "qkv"), (kvmodel, "gemv_add", "o"),
                               (triton_mlp, "gemv_add", "w2")):
        tp.spy(monkeypatch, calls, module, attr, name)
    tp.check_kernel_rows(model, calls, ["qkv", "o", "w2"], **FUSED)


def test_option_errors(model: VisionLanguageModel) -> None:
    with pytest.raises(ValueError, match="parameter 'attn_proj' = 'cuda'"):
        DecodeEngine(model, 1, 64, EOS, attn_proj="cuda")
    with pytest.raises(ValueError, match="'attn_proj' = 'triton': needs decode_attention "
                                         "'triton_fused'.*got 'grouped'"):
        DecodeEngine(model, 1, 64, EOS, attn_proj="triton")
    with pytest.raises(ValueError, match="'attn_proj' = 'triton'.*'gemv'.*must not name qkv"):
        DecodeEngine(model, 1, 64, EOS, attn_proj="triton", decode_attention="triton_fused",
                     gemv="cublas:o")
    with pytest.raises(ValueError, match="parameter 'mlp' = 'triton_fused'.*'gemv'"):
        DecodeEngine(model, 1, 64, EOS, mlp="triton_fused", gemv="cublas:w2")


# ---- GPU -------------------------------------------------------------------------------------
@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dims", [(576, 960, 1536), (2048, 2560, 11008)],
                         ids=["smolvlm-256m", "qwen2.5-vl-3b"])
def test_kernels_match_torch_on_gpu(dims: tuple[int, int, int]) -> None:
    """bf16 in, fp32 accumulation, at the planner-hf shapes (D, qkv outputs, F): each kernel vs
    the same math in fp32 from the same bf16 inputs, error <= 1e-2 of the output's max (the
    kernels round once to bf16; the torch path rounds between its ops)."""
    g = torch.Generator().manual_seed(0)
    d, nq, f = dims

    def close(got: torch.Tensor, want: torch.Tensor) -> None:
        assert got.dtype == torch.bfloat16
        assert (got.float() - want).abs().max() <= 1e-2 * want.abs().max()

    for m in (1, 3):
        x = torch.randn(m, d, generator=g).cuda().bfloat16()
        nw = (torch.rand(d, generator=g) + 0.5).cuda().bfloat16()
        wqkv = (torch.randn(nq, d, generator=g) / d ** 0.5).cuda().bfloat16()
        b = torch.randn(nq, generator=g).cuda().bfloat16()
        h = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
             * nw.float())
        for bias in (b, None):
            want = h @ wqkv.float().T + (0 if bias is None else bias.float())
            close(tg.rms_gemv(x, nw, 1e-6, wqkv, bias), want)
        for k in (d, f):  # the output projection; w_down
            a = torch.randn(m, k, generator=g).cuda().bfloat16()
            w = (torch.randn(d, k, generator=g) / k ** 0.5).cuda().bfloat16()
            close(tg.gemv_add(a, w, x), x.float() + a.float() @ w.float().T)


@pytest.mark.gpu
@gpu
def test_compiled_engine_with_the_options_equals_eager_on_gpu() -> None:
    """fp32, tiny config: the compiled, CUDA-graphed step with attn_proj='triton' and
    mlp='triton_fused' (4 steps per replay) gives the eager torch-path engine's tokens."""
    m = tp.sharp_tiny("cuda")
    prompts, imgs = tp.prompts(), [tp.image(device="cuda"), None, None]
    eager = DecodeEngine(m, 4, 256, EOS, cuda_graph=False, **TORCH).generate(prompts, 24,
                                                                             images=imgs)
    for kw in (FUSED, dict(FUSED, decode_attention="triton_fused_split")):
        eng = DecodeEngine(m, 4, 256, EOS, compile_step=True, steps_per_replay=4, **kw)
        assert eng.generate(prompts, 24, images=imgs).tokens == eager.tokens, kw
