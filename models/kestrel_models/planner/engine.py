"""DecodeEngine: continuous batching over a static KV cache, decode step as a CUDA graph.

Slots: the cache has `max_batch` rows; a request joins a free slot (prefill of its prompt
into that row, SDPA, one row at a time) and leaves it when it stops, between decode steps,
without touching the other rows. Sequence layout per slot:
    [system prefix (optional, shared)] [image tokens (if the request has an image)] [prompt].
Prefix caching: with `prefix_cache=True` the system prefix is prefilled once at construction
and its KV copied into each new slot (positions [0, P)), so only image + prompt are computed.

Decode: one step feeds every active slot's last token at its own position. The step (embed,
all layers, lm_head, on-device sampling, position update) reads/writes only static buffers,
so on CUDA it is captured once per (batch bucket, kv-length bucket) as a torch.cuda.CUDAGraph
and replayed; on CPU the same body runs eagerly. Batch bucket = smallest power of two >= the
highest busy slot + 1 (slots are allocated lowest-first); kv bucket = smallest power of two
(>= 128) >= the longest sequence + 1, capped at max_len.

Sampling per request: greedy (temperature 0) or temperature sampling (Gumbel-max on device),
and an optional `logits_processor(prefix_tokens, logits[vocab] float cpu) -> logits` (the plan
grammar) which moves that row's pick to the host (the generate.py rule, seeded generator).
Stops: <eos> (not emitted), max_new_tokens, should_stop() -> 'cancelled', all tokens masked
-> 'no_allowed_token' -- the same as generate.py.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from kestrel_models.planner.generate import GenerationResult, _pick
from kestrel_models.planner.kvmodel import KVModel
from kestrel_models.planner.vlm import VisionLanguageModel

__all__ = ["DecodeEngine", "EngineRequest", "sample_on_device"]

LogitsProcessor = Callable[[list[int], Tensor], Tensor]


def sample_on_device(logits: Tensor, temperature: Tensor) -> Tensor:
    """logits [B, V] float, temperature [B] float (0 = greedy) -> token ids [B] long.
    Gumbel-max: argmax(logits / T + G) is a sample of softmax(logits / T)."""
    t = temperature[:, None]
    u = torch.rand_like(logits).clamp_(1e-20, 1.0)
    gumbel = -torch.log(-torch.log(u))
    scores = torch.where(t > 0, logits / t.clamp_min(1e-6) + gumbel, logits)
    return torch.argmax(scores, dim=-1)


@dataclass
class EngineRequest:
    """One sequence. tokens: generated ids (<eos> excluded); stop_reason '' while running."""

    prompt: list[int]
    max_new_tokens: int
    image: Tensor | None = None  # [3, H, W] uint8
    temperature: float = 0.0
    logits_processor: LogitsProcessor | None = None
    generator: torch.Generator | None = None
    on_token: Callable[[int], None] | None = None
    should_stop: Callable[[], bool] | None = None
    tokens: list[int] = field(default_factory=list)
    stop_reason: str = ""
    slot: int = -1
    t_submit: float = 0.0
    ttft_s: float = 0.0
    t_done: float = 0.0


def _pow2_at_least(n: int, lo: int, hi: int) -> int:
    b = lo
    while b < n:
        b *= 2
    return min(b, hi)


class DecodeEngine:
    def __init__(self, model: VisionLanguageModel, max_batch: int, max_len: int, eos_id: int,
                 system_prefix: Sequence[int] = (), prefix_cache: bool = True,
                 cuda_graph: bool | None = None, compile: bool = False) -> None:
        self.model = model.eval()
        self.kv = KVModel(model, max_batch, max_len, compile=compile)
        self.max_batch, self.max_len, self.eos_id = max_batch, max_len, eos_id
        dev = self.kv.device
        self.device = dev
        self.cuda_graph = (dev.type == "cuda") if cuda_graph is None else bool(cuda_graph)
        if self.cuda_graph and dev.type != "cuda":
            raise ValueError("parameter 'cuda_graph' = True: needs the model on a CUDA device")
        # Static buffers read/written by the (captured) decode step.
        self.tok_buf = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.pos_buf = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.active_buf = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.temp_buf = torch.zeros(max_batch, dtype=torch.float32, device=dev)
        self.next_buf = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self._pos = [0] * max_batch  # host mirror of pos_buf
        self.slots: list[EngineRequest | None] = [None] * max_batch
        self.pending: deque[EngineRequest] = deque()
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, Tensor]] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.cuda_graph else None
        self.steps = 0
        self.prefix = [int(t) for t in system_prefix]
        self.prefix_cache = bool(prefix_cache) and len(self.prefix) > 0
        self._prefix_kv: tuple[list[Tensor], list[Tensor]] | None = None
        if self.prefix_cache:
            if len(self.prefix) >= max_len:
                raise ValueError(f"system prefix of {len(self.prefix)} tokens >= max_len")
            x = self.kv.embed_tokens(torch.tensor([self.prefix], device=dev))
            self.kv.forward(x, torch.zeros(1, dtype=torch.long, device=dev), slice(0, 1),
                            len(self.prefix), last_only=True)
            self._prefix_kv = self.kv.read_prefix(0, len(self.prefix))

    # ---- requests --------------------------------------------------------------------------
    def submit(self, prompt: Sequence[int], max_new_tokens: int, image: Tensor | None = None,
               **kwargs: object) -> EngineRequest:
        """Queue a request (joins a slot at the next step). kwargs: EngineRequest fields."""
        if len(prompt) == 0:
            raise ValueError("every prompt needs at least one token")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens = {max_new_tokens}: must be >= 1")
        n_img = self.kv.cfg.num_image_tokens if image is not None else 0
        need = len(self.prefix) + n_img + len(prompt) + max_new_tokens
        if need > self.max_len:
            raise ValueError(f"request needs {need} positions > max_len {self.max_len}")
        if image is not None and (image.ndim != 3 or image.shape[0] != 3):
            raise ValueError(f"image must be [3, H, W], got {tuple(image.shape)}")
        r = EngineRequest([int(t) for t in prompt], max_new_tokens, image,
                          **kwargs)  # type: ignore[arg-type]
        r.t_submit = time.monotonic()
        self.pending.append(r)
        return r

    @property
    def active(self) -> list[EngineRequest]:
        return [r for r in self.slots if r is not None]

    def idle(self) -> bool:
        return not self.pending and all(r is None for r in self.slots)

    # ---- prefill ---------------------------------------------------------------------------
    @torch.inference_mode()
    def _admit(self, r: EngineRequest, slot: int) -> None:
        dev, kv = self.device, self.kv
        parts, off = [], 0
        if self.prefix_cache:
            assert self._prefix_kv is not None
            kv.copy_prefix(*self._prefix_kv, slot)
            off = len(self.prefix)
        elif self.prefix:
            parts.append(kv.embed_tokens(torch.tensor([self.prefix], device=dev)))
        if r.image is not None:
            parts.append(kv.embed_image(r.image[None]))
        parts.append(kv.embed_tokens(torch.tensor([r.prompt], device=dev)))
        x = torch.cat(parts, dim=1)
        end = off + x.shape[1]
        logits = kv.forward(x, torch.full((1,), off, dtype=torch.long, device=dev),
                            slice(slot, slot + 1), end, last_only=True)[:, -1]  # [1, V]
        r.slot = slot
        self.slots[slot] = r
        self._pos[slot] = end
        self.pos_buf[slot] = end
        self.temp_buf[slot] = float(r.temperature)
        tok = self._choose(r, logits[0], None)
        r.ttft_s = time.monotonic() - r.t_submit
        self._emit(r, tok)

    def _choose(self, r: EngineRequest, row_logits: Tensor, device_pick: int | None) -> int | None:
        """-> token id, or None when the request stopped (reason set) before picking."""
        if r.should_stop is not None and r.should_stop():
            r.stop_reason = "cancelled"
            return None
        if r.logits_processor is not None:
            row = r.logits_processor(r.tokens, row_logits.float().cpu())
            if not torch.isfinite(row).any():
                r.stop_reason = "no_allowed_token"
                return None
            return _pick(row, r.temperature, r.generator)
        if device_pick is not None:
            return device_pick
        if r.temperature <= 0:
            return int(torch.argmax(row_logits))
        return int(sample_on_device(row_logits[None].float(),
                                    torch.tensor([r.temperature], device=row_logits.device))[0])

    def _emit(self, r: EngineRequest, tok: int | None, fed: int | None = None) -> None:
        """Record the picked token; free the slot when the request stops. fed: the token the
        decode step already put in tok_buf for this slot (skips the host write)."""
        if tok is not None:
            if tok == self.eos_id:
                r.stop_reason = "eos"
            else:
                r.tokens.append(tok)
                if r.on_token is not None:
                    r.on_token(tok)
                if len(r.tokens) >= r.max_new_tokens:
                    r.stop_reason = "max_new_tokens"
        s = r.slot
        if r.stop_reason:
            r.t_done = time.monotonic()
            self.slots[s] = None
            self.active_buf[s] = 0
        else:
            if tok != fed:
                self.tok_buf[s] = tok
            if fed is None:
                self.active_buf[s] = 1

    # ---- decode ----------------------------------------------------------------------------
    def _body(self, b: int, kv_len: int) -> Tensor:
        """One decode step for slots [0, b): static buffers in, logits [b, V] out."""
        x = self.kv.embed_tokens(self.tok_buf[:b, None])
        logits = self.kv.forward(x, self.pos_buf[:b], slice(0, b), kv_len)[:, 0]
        nxt = sample_on_device(logits, self.temp_buf[:b])
        self.next_buf[:b].copy_(nxt)
        self.tok_buf[:b].copy_(nxt)  # fed back next step unless the host overrides a row
        self.pos_buf[:b].add_(self.active_buf[:b])
        return logits

    def _graph(self, b: int, kv_len: int) -> tuple[torch.cuda.CUDAGraph, Tensor]:
        key = (b, kv_len)
        if key not in self._graphs:
            saved, saved_tok = self.pos_buf.clone(), self.tok_buf.clone()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # warm-up (and compile) outside the capture
                    self._body(b, kv_len)
                    self.pos_buf.copy_(saved)
                    self.tok_buf.copy_(saved_tok)
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self._pool):
                out = self._body(b, kv_len)
            self.pos_buf.copy_(saved)
            self._graphs[key] = (g, out)
        return self._graphs[key]

    def buckets(self) -> tuple[int, int]:
        busy = [s for s, r in enumerate(self.slots) if r is not None]
        b = _pow2_at_least(max(busy) + 1, 1, self.max_batch)
        longest = max(self._pos[s] for s in busy) + 1
        return b, _pow2_at_least(longest, 128, self.max_len)

    @torch.inference_mode()
    def warmup(self, batch_sizes: Sequence[int], kv_lens: Sequence[int]) -> None:
        """Capture the decode graphs for these buckets ahead of time (no-op on CPU)."""
        if not self.cuda_graph:
            return
        for b in batch_sizes:
            for n in kv_lens:
                self._graph(_pow2_at_least(b, 1, self.max_batch),
                            _pow2_at_least(n, 128, self.max_len))

    @torch.inference_mode()
    def step(self) -> list[EngineRequest]:
        """Admit queued requests into free slots, then one decode step for the active ones.
        Returns the requests that finished during this call."""
        done: list[EngineRequest] = []
        while self.pending and None in self.slots:
            r = self.pending.popleft()
            self._admit(r, self.slots.index(None))
            if r.stop_reason:
                done.append(r)
        if all(r is None for r in self.slots):
            return done
        b, kv_len = self.buckets()
        if self.cuda_graph:
            g, logits = self._graph(b, kv_len)
            g.replay()
        else:
            logits = self._body(b, kv_len)
        self.steps += 1
        picks = self.next_buf[:b].tolist()
        for s in range(b):
            r = self.slots[s]
            if r is None:
                continue
            self._pos[s] += 1
            self._emit(r, self._choose(r, logits[s], picks[s]), fed=picks[s])
            if r.stop_reason:
                done.append(r)
        return done

    def run(self, max_steps: int = 1_000_000) -> None:
        """Step until every request finished (bounded by max_steps)."""
        for _ in range(max_steps):
            if self.idle():
                return
            self.step()
        raise RuntimeError(f"engine not idle after {max_steps} steps")

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 images: Sequence[Tensor | None] | None = None, temperature: float = 0.0,
                 logits_processor: Sequence[LogitsProcessor | None] | None = None,
                 generator: torch.Generator | None = None,
                 on_token: Callable[[int, int], None] | None = None,
                 should_stop: Sequence[Callable[[], bool] | None] | None = None,
                 ) -> GenerationResult:
        """generate.py-compatible batch call (all requests submitted at once); on_token(row,
        token_id) streams, should_stop[row]() cancels a row."""
        t0 = time.monotonic()
        n = len(prompts)
        imgs = list(images) if images is not None else [None] * n
        procs = list(logits_processor) if logits_processor is not None else [None] * n
        stops = list(should_stop) if should_stop is not None else [None] * n
        if not len(imgs) == len(procs) == len(stops) == n:
            raise ValueError(f"images/logits_processor/should_stop: need {n} entries each")

        def cb(row: int) -> Callable[[int], None] | None:
            return None if on_token is None else (lambda tok: on_token(row, tok))

        reqs = [self.submit(p, max_new_tokens, imgs[i], temperature=temperature,
                            logits_processor=procs[i], generator=generator, on_token=cb(i),
                            should_stop=stops[i])
                for i, p in enumerate(prompts)]
        steps0 = self.steps
        self.run()
        ttfts = [r.ttft_s for r in reqs]
        return GenerationResult([r.tokens for r in reqs], [r.stop_reason for r in reqs],
                                min(ttfts), time.monotonic() - t0, self.steps - steps0, ttfts)
