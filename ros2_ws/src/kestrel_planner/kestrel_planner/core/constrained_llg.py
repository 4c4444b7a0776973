"""Decoding constrained to the plan grammar through llguidance (a maintained grammar engine).

`plan_lark(object_names, max_steps)` writes the plan language of plan.py as a Lark grammar:

    start: line{1,max_steps} "end" | "refuse " REASON "\\n" "end"    (>= 1 step, or a refusal)
    line:  one alternative per skill: skill [" " target] args "\\n"
    target: the scene's object names ONLY (alternatives of literals)
    args:  each argument of the skill at most once, in ANY order: one rule per set of arguments
           still free (2^n rules for n arguments; n <= 3 today): "" | " a=" NUM <args without a>
    NUM:   /-?[0-9]{1,3}(\\.[0-9]{1,3})?/   (format only: values are the validator's job)

Skills that need a target are left out when the scene has no objects (as in constrained.py).

`LLGuidancePlanProcessor(prefix_tokens, logits [vocab]) -> masked logits` has the call interface
of PlanLogitsProcessor. An llguidance.LLMatcher consumes the generated tokens incrementally (it
is reset and re-fed when the prefix is not an extension of the last one) and fills a token
bitmask (preallocated int32 [1, ceil(V/32)]) for ANY tokenizer: the byte tokenizer (wrapped with
llguidance.TokenizerWrapper) or a Hugging Face fast tokenizer incl. BPE (llguidance.hf), where
one token may carry several plan characters.

Token budget (the text reaches `end` before max_new_tokens): the hand automaton (PlanGrammar)
runs beside the matcher on the decoded characters. `min_chars(state)` = fewest characters that
complete a plan. Every reachable state has min_chars <= `slack` (a bound from the longest
skill, object and argument names). While the tokens left after this one are >= slack, every
grammar-allowed token keeps a completion in reach, so the llguidance mask is used as is. When
the budget is tighter, each token the mask allows is also run through the automaton and kept
only if min_chars after it <= tokens left after it. This is exact because the language is
restricted to what the vocabulary can spell one character per token (`alphabet`: the plan
characters that are single tokens; all of them for the byte tokenizer and byte-level BPE):
skill, argument and object names with another character are left out of the grammar (and of
the automaton), so the shortest completion can always be written one token per character, a
token is always left (by induction from min_chars(start) <= max_new_tokens), and no prefix
is a dead end. A vocabulary without single tokens for "end", digits, ".", "-", "=", " " or a
newline cannot write plans: ValueError naming 'hf.grammar'.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from kestrel_planner.core.constrained import EOS, GrammarState, PlanGrammar
from kestrel_planner.core.llg_tokenizers import lltokenizer, require_llguidance
from kestrel_planner.core.plan import END, MAX_FRAC_DIGITS, MAX_INT_DIGITS, REFUSALS, REFUSE
from kestrel_planner.core.skills import NAME_RE, SKILLS

__all__ = ["GRAMMAR_ENGINES", "PLAN_CHARS", "plan_lark", "lltokenizer", "require_llguidance",
           "LLGuidancePlanProcessor"]

GRAMMAR_ENGINES = ("llguidance", "automaton")
PLAN_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789_ =-.\n"  # every character a plan may use
REQUIRED_CHARS = "end0123456789.-= \n"  # without these no plan can be written
NUMBER_LARK = rf"/-?[0-9]{{1,{MAX_INT_DIGITS}}}(\.[0-9]{{1,{MAX_FRAC_DIGITS}}})?/"


def _lit(text: str) -> str:
    return json.dumps(text)  # a Lark string literal (names are identifiers: no escapes needed)


def plan_lark(object_names: Iterable[str], max_steps: int, alphabet: str = PLAN_CHARS) -> str:
    """The plan language for one scene as a Lark grammar (llguidance dialect, see module doc).
    object_names: lower-case identifiers (ValueError otherwise); max_steps >= 0 lines;
    alphabet: names (skills, arguments, objects) with other characters are left out."""
    names = sorted(set(object_names))
    for n in names:
        if not NAME_RE.match(n):
            raise ValueError(f"object name {n!r} is not a lower-case identifier")
    ok = set(alphabet)
    names = [n for n in names if set(n) <= ok]
    if max_steps < 0:
        raise ValueError(f"max_steps = {max_steps}: must be >= 0")
    rules: dict[str, str] = {}

    def args_rule(free: tuple[str, ...]) -> str:
        name = "args_" + ("_".join(free) if free else "none")
        if name not in rules:
            alts = ['""'] + [f'{_lit(f" {a}=")} NUM {args_rule(tuple(x for x in free if x != a))}'
                             for a in free if set(a) <= ok]
            rules[name] = " | ".join(alts)
        return name

    lines = []
    for spec in SKILLS.values():
        if spec.needs_target and not names or not set(spec.name) <= ok:
            continue
        alt = _lit(spec.name)
        if spec.needs_target:
            alt += ' " " target'
        if spec.args:
            alt += " " + args_rule(spec.arg_names)
        lines.append(alt + r' "\n"')
    reasons = [r for r in REFUSALS if set(r) <= ok]
    refusal = f'{_lit(REFUSE + " ")} reason "\\n" {_lit(END)}'
    plans = [f"line{{1,{max_steps}}} {_lit(END)}"] if max_steps else []
    plans += [refusal] if reasons else []
    out = ["start: " + " | ".join(plans), "line: " + " | ".join(lines)]
    if reasons:
        out.append("reason: " + " | ".join(_lit(r) for r in reasons))
    if names:
        out.append("target: " + " | ".join(_lit(n) for n in names))
    out += [f"{k}: {v}" for k, v in rules.items()]
    out.append(f"NUM: {NUMBER_LARK}")
    return "\n".join(out) + "\n"


class _SpellableGrammar(PlanGrammar):
    """PlanGrammar without the skill, argument and object names that use characters outside
    `alphabet` (the same restriction as plan_lark(..., alphabet))."""

    def __init__(self, object_names: Iterable[str], max_steps: int, alphabet: str) -> None:
        self._ok = set(alphabet)
        super().__init__([n for n in object_names if set(n) <= self._ok], max_steps)
        self._skills = {k: v for k, v in self._skills.items() if set(k) <= self._ok}
        self._reasons = tuple(r for r in self._reasons if set(r) <= self._ok)

    def _free_args(self, st: GrammarState, extra: str = "") -> list[str]:
        return [a for a in super()._free_args(st, extra) if set(a) <= self._ok]


class LLGuidancePlanProcessor:
    """Masks (-inf) every token the plan grammar (llguidance) does not allow next for one
    sequence, keeping the token budget (module doc). One instance per sequence.

    lltok: llguidance.LLTokenizer (see lltokenizer()); object_names / max_steps: the scene's
    grammar; max_new_tokens: the decode budget (>= the shortest plan, e.g. 'home\\nend')."""

    def __init__(self, lltok: Any, object_names: Iterable[str], max_steps: int,
                 max_new_tokens: int) -> None:
        llg = require_llguidance()
        names = list(object_names)
        plan_lark(names, max_steps)  # validates names and max_steps
        self.alphabet = "".join(c for c in PLAN_CHARS if self._single_token(lltok, c))
        missing = [c for c in REQUIRED_CHARS if c not in self.alphabet]
        if missing:
            raise ValueError(f"parameter 'hf.grammar' = True: the tokenizer has no single token "
                             f"for {missing[0]!r}; set hf.grammar: false (prompt + parser + "
                             "validator only)")
        self.grammar = _SpellableGrammar(names, max_steps, self.alphabet)
        need = self.grammar.min_chars(self.grammar.initial())  # the shortest plan's characters
        if max_new_tokens < need:
            raise ValueError(f"max_new_tokens = {max_new_tokens}: must be >= {need} (the "
                             "shortest plan)")
        self.lark = plan_lark(names, max_steps, self.alphabet)
        self.lltok = lltok
        self.max_new_tokens = max_new_tokens
        self.eos_id = int(lltok.eos_token)
        self.vocab_size = int(lltok.vocab_size)
        self.matcher = llg.LLMatcher(lltok, llg.LLMatcher.grammar_from_lark(self.lark),
                                     log_level=0)
        if self.matcher.is_error():
            raise ValueError(f"plan grammar rejected by llguidance: {self.matcher.get_error()}")
        self._pristine = self.matcher.deep_copy()  # an error state survives reset(): re-copy
        # bitmask: int32 [1, ceil(V/32)], one bit per token id; bits: uint8 view of it
        self._mask = np.full((1, (self.vocab_size + 31) // 32), -1, dtype=np.int32)
        self._text: dict[int, str | None] = {}  # token id -> its text (None: not plan ASCII)
        max_obj = max((len(n) for n in self.grammar.object_names), default=0)
        max_skill = max(len(s.name) for s in SKILLS.values())
        max_arg = max((len(a.name) for s in SKILLS.values() for a in s.args), default=0)
        # min_chars of any reachable automaton state is <= slack (+2 margin)
        max_reason = max(len(r) for r in REFUSALS)
        self.slack = max(max_skill + max_obj + 5, max_arg + 6, len(END),
                         len(REFUSE) + max_reason + 5) + 2
        self._tokens: list[int] = []
        self._state: GrammarState | None = self.grammar.initial()

    @staticmethod
    def _single_token(lltok: Any, ch: str) -> bool:
        cands = lltok.tokenize_str(ch) + lltok.greedy_tokenize(ch)
        return any(lltok.decode_bytes([t]) == ch.encode() and not lltok.is_special_token(t)
                   for t in cands)

    def _token_text(self, tid: int) -> str | None:
        if tid not in self._text:
            raw = b"" if self.lltok.is_special_token(tid) else self.lltok.decode_bytes([tid])
            ok = raw and raw.isascii()
            self._text[tid] = raw.decode("ascii") if ok else None
        return self._text[tid]

    def _advance(self, st: GrammarState | None, tid: int) -> GrammarState | None:
        if st is None:
            return None
        if tid == self.eos_id:
            return self.grammar.advance(st, EOS)
        text = self._token_text(tid)
        if text is None:
            return None
        for ch in text:
            st = self.grammar.advance(st, ch)
            if st is None:
                return None
        return st

    def _sync(self, prefix_tokens: Sequence[int]) -> None:
        """Feed the matcher and the automaton the tokens not seen yet (reset if needed)."""
        n = len(self._tokens)
        if len(prefix_tokens) < n or [int(t) for t in prefix_tokens[:n]] != self._tokens:
            if self.matcher.is_error():
                self.matcher = self._pristine.deep_copy()
            else:
                self.matcher.reset()
            self._tokens, self._state, n = [], self.grammar.initial(), 0
        for t in prefix_tokens[n:]:
            t = int(t)
            self.matcher.consume_token(t)  # False -> error state, all tokens masked
            self._state = self._advance(self._state, t)
            self._tokens.append(t)

    def allowed_mask(self, prefix_tokens: Sequence[int]) -> np.ndarray:
        """bool [V] (V = the tokenizer's vocabulary): the tokens allowed next."""
        self._sync(prefix_tokens)
        if self.matcher.is_error() or self._state is None:
            return np.zeros(self.vocab_size, dtype=bool)
        self.matcher.unsafe_compute_mask_ptr(self._mask.ctypes.data, self._mask.nbytes)
        bits = np.unpackbits(self._mask.view(np.uint8), bitorder="little")[: self.vocab_size]
        allowed = bits.astype(bool)
        left = self.max_new_tokens - len(prefix_tokens) - 1  # tokens left after this one
        if left < self.slack:  # tight budget: keep tokens whose shortest completion fits
            for tid in np.flatnonzero(allowed):
                if tid == self.eos_id:
                    continue
                nxt = self._advance(self._state, int(tid))
                if nxt is None or self.grammar.min_chars(nxt) > left:
                    allowed[tid] = False
        return allowed

    def allowed_ids(self, prefix_tokens: Sequence[int]) -> list[int]:
        return [int(i) for i in np.flatnonzero(self.allowed_mask(prefix_tokens))]

    def __call__(self, prefix_tokens: Sequence[int], logits: Tensor) -> Tensor:
        """logits [vocab] -> masked copy (disallowed = -inf; ids past the tokenizer's
        vocabulary, e.g. a padded embedding table, are always disallowed)."""
        allowed = torch.from_numpy(self.allowed_mask(prefix_tokens))
        n = min(int(logits.shape[-1]), self.vocab_size)
        keep = torch.zeros(logits.shape[-1], dtype=torch.bool)
        keep[:n] = allowed[:n]
        return logits.masked_fill(~keep.to(logits.device), float("-inf"))
