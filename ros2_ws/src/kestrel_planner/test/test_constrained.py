"""Constrained decoding: the grammar automaton, its token budget, and random-weight models."""

from __future__ import annotations

import random

import pytest
import torch

from kestrel_models.planner import ByteTokenizer, VisionLanguageModel, generate, get_config
from kestrel_planner.core.constrained import EOS, PlanGrammar, PlanLogitsProcessor
from kestrel_planner.core.plan import parse_plan

torch.set_num_threads(1)
TOK = ByteTokenizer()
OBJECTS = ["red_cube", "bin", "bin_large", "cup2"]


def feed(g: PlanGrammar, text: str):
    st = g.initial()
    for ch in text:
        st = g.advance(st, ch)
        if st is None:
            return None
    return st


def test_allowed_symbols_follow_the_grammar() -> None:
    g = PlanGrammar(OBJECTS, max_steps=4)
    # a plan has >= 1 step: no 'end' at the start; 'refuse' only as the first line
    assert set(g.allowed(g.initial())) == {"m", "p", "o", "c", "h", "r"}
    assert set(g.allowed(feed(g, "home\n"))) == {"m", "p", "o", "c", "h", "e"}
    assert set(g.allowed(feed(g, "refuse "))) == {"a", "u"}
    assert g.allowed(feed(g, "refuse absent_object\n")) == ["e"]
    assert feed(g, "end") is None and feed(g, "home\nrefuse") is None
    assert feed(g, "refuse absent_object\nhome") is None
    assert set(g.allowed(feed(g, "pick "))) == {"r", "b", "c"}  # target initials only
    assert set(g.allowed(feed(g, "pick bin"))) == {"_", " ", "\n"}  # bin or bin_large
    assert set(g.allowed(feed(g, "pick bin "))) == {"s", "h"}  # speed, height
    assert set(g.allowed(feed(g, "push cup2 speed=1 "))) == {"h", "d"}  # no repeated speed
    assert set(g.allowed(feed(g, "push cup2 speed="))) == set("-0123456789")
    assert "." in g.allowed(feed(g, "push cup2 speed=12"))
    assert g.allowed(feed(g, "push cup2 speed=123")) == ["\n", " ", "."]
    assert set(g.allowed(feed(g, "push cup2 speed=1.234"))) == {"\n", " "}
    assert g.allowed(feed(g, "home")) == ["\n"]
    assert g.allowed(feed(g, "home\nend")) == [EOS]
    assert feed(g, "pick blue_ball") is None
    assert feed(g, "self_destruct") is None
    assert feed(g, "pick red_cube speed=1e3") is None
    assert feed(g, "home speed=1") is None


def test_max_steps_and_empty_scene() -> None:
    g = PlanGrammar(OBJECTS, max_steps=2)
    assert g.allowed(feed(g, "home\nhome\n")) == ["e"]
    empty = PlanGrammar([], max_steps=3)
    assert set(empty.allowed(empty.initial())) == {"o", "c", "h", "r"}  # no targeted skills
    only_refusal = PlanGrammar(OBJECTS, max_steps=0)
    assert only_refusal.allowed(only_refusal.initial()) == ["r"]
    with pytest.raises(ValueError, match="not a lower-case identifier"):
        PlanGrammar(["Red Cube"], 3)


def test_random_walks_always_parse() -> None:
    """Fuzz the automaton itself: random allowed symbols under the budget -> a parsing plan."""
    g = PlanGrammar(OBJECTS, max_steps=5)
    rng = random.Random(0)
    for budget in [8, 9, 12, 25, 60, 200] * 20:
        proc = PlanLogitsProcessor.for_tokenizer(g, TOK, budget)
        toks: list[int] = []
        while True:
            ids = proc.allowed_ids(toks)
            assert ids, f"dead end after {TOK.decode(toks)!r}"
            t = rng.choice(ids)
            if t == TOK.eos_id:
                break
            toks.append(t)
            assert len(toks) <= budget
        plan = parse_plan(TOK.decode(toks))
        assert all(s.target_object in OBJECTS or s.target_object == "" for s in plan.steps)
        assert len(plan.steps) <= 5


def test_processor_masks_logits_and_recomputes_on_new_prefix() -> None:
    g = PlanGrammar(OBJECTS, max_steps=3)
    proc = PlanLogitsProcessor.for_tokenizer(g, TOK, 50)
    logits = torch.zeros(TOK.vocab_size)
    out = proc(TOK.encode("pick "), logits)
    allowed = {TOK.decode([i]) for i in torch.nonzero(torch.isfinite(out)).flatten().tolist()}
    assert allowed == {"r", "b", "c"}
    out = proc(TOK.encode("ho"), logits)  # not an extension of the last prefix
    assert torch.isfinite(out).sum() == 1 and torch.isfinite(out[TOK.encode("m")[0]])
    assert torch.isinf(proc(TOK.encode("xyz"), logits)).all()  # invalid prefix: nothing allowed


def test_budget_forces_completion() -> None:
    g = PlanGrammar(OBJECTS, max_steps=8)
    # With 8 tokens only 'home\nend' fits; after a step, 3 left: 'end';
    # mid-target the shortest name wins.
    proc = PlanLogitsProcessor.for_tokenizer(g, TOK, 8)
    assert proc.allowed_ids([]) == TOK.encode("h")
    assert proc.allowed_ids(TOK.encode("home\n")) == TOK.encode("e")
    proc = PlanLogitsProcessor.for_tokenizer(g, TOK, len("pick b") + 2 + 1 + 3)
    assert {TOK.decode([i]) for i in proc.allowed_ids(TOK.encode("pick b"))} == {"i"}
    with pytest.raises(ValueError, match="max_new_tokens"):
        PlanLogitsProcessor.for_tokenizer(g, TOK, 7)


@pytest.mark.slow
def test_random_weight_models_always_produce_parsing_plans() -> None:
    """50 seeds (model weights and sampling): every output parses, targets from the scene."""
    cfg = get_config("tiny")
    prompt = TOK.encode("objects: red_cube bin bin_large cup2\ntask: stack them\nplan:\n",
                        add_bos=True)
    img = torch.randint(0, 256, (4, 3, 32, 32), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(0))
    texts = []
    for seed in range(0, 50, 4):  # 13 models x 4 sampled rows in one batch = 52 sequences
        torch.manual_seed(seed)
        model = VisionLanguageModel(cfg).eval()
        model.setup_cache(4, 256)
        budget = 40 + seed  # varied budgets: 40..88 tokens
        procs = [PlanLogitsProcessor.for_tokenizer(PlanGrammar(OBJECTS, 4), TOK, budget)
                 for _ in range(4)]
        res = generate(model, [prompt] * 4, TOK.eos_id, TOK.pad_id, budget, image=img,
                       temperature=1.0 if seed % 8 else 0.0,
                       generator=torch.Generator().manual_seed(seed), logits_processor=procs)
        for toks in res.tokens:
            text = TOK.decode(toks)
            plan = parse_plan(text)
            assert len(toks) <= budget and len(plan.steps) <= 4
            assert all(s.target_object in OBJECTS for s in plan.steps if s.target_object)
            texts.append(text)
    assert len(texts) >= 50
    assert len(set(texts)) > 10  # the seeds really explore different outputs
