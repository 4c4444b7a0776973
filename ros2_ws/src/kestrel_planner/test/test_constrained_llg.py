"""Constrained decoding through llguidance: the Lark plan grammar (acceptance, rejection, same
language as the hand automaton), the processor with the byte tokenizer and a BPE tokenizer
built in the test (random logits, tiny budgets: always a complete plan), and the wiring."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

pytest.importorskip("llguidance", reason="llguidance is not installed")

from kestrel_models.planner import ByteTokenizer  # noqa: E402
from kestrel_planner.core import (PlanLimits, PlannerConfig, PlannerCore,  # noqa: E402
                                  SceneObject)
from kestrel_planner.core.constrained import EOS, PlanGrammar  # noqa: E402
from kestrel_planner.core.constrained_llg import (PLAN_CHARS,  # noqa: E402
                                                  LLGuidancePlanProcessor, lltokenizer,
                                                  plan_lark)
from kestrel_planner.core.plan import parse_plan  # noqa: E402
from kestrel_planner.core.validator import PlanValidator  # noqa: E402

torch.set_num_threads(1)
TOK = ByteTokenizer()
OBJECTS = ["red_cube", "bin", "bin_large", "cup2"]
SCENE = [SceneObject(n, n, (0.3, 0.1 * i, 0.02)) for i, n in enumerate(OBJECTS)]
# Validator reasons that mean "not the schema" (the grammar must exclude all of them); the
# numeric limits and the pick/place order stay the validator's job.
SCHEMA_REASONS = ("unknown skill", "needs a target", "takes no target", "not in the scene",
                  "unknown argument", "has unit", "more than max_steps")


def byte_proc(names=OBJECTS, max_steps: int = 4, budget: int = 400) -> LLGuidancePlanProcessor:
    return LLGuidancePlanProcessor(lltokenizer(TOK), names, max_steps, budget)


def accepts(text: str, names=OBJECTS, max_steps: int = 4) -> bool:
    """The whole text is allowed token by token and then <eos> is allowed (complete plan)."""
    proc, ids = byte_proc(names, max_steps), TOK.encode(text)
    for k, t in enumerate(ids):
        if t not in proc.allowed_ids(ids[:k]):
            return False
    return TOK.eos_id in proc.allowed_ids(ids)


@pytest.mark.parametrize("text", [
    "home\nend",
    "refuse absent_object\nend",
    "refuse unsupported_action\nend",
    "pick red_cube\nend",
    "pick bin_large speed=0.1 height=0.05\nplace bin\nend",
    "push cup2 distance=0.05 speed=0.1 height=-0.2\nend",  # any argument order
    "push cup2 height=1 distance=999.999\nhome\nopen_gripper\nclose_gripper\nend",
    "move_to bin height=-12.5\nend",
])
def test_grammar_accepts_plans(text: str) -> None:
    assert accepts(text), text
    parse_plan(text)


@pytest.mark.parametrize("text,why", [
    ("pick blue_cube\nend", "unknown object"),
    ("pick bin_larg\nend", "prefix of an object"),
    ("jump bin\nend", "unknown skill"),
    ("pick bin speed=1 speed=2\nend", "repeated argument"),
    ("pick bin distance=1\nend", "argument of another skill"),
    ("pick bin speed=1000\nend", "4 integer digits"),
    ("pick bin speed=1.2345\nend", "4 decimals"),
    ("pick bin speed=.5\nend", "no integer part"),
    ("pick bin speed=1.\nend", "no decimals after the dot"),
    ("pick bin speed=+1\nend", "plus sign"),
    ("pick bin\n", "missing end"),
    ("pick bin\nend\n", "text after end"),
    ("home\nhome\nhome\nhome\nhome\nend", "more than max_steps"),
    ("home bin\nend", "target on a targetless skill"),
    ("pick\nend", "missing target"),
    ("pick  bin\nend", "double space"),
    ("Pick bin\nend", "upper case"),
    ("end", "no step"),
    ("refuse bored\nend", "unknown refusal reason"),
    ("refuse absent_object\nhome\nend", "steps after a refusal"),
    ("home\nrefuse absent_object\nend", "refusal after a step"),
])
def test_grammar_rejects(text: str, why: str) -> None:
    assert not accepts(text), why


def test_no_objects_and_zero_steps() -> None:
    assert accepts("home\nend", names=[]) and not accepts("pick bin\nend", names=[])
    assert accepts("refuse absent_object\nend", max_steps=0)
    assert not accepts("home\nend", max_steps=0) and not accepts("end", max_steps=0)
    assert "target" not in plan_lark([], 3)
    with pytest.raises(ValueError, match="not a lower-case identifier"):
        plan_lark(["Red Cube"], 3)
    with pytest.raises(ValueError, match="max_steps = -1"):
        plan_lark(OBJECTS, -1)


def test_same_language_as_the_automaton_and_every_text_parses() -> None:
    """Random walks through the llguidance mask: at every step the allowed bytes equal the
    automaton's allowed characters, and every finished text parses with plan.py."""
    rng = random.Random(0)
    g = PlanGrammar(OBJECTS, 3)
    proc = byte_proc(max_steps=3)
    for _ in range(60):
        ids: list[int] = []
        st = g.initial()
        while True:
            got = set(proc.allowed_ids(ids))
            want = {TOK.eos_id if s == EOS else ord(s) for s in g.allowed(st)}
            assert got == want, (TOK.decode(ids), got ^ want)
            assert g.min_chars(st) <= proc.slack  # the bound the loose mode relies on
            t = rng.choice(sorted(got))
            if t == TOK.eos_id:
                break
            ids.append(t)
            st = g.advance(st, chr(t))
        plan = parse_plan(TOK.decode(ids))
        assert len(plan.steps) <= 3
        assert all(s.target_object in OBJECTS + [""] for s in plan.steps)


