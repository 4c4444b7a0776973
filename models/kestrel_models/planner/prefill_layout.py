"""Where each position of a request goes in the engine's batched prefill (used by engine.py).

A request is a prompt (token ids) and at most one image. The image becomes a block of N
positions (PackedDecoder.image_tokens): at the model's image marker token in the prompt (the
marker itself is replaced: that is where a chat template puts the image), or before the prompt
when the prompt holds no marker (Kestrel's VLM). A prefill chunk row is
    [text before the image] [N image positions] [text after] [right padding]
with token id 0 at the image positions (their embeddings are replaced by the image block's).

Rope positions (M-RoPE decoders, PackedDecoder.image_positions): text before the image keeps
its cache position p; the block starting at cache position A gets A + (t, h, w) relative
positions; the text after it continues at max + 1, i.e. at p + delta with delta = (max + 1) - N
(<= 0), which is also the rope offset of every later decode step of that row.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["split_prompt", "layout", "rope_positions"]


def split_prompt(prompt: Sequence[int], marker: int | None, has_image: bool
                 ) -> tuple[list[int], int]:
    """-> (the prompt's text tokens without the marker, index in them where the image block
    goes). ValueError for a marker without an image or more than one marker."""
    ids = [int(t) for t in prompt]
    n = ids.count(marker) if marker is not None else 0
    if not has_image:
        if n:
            raise ValueError(f"the prompt holds the image marker token {marker} but the request "
                             "has no image")
        return ids, 0
    if n > 1:
        raise ValueError(f"the prompt holds the image marker token {marker} {n} times: one "
                         "image per request")
    if n == 0:
        return ids, 0
    k = ids.index(marker)  # type: ignore[arg-type]
    return ids[:k] + ids[k + 1:], k


def layout(texts: Sequence[Sequence[int]], ats: Sequence[int], n_img: int, t: int
           ) -> tuple[Tensor, Tensor]:
    """Rows of text (each <= t tokens) with the image block at ats[i] -> (tokens [n, n_img + t]
    long, image_index [n, n_img] long: the chunk index of each image position)."""
    n = len(texts)
    tok = torch.zeros(n, n_img + t, dtype=torch.long)
    for i, (txt, at) in enumerate(zip(texts, ats, strict=True)):
        row = [*txt[:at], *([0] * n_img), *txt[at:]]
        tok[i, :len(row)] = torch.tensor(row, dtype=torch.long)
    idx = torch.tensor(list(ats), dtype=torch.long)[:, None] + torch.arange(n_img)
    return tok, idx


def rope_positions(ats: Sequence[int], n_img: int, rel: Tensor | None, length: int, base: int,
                   start: int) -> tuple[Tensor, list[int]]:
    """3-D rope positions of a chunk: rows whose text starts at cache position `start` (after
    the system prefix), image block at text index ats[i] with relative positions rel [N, 3]
    (None: no image), chunk of `length` positions from cache position `base`.
    -> (rope [n, length, 3] long, delta per row: the rope offset after the image)."""
    p = torch.arange(base, base + length)
    rows, deltas = [], []
    for at in ats:
        rp = p[:, None].repeat(1, 3)
        delta = 0
        if rel is not None and n_img:
            a = start + at  # cache position of the block's first token
            advance = int(rel.max()) + 1
            delta = advance - n_img
            i0 = a - base
            rp[i0:i0 + n_img] = a + rel.to(torch.long)
            rp[i0 + n_img:] += delta
        rows.append(rp)
        deltas.append(delta)
    return torch.stack(rows), deltas
