"""What the planner's Triton ops share: the guarded `import triton`, the op registration, the
arrival counter of one-kernel split reductions.

`import triton` happens only here and is guarded: without triton (CPU CI) the ops still exist
and their CPU path runs; their CUDA path raises RuntimeError saying that triton is missing.
"""

from __future__ import annotations

import torch

try:  # the GPU path only
    import triton
    import triton.language as tl
    HAVE_TRITON = True
except ImportError:  # CPU CI: the ops' torch path still works
    triton = tl = None  # type: ignore[assignment]
    HAVE_TRITON = False

__all__ = ["HAVE_TRITON", "triton", "tl", "OP", "need_triton", "wrap", "register"]

OP = (torch.library.triton_op if HAVE_TRITON and hasattr(torch.library, "triton_op")
      else None)


def need_triton(what: str) -> None:
    if not HAVE_TRITON or OP is None:
        raise RuntimeError(f"{what}: the CUDA path needs triton (and torch >= 2.6), which is "
                           f"missing here (import triton failed); use the default options")


def wrap(kernel):  # noqa: ANN001, ANN202 - a triton JITFunction
    return torch.library.wrap_triton(kernel)


def register(name: str, fn, mutates_args: tuple[str, ...] = (), fake=None):  # noqa: ANN001, ANN202
    """triton_op (inductor traces into the body: the kernels join the compiled graph) when
    torch has it, else a plain custom op whose fake impl is `fake` (default: the same body).
    mutates_args: the arguments the op writes in place (functionalized; inductor reinplaces)."""
    if OP is not None:
        return OP(f"kestrel::{name}", fn, mutates_args=mutates_args)
    op = torch.library.custom_op(f"kestrel::{name}", fn, mutates_args=mutates_args)
    op.register_fake(fake or fn)
    return op


if HAVE_TRITON:
    @triton.jit
    def _last_arrival(sem_ptr, n):
        """True in the program that arrives n-th at the counter sem_ptr (each of n programs
        calls this once after its stores). The CTA barrier orders all threads' stores before
        the counter's acq_rel add at GPU scope, so the last program sees every partial (its
        loads bypass L1: .cg)."""
        tl.debug_barrier()
        return tl.atomic_add(sem_ptr, 1, sem="acq_rel", scope="gpu") == n - 1
