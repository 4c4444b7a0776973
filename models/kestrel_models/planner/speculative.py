"""Speculative decoding: a small draft VLM proposes k tokens, the target verifies them at once.

Per sequence and round (Leviathan et al. 2023 / Chen et al. 2023):
  draft: x_i ~ q_i for i = 1..k (q_i the draft's distribution after x_1..x_{i-1});
  target: one forward over [last, x_1..x_k] -> p_1..p_{k+1};
  accept x_i while u_i < p_i(x_i) / q_i(x_i) (u_i ~ U(0, 1)), i.e. with prob min(1, p/q);
  at the first rejection i emit a token from norm(max(0, p_i - q_i)); if all k are accepted,
  emit a bonus token from p_{k+1}.
Every row of a batch accepts its own number of tokens and keeps its own positions in both
KV caches (kvmodel.KVModel); stale entries past a row's position are masked, so a rejected
tail needs no rollback. The emitted tokens are distributed exactly as sampling from the
target alone; with temperature 0 (p, q one-hot at their argmax) the output equals the
target's greedy decoding.

A round (k+1 draft passes, the target's verification pass, the acceptance rule, position
updates) reads and writes only static buffers, so with `cuda_graph` (default on CUDA) it is
captured once per (batch, draft kv bucket, target kv bucket, temperature) and replayed; the
host reads the accepted tokens once per round. Graphed rounds draw their randomness from the
default CUDA generator (a `generator` argument is honoured on the eager path only).

Host decisions (generate(logits_processor=..., on_token=..., should_stop=...), e.g. decoding
under the plan grammar): each draft token is picked on the host under its row's processor,
whose mask is kept and applied to the target's scores at the same position (the processor
must only mask: -inf for disallowed tokens); the acceptance rule then runs on the masked
distributions, so the output is distributed as masked sampling from the target (greedy: the
target's constrained greedy text). Such rounds run eagerly (k + 1 draft passes, each with a
host round trip, and one target pass); a row's draft stops at <eos> or at a position where
nothing is allowed (the row stops 'no_allowed_token' there if the target gets that far).
With `cuda_graph` each of those passes is a CUDA graph of its own, per (batch, kv bucket): one
draft step over static token and position buffers, one verification over a static
[batch, k+1] chunk; the host round trips stay, the per-op launches go.

Prefill (both models): contiguous rows with the same image shape as one right-padded batch
(the pad positions lie past each row's position: masked, later overwritten); with
`cuda_graph` prompts are padded to power-of-two buckets and each (model, first row, rows,
image shape, bucket) is a CUDA graph, without it they are padded to the longest only.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from kestrel_models.planner.engine_request import _pow2_at_least
from kestrel_models.planner.graphs import replay
from kestrel_models.planner.kvmodel import KVModel
from kestrel_models.planner.vlm import VisionLanguageModel

__all__ = ["SpeculativeDecoder", "SpecResult", "accept_draft", "sample_probs", "to_probs",
           "truncated_draft"]

LogitsProcessor = Callable[[list[int], Tensor], Tensor]  # (row's tokens so far, logits [V])


def to_probs(logits: Tensor, temperature: float) -> Tensor:
    """logits [..., V] -> probabilities (one-hot at the argmax when temperature == 0)."""
    if temperature <= 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    return torch.softmax(logits.float() / temperature, dim=-1)


def sample_probs(probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """probs [..., V] -> one index per row, distributed as probs (exponential race:
    argmax p_i / E_i with E_i ~ Exp(1)). Unlike torch.multinomial it never syncs with the
    host, so it can be captured in a CUDA graph."""
    e = torch.empty_like(probs, dtype=torch.float32).exponential_(generator=generator)
    return torch.argmax(probs.float() / e.clamp_min(torch.finfo(torch.float32).tiny), dim=-1)


def accept_draft(p: Tensor, q: Tensor, draft: Tensor,
                 generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """p [B, k+1, V] target probs, q [B, k, V] draft probs, draft [B, k] the drafted ids ->
    (n_accepted [B] in 0..k, next_token [B]: the correction or the bonus token)."""
    b, k = draft.shape
    px = p[:, :k].gather(-1, draft[..., None])[..., 0]  # [B, k]
    qx = q.gather(-1, draft[..., None])[..., 0]
    u = torch.rand(b, k, device=p.device, generator=generator)
    ok = u * qx < px  # u < p/q without dividing (qx > 0: x was drawn from q)
    n_acc = ok.long().cumprod(dim=1).sum(dim=1)  # leading accepted tokens
    rows = torch.arange(b, device=p.device)
    q_pad = torch.cat([q, torch.zeros_like(q[:, :1])], dim=1)  # bonus: residual = p_{k+1}
    res = (p[rows, n_acc] - q_pad[rows, n_acc]).clamp_min(0.0)  # [B, V]
    mass = res.sum(-1, keepdim=True)
    res = torch.where(mass > 0, res / mass.clamp_min(1e-30), p[rows, n_acc])
    return n_acc, sample_probs(res, generator)


def truncated_draft(model: VisionLanguageModel, n_layers: int) -> VisionLanguageModel:
    """A draft made of the model's first n_layers decoder layers (and its vision tower,
    embeddings, final norm and head): shares the model's tensors, no copy."""
    if not 1 <= n_layers < model.cfg.n_layers:
        raise ValueError(f"parameter 'draft_layers' = {n_layers}: must be in [1, "
                         f"{model.cfg.n_layers}) (the target's decoder layers)")
    cfg = model.cfg.with_overrides(n_layers=n_layers)
    with torch.device("meta"):
        draft = VisionLanguageModel(cfg)
    state = {k: v for k, v in model.state_dict().items()
             if not k.startswith("layers.") or int(k.split(".")[1]) < n_layers}
    draft.load_state_dict(state, assign=True)
    draft.rope_cos, draft.rope_sin = model.rope_cos, model.rope_sin
    if cfg.tie_embeddings:
        draft.lm_head.weight = draft.tok_emb.weight
    return draft.eval()


