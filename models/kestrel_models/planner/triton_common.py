"""What the planner's Triton ops share: the guarded `import triton`, the op registration, the
arrival counter of one-kernel split reductions, programmatic dependent launch (PDL).

PDL (Hopper and later): a kernel launched with `launch_pdl=True` may start while the kernel
before it in the stream is still running; its programs load what does not depend on that
kernel (the weights) and then wait (`gdc_wait`) until it has finished and its writes are
visible. Every kernel launched so must wait before its first store and before it reads
anything that a kernel of the chain writes: before the wait it reads only what was written
before the chain began (the weights; the fused attention also reads pos and its first block of
cached keys, which earlier steps wrote). Each such kernel also lets the next one start at once
(`gdc_launch_dependents` on entry). Inductor does not pass `launch_pdl` through to the
kernels of a triton_op, so the PDL variants of the ops are registered opaque (`register(...,
opaque=True)`): inductor calls the op, which launches the kernel itself (inside the CUDA
graph capture, so the launch path costs nothing at replay).

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

__all__ = ["HAVE_TRITON", "triton", "tl", "OP", "need_triton", "wrap", "register",
           "pdl_unsupported", "launch"]

OP = (torch.library.triton_op if HAVE_TRITON and hasattr(torch.library, "triton_op")
      else None)


def need_triton(what: str) -> None:
    if not HAVE_TRITON or OP is None:
        raise RuntimeError(f"{what}: the CUDA path needs triton (and torch >= 2.6), which is "
                           f"missing here (import triton failed); use the default options")


def wrap(kernel):  # noqa: ANN001, ANN202 - a triton JITFunction
    return torch.library.wrap_triton(kernel)


def pdl_unsupported(device: torch.device) -> str | None:
    """None when kernels on `device` can be launched with PDL, else why not."""
    if device.type != "cuda":
        return f"the model is on {device.type}, not CUDA"
    cuda_ext = getattr(getattr(tl, "extra", None), "cuda", None)
    if not HAVE_TRITON or not hasattr(cuda_ext, "gdc_wait"):
        return "this triton has no grid dependency control (tl.extra.cuda.gdc_wait)"
    major = torch.cuda.get_device_capability(device)[0]
    if major < 9:
        return f"compute capability {major}.x (PDL needs 9.0, Hopper, or later)"
    return None


def launch(kernel, grid: tuple, pdl: bool, *args: object, **kw: object) -> None:  # noqa: ANN001
    """kernel[grid](*args, PDL=pdl, **kw): traced by inductor inside a triton_op (pdl False),
    or launched with PDL from an opaque op (pdl True; the kernel waits via its PDL constexpr)."""
    if pdl:
        kernel[grid](*args, PDL=True, launch_pdl=True, **kw)
    else:
        wrap(kernel)[grid](*args, PDL=False, **kw)


def register(name: str, fn, mutates_args: tuple[str, ...] = (), fake=None,  # noqa: ANN001, ANN202
             opaque: bool = False):
    """triton_op (inductor traces into the body: the kernels join the compiled graph) when
    torch has it and not `opaque`, else a plain custom op whose fake impl is `fake` (default:
    the same body). mutates_args: the arguments the op writes in place (functionalized;
    inductor reinplaces)."""
    if OP is not None and not opaque:
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
