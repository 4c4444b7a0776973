"""Decode-step kernel options of the engine: cuBLAS linears through the opaque custom op
(gemv='cublas' / 'cublas:<names>'), SDPA decode attention, the two-stage greedy pick. Each one
must give exactly the default engine's tokens (fp32, CPU; the GPU mirror is marked gpu)."""

from __future__ import annotations

import pytest
import torch
import tiny_planner as tp
import torch.nn.functional as F

from kestrel_models.planner import VisionLanguageModel
from kestrel_models.planner.engine import DecodeEngine
from kestrel_models.planner.engine_request import two_stage_argmax
from kestrel_models.planner.kvmodel import KVModel, cublas_linear, parse_gemv

torch.set_num_threads(1)
EOS = 257
OPTIONS = [dict(gemv="cublas"), dict(gemv="cublas:w2,lm_head"), dict(decode_attention="sdpa"),
           dict(greedy="two_stage"),
           dict(gemv="cublas", decode_attention="sdpa", greedy="two_stage", steps_per_replay=4)]


@pytest.fixture(scope="module")
def model() -> VisionLanguageModel:
    return tp.sharp_tiny()


@pytest.mark.slow
def test_cublas_linear_is_f_linear_and_a_valid_custom_op() -> None:
    torch.manual_seed(0)
    x, w = torch.randn(2, 1, 24), torch.randn(40, 24)
    torch.testing.assert_close(cublas_linear(x, w), F.linear(x, w), rtol=0, atol=0)
    torch.library.opcheck(cublas_linear, (x, w))  # schema, fake (meta) impl, dispatch
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    torch.library.opcheck(cublas_linear, (xg, wg))  # + the registered autograd formula
    cublas_linear(xg, wg).square().sum().backward()
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    F.linear(xr, wr).square().sum().backward()
    torch.testing.assert_close((xg.grad, wg.grad), (xr.grad, wr.grad))
    with torch._subclasses.fake_tensor.FakeTensorMode():
        out = cublas_linear(torch.empty(3, 5, 24), torch.empty(7, 24))
    assert out.shape == (3, 5, 7)


def test_parse_gemv() -> None:
    assert parse_gemv("inductor") == frozenset()
    assert parse_gemv("cublas") == {"qkv", "o", "w13", "w2", "lm_head"}
    assert parse_gemv("cublas:w2,lm_head") == {"w2", "lm_head"}
    for bad in ("cuda", "cublas:", "cublas:w2,bogus"):
        with pytest.raises(ValueError, match="parameter 'gemv'"):
            parse_gemv(bad)


