"""`python -m kestrel_bench.chain_floor`: the GPU time of a chain of dependent grid-wide steps
that do almost nothing, the floor under a decode step built of one kernel per fused op, and the
same chain run inside one persistent kernel.

Cases (one line each; GPU only, Hopper or later for PDL):
- `kernels`: each of N kernels reads the whole 576-element row (SmolVLM-256M's hidden size) that
  the kernel before it wrote and writes its own, with no weights, with and without
  programmatic dependent launch (PDL: each kernel starts while the one before it finishes and
  waits in `gdc_wait`), at grids of 3 programs (the fused attention at 3 kv heads) and 144
  and 384 (the whole-row GEMVs).
  A decode step of L layers of k such kernels cannot take less than L * k times the per-kernel
  figure, whatever it reads.
- `barrier`: the same N links as phases of one kernel whose programs all stay resident and
  meet at a grid-wide barrier between phases (BARRIERS: an atomic counter polled with atomics
  or with acquire loads, or one flag a program), at one and two programs an SM: the floor of a
  persistent design that still waits for the whole grid at every op.
- `stream`: N phases of one persistent kernel, each a GEMV of its own weights ([rows, 576]
  bf16, rows = programs * 8) on the row the phase before wrote. Each program issues the loads
  of its weight tile before it waits at the barrier, so weight traffic overlaps the wait; also
  timed as N PDL kernels doing the same GEMVs. Reported as weight bytes per second against the
  device-to-device copy bandwidth measured in the same run (the floor's denominator).
Every case is captured in one CUDA graph and timed per replay with CUDA events
(`kestrel_bench.timing.cuda_graph_ms`).

  python -m kestrel_bench.chain_floor [--kernels 150] [--reps 200] [--cases kernels ...]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import torch

from kestrel_bench.planner_hf import copy_bandwidth
from kestrel_bench.timing import cuda_graph_ms

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU machines: main() says what is missing
    triton = tl = None

D = 576  # the row each link reads: SmolVLM-256M's hidden size
BD = 1024  # D padded to a power of two
GRIDS = (3, 144, 384)
ROWS = 8  # weight rows a program owns in a `stream` phase
# the persistent kernels' grid barriers (_grid_barrier's KIND, in this order)
BARRIERS = ("counter", "counter_ld", "flags")

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

    @triton.jit
    def _acquire_ld(ptrs):
        """ld.acquire.gpu of each pointer: sees the stores released before a flag or count."""
        return tl.inline_asm_elementwise("ld.global.acquire.gpu.b32 $0, [$1];", "=r,l", [ptrs],
                                         dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _grid_barrier(cnt_ptr, target, KIND: tl.constexpr, GP: tl.constexpr):
        """Wait until every program of the grid has reached phase `target`; this program's
        earlier stores are released first. KIND 0: one counter, an atomic add per program,
        polled with atomic reads. KIND 1: the same counter polled with acquire loads. KIND 2:
        one flag a program (cnt_ptr[pid] = target, a release), all GP flags polled at once
        with acquire loads: no two programs write one address."""
        tl.debug_barrier()  # every thread of the program has stored
        g = tl.num_programs(0)
        if KIND == 2:
            tl.atomic_xchg(cnt_ptr + tl.program_id(0), target, sem="release", scope="gpu")
            ptrs = cnt_ptr + tl.minimum(tl.arange(0, GP), g - 1)
            f = _acquire_ld(ptrs)
            while tl.min(f, 0) < target:
                f = _acquire_ld(ptrs)
        elif KIND == 1:
            tl.atomic_add(cnt_ptr, 1, sem="release", scope="gpu")
            ptr = cnt_ptr + tl.zeros([1], tl.int32)
            c = _acquire_ld(ptr)
            while tl.max(c, 0) < target * g:
                c = _acquire_ld(ptr)
        else:
            tl.atomic_add(cnt_ptr, 1, sem="release", scope="gpu")
            c = tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
            while c < target * g:
                c = tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
        tl.debug_barrier()

    @triton.jit
    def _barrier_chain(buf_ptr, cnt_ptr, n, D: tl.constexpr, BD: tl.constexpr,
                       STRIDE: tl.constexpr, KIND: tl.constexpr, GP: tl.constexpr):
        """n links as phases of one kernel, a grid barrier between them."""
        pid = tl.program_id(0)
        d = tl.arange(0, BD)
        for i in range(n):
            src = buf_ptr + (i % 2) * STRIDE
            x = tl.load(src + d, mask=d < D, other=0.0, cache_modifier=".cg")
            s = tl.sum(x * x, 0)
            tl.store(buf_ptr + ((i + 1) % 2) * STRIDE + pid * 4 + tl.arange(0, 4),
                     (s * 1e-6 + pid).to(tl.float32) + tl.zeros([4], tl.float32))
            _grid_barrier(cnt_ptr, i + 1, KIND, GP)

    @triton.jit
    def _gemv_rows(x, pid, out_ptr, D: tl.constexpr, BD: tl.constexpr,
                   ROWS: tl.constexpr, w):
        """out[pid*ROWS + r] = w[r] . x for the tile w [ROWS, BD] already loaded."""
        y = tl.sum(w.to(tl.float32) * x[None, :], 1)
        tl.store(out_ptr + pid * ROWS + tl.arange(0, ROWS), y * (1.0 / 24))  # 1/sqrt(D)

    @triton.jit
    def _stream_chain(w_ptr, buf_ptr, cnt_ptr, n, D: tl.constexpr, BD: tl.constexpr,
                      ROWS: tl.constexpr, STRIDE: tl.constexpr, KIND: tl.constexpr,
                      GP: tl.constexpr):
        """n GEMV phases of one kernel: load this phase's weight tile, wait for the phase
        before, then read its row and write this phase's."""
        pid, g = tl.program_id(0), tl.num_programs(0)
        r, d = tl.arange(0, ROWS), tl.arange(0, BD)
        tile = (pid * ROWS + r)[:, None] * D + d[None, :]
        for i in range(n):
            w = tl.load(w_ptr + i * g * ROWS * D + tile, mask=(d < D)[None, :], other=0.0,
                        eviction_policy="evict_first")
            if i > 0:
                _grid_barrier(cnt_ptr, i, KIND, GP)
            x = tl.load(buf_ptr + (i % 2) * STRIDE + d, mask=d < D, other=0.0,
                        cache_modifier=".cg")
            _gemv_rows(x, pid, buf_ptr + ((i + 1) % 2) * STRIDE, D, BD, ROWS, w)

    @triton.jit
    def _stream_link(w_ptr, x_ptr, y_ptr, D: tl.constexpr, BD: tl.constexpr,
                     ROWS: tl.constexpr):
        """One GEMV kernel of the `stream` chain with PDL: the weight loads go out before
        gdc_wait, as the decode kernels' early reads do."""
        pid = tl.program_id(0)
        r, d = tl.arange(0, ROWS), tl.arange(0, BD)
        tl.extra.cuda.gdc_launch_dependents()
        w = tl.load(w_ptr + (pid * ROWS + r)[:, None] * D + d[None, :], mask=(d < D)[None, :],
                    other=0.0, eviction_policy="evict_first")
        tl.extra.cuda.gdc_wait()
        x = tl.load(x_ptr + d, mask=d < D, other=0.0)
        _gemv_rows(x, pid, y_ptr, D, BD, ROWS, w)


