"""Decoding constrained to the plan grammar (plan.py), so every decoded text parses.

A character-level automaton over the plan text form. At each step the allowed next characters
are: skill names from the enumeration (skills.py) at a line start, `end` at a line start once
a step is complete (a plan has >= 1 step), `refuse` + a reason (plan.REFUSALS) as the first
and only line of a refusal; target names ONLY
from the current scene's object list; argument names valid for the line's skill, each at most
once; numbers in the bounded format -?d{1,3}(.d{1,3})? (format only: values are the validator's
job); single spaces, `=`, newline; <eos> only after `end`. The automaton also keeps a token
budget: a character is allowed only if the shortest valid completion after it still fits in
max_new_tokens, so the text always reaches `end` before the budget runs out. `max_steps` caps
the number of lines.

`PlanLogitsProcessor(prefix_tokens, logits) -> logits` applies it to one sequence's logits for
a tokenizer whose grammar characters are single tokens (the byte tokenizer).

The default engine is now llguidance (constrained_llg.py: the same language as a Lark grammar,
token masks for any tokenizer incl. multi-character BPE tokens, parameter grammar_engine). This
automaton stays for two reasons: (1) it is the fallback (grammar_engine: automaton) where the
llguidance wheel is not available; (2) its `min_chars` is the token-budget check that
LLGuidancePlanProcessor intersects with llguidance's mask when the budget gets tight (llguidance
has no notion of "the shortest completion must fit in the tokens left").
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from kestrel_planner.core.plan import END, MAX_FRAC_DIGITS, MAX_INT_DIGITS, REFUSALS, REFUSE
from kestrel_planner.core.skills import NAME_RE, SKILLS, SkillSpec, skill_by_name

__all__ = ["EOS", "GrammarState", "PlanGrammar", "PlanLogitsProcessor"]

EOS = "<eos>"  # the end-of-sequence symbol in the automaton's alphabet
_WORD, _TARGET, _ARG, _NUM, _REASON = "word", "target", "arg", "number", "reason"


@dataclass(frozen=True)
class GrammarState:
    """phase: 'word' (line start: skill, end or refuse), 'target', 'arg' (argument name),
    'number', 'reason' (of a refusal); partial: characters of the current word/number;
    steps: completed lines; refused: the refusal line is complete (only `end` may follow)."""

    phase: str = _WORD
    partial: str = ""
    skill: str = ""
    arg: str = ""
    used: frozenset[str] = frozenset()
    steps: int = 0
    refused: bool = False


class PlanGrammar:
    """The plan language for one scene: object_names (valid identifiers), max_steps >= 0."""

    def __init__(self, object_names: Iterable[str], max_steps: int) -> None:
        names = sorted(set(object_names))
        for n in names:
            if not NAME_RE.match(n):
                raise ValueError(f"object name {n!r} is not a lower-case identifier")
        if max_steps < 0:
            raise ValueError(f"max_steps = {max_steps}: must be >= 0")
        self.object_names = tuple(names)
        self.max_steps = max_steps
        self._min_obj = min((len(n) for n in names), default=0)
        usable = [s for s in SKILLS.values() if names or not s.needs_target]
        self._skills = {s.name: s for s in usable}
        self._reasons: tuple[str, ...] = tuple(REFUSALS)  # refusal reasons the text may use

    def initial(self) -> GrammarState:
        return GrammarState()

    # ---- helpers ---------------------------------------------------------------------------
    def _line_words(self, st: GrammarState) -> list[str]:
        if st.refused:
            return [END]
        words = [END] if st.steps else [REFUSE] if self._reasons else []
        if st.steps < self.max_steps:
            words += list(self._skills)
        return words

    def _spec(self, st: GrammarState) -> SkillSpec:
        spec = skill_by_name(st.skill)
        assert spec is not None
        return spec

    def _free_args(self, st: GrammarState, extra: str = "") -> list[str]:
        used = st.used | {extra} if extra else st.used
        return [a for a in self._spec(st).arg_names if a not in used]

    def _vocab(self, st: GrammarState) -> list[str]:
        if st.phase == _WORD:
            return self._line_words(st)
        if st.phase == _TARGET:
            return list(self.object_names)
        if st.phase == _REASON:
            return list(self._reasons)
        return self._free_args(st)

    @staticmethod
    def _num_complete(p: str) -> bool:
        digits = p.lstrip("-")
        return bool(digits) and digits[0] != "." and not digits.endswith(".")

    def _end_line(self, st: GrammarState, ch: str, more_args: bool) -> GrammarState | None:
        """After a complete word/number: ' ' -> next argument, '\\n' -> next line."""
        if ch == " " and more_args:
            return replace(st, phase=_ARG, partial="", arg="")
        if ch == "\n":
            return GrammarState(steps=st.steps + 1)
        return None

    # ---- the automaton ---------------------------------------------------------------------
    def advance(self, st: GrammarState, ch: str) -> GrammarState | None:
        """The state after symbol ch (one character or EOS); None when ch is not allowed."""
        if st.phase == "done":
            return None
        if st.phase == _NUM:
            return self._advance_number(st, ch)
        p = st.partial
        if ch != EOS and len(ch) == 1 and (ch.isalnum() or ch == "_"):
            if any(w.startswith(p + ch) for w in self._vocab(st)):
                return replace(st, partial=p + ch)
            return None
        if p not in self._vocab(st):
            return None
        if st.phase == _WORD:
            if p == END:
                return GrammarState(phase="done", steps=st.steps) if ch == EOS else None
            if p == REFUSE:
                return replace(st, phase=_REASON, partial="") if ch == " " else None
            spec = self._skills[p]
            started = replace(st, skill=p, used=frozenset(), arg="")
            if ch == " " and spec.needs_target:
                return replace(started, phase=_TARGET, partial="")
            if ch == " " and spec.args:
                return replace(started, phase=_ARG, partial="")
            if ch == "\n" and not spec.needs_target:
                return GrammarState(steps=st.steps + 1)
            return None
        if st.phase == _TARGET:
            return self._end_line(st, ch, bool(self._free_args(st)))
        if st.phase == _REASON:
            return GrammarState(steps=st.steps + 1, refused=True) if ch == "\n" else None
        if st.phase == _ARG and ch == "=":
            return replace(st, phase=_NUM, partial="", arg=p, used=st.used | {p})
        return None

    def _advance_number(self, st: GrammarState, ch: str) -> GrammarState | None:
        p = st.partial
        int_part, dot, frac = p.lstrip("-").partition(".")
        if ch == "-" and p == "":
            return replace(st, partial="-")
        if ch.isdigit() and len(ch) == 1:
            if dot and len(frac) < MAX_FRAC_DIGITS or not dot and len(int_part) < MAX_INT_DIGITS:
                return replace(st, partial=p + ch)
            return None
        if ch == "." and int_part and not dot:
            return replace(st, partial=p + ".")
        if self._num_complete(p):
            return self._end_line(st, ch, bool(self._free_args(st)))
        return None

    def is_done(self, st: GrammarState) -> bool:
        return st.phase == "done" or (st.phase == _WORD and st.partial == END)

    def min_chars(self, st: GrammarState) -> int:
        """Fewest characters (EOS not counted) that complete a valid plan from st."""
        p = st.partial
        if self.is_done(st):
            return 0
        tail = 1 + len(END)  # "\n" + "end"
        if st.phase == _WORD:
            best = None
            for w in self._line_words(st):
                if not w.startswith(p):
                    continue
                if w == END:
                    cost = len(END) - len(p)
                elif w == REFUSE:
                    cost = len(w) - len(p) + 1 + min(len(r) for r in self._reasons) + tail
                else:
                    line = (1 + self._min_obj + 1) if self._skills[w].needs_target else 1
                    cost = len(w) - len(p) + line + len(END)
                best = cost if best is None else min(best, cost)
            return best if best is not None else 10**9
        if st.phase == _REASON:
            return min((len(r) - len(p) for r in self._reasons if r.startswith(p)),
                       default=10**9) + tail
        if st.phase == _TARGET:
            return min((len(n) - len(p) for n in self.object_names if n.startswith(p)),
                       default=10**9) + tail
        if st.phase == _ARG:
            return min((len(a) - len(p) for a in self._free_args(st) if a.startswith(p)),
                       default=10**9) + 2 + tail  # "=" + one digit
        if self._num_complete(p):
            return tail
        return 1 + tail  # one more digit

    def allowed(self, st: GrammarState) -> list[str]:
        """Every symbol allowed next (no budget applied)."""
        if st.phase == "done":
            return []
        cands = set("\n =-.")
        for w in self._vocab(st) if st.phase != _NUM else []:
            if w.startswith(st.partial) and len(w) > len(st.partial):
                cands.add(w[len(st.partial)])
        if st.phase == _NUM:
            cands |= set("0123456789")
        out = [c for c in sorted(cands) if self.advance(st, c) is not None]
        if st.phase == _WORD and st.partial == END:
            out.append(EOS)
        return out


class PlanLogitsProcessor:
    """Masks (-inf) every token the grammar does not allow next for one sequence.

    prefix_tokens: the tokens generated so far (prompt excluded); the automaton state is kept
    incrementally and recomputed when the prefix is not an extension of the last one."""

    def __init__(self, grammar: PlanGrammar, char_to_id: dict[str, int], eos_id: int,
                 max_new_tokens: int) -> None:
        need = grammar.min_chars(grammar.initial())  # the shortest plan's characters
        if max_new_tokens < need:
            raise ValueError(f"max_new_tokens = {max_new_tokens}: must be >= {need} (the "
                             "shortest plan)")
        self.grammar = grammar
        self.max_new_tokens = max_new_tokens
        self._sym_to_id = dict(char_to_id)
        self._sym_to_id[EOS] = eos_id
        self._id_to_sym = {i: s for s, i in self._sym_to_id.items()}
        self._tokens: list[int] = []
        self._state: GrammarState | None = grammar.initial()

    @classmethod
    def for_tokenizer(cls, grammar: PlanGrammar, tokenizer: object,
                      max_new_tokens: int) -> PlanLogitsProcessor:
        chars = "abcdefghijklmnopqrstuvwxyz0123456789_ =-.\n"
        mapping = {c: tokenizer.token_for_char(c) for c in chars}  # type: ignore[attr-defined]
        return cls(grammar, mapping, tokenizer.eos_id, max_new_tokens)  # type: ignore[attr-defined]

    def state_for(self, prefix_tokens: Sequence[int]) -> GrammarState | None:
        n = len(self._tokens)
        if len(prefix_tokens) < n or list(prefix_tokens[:n]) != self._tokens:
            self._tokens, self._state, n = [], self.grammar.initial(), 0
        for t in prefix_tokens[n:]:
            sym = self._id_to_sym.get(int(t))
            self._state = (self.grammar.advance(self._state, sym)
                           if self._state is not None and sym is not None else None)
            self._tokens.append(int(t))
        return self._state

    def allowed_ids(self, prefix_tokens: Sequence[int]) -> list[int]:
        st = self.state_for(prefix_tokens)
        if st is None:
            return []
        budget = self.max_new_tokens - len(prefix_tokens) - 1  # chars left after this one
        ids = []
        for sym in self.grammar.allowed(st):
            if sym != EOS:
                nxt = self.grammar.advance(st, sym)
                if nxt is None or self.grammar.min_chars(nxt) > budget:
                    continue
            ids.append(self._sym_to_id[sym])
        return ids

    def __call__(self, prefix_tokens: Sequence[int], logits: Tensor) -> Tensor:
        """logits [vocab] -> masked copy (disallowed = -inf)."""
        ids = self.allowed_ids(prefix_tokens)
        out = torch.full_like(logits, float("-inf"))
        if ids:
            idx = torch.tensor(ids, dtype=torch.long, device=logits.device)
            out[idx] = logits[idx]
        return out
