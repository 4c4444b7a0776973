"""DecodeEngine (continuous batching, prefix cache, CUDA-graph decode) against generate.py."""

from __future__ import annotations

import pytest
import torch

from kestrel_models.planner import VisionLanguageModel, generate, get_config
from kestrel_models.planner.engine import DecodeEngine, sample_on_device
from kestrel_models.planner.kvmodel import KVModel

torch.set_num_threads(1)
EOS = 257
PAD = 258


def sharpen(m: VisionLanguageModel, scale: float = 30.0) -> VisionLanguageModel:
    """Scale the random weights so greedy decoding varies from token to token (the default
    std-0.02 init repeats one token, which would make the equality tests weak)."""
    with torch.no_grad():
        for p in m.parameters():
            if p.ndim >= 2:
                p.mul_(scale)
    return m


@pytest.fixture(scope="module")
def model() -> VisionLanguageModel:
    torch.manual_seed(0)
    m = sharpen(VisionLanguageModel(get_config("tiny")).eval())
    m.setup_cache(4, 256)
    return m


def _prompts(seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (7, 12, 3)]


def _imgs(b: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (b, 3, 32, 32), dtype=torch.uint8, generator=g)


@pytest.mark.parametrize("with_image", [False, True])
def test_engine_greedy_equals_generate(model: VisionLanguageModel, with_image: bool) -> None:
    prompts = _prompts()
    img = _imgs(3) if with_image else None
    ref = generate(model, prompts, EOS, PAD, 20, image=img)
    eng = DecodeEngine(model, max_batch=4, max_len=256, eos_id=EOS)
    out = eng.generate(prompts, 20, images=None if img is None else list(img))
    assert out.tokens == ref.tokens
    assert out.stop_reasons == ref.stop_reasons
    assert sum(len(t) for t in out.tokens) >= 40
    assert max(len(set(t)) for t in out.tokens) > 10  # varied text, not one repeated token


def test_kvmodel_logits_match_full_forward(model: VisionLanguageModel) -> None:
    """Prefill + 5 single-token steps through the static cache == full causal forward."""
    toks = torch.tensor([_prompts()[1]])
    img = _imgs(1)
    ref = model(img, toks)  # [1, 12, V]
    kv = KVModel(model, max_batch=2, max_len=128)
    x = torch.cat([kv.embed_image(img), kv.embed_tokens(toks[:, :7])], dim=1)
    n = x.shape[1]
    out = [kv.forward(x, torch.zeros(1, dtype=torch.long), slice(1, 2), n)[:, -1]]
    for t in range(7, 12):
        pos = torch.tensor([n + t - 7])
        out.append(kv.forward(kv.embed_tokens(toks[:, t:t + 1]), pos, slice(1, 2), 128)[:, -1])
    got = torch.stack(out[:-1], dim=1)
    ref = ref[:, 6:11]
    assert float((got - ref).norm() / ref.norm()) < 1e-5  # fp32 round-off only


def test_prefix_cache_equals_uncached(model: VisionLanguageModel) -> None:
    prefix = list(b"You are a robot task planner.\n")
    prompts = _prompts(5)
    imgs = list(_imgs(3, seed=7))
    a = DecodeEngine(model, 4, 256, EOS, system_prefix=prefix, prefix_cache=True)
    b = DecodeEngine(model, 4, 256, EOS, system_prefix=prefix, prefix_cache=False)
    ra = a.generate(prompts, 16, images=imgs)
    rb = b.generate(prompts, 16, images=imgs)
    assert ra.tokens == rb.tokens
    # And == generate() over the full text when there is no image (prefix + prompt).
    ref = generate(model, [prefix + p for p in prompts], EOS, PAD, 16)
    rc = a.generate(prompts, 16)
    assert rc.tokens == ref.tokens


def test_join_and_leave_do_not_change_other_sequences(model: VisionLanguageModel) -> None:
    prompts = _prompts(9)
    alone = DecodeEngine(model, 4, 256, EOS).generate([prompts[0]], 30).tokens[0]
    eng = DecodeEngine(model, 4, 256, EOS)
    a = eng.submit(prompts[0], 30)
    eng.step()
    eng.step()
    b = eng.submit(prompts[1], 4)  # joins at step 3, leaves after 4 tokens
    for _ in range(6):
        eng.step()
    assert b.stop_reason == "max_new_tokens" and eng.slots[b.slot] is None
    c = eng.submit(prompts[2], 10, image=_imgs(1)[0])  # re-uses b's slot
    eng.run()
    assert c.slot == b.slot == 1
    assert a.tokens == alone
    ref_c = generate(model, [prompts[2]], EOS, PAD, 10, image=_imgs(1)).tokens[0]
    assert c.tokens == ref_c


def test_logits_processor_and_cancel(model: VisionLanguageModel) -> None:
    allowed = [ord(c) for c in "abc"]

    def only_abc(prefix: list[int], logits: torch.Tensor) -> torch.Tensor:
        out = torch.full_like(logits, float("-inf"))
        out[allowed] = logits[allowed]
        if len(prefix) >= 5:
            out[:] = float("-inf")
            out[EOS] = 0.0
        return out

    eng = DecodeEngine(model, 4, 256, EOS)
    res = eng.generate(_prompts(), 20, logits_processor=[only_abc, None, only_abc])
    ref = generate(model, _prompts(), EOS, PAD, 20, logits_processor=[only_abc, None, only_abc])
    assert res.tokens == ref.tokens
    assert res.stop_reasons == ["eos", "max_new_tokens", "eos"]
    assert set(res.tokens[0]) <= set(allowed) and len(res.tokens[0]) == 5
    n = {"calls": 0}

    def stop_after_3() -> bool:
        n["calls"] += 1
        return n["calls"] > 3

    r = eng.submit(_prompts()[0], 20, should_stop=stop_after_3)
    eng.run(100)
    assert r.stop_reason == "cancelled" and len(r.tokens) == 3
    assert eng.idle()