def _graph_times(fn: Callable[[], None], reps: int) -> list[float]:
    """GPU time per replay of fn captured in one CUDA graph (kestrel_bench.timing), us, sorted."""
    ms, _, _ = cuda_graph_ms(fn, reps, warmup=20)
    return sorted(float(t) * 1e3 for t in ms)


def _resident(grid: int) -> bool:
    """A persistent grid must fit on the device at once (4 warps a program), or it deadlocks."""
    return grid <= torch.cuda.get_device_properties(0).multi_processor_count * 8


def time_chain(n: int, grid: int, pdl: bool, reps: int) -> list[float]:
    """`kernels` case: n links of `grid` programs in one CUDA graph; us per replay, sorted."""
    bufs = [torch.zeros(max(D, grid * 4), device="cuda") for _ in range(2)]

    def chain() -> None:
        for i in range(n):
            _link[(grid,)](bufs[i % 2], bufs[(i + 1) % 2], D=D, BD=BD, PDL=pdl, launch_pdl=pdl)
    return _graph_times(chain, reps)


def time_barrier(n: int, grid: int, barrier: str, reps: int) -> list[float]:
    """`barrier` case: n phases of one persistent kernel of `grid` programs, `barrier` (one of
    BARRIERS) between them; us per replay, sorted."""
    assert _resident(grid), f"grid {grid} does not fit on the device at once"
    stride = max(D, grid * 4)
    buf, cnt = torch.zeros(2 * stride, device="cuda"), torch.zeros(grid, dtype=torch.int32,
                                                                     device="cuda")

    def run() -> None:
        cnt.zero_()
        _barrier_chain[(grid,)](buf, cnt, n, D=D, BD=BD, STRIDE=stride,
                                KIND=BARRIERS.index(barrier),
                                GP=triton.next_power_of_2(grid))
    return _graph_times(run, reps)


