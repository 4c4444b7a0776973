"""DecodeEngine: continuous batching over a static KV cache, decode step as a CUDA graph.

Slots: the cache has `max_batch` rows; requests join free slots (lowest first) and leave them
when they stop, between decode steps, without touching the other rows. Joins are prefilled
together: the queued requests that land in a contiguous block of slots with the same image
shape run as ONE right-padded batch (prompt padded to a power-of-two bucket >= 16; the pad
positions' KV entries lie past each row's position, so they are masked and later overwritten).
On CUDA (`prefill_graph`) that batched prefill (prefix KV copy, vision tower, projector,
decoder pass, last-token lm_head) is captured as a CUDA graph per (first slot, rows, image
shape, prompt bucket) and replayed: TTFT without launch overhead. Sequence layout per slot:
    [system prefix (optional, shared)] [image tokens (if the request has an image)] [prompt],
or, when the prompt holds the model's image marker token (a chat template's image place, HF
checkpoints: hf_engine/), [prefix] [prompt up to the marker] [image tokens] [rest of the
prompt] (prefill_layout.py; M-RoPE decoders also get their 3-D positions and per-row offsets).
The model: Kestrel's VisionLanguageModel or any PackedDecoder (decoder.py).
Prefix caching: with `prefix_cache=True` the system prefix is prefilled once at construction
and its KV copied into each new slot (positions [0, P)), so only image + prompt are computed.
With `prefix_entries=N` the engine also keeps the KV of the last N request prefixes (system
prefix + image + the first `prefix_tokens` prompt tokens, keyed by the request's `image_key`
and those tokens; prefix_store.py): a request whose prefix is kept copies it into its slot and
prefills only the rest of its prompt (on its own, a group of one; padded to a bucket and, on
CUDA, captured as a graph per (slot, bucket, kv bucket) like the batched prefill).

Decode: one step feeds every active slot's last token at its own position. The step (embed,
all layers, lm_head, on-device sampling, position update) reads/writes only static buffers,
so on CUDA it is captured once per (batch bucket, kv-length bucket, steps) as a
torch.cuda.CUDAGraph and replayed; on CPU the same body runs eagerly. `compile_step=True`
compiles KVModel.decode + sampling as ONE inductor graph (fullgraph; every layer, the final
norm, lm_head and Gumbel-max sampling fused across layer boundaries, e.g. residual add + the
next RMSNorm) before capture; `coordinate_descent=True` also turns the batch-1 GEMVs into
tuned Triton reductions (inductor's mm decomposition, as gpt-fast). `steps_per_replay=N`
captures N decode steps in one graph when no host decision is needed in between (no
logits_processor on any active row, every row has >= N tokens left): tokens are kept on
device ([N, B] buffer, <eos> stops a row's position on device) and the host catches up after
the replay (should_stop and <eos> are honoured token by token; the tokens decoded past a stop
are discarded). `attention` selects the decode attention policy (attention_policy.py).
Batch bucket = smallest power of two >= the highest busy slot + 1 (slots are allocated
lowest-first); kv bucket = smallest power of two (>= 128) >= the longest sequence + steps,
capped at max_len.

Sampling per request: greedy (temperature 0) or temperature sampling (Gumbel-max on device),
and an optional `logits_processor(prefix_tokens, logits[vocab] float cpu) -> logits` (the plan
grammar) which moves that row's pick to the host (the generate.py rule, seeded generator).
Stops: <eos> (not emitted), max_new_tokens, should_stop() -> 'cancelled', all tokens masked
-> 'no_allowed_token' -- the same as generate.py.

Decode-step kernel options: `gemv` ('inductor' | 'cublas' | 'cublas:<linears>'),
`decode_attention` ('auto' | 'grouped' | 'sdpa' | 'triton' | 'triton_split' | 'triton_fused' |
'triton_fused_split'), `mlp` ('auto' | 'inductor' | 'triton_down' | 'triton_down_residual' |
'triton' | 'triton_fused'), `attn_proj` ('auto' | 'inductor' | 'triton') and `pdl` (None = auto |
True | False: programmatic dependent launch of those Triton kernels), see decode_options.py
('auto': Triton on CUDA when importable, else the torch paths); `greedy` ('argmax' |
'two_stage': block maxima then their argmax, the same ids | 'auto', the default: two_stage on
CUDA for vocabularies of at least TWO_STAGE_MIN_VOCAB tokens) for all-greedy steps.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence

import torch
from torch import Tensor

from kestrel_models.planner.attention_policy import AttentionPolicy
from kestrel_models.planner.decoder import PackedDecoder
from kestrel_models.planner.engine_request import (GREEDY, TWO_STAGE_MIN_VOCAB, EngineRequest,
                                                   LogitsProcessor,
                                                   _pow2_at_least, greedy_pick,
                                                   sample_on_device, two_stage_argmax)
from kestrel_models.planner.generate import GenerationResult, _pick
from kestrel_models.planner.graphs import capture
from kestrel_models.planner.kvmodel import KVModel
from kestrel_models.planner.engine_prefill import PrefillMixin
from kestrel_models.planner.prefill_layout import split_prompt
from kestrel_models.planner.prefix_store import PrefixStore
from kestrel_models.planner.vlm import VisionLanguageModel

__all__ = ["DecodeEngine", "EngineRequest", "greedy_pick", "sample_on_device"]

class DecodeEngine(PrefillMixin):
    def __init__(self, model: VisionLanguageModel | PackedDecoder, max_batch: int,
                 max_len: int, eos_id: int,
                 system_prefix: Sequence[int] = (), prefix_cache: bool = True,
                 cuda_graph: bool | None = None, compile: bool = False,
                 compile_step: bool = False, compile_mode: str = "default",
                 coordinate_descent: bool = False, steps_per_replay: int = 1,
                 attention: AttentionPolicy | None = None,
                 prefill_graph: bool | None = None, gemv: str = "inductor",
                 decode_attention: str = "auto", greedy: str = "auto",
                 mlp: str = "auto", prefix_entries: int = 0,
                 attn_proj: str = "auto", pdl: bool | None = None) -> None:
        if greedy not in GREEDY:
            raise ValueError(f"parameter 'greedy' = {greedy!r}: must be one of {GREEDY}")
        if steps_per_replay < 1:
            raise ValueError(f"parameter 'steps_per_replay' = {steps_per_replay}: must be >= 1")
        if compile and compile_step:
            raise ValueError("parameter 'compile' = True: use either compile (layer pieces) "
                             "or compile_step (whole step), not both")
        self.model = model.eval() if isinstance(model, torch.nn.Module) else model
        self.kv = KVModel(model, max_batch, max_len, compile=compile, policy=attention,
                          gemv=gemv, decode_attention=decode_attention, mlp=mlp,
                          attn_proj=attn_proj, pdl=pdl)
        if greedy == "auto":  # the two stages are measured faster on CUDA only
            big = self.kv.cfg.vocab_size >= TWO_STAGE_MIN_VOCAB
            greedy = "two_stage" if big and self.kv.device.type == "cuda" else "argmax"
        self.greedy = greedy
        self._greedy = two_stage_argmax if greedy == "two_stage" else greedy_pick
        self.dec = self.kv.dec  # the packed decoder and its image side
        self.max_batch, self.max_len, self.eos_id = max_batch, max_len, eos_id
        dev = self.kv.device
        self.device = dev
        self.cuda_graph = (dev.type == "cuda") if cuda_graph is None else bool(cuda_graph)
        if self.cuda_graph and dev.type != "cuda":
            raise ValueError("parameter 'cuda_graph' = True: needs the model on a CUDA device")
        self.prefill_graph = (self.cuda_graph and self.dec.graphable_prefill
                              if prefill_graph is None else bool(prefill_graph))
        if self.prefill_graph and dev.type != "cuda":
            raise ValueError("parameter 'prefill_graph' = True: needs the model on a CUDA device")
        self.steps_per_replay = steps_per_replay
        # Static buffers read/written by the (captured) decode step.
        self.tok_buf = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.pos_buf = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.active_buf = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.temp_buf = torch.zeros(max_batch, dtype=torch.float32, device=dev)
        self.out_buf = torch.zeros(steps_per_replay, max_batch, dtype=torch.long, device=dev)
        self.noise_buf = torch.zeros(max_batch, self.kv.cfg.vocab_size, device=dev)
        self._pos = [0] * max_batch  # host mirror of pos_buf
        self.slots: list[EngineRequest | None] = [None] * max_batch
        self.pending: deque[EngineRequest] = deque()
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, object]] = {}
        self._pgraphs: dict[tuple, tuple[torch.cuda.CUDAGraph, object]] = {}
        self._pin: dict[tuple, tuple] = {}  # prefill graph inputs
        cuda = dev.type == "cuda"
        self._pool = torch.cuda.graph_pool_handle() if cuda else None
        self._ppool = torch.cuda.graph_pool_handle() if cuda else None
        self.steps = 0
        self._step_fn: Callable = self._step_impl
        if compile_step:
            import torch._inductor.config as ic
            torch._dynamo.config.cache_size_limit = max(
                torch._dynamo.config.cache_size_limit, 64)
            if coordinate_descent:
                ic.coordinate_descent_tuning = True
            self.kv._real_rope = True  # complex RoPE does not lower to inductor
            self._step_fn = torch.compile(self._step_impl, fullgraph=True, dynamic=False,
                                          mode=compile_mode)
        self.prefix = [int(t) for t in system_prefix]
        self.prefix_cache = bool(prefix_cache) and len(self.prefix) > 0
        self._prefix_t = torch.tensor([self.prefix], dtype=torch.long, device=dev)  # [1, P]
        self._prefix_kv: tuple[list[Tensor], list[Tensor]] | None = None
        if self.prefix_cache:
            if len(self.prefix) >= max_len:
                raise ValueError(f"system prefix of {len(self.prefix)} tokens >= max_len")
            x = self.kv.embed_tokens(torch.tensor([self.prefix], device=dev))
            self.kv.forward(x, torch.zeros(1, dtype=torch.long, device=dev), slice(0, 1),
                            len(self.prefix), last_only=True)
            self._prefix_kv = self.kv.read_prefix(0, len(self.prefix))
        self.store = PrefixStore(prefix_entries)  # request prefixes kept for reuse

    def set_steps_per_replay(self, n: int) -> None:
        """Change the decode steps per replay (graphs already captured stay valid)."""
        if n < 1:
            raise ValueError(f"parameter 'steps_per_replay' = {n}: must be >= 1")
        self.steps_per_replay = n
        if self.out_buf.shape[0] < n:
            self.out_buf = torch.zeros(n, self.max_batch, dtype=torch.long, device=self.device)

    # ---- requests --------------------------------------------------------------------------
    def submit(self, prompt: Sequence[int], max_new_tokens: int, image: Tensor | None = None,
               **kwargs: object) -> EngineRequest:
        """Queue a request (joins a slot at the next step). kwargs: EngineRequest fields."""
        if len(prompt) == 0:
            raise ValueError("every prompt needs at least one token")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens = {max_new_tokens}: must be >= 1")
        if image is not None and (image.ndim != 3 or image.shape[0] != 3):
            raise ValueError(f"image must be [3, H, W], got {tuple(image.shape)}")
        text, _ = split_prompt(prompt, self.dec.image_marker, image is not None)
        n_img = self.dec.image_tokens(tuple(image.shape)) if image is not None else 0
        need = len(self.prefix) + n_img + len(text) + max_new_tokens
        if need > self.max_len:
            raise ValueError(f"request needs {need} positions > max_len {self.max_len}")
        if not 0 <= int(kwargs.get("prefix_tokens", 0)) < len(prompt):  # type: ignore[arg-type]
            raise ValueError(f"prefix_tokens = {kwargs['prefix_tokens']}: must be in "
                             f"[0, {len(prompt)}) (a prompt token is left to prefill)")
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
    def _start(self, grp: list[tuple[int, EngineRequest]], logits: Tensor,
               ends: list[int]) -> None:
        """After a prefill: each row's position (ends[i]: its next position), temperature and
        first token (logits [n, V] of its last prompt position)."""
        for i, (slot, r) in enumerate(grp):
            r.slot = slot
            end = ends[i]
            self._pos[slot] = end
            self.pos_buf[slot] = end
            self.temp_buf[slot] = float(r.temperature)
            tok = self._choose(r, logits[i], None)
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
    def _step_impl(self, tok: Tensor, pos: Tensor, temp: Tensor, noise: Tensor | None,
                   kv_len: int) -> tuple[Tensor, Tensor]:
        """The compiled unit: tok, pos [B] long, temp [B], noise [B, V] uniform or None
        (all greedy) -> (logits [B, V] float32, next token [B] long)."""
        logits = self.kv.decode(tok, pos, kv_len)
        if noise is None:
            return logits, self._greedy(logits)
        return logits, sample_on_device(logits, temp, noise)

    def _body(self, b: int, kv_len: int, n: int = 1, sampled: bool = True
              ) -> tuple[Tensor, Tensor]:
        """n decode steps for slots [0, b): static buffers in -> (logits [b, V] of the last
        step, tokens out_buf[:n, :b]). With n > 1 a row that samples <eos> stops advancing."""
        logits = self.noise_buf[:b]
        for i in range(n):
            noise = self.noise_buf[:b].uniform_() if sampled else None
            logits, nxt = self._step_fn(self.tok_buf[:b], self.pos_buf[:b], self.temp_buf[:b],
                                        noise, kv_len)
            self.out_buf[i, :b].copy_(nxt)
            self.tok_buf[:b].copy_(nxt)  # fed back next step unless the host overrides a row
            self.pos_buf[:b].add_(self.active_buf[:b])
            if n > 1:
                self.active_buf[:b].mul_(nxt != self.eos_id)
        return logits, self.out_buf[:n, :b]

    def _graph(self, b: int, kv_len: int, n: int = 1, sampled: bool = True
               ) -> tuple[torch.cuda.CUDAGraph, object]:
        key = (b, kv_len, n, sampled)
        if key not in self._graphs:
            state = [self.pos_buf, self.tok_buf, self.active_buf, *self.kv.score,
                     *self.kv.alive]
            self._graphs[key] = capture(lambda: self._body(b, kv_len, n, sampled), self._pool,
                                        state)
        return self._graphs[key]

    def buckets(self, extra: int = 1) -> tuple[int, int]:
        busy = [s for s, r in enumerate(self.slots) if r is not None]
        b = _pow2_at_least(max(busy) + 1, 1, self.max_batch)
        longest = max(self._pos[s] for s in busy) + extra
        return b, _pow2_at_least(longest, 128, self.max_len)

    def _chunk(self) -> int:
        """Decode steps for the next replay: steps_per_replay when no host decision is
        needed in between, else 1."""
        n = self.steps_per_replay
        if n == 1:
            return 1
        for s, r in enumerate(self.slots):
            if r is None:
                continue
            if (r.logits_processor is not None or r.max_new_tokens - len(r.tokens) < n
                    or self._pos[s] + n > self.max_len):
                return 1
        return n

    def graph_count(self) -> int:
        """CUDA graphs captured so far: decode steps and prefills."""
        return len(self._graphs) + len(self._pgraphs)

    @torch.inference_mode()
    def warmup(self, batch_sizes: Sequence[int], kv_lens: Sequence[int],
               sampled: bool = False) -> None:
        """Capture the one-step decode graphs for these buckets, greedy or (sampled) with
        temperature sampling on device (no-op without cuda_graph)."""
        if not self.cuda_graph:
            return
        for b in batch_sizes:
            for n in kv_lens:
                self._graph(_pow2_at_least(b, 1, self.max_batch),
                            _pow2_at_least(n, 128, self.max_len), 1, sampled)

    @torch.inference_mode()
    def step(self) -> list[EngineRequest]:
        """Admit queued requests into free slots, then one decode replay (1 or
        steps_per_replay steps) for the active ones. Returns the requests that finished."""
        done = self._admit_pending()
        if all(r is None for r in self.slots):
            return done
        n = self._chunk()
        b, kv_len = self.buckets(n)
        sampled = any(r is not None and r.temperature > 0 for r in self.slots[:b])
        if self.cuda_graph:
            g, (logits, toks) = self._graph(b, kv_len, n, sampled)
            g.replay()
        else:
            logits, toks = self._body(b, kv_len, n, sampled)
        self.steps += n
        picks = toks.tolist()  # [n, b]
        for i in range(n):
            for s in range(b):
                r = self.slots[s]
                if r is None:
                    continue
                self._pos[s] += 1
                self._emit(r, self._choose(r, logits[s], picks[i][s]), fed=picks[i][s])
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
                 image_keys: Sequence[Hashable | None] | None = None,
                 prefix_tokens: Sequence[int] | None = None,
                 ) -> GenerationResult:
        """generate.py-compatible batch call (all requests submitted at once); on_token(row,
        token_id) streams, should_stop[row]() cancels a row; image_keys / prefix_tokens: each
        row's reusable prefix (EngineRequest; used with prefix_entries > 0)."""
        t0 = time.monotonic()
        n = len(prompts)
        imgs = list(images) if images is not None else [None] * n
        procs = list(logits_processor) if logits_processor is not None else [None] * n
        stops = list(should_stop) if should_stop is not None else [None] * n
        keys = list(image_keys) if image_keys is not None else [None] * n
        npre = list(prefix_tokens) if prefix_tokens is not None else [0] * n
        if not len(imgs) == len(procs) == len(stops) == len(keys) == len(npre) == n:
            raise ValueError(f"images/logits_processor/should_stop/image_keys/prefix_tokens: "
                             f"need {n} entries each")

        def cb(row: int) -> Callable[[int], None] | None:
            return None if on_token is None else (lambda tok: on_token(row, tok))

        reqs = [self.submit(p, max_new_tokens, imgs[i], temperature=temperature,
                            logits_processor=procs[i], generator=generator, on_token=cb(i),
                            should_stop=stops[i], image_key=keys[i], prefix_tokens=npre[i])
                for i, p in enumerate(prompts)]
        steps0 = self.steps
        self.run()
        ttfts = [r.ttft_s for r in reqs]
        return GenerationResult([r.tokens for r in reqs], [r.stop_reason for r in reqs],
                                min(ttfts), time.monotonic() - t0, self.steps - steps0, ttfts,
                                [r.prefix_hit for r in reqs])