@dataclass
class SpecResult:
    tokens: list[list[int]]
    stop_reasons: list[str]
    rounds: int
    drafted: int  # draft tokens proposed to rows still running
    accepted: int  # of those, accepted by the target
    ttft_s: float
    total_s: float
    drafted_rows: list[int] = field(default_factory=list)  # per row: drafted, accepted
    accepted_rows: list[int] = field(default_factory=list)
    ttft_rows: list[float] = field(default_factory=list)  # s from the call to a row's 1st token

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


class SpeculativeDecoder:
    """target and draft: VisionLanguageModels with the same vocabulary (the draft may use its
    own vision tower and image-token count). k: tokens drafted per round."""

    def __init__(self, target: VisionLanguageModel, draft: VisionLanguageModel, k: int,
                 max_batch: int, max_len: int, eos_id: int, compile: bool = False,
                 cuda_graph: bool | None = None) -> None:
        if k < 1:
            raise ValueError(f"parameter 'k' = {k}: must be >= 1")
        if target.cfg.vocab_size != draft.cfg.vocab_size:
            raise ValueError(f"draft vocab {draft.cfg.vocab_size} != target vocab "
                             f"{target.cfg.vocab_size}")
        self.k, self.eos_id, self.max_len = k, eos_id, max_len
        self.t = KVModel(target.eval(), max_batch, max_len, compile=compile)
        self.d = KVModel(draft.eval(), max_batch, max_len, compile=compile)
        self.device = dev = self.t.device
        self.cuda_graph = (dev.type == "cuda") if cuda_graph is None else bool(cuda_graph)
        if self.cuda_graph and dev.type != "cuda":
            raise ValueError("parameter 'cuda_graph' = True: needs the model on a CUDA device")
        # Static round state [max_batch]: last emitted token, positions, running flag; outputs.
        z = dict(dtype=torch.long, device=dev)
        self.last, self.tpos, self.dpos = (torch.zeros(max_batch, **z) for _ in range(3))
        self.running = torch.zeros(max_batch, dtype=torch.bool, device=dev)
        self.n_acc, self.nxt = torch.zeros(max_batch, **z), torch.zeros(max_batch, **z)
        self.xbuf = torch.zeros(max_batch, k, **z)
        # Static inputs of the host rounds' passes: draft token and position, verified chunk
        # [last, x_1..x_k] and its first position.
        self.h_cur, self.h_dpos, self.h_tpos = (torch.zeros(max_batch, **z) for _ in range(3))
        self.h_seq = torch.zeros(max_batch, k + 1, **z)
        self._pin: dict[tuple, tuple[Tensor, Tensor, Tensor]] = {}  # prefill inputs per key
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, object]] = {}
        self._pool = torch.cuda.graph_pool_handle() if dev.type == "cuda" else None

    def _run(self, key: tuple, body: Callable[[], Tensor]) -> Tensor:
        """body() -> output: with `cuda_graph` its CUDA graph for `key` (captured on first
        use; body reads only static buffers) replayed, else run. The output is static: read
        it before the next pass."""
        if not self.cuda_graph:
            return body()
        return replay(self._graphs, key, body, self._pool)

    def draft_pass(self, b: int, ld: int) -> Tensor:
        """The draft's step for rows [0, b): token h_cur at position h_dpos -> logits
        [b, V] float (static)."""
        def body() -> Tensor:
            x = self.d.embed_tokens(self.h_cur[:b, None])
            return self.d.forward(x, self.h_dpos[:b], slice(0, b), ld)[:, 0]

        return self._run(("draft", b, ld), body)

    def verify_pass(self, b: int, lt: int) -> Tensor:
        """The target over h_seq [b, k+1] at positions h_tpos.. -> logits [b, k+1, V] float
        (static)."""
        def body() -> Tensor:
            x = self.t.embed_tokens(self.h_seq[:b])
            return self.t.forward(x, self.h_tpos[:b], slice(0, b), lt)

        return self._run(("verify", b, lt), body)

    def graph_count(self) -> int:
        """CUDA graphs captured so far: prefills, draft and verification passes, rounds."""
        return len(self._graphs)

    @torch.inference_mode()
    def warmup(self, batch_sizes: Sequence[int], kv_lens: Sequence[int]) -> None:
        """Capture the host rounds' draft and verification graphs for these batch sizes and
        kv lengths' buckets (no-op without cuda_graph). They write scratch KV entries into
        rows [0, b) at the first positions, which a request's prefill overwrites before any
        read."""
        if not self.cuda_graph:
            return
        for buf in (self.h_cur, self.h_dpos, self.h_seq, self.h_tpos):
            buf.zero_()
        for b in batch_sizes:
            for n in kv_lens:
                kv = self._bucket(n, self.max_len)
                self.draft_pass(b, kv)
                self.verify_pass(b, kv)

    def _prefill(self, kv: KVModel, prompts: Sequence[Sequence[int]],
                 images: Sequence[Tensor | None]) -> tuple[Tensor, Tensor]:
        """-> (last-position logits [B, V] float, positions [B]) after the prefill (module
        doc: contiguous same-image-shape rows as one padded batch)."""
        shapes = [None if im is None else tuple(im.shape) for im in images]
        out, pos, s0 = [], [], 0
        while s0 < len(prompts):
            n = 1
            while s0 + n < len(prompts) and shapes[s0 + n] == shapes[s0]:
                n += 1
            lg, ps = self._prefill_rows(kv, s0, prompts[s0:s0 + n], images[s0:s0 + n],
                                        shapes[s0])
            out.append(lg.clone())  # the graph's output is overwritten by the next pass
            pos += ps
            s0 += n
        return torch.cat(out), torch.tensor(pos, device=self.device)

    def _prefill_rows(self, kv: KVModel, s0: int, prompts: Sequence[Sequence[int]],
                      images: Sequence[Tensor | None], shape: tuple[int, ...] | None
                      ) -> tuple[Tensor, list[int]]:
        """Rows [s0, s0+n), one image shape (or none): [image block][prompt, right-padded]."""
        n, dev = len(prompts), self.device
        n_img = 0 if shape is None else kv.dec.image_tokens(shape)
        lens = [len(p) for p in prompts]
        t = _pow2_at_least(max(lens), 16, 1 << 30)
        if n_img + t > self.max_len or not self.cuda_graph:  # eager: no padding to pay for
            t = max(lens)
        kv_len = (_pow2_at_least(n_img + t, 128, self.max_len) if self.cuda_graph
                  else n_img + t)
        key = ("prefill", "t" if kv is self.t else "d", s0, n, shape, t, kv_len)
        if key in self._pin:
            img_b, tok_b, last_b = self._pin[key]
        else:
            img_b = (torch.zeros((n, *shape), dtype=images[0].dtype, device=dev)
                     if shape is not None else torch.zeros(0, device=dev))
            tok_b = torch.zeros(n, t, dtype=torch.long, device=dev)
            last_b = torch.zeros(n, dtype=torch.long, device=dev)
            if self.cuda_graph:  # a graph reads these: kept (eager: as many lengths as goals)
                self._pin[key] = (img_b, tok_b, last_b)
        for i, im in enumerate(images):
            if im is not None:
                img_b[i].copy_(im, non_blocking=True)
        tok_b.copy_(torch.tensor([list(p) + [0] * (t - len(p)) for p in prompts]),
                    non_blocking=True)
        last_b.copy_(torch.tensor([n_img + m - 1 for m in lens]), non_blocking=True)

        def body() -> Tensor:
            x = kv.embed_tokens(tok_b)
            if shape is not None:
                x = torch.cat([kv.embed_image(img_b).to(x.dtype), x], dim=1)
            zero = torch.zeros(n, dtype=torch.long, device=dev)
            return kv.forward(x, zero, slice(s0, s0 + n), kv_len, last_index=last_b)[:, 0]

        return self._run(key, body), [n_img + m for m in lens]

    @staticmethod
    def _bucket(n: int, hi: int) -> int:
        b = 128
        while b < n:
            b *= 2
        return min(b, hi)

    def _round(self, b: int, ld: int, lt: int, temperature: float,
               generator: torch.Generator | None) -> None:
        """One draft-and-verify round for rows [0, b) on the static buffers (graphable)."""
        k = self.k
        last, tpos, dpos = self.last[:b], self.tpos[:b], self.dpos[:b]
        running = self.running[:b]
        drafts, qs, cur = [], [], last
        for i in range(k + 1):  # the (k+1)-th pass only writes x_k into the draft cache
            lg = self.d.forward(self.d.embed_tokens(cur[:, None]), dpos + i, slice(0, b),
                                ld)[:, 0]
            if i == k:
                break
            q = to_probs(lg, temperature)
            cur = lg.argmax(-1) if temperature <= 0 else sample_probs(q, generator)
            drafts.append(cur)
            qs.append(q)
        x = torch.stack(drafts, dim=1)  # [B, k]
        seq = torch.cat([last[:, None], x], dim=1)  # [B, k+1]
        p = to_probs(self.t.forward(self.t.embed_tokens(seq), tpos, slice(0, b), lt),
                     temperature)
        n_acc, nxt = accept_draft(p, torch.stack(qs, dim=1), x, generator)
        n_acc = torch.where(running, n_acc, torch.zeros_like(n_acc))
        self.n_acc[:b].copy_(n_acc)
        self.nxt[:b].copy_(nxt)
        self.xbuf[:b].copy_(x)
        step = torch.where(running, n_acc + 1, torch.zeros_like(n_acc))
        tpos.add_(step)
        dpos.add_(step)
        last.copy_(torch.where(running, nxt, last))

    @torch.inference_mode()
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 images: Sequence[Tensor | None] | None = None, temperature: float = 0.0,
                 generator: torch.Generator | None = None,
                 logits_processor: Sequence[LogitsProcessor | None] | None = None,
                 on_token: Callable[[int, int], None] | None = None,
                 should_stop: Sequence[Callable[[], bool] | None] | None = None,
                 ) -> SpecResult:
        """prompts: B token lists, images: B [3, H, W] uint8 or None. With logits_processor
        (per row), on_token(row, token_id) or should_stop (per row: 'cancelled' when it
        returns True) the rounds take host decisions (module doc)."""
        t0 = time.monotonic()
        b, k = len(prompts), self.k
        if not 1 <= b <= self.t.max_batch:
            raise ValueError(f"{b} prompts: must be 1..{self.t.max_batch}")
        imgs = list(images) if images is not None else [None] * b
        procs = list(logits_processor) if logits_processor is not None else [None] * b
        stops = list(should_stop) if should_stop is not None else [None] * b
        if not len(imgs) == len(procs) == len(stops) == b:
            raise ValueError(f"images/logits_processor/should_stop: need {b} entries each")
        logits, tpos = self._prefill(self.t, prompts, imgs)
        _, dpos = self._prefill(self.d, prompts, imgs)
        tp, dp = tpos.tolist(), dpos.tolist()  # host mirrors of the positions
        need = max(max(tp), max(dp)) + max_new_tokens + k + 1
        if need > self.max_len:
            raise ValueError(f"request needs {need} positions > max_len {self.max_len}")
        if any(procs) or any(stops) or on_token is not None:
            from kestrel_models.planner.speculative_host import HostRounds
            return HostRounds(self, procs, stops, on_token, temperature, generator).run(
                t0, logits, tp, dp, max_new_tokens)
        p0 = to_probs(logits, temperature)
        last = sample_probs(p0, generator)
        self.last[:b].copy_(last)
        self.tpos[:b].copy_(tpos)
        self.dpos[:b].copy_(dpos)
        ttft = time.monotonic() - t0
        out: list[list[int]] = [[] for _ in range(b)]
        reasons = [""] * b
        self._emit(out, reasons, [[t] for t in last.tolist()], max_new_tokens)
        rounds = drafted = accepted = 0
        d_rows, a_rows = [0] * b, [0] * b
        while not all(reasons):
            self.running[:b].copy_(torch.tensor([not r for r in reasons]))
            ld = self._bucket(max(dp) + k + 1, self.max_len)
            lt = self._bucket(max(tp) + k + 1, self.max_len)
            if self.cuda_graph:
                replay(self._graphs, ("round", b, ld, lt, float(temperature)),
                       lambda ld=ld, lt=lt: self._round(b, ld, lt, temperature, None),
                       self._pool, [self.last, self.tpos, self.dpos])
            else:
                self._round(b, ld, lt, temperature, generator)
            na, xs, nx = (self.n_acc[:b].tolist(), self.xbuf[:b].tolist(),
                          self.nxt[:b].tolist())
            n_run = sum(1 for r in reasons if not r)
            rounds += 1
            drafted += k * n_run
            accepted += sum(na)
            new = [xs[i][:na[i]] + [nx[i]] if not reasons[i] else [] for i in range(b)]
            for i in range(b):
                if not reasons[i]:
                    tp[i] += na[i] + 1
                    dp[i] += na[i] + 1
                    d_rows[i] += k
                    a_rows[i] += na[i]
            self._emit(out, reasons, new, max_new_tokens)
        return SpecResult(out, reasons, rounds, drafted, accepted, ttft, time.monotonic() - t0,
                          d_rows, a_rows, [ttft] * b)

    def _emit(self, out: list[list[int]], reasons: list[str], new: list[list[int]],
              max_new: int, on_token: Callable[[int, int], None] | None = None) -> None:
        for i, toks in enumerate(new):
            for t in toks:
                if reasons[i]:
                    break
                if t == self.eos_id:
                    reasons[i] = "eos"
                    break
                out[i].append(t)
                if on_token is not None:
                    on_token(i, t)
                if len(out[i]) >= max_new:
                    reasons[i] = "max_new_tokens"