def test_sampling_on_device_distribution() -> None:
    torch.manual_seed(0)
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]]).repeat(20000, 1)
    toks = sample_on_device(logits, torch.full((20000,), 1.0))
    freq = torch.bincount(toks, minlength=4).float() / 20000
    assert (freq - torch.softmax(logits[0], -1)).abs().max() < 0.015
    greedy = sample_on_device(logits[:3], torch.zeros(3))
    assert greedy.tolist() == [2, 2, 2]


def test_config_errors(model: VisionLanguageModel) -> None:
    with pytest.raises(ValueError, match="max_batch"):
        DecodeEngine(model, 0, 256, EOS)
    with pytest.raises(ValueError, match="max_len"):
        DecodeEngine(model, 2, 10**6, EOS)
    with pytest.raises(ValueError, match="cuda_graph"):
        DecodeEngine(model, 2, 256, EOS, cuda_graph=True) if not torch.cuda.is_available() \
            else (_ for _ in ()).throw(ValueError("cuda_graph"))
    eng = DecodeEngine(model, 2, 64, EOS)
    with pytest.raises(ValueError, match="max_len"):
        eng.submit(list(range(40)), 40)


@pytest.mark.parametrize("steps", [1, 4])
def test_graph_path_equals_eager(model: VisionLanguageModel, cpu_graphs: None, steps: int) -> None:
    """The decode and prefill graph paths on the CPU (cpu_graphs: replays recompute): the
    tokens are the eager engine's, with steps_per_replay 1 and 4, a logits processor on one
    row, requests joining mid-run and a slot reused, so every static input a step reads is
    refreshed before its replay and a capture leaves the positions as they were."""


    def abc(prefix: list[int], logits: torch.Tensor) -> torch.Tensor:
        keep = torch.zeros_like(logits, dtype=torch.bool)
        keep[[ord(c) for c in "abc"]] = True
        return logits.masked_fill(~keep, float("-inf"))

    def run(eng: DecodeEngine) -> list[list[int]]:
        p = _prompts(5)
        reqs = [eng.submit(p[0], 20, _imgs(1)[0]), eng.submit(p[1], 6, logits_processor=abc)]
        for _ in range(3):
            eng.step()
        reqs.append(eng.submit(p[2], 12))
        eng.run()
        reqs.append(eng.submit(p[1], 9, _imgs(1, seed=2)[0]))  # a freed slot again
        eng.run()
        return [r.tokens for r in reqs]

    ref = run(DecodeEngine(model, 4, 256, EOS, steps_per_replay=steps))
    eng = DecodeEngine(model, 4, 256, EOS, steps_per_replay=steps)
    eng.cuda_graph = eng.prefill_graph = True  # the CUDA code paths, on cpu_graphs
    assert run(eng) == ref
    assert eng._graphs and eng._pgraphs
    assert steps == 1 or any(key[2] == steps for key in eng._graphs)  # multi-step replays


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_engine_equals_eager() -> None:
    torch.manual_seed(0)
    m = sharpen(VisionLanguageModel(get_config("tiny"))).cuda().eval()
    prompts = _prompts()
    eager = DecodeEngine(m, 4, 256, EOS, cuda_graph=False, decode_attention="grouped",
                         mlp="inductor").generate(prompts, 24)  # torch paths (not 'auto')
    graph = DecodeEngine(m, 4, 256, EOS, cuda_graph=True).generate(prompts, 24)
    assert graph.tokens == eager.tokens


def test_real_rope_path_equals_complex(model: VisionLanguageModel) -> None:
    """The compile path's real-arithmetic RoPE gives the same logits as the complex one."""
    toks = torch.tensor([_prompts()[0]])
    outs = []
    for real in (False, True):
        kv = KVModel(model, 1, 64)
        kv._real_rope = real
        x = kv.embed_tokens(toks)
        outs.append(kv.forward(x, torch.zeros(1, dtype=torch.long), slice(0, 1), 64))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


def test_bf16_model_runs_and_tracks_fp32(model: VisionLanguageModel) -> None:
    """bf16 weights (buffers follow the model dtype): the engine runs; logits near fp32."""
    import copy
    m16 = copy.deepcopy(model).to(torch.bfloat16)
    toks = torch.tensor([_prompts()[1]])
    outs = []
    for m in (model, m16):
        kv = KVModel(m, 1, 64)
        outs.append(kv.forward(kv.embed_tokens(toks), torch.zeros(1, dtype=torch.long),
                               slice(0, 1), 64, last_only=True))
    assert float((outs[1] - outs[0]).norm() / outs[0].norm()) < 0.05
    res = DecodeEngine(m16, 2, 64, EOS).generate([_prompts()[1]], 5)
    assert len(res.tokens[0]) + (res.stop_reasons[0] == "eos") >= 1