def test_two_stage_argmax_equals_argmax_with_ties() -> None:
    g = torch.Generator().manual_seed(0)
    for v in (260, 151_936, 97):  # 97 is prime: one block of the whole row
        x = torch.randn(3, v, generator=g)
        x[1, v // 3] = x[1, v - 2] = x[1].max() + 1.0  # tie across blocks: first one wins
        x[2, 5] = x[2, 6] = x[2].max() + 1.0  # tie inside a block
        want = torch.argmax(x, dim=-1)
        assert two_stage_argmax(x).tolist() == want.tolist()
        assert want[1] == v // 3 and want[2] == 5


@pytest.mark.slow
@pytest.mark.parametrize("kw", OPTIONS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_option_gives_the_default_engines_tokens(model: VisionLanguageModel, kw: dict) -> None:
    prompts, imgs = tp.prompts(), [tp.image(), None, None]
    want = DecodeEngine(model, 4, 256, EOS).generate(prompts, 24, images=imgs)
    got = DecodeEngine(model, 4, 256, EOS, **kw).generate(prompts, 24, images=imgs)
    assert got.tokens == want.tokens
    assert got.stop_reasons == want.stop_reasons
    assert len(set(want.tokens[0])) > 5  # varied text: the equality means something


@pytest.mark.slow
def test_decode_step_traces_as_one_graph_with_the_options(model: VisionLanguageModel) -> None:
    """torch.compile (fullgraph, no graph break: the custom op's fake impl is used for
    tracing) of KVModel.decode with every option equals the eager default step."""
    toks = torch.tensor([tp.prompts()[1][:9]] * 2)
    pos = torch.tensor([9, 9])
    ref = KVModel(model, 2, 128)
    kv = KVModel(model, 2, 128, gemv="cublas", decode_attention="sdpa")
    for m in (ref, kv):
        m.forward(m.embed_tokens(toks), torch.zeros(2, dtype=torch.long), slice(0, 2), 9)
    step = torch.compile(kv.decode, fullgraph=True, dynamic=False, backend="aot_eager")
    for t in range(3):
        want = ref.decode(toks[:, t], pos + t, 128)
        got = step(toks[:, t], pos + t, 128)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_option_errors(model: VisionLanguageModel) -> None:
    with pytest.raises(ValueError, match="parameter 'gemv' = 'fast'"):
        DecodeEngine(model, 1, 64, EOS, gemv="fast")
    with pytest.raises(ValueError, match="parameter 'decode_attention' = 'flash'"):
        DecodeEngine(model, 1, 64, EOS, decode_attention="flash")
    with pytest.raises(ValueError, match="parameter 'greedy' = 'topk'"):
        DecodeEngine(model, 1, 64, EOS, greedy="topk")


def _big_vocab_model() -> VisionLanguageModel:
    from kestrel_models.planner.config import VLMConfig
    from kestrel_models.planner.engine_request import TWO_STAGE_MIN_VOCAB
    return VisionLanguageModel(VLMConfig(vocab_size=TWO_STAGE_MIN_VOCAB, dim=32, n_heads=2,
                                         n_kv_heads=1, n_layers=1, ffn_hidden=64))


def test_greedy_auto_keeps_one_argmax_off_cuda(model: VisionLanguageModel) -> None:
    """greedy='auto' (the default): one argmax for a small vocabulary, and on the CPU for any
    vocabulary (the two stages are measured faster on CUDA only); 'two_stage' on request."""
    assert DecodeEngine(model, 1, 64, EOS).greedy == "argmax"
    big = _big_vocab_model()
    assert DecodeEngine(big, 1, 64, EOS).greedy == "argmax"
    assert DecodeEngine(big, 1, 64, EOS, greedy="two_stage").greedy == "two_stage"


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
def test_greedy_auto_takes_two_stage_for_large_vocabularies_on_cuda() -> None:
    """On CUDA the default picks the two-stage argmax (the same ids) from TWO_STAGE_MIN_VOCAB
    tokens up, one argmax below."""
    assert DecodeEngine(_big_vocab_model().cuda(), 1, 64, EOS).greedy == "two_stage"
    assert DecodeEngine(tp.sharp_tiny("cuda"), 1, 64, EOS).greedy == "argmax"


@pytest.mark.gpu
@gpu
def test_options_equal_eager_on_gpu() -> None:
    """fp32 on CUDA: every option in the CUDA-graphed engine, and all of them together in the
    compiled whole step (coordinate-descent tuning on: the default linears would be
    decomposed, the custom op's stay cuBLAS) with 4 steps per replay, give the eager tokens."""
    m = tp.sharp_tiny("cuda")
    prompts, imgs = tp.prompts(), [tp.image(device="cuda"), None, None]
    eager = DecodeEngine(m, 4, 256, EOS, cuda_graph=False, decode_attention="grouped",
                         mlp="inductor").generate(prompts, 24, images=imgs)  # not 'auto'
    for kw in OPTIONS:
        got = DecodeEngine(m, 4, 256, EOS, **kw).generate(prompts, 24, images=imgs)
        assert got.tokens == eager.tokens, kw
    got = DecodeEngine(m, 4, 256, EOS, compile_step=True, coordinate_descent=True,
                       **OPTIONS[-1]).generate(prompts, 24, images=imgs)
    assert got.tokens == eager.tokens