def decode_random(proc: LLGuidancePlanProcessor, vocab: int, budget: int, eos: int,
                  gen: torch.Generator) -> list[int]:
    """Sampling from random logits under the processor, like generate(): stop at eos/budget."""
    ids: list[int] = []
    while len(ids) < budget:
        logits = proc(ids, torch.randn(vocab, generator=gen) * 3)
        assert torch.isfinite(logits).any(), "no allowed token"
        t = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
        if t == eos:
            break
        ids.append(t)
    return ids


def check_plan(text: str, max_steps: int) -> None:
    plan = parse_plan(text)
    if plan.refusal:  # a refusal is a whole plan of its own (rejected by design)
        return
    report = PlanValidator(PlanLimits(max_steps=8)).validate(plan, SCENE, max_steps)
    bad = [r for r in report.reasons if any(s in r for s in SCHEMA_REASONS)]
    assert not bad, (text, bad)


@pytest.mark.slow
def test_byte_tokenizer_random_logits_tiny_budgets() -> None:
    gen = torch.Generator().manual_seed(0)
    for budget in (8, 9, 10, 11, 16, 24, 40):
        for _ in range(6):
            proc = byte_proc(max_steps=3, budget=budget)
            ids = decode_random(proc, 300, budget, TOK.eos_id, gen)  # model vocab > tokenizer's
            assert all(t < TOK.NUM_BYTES for t in ids)  # no special / padded-vocab ids
            text = TOK.decode(ids)
            assert text.endswith("end"), (budget, text)
            check_plan(text, 3)


