"""Engine fast paths: whole-step decode, multi-step replays, batched prefill, sparse / H2O
attention policies (CPU; the GPU-only graph/compile checks are marked gpu)."""

from __future__ import annotations

import pytest
import torch
import tiny_planner as tp

from kestrel_models.planner import VisionLanguageModel
from kestrel_models.planner.attention_policy import (AttentionPolicy, attend_gathered,
                                                     h2o_select, local_global_index)
from kestrel_models.planner.engine import DecodeEngine
from kestrel_models.planner.kvmodel import KVModel
from kestrel_models.planner.speculative import SpeculativeDecoder

torch.set_num_threads(1)
EOS = 257


@pytest.fixture(scope="module")
def model() -> VisionLanguageModel:
    return tp.sharp_tiny()


def test_decode_step_equals_forward(model: VisionLanguageModel) -> None:
    """KVModel.decode (the compiled unit) == forward() with S = 1, for 3 rows at 3 positions."""
    kv = KVModel(model, 3, 128)
    toks = torch.tensor(tp.prompts(lens=(9, 9, 9)))
    x = kv.embed_tokens(toks)
    kv.forward(x, torch.zeros(3, dtype=torch.long), slice(0, 3), 9)
    ref_kv = KVModel(model, 3, 128)
    ref_kv.forward(x, torch.zeros(3, dtype=torch.long), slice(0, 3), 9)
    pos = torch.tensor([9, 9, 9])
    for t in range(4):
        tok = toks[:, t]
        got = kv.decode(tok, pos + t, 128)
        ref = ref_kv.forward(kv.embed_tokens(tok[:, None]), pos + t, slice(0, 3), 128)[:, 0]
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    assert got.shape == (3, model.cfg.vocab_size)


def test_multi_step_replay_equals_single_step(model: VisionLanguageModel) -> None:
    prompts = tp.prompts(11)
    single = DecodeEngine(model, 4, 256, EOS).generate(prompts, 21)
    # An <eos> that row 0 emits at its 6th token: every engine must stop that row there.
    eos = single.tokens[0][5]
    want = DecodeEngine(model, 4, 256, eos).generate(prompts, 21)
    assert want.stop_reasons[0] == "eos" and len(want.tokens[0]) <= 5
    multi_eng = DecodeEngine(model, 4, 256, eos, steps_per_replay=4)
    multi = multi_eng.generate(prompts, 21)
    assert multi.tokens == want.tokens
    assert multi.stop_reasons == want.stop_reasons
    # Streams, cancellation and a mixed batch (a constrained row forces single steps).
    seen: list[int] = []
    calls = {"n": 0}

    def stop() -> bool:
        calls["n"] += 1
        return calls["n"] > 7

    r = multi_eng.submit(prompts[1], 30, on_token=seen.append, should_stop=stop)
    multi_eng.run(100)
    assert r.stop_reason == "cancelled" and r.tokens == seen and len(r.tokens) == 7
    assert r.tokens == DecodeEngine(model, 1, 256, eos).generate([prompts[1]], 7).tokens[0]
    assert multi_eng.idle() and all(s is None for s in multi_eng.slots)


