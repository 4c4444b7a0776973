"""Speculative rounds with host decisions: per-row logits processors (the plan grammar),
streaming and cancellation (SpeculativeDecoder.generate with those arguments; the rule is in
speculative.py's module doc).

Per round, for rows [0, B) of both KV caches (rows that stopped ride along, ignored):
  draft pass i = 0..k: feed the last token (i = 0) or x_i at dpos + i; for i < k pick x_{i+1}
    on the host: masked = processor(tokens so far + x_1..x_i, draft logits) (its -inf
    positions are the mask m_{i+1}), q_{i+1} = masked distribution, x_{i+1} its argmax or a
    sample. A row's draft ends after <eos> or at a position where nothing is allowed (`real`
    = its meaningful draft positions); later positions carry token 0 with a one-hot q.
  mask m_{k+1} (the bonus position) = processor(tokens + x_1..x_k, zeros).
  target: one pass over [last, x_1..x_k] at tpos; its logits get m_1..m_{k+1}; accept_draft on
    the masked p and q; n = min(n_accepted, real).
  emit x_1..x_n and then the correction/bonus token, except: a row whose n reached a position
    with nothing allowed stops 'no_allowed_token'; a drafted <eos> that was accepted ends it.
Positions advance by n + 1 in both caches (stale entries past them are masked next round).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from kestrel_models.planner.speculative import (LogitsProcessor, SpecResult, accept_draft,
                                                sample_probs, to_probs)

if TYPE_CHECKING:
    from kestrel_models.planner.speculative import SpeculativeDecoder

__all__ = ["HostRounds"]


class HostRounds:
    """One generate() call of a SpeculativeDecoder with host decisions (see the module doc)."""

    def __init__(self, spec: SpeculativeDecoder, procs: Sequence[LogitsProcessor | None],
                 stops: Sequence[Callable[[], bool] | None],
                 on_token: Callable[[int, int], None] | None, temperature: float,
                 generator: torch.Generator | None) -> None:
        self.spec, self.procs, self.stops = spec, list(procs), list(stops)
        self.on_token, self.temperature, self.generator = on_token, temperature, generator
        self.vocab = spec.t.cfg.vocab_size

    def _pick(self, row_logits: Tensor, proc: LogitsProcessor | None, prefix: list[int]
              ) -> tuple[int | None, Tensor, Tensor | None]:
        """row_logits [V] float cpu -> (token or None when nothing is allowed, its
        distribution [V], allowed mask [V] bool or None: no processor)."""
        allowed = None
        if proc is not None:
            row_logits = proc(prefix, row_logits)
            allowed = ~torch.isneginf(row_logits)
            if not allowed.any():
                return None, row_logits, allowed
        probs = to_probs(row_logits[None], self.temperature)[0]
        if self.temperature <= 0:
            return int(row_logits.argmax()), probs, allowed
        return int(sample_probs(probs, self.generator)), probs, allowed

    def run(self, t0: float, logits: Tensor, tp: list[int], dp: list[int],
            max_new: int) -> SpecResult:
        """logits [B, V]: the target's last prompt position; tp, dp: positions after the
        prompts (target, draft)."""
        sp, b = self.spec, len(tp)
        out: list[list[int]] = [[] for _ in range(b)]
        reasons = [""] * b
        ttft = [0.0] * b
        drafted, accepted = [0] * b, [0] * b
        lg = logits.float().cpu()
        last = [0] * b
        for r in range(b):
            if self.stops[r] is not None and self.stops[r]():
                reasons[r] = "cancelled"
                continue
            tok, _, _ = self._pick(lg[r], self.procs[r], [])
            ttft[r] = time.monotonic() - t0
            if tok is None:
                reasons[r] = "no_allowed_token"
                continue
            last[r] = tok
            sp._emit(out, reasons, [[tok] if i == r else [] for i in range(b)], max_new,
                     self.on_token)
        rounds = 0
        while not all(reasons):
            for r in range(b):
                if not reasons[r] and self.stops[r] is not None and self.stops[r]():
                    reasons[r] = "cancelled"
            if all(reasons):
                break
            n_acc, nxt, drafts, real, dead = self._round(b, last, tp, dp, out, reasons)
            rounds += 1
            new: list[list[int]] = [[] for _ in range(b)]
            for r in range(b):
                if reasons[r]:
                    continue
                n = min(n_acc[r], real[r])
                drafted[r] += real[r]
                accepted[r] += n
                if dead[r] is not None and n >= dead[r]:
                    new[r] = drafts[r][:n]
                elif n == real[r] < sp.k:  # the accepted draft ends with <eos>
                    new[r] = drafts[r][:n]
                else:
                    new[r] = drafts[r][:n] + [nxt[r]]
                    last[r] = nxt[r]
                tp[r] += n + 1
                dp[r] += n + 1
            sp._emit(out, reasons, new, max_new, self.on_token)
            for r in range(b):
                if not reasons[r] and dead[r] is not None and min(n_acc[r], real[r]) >= dead[r]:
                    reasons[r] = "no_allowed_token"
        return SpecResult(out, reasons, rounds, sum(drafted), sum(accepted), min(ttft),
                          time.monotonic() - t0, drafted, accepted, ttft)

    def _round(self, b: int, last: list[int], tp: list[int], dp: list[int],
               out: list[list[int]], reasons: list[str]
               ) -> tuple[list[int], list[int], list[list[int]], list[int], list[int | None]]:
        """One draft-and-verify round -> (n_accepted, next token, drafts, real, dead) per row:
        real = meaningful draft positions, dead = the position where nothing is allowed."""
        sp, k, v = self.spec, self.spec.k, self.vocab
        ld = sp._bucket(max(dp) + k + 1, sp.max_len)
        lt = sp._bucket(max(tp) + k + 1, sp.max_len)
        drafts: list[list[int]] = [[] for _ in range(b)]
        qs = torch.zeros(b, k, v)
        masks: list[list[Tensor | None]] = [[None] * (k + 1) for _ in range(b)]
        drafting = [not reasons[r] for r in range(b)]
        dead: list[int | None] = [None] * b
        sp.h_dpos[:b].copy_(torch.tensor(dp), non_blocking=True)
        sp.h_cur[:b].copy_(torch.tensor(last), non_blocking=True)
        for i in range(k + 1):
            if i:
                sp.h_dpos[:b].add_(1)
            lg = sp.draft_pass(b, ld)
            if i == k:  # this pass only writes x_k into the draft cache
                break
            lgh = lg.cpu()
            nxt = []
            for r in range(b):
                tok = None
                if drafting[r]:
                    tok, q, masks[r][i] = self._pick(lgh[r], self.procs[r], out[r] + drafts[r])
                    if tok is None:
                        dead[r], drafting[r] = i, False
                        masks[r][i] = None
                    else:
                        qs[r, i] = q
                        drafting[r] = tok != sp.eos_id
                if tok is None:
                    tok = 0
                    qs[r, i, 0] = 1.0
                drafts[r].append(tok)
                nxt.append(tok)
            sp.h_cur[:b].copy_(torch.tensor(nxt), non_blocking=True)
        real = [dead[r] if dead[r] is not None else
                (drafts[r].index(sp.eos_id) + 1 if sp.eos_id in drafts[r] else k)
                for r in range(b)]
        for r in range(b):  # the bonus position's mask
            if not reasons[r] and dead[r] is None and real[r] == k and self.procs[r]:
                row = self.procs[r](out[r] + drafts[r], torch.zeros(v))
                allowed = ~torch.isneginf(row)
                if allowed.any():
                    masks[r][k] = allowed
                else:
                    dead[r] = k
        sp.h_seq[:b].copy_(torch.tensor([[last[r]] + drafts[r] for r in range(b)]),
                           non_blocking=True)
        sp.h_tpos[:b].copy_(torch.tensor(tp), non_blocking=True)
        p_logits = sp.verify_pass(b, lt).cpu()
        for r in range(b):
            for i, m in enumerate(masks[r]):
                if m is not None:
                    p_logits[r, i].masked_fill_(~m, float("-inf"))
        p = to_probs(p_logits, self.temperature)  # [B, k+1, V]
        x = torch.tensor(drafts, dtype=torch.long)
        n_acc, nxt_t = accept_draft(p, qs, x, self.generator)
        return n_acc.tolist(), nxt_t.tolist(), drafts, real, dead
