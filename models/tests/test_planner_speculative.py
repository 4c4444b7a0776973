"""Speculative decoding: the acceptance rule keeps the target's distribution; greedy equality."""

from __future__ import annotations

import itertools

import pytest
import torch

from kestrel_models.planner import VisionLanguageModel, VLMConfig, generate, get_config
from kestrel_models.planner.speculative import SpeculativeDecoder, accept_draft

torch.set_num_threads(1)

TOY = VLMConfig(image_size=8, patch_size=8, vision_dim=16, vision_depth=1, vision_heads=2,
                projector_hidden=16, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                ffn_hidden=64, vocab_size=5, max_seq_len=64)


def _toy(seed: int, scale: float) -> VisionLanguageModel:
    torch.manual_seed(seed)
    m = VisionLanguageModel(TOY).eval()
    with torch.no_grad():
        m.tok_emb.weight.mul_(scale)  # tied with lm_head: sharper, non-uniform distributions
    return m


def sharpen(m: VisionLanguageModel, scale: float = 30.0) -> VisionLanguageModel:
    """Scale random weights so greedy text varies (as in test_planner_engine.py)."""
    with torch.no_grad():
        for p in m.parameters():
            if p.ndim >= 2:
                p.mul_(scale)
    return m


def _tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a - b).abs().sum())


def test_accept_rule_marginals_equal_target() -> None:
    """k = 2 hand-made p, q: the first emitted token ~ p_1; given x_1 accepted, the second
    ~ p_2; given both accepted, the bonus ~ p_3 (exact rule, 200k rows)."""
    g = torch.Generator().manual_seed(0)
    n, v = 200_000, 4
    p = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.7, 0.1, 0.1, 0.1], [0.25, 0.25, 0.4, 0.1]])
    q = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.1, 0.1, 0.1, 0.7]])
    draft = torch.stack([torch.multinomial(q[i], n, replacement=True, generator=g)
                         for i in range(2)], dim=1)  # [N, 2]
    n_acc, nxt = accept_draft(p.expand(n, 3, v), q.expand(n, 2, v), draft, g)
    first = torch.where(n_acc >= 1, draft[:, 0], nxt)
    assert _tv(torch.bincount(first, minlength=v) / n, p[0]) < 0.006
    sel = n_acc >= 1
    second = torch.where(n_acc[sel] >= 2, draft[sel, 1], nxt[sel])
    assert _tv(torch.bincount(second, minlength=v) / sel.sum(), p[1]) < 0.01
    bonus = nxt[n_acc == 2]
    assert _tv(torch.bincount(bonus, minlength=v) / bonus.numel(), p[2]) < 0.02
    # Acceptance probability of x_1 is sum_x min(p, q) = 1 - TV(p, q).
    assert abs(float(sel.float().mean()) - (1 - _tv(p[0], q[0]))) < 0.005


@pytest.mark.slow
def test_speculative_distribution_equals_target_toy_vocab() -> None:
    """Joint distribution of the first 3 sampled tokens (125 outcomes) from 6000 sequences of
    speculative decoding (k = 2) vs the exact target distribution (enumerated)."""
    target, draft = _toy(1, 3.0), _toy(2, 1.0)
    prompt = [1, 3, 2]
    exact = torch.zeros(5, 5, 5)
    for a, b in itertools.product(range(5), range(5)):
        pa = torch.softmax(target(None, torch.tensor([prompt]))[0, -1], -1)
        pb = torch.softmax(target(None, torch.tensor([prompt + [a]]))[0, -1], -1)
        pc = torch.softmax(target(None, torch.tensor([prompt + [a, b]]))[0, -1], -1)
        exact[a, b] = pa[a] * pb[b] * pc
    exact_d = torch.zeros(5, 5, 5)  # the draft's own distribution: the negative control
    for a, b in itertools.product(range(5), range(5)):
        qa = torch.softmax(draft(None, torch.tensor([prompt]))[0, -1], -1)
        qb = torch.softmax(draft(None, torch.tensor([prompt + [a]]))[0, -1], -1)
        qc = torch.softmax(draft(None, torch.tensor([prompt + [a, b]]))[0, -1], -1)
        exact_d[a, b] = qa[a] * qb[b] * qc
    assert _tv(exact.flatten(), exact_d.flatten()) > 0.15  # the test can tell them apart
    n = 6000
    spec = SpeculativeDecoder(target, draft, k=2, max_batch=n, max_len=16, eos_id=-1)
    res = spec.generate([prompt] * n, 3, temperature=1.0,
                        generator=torch.Generator().manual_seed(0))
    assert all(len(t) == 3 for t in res.tokens)
    idx = torch.tensor([a * 25 + b * 5 + c for a, b, c in res.tokens])
    emp = torch.bincount(idx, minlength=125).float() / n
    tv = _tv(emp, exact.flatten())
    print(f"TV(spec, target) = {tv:.4f}; TV(draft, target) = "
          f"{_tv(exact.flatten(), exact_d.flatten()):.4f}; accept = {res.acceptance_rate:.3f}")
    assert tv < 0.07, tv  # sampling noise for 6000 draws over 125 cells is ~0.04
    assert 0.2 < res.acceptance_rate < 0.95


@pytest.mark.slow
def test_speculative_greedy_equals_target_greedy() -> None:
    torch.manual_seed(0)
    target = sharpen(VisionLanguageModel(get_config("tiny")).eval())
    target.setup_cache(3, 256)
    dcfg = get_config("tiny").with_overrides(dim=64, n_layers=1, n_heads=2, n_kv_heads=1,
                                             ffn_hidden=128)
    draft = sharpen(VisionLanguageModel(dcfg).eval())
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 9, 2)]
    img = torch.randint(0, 256, (3, 3, 32, 32), dtype=torch.uint8, generator=g)
    ref = generate(target, prompts, 257, 258, 25, image=img)
    for k in (1, 4):
        spec = SpeculativeDecoder(target, draft, k=k, max_batch=3, max_len=256, eos_id=257)
        res = spec.generate(prompts, 25, images=list(img))
        assert res.tokens == ref.tokens
        assert res.stop_reasons == ref.stop_reasons
        assert 0.0 <= res.acceptance_rate < 1.0
    # The target as its own draft: everything is accepted (k + 1 tokens per round).
    self_spec = SpeculativeDecoder(target, target, k=4, max_batch=3, max_len=256, eos_id=257)
    res = self_spec.generate(prompts, 25, images=list(img))
    assert res.tokens == ref.tokens and res.acceptance_rate == 1.0


def test_speculative_config_errors() -> None:
    m = _toy(0, 1.0)
    with pytest.raises(ValueError, match="'k'"):
        SpeculativeDecoder(m, m, 0, 2, 32, 0)
    other = VisionLanguageModel(TOY.with_overrides(vocab_size=7))
    with pytest.raises(ValueError, match="vocab"):
        SpeculativeDecoder(m, other, 2, 2, 32, 0)