def _stream(n: int, grid: int, persistent: bool,
            barrier: str) -> tuple[Callable[[], None], torch.Tensor, torch.Tensor]:
    """The `stream` chain's buffers and its launch: (run, the weights, a view of the row the
    last phase writes). The first row is ones; the weights are seeded."""
    assert not persistent or _resident(grid), f"grid {grid} does not fit on the device at once"
    rows = grid * ROWS
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(n * rows * D, device="cuda", generator=g).to(torch.bfloat16)
    stride = max(D, rows)
    buf = torch.zeros(2 * stride, device="cuda")
    buf[:D] = 1.0
    cnt = torch.zeros(grid, dtype=torch.int32, device="cuda")

    def run() -> None:
        if persistent:
            cnt.zero_()
            _stream_chain[(grid,)](w, buf, cnt, n, D=D, BD=BD, ROWS=ROWS, STRIDE=stride,
                                   KIND=BARRIERS.index(barrier),
                                   GP=triton.next_power_of_2(grid))
        else:
            for i in range(n):
                _stream_link[(grid,)](w[i * rows * D:], buf[(i % 2) * stride:],
                                      buf[((i + 1) % 2) * stride:], D=D, BD=BD, ROWS=ROWS,
                                      launch_pdl=True)
    return run, w, buf[(n % 2) * stride:][:rows]


def time_stream(n: int, grid: int, persistent: bool, reps: int,
                barrier: str = "counter") -> tuple[list[float], int]:
    """`stream` case: n GEMV phases of grid * ROWS weight rows each, in one persistent kernel
    or as n PDL kernels. Returns (us per replay sorted, weight bytes read per replay)."""
    run, w, _ = _stream(n, grid, persistent, barrier)
    return _graph_times(run, reps), w.numel() * w.element_size()


def stream_result(n: int, grid: int, persistent: bool, barrier: str = "counter") -> torch.Tensor:
    """The row the last of n `stream` phases writes, from one run on fresh buffers."""
    run, _, last = _stream(n, grid, persistent, barrier)
    run()
    torch.cuda.synchronize()
    return last.clone()


def _line(name: str, t: list[float], n: int, extra: str = "") -> str:
    p50, p99 = t[len(t) // 2], t[int(len(t) * 0.99)]
    return (f"{name}: p50 {p50:7.1f} us ({p50 / n:.2f} us a link), p99 {p99:7.1f} us{extra}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kestrel_bench.chain_floor",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernels", type=int, default=150, help="links in the chain")
    ap.add_argument("--reps", type=int, default=200, help="timed replays per case")
    ap.add_argument("--cases", nargs="+", default=["kernels", "barrier", "stream"],
                    choices=["kernels", "barrier", "stream"], help="which chains to time")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() or triton is None:
        print("chain_floor: needs a CUDA GPU and triton", file=sys.stderr)
        return 2
    n = args.kernels
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name()} ({sms} SMs), {n} links, {args.reps} replays")
    if "kernels" in args.cases:
        for grid in GRIDS:
            for pdl in (False, True):
                print(_line(f"kernels grid {grid:4d} pdl {pdl!s:5}",
                            time_chain(n, grid, pdl, args.reps), n))
    if "barrier" in args.cases:
        for grid in (sms, 2 * sms):
            for barrier in BARRIERS:
                print(_line(f"barrier {barrier:10} grid {grid:4d}",
                            time_barrier(n, grid, barrier, args.reps), n))
    if "stream" in args.cases:
        bw = copy_bandwidth(torch.device("cuda"), 1 << 30)
        print(f"copy bandwidth {bw / 1e9:.1f} GB/s")
        for grid in (sms, 2 * sms):
            for kind in ("pdl kernels", *BARRIERS):
                t, nbytes = time_stream(n, grid, kind != "pdl kernels", args.reps, kind)
                p50 = t[len(t) // 2]
                frac = nbytes / (p50 * 1e-6) / bw
                print(_line(f"stream {kind:11} grid {grid:4d}", t, n,
                            f"; {nbytes / 1e6:.1f} MB of weights, {frac:.1%} of the copy "
                            f"bandwidth"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