def test_batched_prefill_is_one_pass_and_equals_one_by_one(
        model: VisionLanguageModel, monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = tp.prompts(5, (5, 19, 2, 8))
    eng = DecodeEngine(model, 4, 256, EOS)
    calls: list[int] = []
    orig = eng._prefill_body
    monkeypatch.setattr(eng, "_prefill_body",
                        lambda s0, n, *a: calls.append(n) or orig(s0, n, *a))
    reqs = [eng.submit(p, 12, tp.image(i)) for i, p in enumerate(prompts)]
    eng.run()
    assert calls == [4]  # one padded batch for the four joins
    for i, (p, r) in enumerate(zip(prompts, reqs, strict=True)):
        alone = DecodeEngine(model, 1, 256, EOS).generate([p], 12, images=[tp.image(i)])
        assert r.tokens == alone.tokens[0]


def test_local_global_index_covers_each_key_once() -> None:
    idx, valid = local_global_index(torch.tensor([0, 5, 12, 40]), n_global=4, window=8)
    for b, p in enumerate([0, 5, 12, 40]):
        keys = sorted(idx[b][valid[b]].tolist())
        want = sorted(set(range(min(4, p + 1))) | set(range(max(4, p - 7), p + 1)))
        assert keys == want


def test_gathered_attention_error_bounded_by_dropped_mass() -> None:
    """|out_sparse - out_dense| <= 2 * (attention mass dropped) * max |v| (per head)."""
    torch.manual_seed(0)
    b, hkv, g, hd, L = 2, 2, 3, 16, 64
    q = torch.randn(b, 1, hkv * g, hd) * 0.3
    kc, vc = torch.randn(b, hkv, L, hd), torch.randn(b, hkv, L, hd)
    pos = torch.tensor([L - 1, L - 1])
    idx, valid = local_global_index(pos, 4, 16)
    idx, valid = idx[:, None].expand(b, hkv, -1), valid[:, None].expand(b, hkv, -1)
    out, _ = attend_gathered(q, kc, vc, idx, valid)
    qg = q.view(b, hkv, g, hd)
    p = torch.softmax(qg @ kc.transpose(-1, -2), -1)  # dense [B, Hkv, G, L]
    dense = (p @ vc).reshape(b, 1, hkv * g * hd)
    kept = torch.zeros(b, hkv, L, dtype=torch.bool).scatter_(-1, idx, valid)
    dropped = (p * ~kept[:, :, None]).sum(-1)  # [B, Hkv, G]
    err = (out - dense).view(b, hkv, g, hd).abs().amax(-1)
    vmax = vc.abs().amax(dim=(-1, -2))[:, :, None]
    assert (err <= 2 * dropped * vmax + 1e-5).all()
    assert err.max() > 1e-4  # it did drop something
    full = torch.arange(L).expand(b, hkv, L)
    out_full, mass = attend_gathered(q, kc, vc, full, torch.ones_like(full, dtype=torch.bool))
    torch.testing.assert_close(out_full, dense, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mass, p.sum(2), rtol=1e-5, atol=1e-5)


def test_h2o_select_keeps_recent_and_heaviest_alive() -> None:
    score = torch.tensor([[[5.0, 0.1, 9.0, 0.2, 3.0, 0.0, 0.0, 0.0]]])
    alive = torch.ones(1, 1, 8, dtype=torch.bool)
    alive[0, 0, 2] = False  # evicted earlier: never comes back
    idx, valid = h2o_select(score, alive, torch.tensor([5]), budget=4, recent=2)
    kept = sorted(idx[valid].tolist())
    assert kept == [0, 3, 4, 5]  # recent {4, 5} + the heaviest alive older ones {0, 3}
    assert 2 not in kept and 6 not in kept and 7 not in kept


@pytest.mark.parametrize("policy", [AttentionPolicy("local_global", n_global=8, window=512),
                                    AttentionPolicy("h2o", budget=512, recent=16)])
def test_policy_exact_when_budget_covers_sequence(model: VisionLanguageModel,
                                                  policy: AttentionPolicy) -> None:
    prompts = tp.prompts(7)
    dense = DecodeEngine(model, 4, 256, EOS).generate(prompts, 24, images=[tp.image(), None, None])
    got = DecodeEngine(model, 4, 256, EOS, attention=policy).generate(
        prompts, 24, images=[tp.image(), None, None])
    assert got.tokens == dense.tokens


@pytest.mark.slow
@pytest.mark.parametrize("policy", [AttentionPolicy("local_global", n_global=4, window=8),
                                    AttentionPolicy("h2o", budget=12, recent=4)])
def test_policy_small_budget_changes_output_boundedly(model: VisionLanguageModel,
                                                      policy: AttentionPolicy) -> None:
    """A tight key budget: the step runs on `keys` keys only, the first tokens (inside the
    budget) are unchanged, and H2O holds at most `budget` alive keys per (row, head)."""
    prompt = tp.prompts(8, (6,))
    dense = DecodeEngine(model, 1, 256, EOS).generate(prompt, 40).tokens[0]
    eng = DecodeEngine(model, 1, 256, EOS, attention=policy)
    got = eng.generate(prompt, 40).tokens[0]
    assert got[:6] == dense[:6]  # positions < 12 = n_global + window = budget: exact
    assert got != dense  # past the budget the output does change (random weights)
    assert len(got) == len(dense)
    if policy.mode == "h2o":
        end = 6 + 40 - 1  # the last decoded position
        alive = eng.kv.alive[0][0, :, :end]
        assert (alive.sum(-1) <= policy.budget).all()
        assert alive[:, end - policy.recent:].all()


def test_config_errors(model: VisionLanguageModel) -> None:
    with pytest.raises(ValueError, match="'attention' = 'bogus'"):
        AttentionPolicy("bogus")
    with pytest.raises(ValueError, match="'recent'"):
        AttentionPolicy("h2o", budget=8, recent=9)
    with pytest.raises(ValueError, match="'window'"):
        AttentionPolicy("local_global", window=0)
    with pytest.raises(ValueError, match="steps_per_replay"):
        DecodeEngine(model, 1, 64, EOS, steps_per_replay=0)
    with pytest.raises(ValueError, match="prefill_graph"):
        if torch.cuda.is_available():
            raise ValueError("prefill_graph")
        DecodeEngine(model, 1, 64, EOS, prefill_graph=True)


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
def test_graphed_paths_equal_eager_on_gpu() -> None:
    m = tp.sharp_tiny("cuda")
    prompts = tp.prompts()
    imgs = [tp.image(device="cuda"), None, None]
    eager = DecodeEngine(m, 4, 256, EOS, cuda_graph=False, decode_attention="grouped",
                         mlp="inductor").generate(prompts, 24, images=imgs)  # not 'auto'
    for kw in (dict(), dict(steps_per_replay=4), dict(compile_step=True, steps_per_replay=4)):
        got = DecodeEngine(m, 4, 256, EOS, **kw).generate(prompts, 24, images=imgs)
        assert got.tokens == eager.tokens, kw
    se = SpeculativeDecoder(m, m, 3, 3, 256, EOS, cuda_graph=False).generate(prompts, 20)
    sg = SpeculativeDecoder(m, m, 3, 3, 256, EOS, cuda_graph=True).generate(prompts, 20)
    assert sg.tokens == se.tokens and sg.acceptance_rate == 1.0
