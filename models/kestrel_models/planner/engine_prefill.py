"""Prefill of the decode engine (engine.py's PrefillMixin): queued requests join free cache
slots and are prefilled, contiguous same-image-shape runs as one right-padded batch (a CUDA
graph per (first slot, rows, image shape, prompt bucket) with `prefill_graph`), a request whose
prefix is kept in the PrefixStore from that prefix on. Layout of a slot: prefill_layout.py.
Mixed into DecodeEngine: uses its kv, dec, prefix, prefix_cache, store, slots, pending, the
prefill graph state (_pin, _pgraphs, _ppool) and _start (first token of each row).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import torch
from torch import Tensor

from kestrel_models.planner.engine_request import EngineRequest, _pow2_at_least
from kestrel_models.planner.graphs import replay
from kestrel_models.planner.prefill_layout import layout, rope_positions, split_prompt
from kestrel_models.planner.prefix_store import PrefixEntry

__all__ = ["PrefillMixin"]


class PrefillMixin:
    def _admit_pending(self) -> list[EngineRequest]:
        """Move queued requests into free slots (lowest first); prefill contiguous same-shape
        runs as one batch. Returns those that already stopped at their first token."""
        groups: list[list[tuple[int, EngineRequest]]] = []
        reused: dict[int, PrefixEntry] = {}  # slot -> its kept prefix
        while self.pending and None in self.slots:
            r = self.pending.popleft()
            slot = self.slots.index(None)
            self.slots[slot] = r
            key = self._prefix_key(r)
            hit = None if key is None else self.store.get(key)
            if hit is not None:
                reused[slot] = hit
                groups.append([(slot, r)])
                continue
            shape = None if r.image is None else tuple(r.image.shape)
            last = groups[-1][-1] if groups else None
            if (last is not None and last[0] == slot - 1 and last[0] not in reused and
                    (None if last[1].image is None else tuple(last[1].image.shape)) == shape):
                groups[-1].append((slot, r))
            else:
                groups.append([(slot, r)])
        done = []
        for grp in groups:
            slot, r = grp[0]
            if slot in reused:
                self._prefill_reused(slot, r, reused[slot])
            else:
                self._prefill_group(grp)
            done += [r for _, r in grp if r.stop_reason]
        return done

    def _prefix_key(self, r: EngineRequest) -> Hashable | None:
        """The PrefixStore key of a request's reusable prefix (None: nothing to keep)."""
        if self.store.capacity == 0 or r.prefix_tokens == 0 or (
                r.image is not None and r.image_key is None):
            return None
        shape = None if r.image is None else tuple(r.image.shape)
        text, at = split_prompt(r.prompt, self.dec.image_marker, shape is not None)
        if len(text) < len(r.prompt) and at >= r.prefix_tokens:
            return None  # the image comes after the prefix: nothing before it to keep
        return (r.image_key, shape, tuple(r.prompt[:r.prefix_tokens]))

    def _delta(self, shape: tuple[int, ...] | None) -> int:
        """Rope offset after an image of this shape (M-RoPE; 0 otherwise)."""
        rel = None if shape is None else self.dec.image_positions(shape)
        return 0 if rel is None else int(rel.max()) + 1 - self.dec.image_tokens(shape)

    @torch.inference_mode()
    def _prefill_reused(self, slot: int, r: EngineRequest, e: PrefixEntry) -> None:
        """Slot <- the kept prefix's KV (positions [0, e.length)); prefill the prompt after
        it as one row, right-padded to a power-of-two bucket (the pad positions lie past the
        row's position: masked, later overwritten) with the keys in a power-of-two kv bucket,
        so that with `prefill_graph` it is a CUDA graph per (slot, bucket, kv bucket)."""
        kv = self.kv
        kv.reset_slots(slice(slot, slot + 1))
        kv.copy_prefix(e.k, e.v, slot)
        if kv._use_off:  # the rest's rope positions follow the kept image's
            kv.rope_off[slot] = self._delta(None if r.image is None else tuple(r.image.shape))
        rest = r.prompt[r.prefix_tokens:]
        n = len(rest)
        t = _pow2_at_least(n, 16, 1 << 30)
        if e.length + t > self.max_len:
            t = n
        kv_len = _pow2_at_least(e.length + t, 128, self.max_len)
        logits = self._kept_rest(slot, t, kv_len, rest, e.length)
        r.prefix_hit = True
        self._start([(slot, r)], logits, [e.length + n])

    def _kept_rest(self, slot: int, t: int, kv_len: int, rest: list[int],
                   start: int) -> Tensor:
        """The prefill of `rest` (at most t tokens) at positions start.. of slot's row, over
        the keys of the kv_len bucket, right-padded to t: [1, V] logits of its last token.
        With `prefill_graph` a CUDA graph per ("kept", slot, t, kv_len) whose static inputs
        (tokens, start, last index) are refreshed before each replay."""
        dev, kv = self.device, self.kv
        key = ("kept", slot, t, kv_len)
        if self.prefill_graph and key in self._pin:
            tok_b, pos_b, last_b = self._pin[key]
        else:
            tok_b = torch.zeros(1, t, dtype=torch.long, device=dev)
            pos_b = torch.zeros(1, dtype=torch.long, device=dev)
            last_b = torch.zeros(1, dtype=torch.long, device=dev)
            if self.prefill_graph:
                self._pin[key] = (tok_b, pos_b, last_b)
        n = len(rest)
        tok_b.copy_(torch.tensor([rest + [0] * (t - n)]), non_blocking=True)
        pos_b.fill_(start)
        last_b.fill_(n - 1)
        rows = slice(slot, slot + 1)

        def body() -> Tensor:
            x = kv.embed_tokens(tok_b)
            return kv.forward(x, pos_b, rows, kv_len, last_index=last_b)[:, 0]

        return self._run_prefill(key, body)

    @torch.inference_mode()
    def warmup_kept(self, buckets: Sequence[int], kv_lens: Sequence[int],
                    min_prefix: int = 0) -> None:
        """Capture the kept-prefix prefill graphs (`_kept_rest`) of every slot for these
        prompt-rest buckets and the kv buckets that a kept prefix of at least min_prefix
        positions and such a rest reach, so that a prefix hit replays a graph captured
        before (no-op without `prefill_graph` or a prefix store). Needs every slot free: what
        it writes to their KV is reset or overwritten by the next request."""
        if not self.prefill_graph or self.store.capacity == 0:
            return
        if any(s is not None for s in self.slots):
            raise RuntimeError("warmup_kept() needs every slot free")
        for slot in range(self.max_batch):
            for t in sorted({_pow2_at_least(b, 16, 1 << 30) for b in buckets}):
                for kv_len in sorted({_pow2_at_least(n, 128, self.max_len) for n in kv_lens}):
                    if t < kv_len and min_prefix + t <= kv_len:
                        self._kept_rest(slot, t, kv_len, [0], kv_len - t)

    def _run_prefill(self, key: Hashable, body: Callable[[], Tensor]) -> Tensor:
        """body() -> logits: with `prefill_graph` its CUDA graph for `key` (captured on first
        use; body reads only the static buffers pinned for that key) replayed, else run."""
        if not self.prefill_graph:
            return body()
        return replay(self._pgraphs, key, body, self._ppool)

    def _prefill_body(self, s0: int, n: int, img: Tensor | None, tok: Tensor, last: Tensor,
                      idx: Tensor, rope: Tensor | None) -> Tensor:
        """Rows [s0, s0+n): img [n, 3, H, W] or None, tok [n, T] right-padded (image
        positions included), last [n] the chunk index of each row's last token, idx [n, N] the
        image positions in tok, rope [n, chunk, 3] M-RoPE positions or None -> logits [n, V].
        Static shapes (graphable)."""
        kv, dev = self.kv, self.device
        rows = slice(s0, s0 + n)  # graph-safe: no host->device copies in here
        kv.reset_slots(rows)
        parts, off = [], 0
        if self.prefix_cache:
            assert self._prefix_kv is not None
            for s in range(s0, s0 + n):
                kv.copy_prefix(*self._prefix_kv, s)
            off = len(self.prefix)
        elif self.prefix:
            parts.append(kv.embed_tokens(self._prefix_t).expand(n, -1, -1))
        x = kv.embed_tokens(tok)
        if img is not None:  # the image block replaces the embeddings at its positions
            bi = torch.arange(n, device=dev)[:, None]
            x = x.index_put((bi, idx), kv.embed_image(img).to(x.dtype))
        x = torch.cat([*parts, x], dim=1)
        pos = torch.full((n,), off, dtype=torch.long, device=dev)
        return kv.forward(x, pos, rows, off + x.shape[1], last_index=last, rope_pos=rope)[:, 0]

    @torch.inference_mode()
    def _prefill_group(self, grp: list[tuple[int, EngineRequest]]) -> None:
        s0, n, dev = grp[0][0], len(grp), self.device
        first = grp[0][1]
        img_shape = None if first.image is None else tuple(first.image.shape)
        n_img = self.dec.image_tokens(img_shape) if img_shape is not None else 0
        off = len(self.prefix)  # cached or recomputed: the prompt starts after it
        split = [split_prompt(r.prompt, self.dec.image_marker, img_shape is not None)
                 for _, r in grp]
        texts, ats = [x[0] for x in split], [x[1] for x in split]
        lens = [len(txt) for txt in texts]
        t = _pow2_at_least(max(lens), 16, 1 << 30)
        if off + n_img + t > self.max_len:
            t = max(lens)
        key = (s0, n, img_shape, t)
        pre = 0 if self.prefix_cache else off
        toks, idx = layout(texts, ats, n_img, t)
        rope, deltas = None, [0] * n
        if self.kv._use_off:  # M-RoPE: 3-D positions of the chunk, offsets after the image
            rel = self.dec.image_positions(img_shape) if img_shape is not None else None
            rope, deltas = rope_positions(ats, n_img, rel, pre + n_img + t, off - pre, off)
        if img_shape is not None:
            self.dec.prepare_image(img_shape)  # outside the capture: no host copies in it
        if self.prefill_graph and key in self._pin:
            img_b, tok_b, last_b, idx_b, rope_b = self._pin[key]
        else:
            img_b = (torch.zeros((n, *img_shape), dtype=first.image.dtype, device=dev)
                     if img_shape is not None else torch.zeros(0, device=dev))
            tok_b = torch.zeros(n, n_img + t, dtype=torch.long, device=dev)
            last_b = torch.zeros(n, dtype=torch.long, device=dev)
            idx_b = torch.zeros(n, n_img, dtype=torch.long, device=dev)
            rope_b = None if rope is None else torch.zeros(rope.shape, dtype=torch.long,
                                                           device=dev)
            if self.prefill_graph:
                self._pin[key] = (img_b, tok_b, last_b, idx_b, rope_b)
        for i, (slot, r) in enumerate(grp):
            if img_shape is not None:
                img_b[i].copy_(r.image, non_blocking=True)
            if self.kv._use_off:
                self.kv.rope_off[slot] = deltas[i]
        tok_b.copy_(toks, non_blocking=True)
        idx_b.copy_(idx, non_blocking=True)
        if rope_b is not None:
            rope_b.copy_(rope, non_blocking=True)
        last_b.copy_(torch.tensor([pre + n_img + m - 1 for m in lens]), non_blocking=True)
        img_arg = img_b if img_shape is not None else None

        def body() -> Tensor:
            return self._prefill_body(s0, n, img_arg, tok_b, last_b, idx_b, rope_b)

        logits = self._run_prefill(key, body)
        for i, (slot, r) in enumerate(grp):  # keep the prefixes asked for (positions < L
            pkey = self._prefix_key(r)  # depend on them only); a marker in it took 1 token
            if pkey is not None:
                keep = off + n_img + r.prefix_tokens - (len(r.prompt) - lens[i])
                self.store.put(pkey, *self.kv.read_prefix(slot, keep))
        self._start(grp, logits, [off + n_img + m for m in lens])
