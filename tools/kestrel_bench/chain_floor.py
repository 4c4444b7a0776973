"""`python -m kestrel_bench.chain_floor`: the GPU time of a chain of dependent grid-wide kernels
that do almost nothing, the floor under a decode step built of one kernel per fused op.

Each of N kernels reads the whole 576-element row (SmolVLM-256M's hidden size) that the kernel
before it wrote and writes its own, with no weights; the chain is captured in one CUDA graph and
timed per replay with CUDA events, with and without programmatic dependent launch (PDL: each
kernel starts while the one before it finishes and waits in `gdc_wait`), at grids of 3 programs
(the fused attention at 3 kv heads) and 144 and 384 (the whole-row GEMVs). A decode step of L
layers of k such kernels cannot take less than L * k times the per-kernel figure, whatever it
reads. Prints one line per case; GPU only (Hopper or later for PDL).

  python -m kestrel_bench.chain_floor [--kernels 150] [--reps 200]
"""

from __future__ import annotations

import argparse
import sys

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU machines: main() says what is missing
    triton = tl = None

D = 576  # the row each kernel reads: SmolVLM-256M's hidden size
GRIDS = (3, 144, 384)

if triton is not None:
    @triton.jit
    def _link(x_ptr, y_ptr, D: tl.constexpr, BD: tl.constexpr, PDL: tl.constexpr):
        """One link: wait for the kernel before (PDL), read its row, write 4 values a program."""
        pid = tl.program_id(0)
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        d = tl.arange(0, BD)
        x = tl.load(x_ptr + d, mask=d < D, other=0.0)
        s = tl.sum(x * x, 0)
        tl.store(y_ptr + pid * 4 + tl.arange(0, 4),
                 (s * 1e-6 + pid).to(tl.float32) + tl.zeros([4], tl.float32))


def time_chain(n: int, grid: int, pdl: bool, reps: int) -> list[float]:
    """GPU time per replay, us, sorted: n links of `grid` programs in one CUDA graph."""
    bufs = [torch.zeros(max(D, grid * 4), device="cuda") for _ in range(2)]

    def chain() -> None:
        for i in range(n):
            _link[(grid,)](bufs[i % 2], bufs[(i + 1) % 2], D=D, BD=triton.next_power_of_2(D),
                           PDL=pdl, launch_pdl=pdl)

    chain()  # compiles the kernel outside the capture
    torch.cuda.synchronize()
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream):
        chain()
        with torch.cuda.graph(graph, stream=stream):
            chain()
    torch.cuda.synchronize()
    for _ in range(20):  # warm-up
        graph.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return sorted(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kestrel_bench.chain_floor",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernels", type=int, default=150, help="links in the chain")
    ap.add_argument("--reps", type=int, default=200, help="timed replays per case")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() or triton is None:
        print("chain_floor: needs a CUDA GPU and triton", file=sys.stderr)
        return 2
    print(f"{torch.cuda.get_device_name()}, {args.kernels} kernels, {args.reps} replays")
    for grid in GRIDS:
        for pdl in (False, True):
            t = time_chain(args.kernels, grid, pdl, args.reps)
            p50, p99 = t[len(t) // 2], t[int(len(t) * 0.99)]
            print(f"grid {grid:4d} pdl {pdl!s:5}: p50 {p50:7.1f} us ({p50 / args.kernels:.2f} "
                  f"us a kernel), p99 {p99:7.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