@pytest.fixture(scope="module")
def bpe():
    """A byte-level BPE trained in the test on plan-like text (multi-character tokens such as
    'pick', 'speed', '=0.'), plus special tokens <eos> and <pad>."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers
    tk = tokenizers.Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<pad>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["pick red_cube speed=0.1 height=0.05\nplace bin height=0.1\nend",
              "push cup2 distance=0.05 speed=0.2\nhome\nopen_gripper\nclose_gripper\nend",
              "move_to bin_large height=0.3 speed=0.25\nend"] * 20
    tk.train_from_iterator(corpus, trainer)
    return tk


@pytest.mark.slow
def test_bpe_tokenizer_random_logits_tiny_budgets(bpe) -> None:
    eos = bpe.token_to_id("<eos>")
    llt = lltokenizer(bpe, eos_id=eos)
    multi = [i for i in range(bpe.get_vocab_size()) if len(bpe.decode([i])) > 1]
    assert len(multi) > 50  # a real BPE: many multi-character tokens
    gen = torch.Generator().manual_seed(1)
    used_multi = False
    for budget in (8, 9, 10, 14, 20, 32):
        for _ in range(6):
            proc = LLGuidancePlanProcessor(llt, OBJECTS, 3, budget)
            assert proc.alphabet == PLAN_CHARS  # byte-level BPE: every plan char is one token
            ids = decode_random(proc, bpe.get_vocab_size(), budget, eos, gen)
            used_multi |= any(len(bpe.decode([t])) > 1 for t in ids)
            text = bpe.decode(ids)
            assert text.endswith("end"), (budget, text)
            check_plan(text, 3)
    assert used_multi  # the grammar was followed with multi-character tokens


def test_bpe_mask_allows_multichar_tokens(bpe) -> None:
    eos = bpe.token_to_id("<eos>")
    proc = LLGuidancePlanProcessor(lltokenizer(bpe, eos_id=eos), ["red_cube"], 2, 100)
    texts = {bpe.decode([i]) for i in proc.allowed_ids([])}
    assert {"pick", "place"} & texts  # whole skill names in one token
    assert all(t and ("refuse".startswith(t) or t[0] in "mppohc") for t in texts)
    ids = bpe.encode("pick red_cube").ids
    texts = {bpe.decode([i]) for i in proc.allowed_ids(ids)}
    assert "\n" in texts and all(t[0] in " \n" for t in texts)


def test_incremental_reset_and_rejected_prefix() -> None:
    proc = byte_proc()
    a = proc.allowed_ids(TOK.encode("pick bin"))
    assert set(a) == {ord(c) for c in "_ \n"}
    assert proc.allowed_ids(TOK.encode("home")) == [ord("\n")]  # not an extension: reset
    assert proc.allowed_ids(TOK.encode("pick bin")) == a
    assert proc.allowed_ids(TOK.encode("pick xx")) == []  # a token outside the grammar
    out = proc(TOK.encode("pick xx"), torch.zeros(260))
    assert torch.isinf(out).all()
    assert proc.allowed_ids([]) != []  # a fresh prefix recovers


def test_budget_forces_end() -> None:
    proc = byte_proc(budget=len("pick bin") + 5)  # 13 tokens
    ids = TOK.encode("pick bin")
    allowed = {chr(i) for i in proc.allowed_ids(ids)}
    assert allowed == {"\n"}  # no room for '_large' or an argument: the line must end
    proc = byte_proc(budget=8)  # only 'home\nend' fits
    assert {chr(i) for i in proc.allowed_ids([])} == {"h"}
    assert {chr(i) for i in proc.allowed_ids(TOK.encode("home\n"))} == {"e"}
    with pytest.raises(ValueError, match="max_new_tokens = 7"):
        byte_proc(budget=7)


@pytest.mark.slow
def test_planner_core_engines() -> None:
    lim = PlanLimits(max_speed=0.5, max_height=0.4, max_steps=4)
    scene = [SceneObject("red_cube", "red_cube", (0.4, 0.0, 0.02))]
    texts = {}
    for engine in ("llguidance", "automaton"):
        core = PlannerCore(PlannerConfig(demo_plan="pick red_cube speed=0.2\nend", limits=lim,
                                         max_new_tokens=40, warmup=False, grammar_engine=engine))
        r = core.plan("pick up the red cube", None, scene)
        assert r.plan is not None and r.report.accepted, (engine, r.text, r.report.reasons)
        texts[engine] = r.text
    assert texts["llguidance"] == texts["automaton"] == "pick red_cube speed=0.2\nend"
    with pytest.raises(ValueError, match="parameter 'grammar_engine' = 'xgrammar'"):
        PlannerConfig(grammar_engine="xgrammar")


def test_first_token_mask() -> None:
    """At the start: the skills' and 'refuse''s initials, never 'end' (>= 1 step)."""
    proc = byte_proc(budget=400)
    np.testing.assert_array_equal(proc.allowed_mask([])[: TOK.NUM_BYTES].nonzero()[0],
                                  sorted({ord(c) for c in "mpohcr"}))


def test_alphabet_restricts_names() -> None:
    """Names a vocabulary cannot spell one character per token are left out of the grammar
    and of the budget automaton alike (no dead-end prefix such as 'close' without '_')."""
    from kestrel_planner.core.constrained_llg import _SpellableGrammar
    no_us = PLAN_CHARS.replace("_", "")
    lark = plan_lark(OBJECTS, 3, alphabet=no_us)
    assert '"bin"' in lark and '"cup2"' in lark and "red_cube" not in lark
    assert "close_gripper" not in lark and "move_to" not in lark and '"pick"' in lark
    g = _SpellableGrammar(OBJECTS, 3, no_us)
    assert set(g.allowed(g.initial())) == {"p", "h"}  # pick place push home (no refusal)
    assert "refuse" not in lark
    assert set(g.allowed(feed_text(g, "pick "))) == {"b", "c"}


def feed_text(g: PlanGrammar, text: str):
    st = g.initial()
    for ch in text:
        st = g.advance(st, ch)
    return st
