"""torch.compile for the small element-wise functions of the per-frame post-processing.

Why: on CUDA the static decode / NMS preparation / LiDAR projection / box positions are
hundreds of tiny kernels per frame when launched op by op. Inductor fuses each function's
element-wise chain into one or two kernels; top-k, sorts and our Triton kernels stay as they
are (they are called outside the compiled functions or as inductor fallbacks).

`compiled(fn)` is memoised per function and compiled with fullgraph=True: a graph break or
Dynamo's recompile limit raises instead of silently running eager. When compiling or running
a compiled function raises and the plain function then succeeds on the same arguments, the
error is kept in `errors` (the node logs it and reports `region_compile_failed`), compilation
is switched off for the whole process and the plain functions run from then on: a compile
problem costs speed, never a frame. An error the plain function raises too (bad input, out of
memory, a CUDA error) is not a compile problem: it propagates and compilation stays on.
A function's first call compiles it (static shapes); a call with new shapes or changed Python
constants (e.g. a decode threshold set at run time) recompiles it once, then as dynamic.
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


def compiled(fn: F, on: bool = True) -> F:
    """`fn` compiled (see the module docstring), falling back to `fn` itself for good if
    compiling or running it raises where `fn` does not; `fn` itself when `on` is False."""
    if errors or not on:
        return fn
    c = _CACHE.get(fn)
    if c is None:
        inner: list[Callable] = []  # built on first use, inside the guarded call

        @functools.wraps(fn)
        def c(*args: Any, **kwargs: Any) -> Any:
            if errors:
                return fn(*args, **kwargs)
            try:
                if not inner:
                    _raise_recompile_limit()
                    inner.append(torch.compile(fn, fullgraph=True))
                return inner[0](*args, **kwargs)
            except Exception as exc:
                out = fn(*args, **kwargs)  # raises too: not a compile problem, propagate
                errors.append(f"{fn.__qualname__}: {type(exc).__name__}: {str(exc)[:300]}")
                return out

        _CACHE[fn] = c
    return c  # type: ignore[return-value]


def _raise_recompile_limit(at_least: int = 64) -> None:
    """Dynamo recompiles a function at most `recompile_limit` times (default 8) per process.
    A region step is specialised on its head set, point bucket and output settings; a node
    reconfigured a few times with other settings could pass 8, and with fullgraph=True that
    raises (compile switched off). Raised, never lowered; it only bounds recompiles."""
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):  # (the older name)
        if isinstance(getattr(cfg, name, None), int) and getattr(cfg, name) < at_least:
            setattr(cfg, name, at_least)
            return
