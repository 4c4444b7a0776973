"""torch.compile for the small element-wise functions of the per-frame post-processing.

Why: on CUDA the static decode / NMS preparation / LiDAR projection / box positions are
~300 kernels of 1-3 us each per frame (6 cameras, H200: 1.17 ms of kernel time,
docs/benchmarks/perception_core_kernels_h200_s11.md). Inductor fuses each function's
element-wise chain into one or two kernels; top-k, sorts and our Triton kernels stay as they
are (they are called outside the compiled functions or as inductor fallbacks).

`compiled(fn)` is memoised per function (one Dynamo cache per function, so a new shape, e.g.
another point bucket, recompiles that function once, then as a dynamic-shape kernel). If
compiling or running a compiled function raises, the error is kept in `errors` (the node
reports it), compilation is switched off for the whole process and the plain function runs
instead: a compile problem costs speed, never a frame.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])

_CACHE: dict[Callable, Callable] = {}
errors: list[str] = []  # why compilation was switched off (empty: it is on)


def enabled() -> bool:
    """False after a compile failure in this process (everything then runs uncompiled)."""
    return not errors


def compiled(fn: F) -> F:
    """`fn` compiled (dynamic=None: static first, dynamic dims after a shape change), falling
    back to `fn` itself for good if compiling or running it raises."""
    if errors:
        return fn
    c = _CACHE.get(fn)
    if c is None:
        inner = torch.compile(fn)

        @functools.wraps(fn)
        def c(*args: Any, **kwargs: Any) -> Any:
            if errors:
                return fn(*args, **kwargs)
            try:
                return inner(*args, **kwargs)
            except Exception as exc:  # compile or run failure: never lose the frame
                errors.append(f"{fn.__qualname__}: {type(exc).__name__}: {str(exc)[:300]}")
                return fn(*args, **kwargs)

        _CACHE[fn] = c
    return c  # type: ignore[return-value]
