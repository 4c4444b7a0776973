"""Bottleneck identifier: classify each stage of a torch.profiler trace, and the whole step, as
compute-, memory-bandwidth-, launch/CPU-overhead- or transport-bound. Pure: no torch import.

Input: the events of a chrome trace as torch.profiler writes it (`export_chrome_trace`): complete
events ("ph": "X") with `cat` one of
  user_annotation / cpu_op  host ranges: record_function ranges and aten ops (args "Input Dims",
                            "Input type", "flops" with `with_flops=True`, "External id")
  kernel / gpu_memset       device work (args "correlation", "External id")
  gpu_memcpy                host<->device copies (args "bytes")
  cuda_runtime              launches (args "correlation")
and times in microseconds. Any event may carry explicit "flops" / "bytes" args (used as is).

Stages are the top-level record_function ranges of the host (ProfilerStep#N excluded), summed over
every occurrence of the same name. Per stage:
  host_us        time inside the range on the host
  wall_us        range start -> the end of its last device work (host_us on a CPU-only trace)
  busy_us        device busy time: the union of its kernels (GPU), or its top-level aten ops (CPU)
  kernels        kernel launches (GPU) or top-level ops (CPU) and their mean duration
  gaps_us        device idle time between its first and last kernel
  copy_us        host<->device copies (transport)
  flops, bytes   from the work ops (_nesting): the profiler's flop counts where the trace has
                 them, else estimated from the input shapes for matmuls and convolutions;
                 bytes from the input shapes (inputs read once + the largest written once);
                 or explicit args
Rules, in order (thresholds in THRESHOLDS):
  transport  copies (or a stage named like transport: receive, publish, serialize...) take
             >= transport_share of the wall time
  launch     the device is busy < busy_share of the wall time (it waits on the host: Python,
             dispatch, launches), a stage of a GPU trace has no device work at all, or its
             kernels are small (mean < 10 x small_kernel_us) and neither FLOP/s nor bytes/s
             reach low_util of the peak (per-launch overhead)
  compute    FLOP/s share of peak >= bytes/s share of peak (arithmetic intensity above the
             ridge point peak_flops / peak_bytes_per_s)
  memory     otherwise
  unknown    no FLOP or byte counts (profile with record_shapes=True, with_flops=True)
"""

from __future__ import annotations

import json
import re
from bisect import bisect_left, bisect_right
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

CLASSES = ("compute", "memory", "launch", "transport", "unknown")
THRESHOLDS = {"transport_share": 0.4, "busy_share": 0.5, "small_kernel_us_gpu": 10.0,
              "small_kernel_us_cpu": 20.0, "low_util": 0.1}
TRANSPORT_NAME = re.compile(r"transport|receive|recv|publish|serial|deseriali|dds|to_host|"
                            r"h2d|d2h|memcpy|upload|download", re.IGNORECASE)
STEP_NAME = re.compile(r"^ProfilerStep#\d+$")
HOST_CATS = ("user_annotation", "cpu_op")  # python_function (with_stack) wraps all: not read
DEVICE_CATS = ("kernel", "gpu_memset")
COPY_CATS = ("gpu_memcpy",)
_ITEMSIZE = {"float": 4, "double": 8, "c10::Half": 2, "c10::BFloat16": 2, "half": 2,
             "bfloat16": 2, "long int": 8, "int": 4, "short int": 2, "signed char": 1,
             "unsigned char": 1, "bool": 1, "c10::Float8_e4m3fn": 1, "c10::Float8_e5m2": 1}
_DTYPE = {"float": "fp32", "double": "fp64", "c10::Half": "fp16", "half": "fp16",
          "c10::BFloat16": "bf16", "bfloat16": "bf16", "c10::Float8_e4m3fn": "fp8",
          "c10::Float8_e5m2": "fp8", "signed char": "int8"}


@dataclass
class Event:
    name: str
    cat: str
    ts: float               # us
    dur: float              # us
    tid: Any = 0
    args: dict = field(default_factory=dict)

    @property
    def end(self) -> float:
        return self.ts + self.dur


@dataclass
class Peaks:
    """Device peaks: FLOP/s per dtype ("fp32", "bf16", ...; "default" for the others) and bytes/s
    of the main memory. `source` says where they come from (table, probe, option)."""
    device: str
    flops: dict[str, float]
    bytes_per_s: float
    source: str = "table"

    def flops_for(self, dtype: str) -> float:
        return float(self.flops.get(dtype, self.flops.get("default", max(self.flops.values()))))


@dataclass
class StageStats:
    name: str
    occurrences: int = 0
    host_us: float = 0.0
    wall_us: float = 0.0
    busy_us: float = 0.0
    gaps_us: float = 0.0
    copy_us: float = 0.0
    kernels: int = 0
    flops: float = 0.0
    bytes: float = 0.0
    dtype: str = "fp32"
    klass: str = "unknown"
    flop_util: float = 0.0      # achieved FLOP/s over the busy time / peak
    bw_util: float = 0.0        # achieved bytes/s over the busy time / peak
    reason: str = ""

    @property
    def mean_kernel_us(self) -> float:
        return self.busy_us / self.kernels if self.kernels else 0.0

    @property
    def busy_share(self) -> float:
        return self.busy_us / self.wall_us if self.wall_us > 0 else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "mean_kernel_us": self.mean_kernel_us,
                "busy_share": self.busy_share}


@dataclass
class Analysis:
    device: str             # "gpu" when the trace has kernels, else "cpu"
    peaks: Peaks
    stages: list[StageStats]
    step: StageStats

    def as_dict(self) -> dict:
        return {"device": self.device, "peaks": asdict(self.peaks),
                "stages": [s.as_dict() for s in self.stages], "step": self.step.as_dict()}


def load_trace(source: str | Path | dict | list) -> list[Event]:
    """Chrome-trace JSON file, its parsed dict ({"traceEvents": [...]}) or a list of event dicts
    -> complete events with a duration (others dropped)."""
    if isinstance(source, (str, Path)):
        source = json.loads(Path(source).read_text())
    raw = source.get("traceEvents", []) if isinstance(source, dict) else source
    events = []
    for e in raw:
        if e.get("ph", "X") != "X" or "dur" not in e:
            continue
        events.append(Event(str(e.get("name", "")), str(e.get("cat", "")), float(e["ts"]),
                            float(e["dur"]), e.get("tid", 0), dict(e.get("args") or {})))
    return sorted(events, key=lambda e: (e.ts, -e.dur))


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


# ops that move no data (views, metadata), or none when they have no child op (to/contiguous
# without a copy)
NO_BYTES = frozenset(f"aten::{n}" for n in (
    "as_strided", "view", "_unsafe_view", "reshape", "t", "transpose", "permute", "expand",
    "squeeze", "unsqueeze", "slice", "select", "detach", "alias", "resolve_conj",
    "resolve_neg", "lift_fresh", "empty", "empty_strided", "unbind", "split", "chunk",
    "narrow", "to", "contiguous", "numpy_T", "_reshape_alias", "view_as", "expand_as")) | {
    "detach"}


def _op_bytes(name: str, args: dict) -> float:
    """Bytes an op moves: explicit args["bytes"], else its tensor inputs read once plus its
    output written once (matmuls and convolutions: the exact output size; other ops: the size
    of the largest input); 0 for views."""
    if "bytes" in args:
        return float(args["bytes"])
    if name in NO_BYTES:
        return 0.0
    sizes, itemsize = [], 4
    for dims, typ in zip(args.get("Input Dims") or [], args.get("Input type") or [],
                         strict=False):
        if isinstance(dims, list) and dims and all(isinstance(d, int) for d in dims):
            itemsize = _ITEMSIZE.get(str(typ), 4)
            sizes.append(_numel(dims) * itemsize)
    out = _out_numel(name, args.get("Input Dims") or [], args)
    return float(sum(sizes) + (out * itemsize if out is not None else max(sizes, default=0)))


_MATMUL = {"aten::mm": (0, 1), "aten::addmm": (1, 2), "aten::bmm": (0, 1),
           "aten::baddbmm": (1, 2)}
_CONV = re.compile(r"^aten::(_?convolution|conv\dd|cudnn_convolution|mkldnn_convolution|"
                   r"_slow_conv2d_forward)$")


def _numel(dims: list) -> int:
    n = 1
    for d in dims:
        n *= int(d)
    return n


def _stride(args: dict) -> int:
    concrete = args.get("Concrete Inputs") or []
    if len(concrete) > 3 and str(concrete[3]).strip("[]"):
        try:
            return max(int(str(concrete[3]).strip("[]").split(",")[0]), 1)
        except ValueError:
            return 1
    return 1


def _out_numel(name: str, dims: list, args: dict) -> float | None:
    """Output elements of a matmul ([..., M, N]) or convolution (input / stride), else None."""
    if name in _MATMUL:
        a, b = (dims[i] if len(dims) > i else [] for i in _MATMUL[name])
        if len(a) >= 2 and len(b) >= 2:
            return _numel(a[:-1]) * b[-1]
    elif _CONV.match(name) and len(dims) >= 2 and len(dims[0]) >= 3 and len(dims[1]) >= 3:
        x, w = dims[0], dims[1]
        return x[0] * w[0] * _numel(x[2:]) / _stride(args) ** (len(x) - 2)
    return None


def _op_flops(name: str, args: dict) -> float:
    """The op's FLOPs: the profiler's count where the trace has it, else from the input shapes
    for matmuls (2*M*K*N per batch) and convolutions (2 * output elements * C/g * kh * kw,
    stride from the concrete inputs, output size input/stride); 0 for other ops."""
    if "flops" in args:
        return float(args["flops"])
    dims = args.get("Input Dims") or []
    out = _out_numel(name, dims, args)
    if out is None:
        return 0.0
    if name in _MATMUL:
        return 2.0 * out * dims[_MATMUL[name][0]][-1]
    return 2.0 * out * _numel(dims[1][1:])


def _op_dtype(args: dict) -> str | None:
    for typ in args.get("Input type") or []:
        if str(typ) in _DTYPE:
            return _DTYPE[str(typ)]
    return args.get("dtype")


def _nesting(host: list[Event]) -> tuple[list[Event], list[Event], list[Event]]:
    """(top-level stage ranges, top-level ops, work ops) of the host events, per thread. Work
    ops carry the FLOPs and bytes: each outermost op with a FLOP count (its children are
    its implementation: not counted again), and every leaf op outside such an op."""
    stages, top_ops, work = [], [], []
    by_tid: dict[Any, list[Event]] = {}
    for e in host:
        by_tid.setdefault(e.tid, []).append(e)
    for evs in by_tid.values():
        stack: list[Event] = []
        has_child: set[int] = set()
        covered: set[int] = set()   # inside an op that counts FLOPs
        counted: list[Event] = []
        for e in evs:
            while stack and stack[-1].end <= e.ts:
                stack.pop()
            parents = [p for p in stack if not STEP_NAME.match(p.name)]
            if stack:
                has_child.add(id(stack[-1]))
            if any(id(p) in covered or (p.cat == "cpu_op" and _op_flops(p.name, p.args) > 0)
                   for p in parents):
                covered.add(id(e))
            if STEP_NAME.match(e.name):
                pass
            elif not parents and e.cat == "user_annotation":
                stages.append(e)
            elif e.cat == "cpu_op" and not any(p.cat == "cpu_op" for p in parents):
                top_ops.append(e)
            if e.cat == "cpu_op" and id(e) not in covered and _op_flops(e.name, e.args) > 0:
                counted.append(e)
            stack.append(e)
        counted_ids = {id(e) for e in counted}
        work += counted + [e for e in evs if e.cat == "cpu_op" and id(e) not in has_child
                           and id(e) not in covered and id(e) not in counted_ids]
    return stages, top_ops, work


def _inside(e: Event, r: Event) -> bool:
    return r.ts <= e.ts and e.end <= r.end + 1e-6 and (r.tid is None or e.tid == r.tid)


class _ByTime:
    """Events sorted by a key time (their start, or their launch's start), for range look-ups."""

    def __init__(self, events: list[Event], key=lambda e: e.ts) -> None:
        pairs = sorted(((key(e), i, e) for i, e in enumerate(events)), key=lambda p: p[:2])
        self.keys = [p[0] for p in pairs]
        self.events = [p[2] for p in pairs]

    def between(self, t0: float, t1: float) -> list[Event]:
        return self.events[bisect_left(self.keys, t0):bisect_right(self.keys, t1)]


def analyze(events: list[Event], peaks: Peaks, thresholds: dict | None = None) -> Analysis:
    """Per-stage and whole-step statistics and classes (see the module docstring)."""
    th = {**THRESHOLDS, **(thresholds or {})}
    host = [e for e in events if e.cat in HOST_CATS]
    device_ev = [e for e in events if e.cat in DEVICE_CATS]
    copies = [e for e in events if e.cat in COPY_CATS]
    launches = {e.args.get("correlation"): e for e in events if e.cat == "cuda_runtime"
                and e.args.get("correlation") is not None}
    gpu = bool(device_ev or copies)
    stage_ranges, top_ops, work_ops = _nesting(host)

    ops_by_ext = {e.args.get("External id"): e for e in host if e.cat == "cpu_op"
                  and e.args.get("External id") is not None}

    def launched_at(d: Event) -> float:
        """Device work belongs where its launch ran (the runtime call of its correlation id,
        else the op of its External id, else its own start)."""
        h = launches.get(d.args.get("correlation")) or ops_by_ext.get(d.args.get("External id"))
        return h.ts if h is not None else d.ts

    work_idx, top_idx = _ByTime(work_ops), _ByTime(top_ops)
    dev_idx = _ByTime(device_ev + copies, launched_at)

    def collect(name: str, ranges: list[Event]) -> StageStats:
        s = StageStats(name=name, occurrences=len(ranges))
        dtypes: dict[str, float] = {}
        busy, gaps, copy_t, wall = 0.0, 0.0, 0.0, 0.0
        for r in ranges:
            s.host_us += r.dur
            ops = [o for o in work_idx.between(r.ts, r.end) if _inside(o, r)]
            for o in ops:
                s.flops += _op_flops(o.name, o.args)
                s.bytes += _op_bytes(o.name, o.args)
                dt = _op_dtype(o.args)
                if dt:
                    dtypes[dt] = dtypes.get(dt, 0.0) + o.dur
            if gpu:
                mine = dev_idx.between(r.ts, r.end)
                kern = [d for d in mine if d.cat in DEVICE_CATS]
                cp = [d for d in mine if d.cat in COPY_CATS]
                for d in kern:
                    s.flops += float(d.args.get("flops", 0.0))
                    s.bytes += float(d.args.get("bytes", 0.0))
                b = _union([(d.ts, d.end) for d in kern])
                c = _union([(d.ts, d.end) for d in cp])
                end = max([r.end] + [d.end for d in mine])
                if mine:
                    window = max(d.end for d in mine) - min(d.ts for d in mine)
                    gaps += max(0.0, window - _union([(d.ts, d.end) for d in mine]))
                busy, copy_t, wall = busy + b, copy_t + c, wall + (end - r.ts)
                s.kernels += len(kern)
            else:
                tops = [o for o in top_idx.between(r.ts, r.end) if _inside(o, r)]
                busy += _union([(o.ts, o.end) for o in tops])
                wall += r.dur
                s.kernels += len(tops)
                copy_t += sum(float(o.dur) for o in tops if TRANSPORT_NAME.search(o.name))
        s.busy_us, s.gaps_us, s.copy_us, s.wall_us = busy, gaps, copy_t, wall
        s.dtype = max(dtypes, key=dtypes.get) if dtypes else "fp32"
        _classify(s, peaks, th, gpu)
        return s

    names: dict[str, list[Event]] = {}
    for r in stage_ranges:
        names.setdefault(r.name, []).append(r)
    stages = [collect(n, rs) for n, rs in names.items()]
    # the step: each ProfilerStep range, else one range over the whole host timeline
    steps = [e for e in host if STEP_NAME.match(e.name)]
    if not steps and host:
        t0, t1 = min(e.ts for e in host), max(e.end for e in host)
        steps = [Event("step", "step", t0, t1 - t0, None)]  # every thread's work
    step = collect("step", steps) if steps else StageStats("step")
    transport_stage_us = sum(s.host_us for s in stages if TRANSPORT_NAME.search(s.name))
    if step.wall_us and transport_stage_us / step.wall_us >= th["transport_share"]:
        step.klass = "transport"
        step.reason = (f"transport-named stages take {transport_stage_us / step.wall_us:.0%} "
                       "of the step")
    return Analysis("gpu" if gpu else "cpu", peaks, stages, step)


def _classify(s: StageStats, peaks: Peaks, th: dict, gpu: bool) -> None:
    if s.busy_us > 0:
        s.flop_util = s.flops / (s.busy_us * 1e-6) / peaks.flops_for(s.dtype)
        s.bw_util = s.bytes / (s.busy_us * 1e-6) / peaks.bytes_per_s
    wall = s.wall_us or 1e-9
    small = th["small_kernel_us_gpu" if gpu else "small_kernel_us_cpu"]
    if TRANSPORT_NAME.search(s.name) or s.copy_us / wall >= th["transport_share"]:
        s.klass = "transport"
        s.reason = ("named as transport" if TRANSPORT_NAME.search(s.name)
                    else f"host<->device copies take {s.copy_us / wall:.0%} of the time")
    elif gpu and not s.kernels:
        s.klass = "launch"
        s.reason = (f"no device work: {s.host_us / 1e3:.3f} ms of host time (Python, "
                    "dispatch, host-side math) while the GPU waits")
    elif s.kernels and s.busy_share < th["busy_share"]:
        s.klass = "launch"
        s.reason = (f"the {'GPU' if gpu else 'CPU'} computes {s.busy_share:.0%} of the time "
                    f"({s.kernels} {'kernels' if gpu else 'ops'}, "
                    f"{s.gaps_us / 1e3:.2f} ms idle between them): it waits on the host")
    elif s.flops <= 0 and s.bytes <= 0:
        s.klass = "unknown"
        s.reason = "no FLOP or byte counts (profile with record_shapes=True, with_flops=True)"
    elif (s.kernels and s.mean_kernel_us < 10 * small
          and max(s.flop_util, s.bw_util) < th["low_util"]):
        s.klass = "launch"
        s.reason = (f"{s.kernels} small {'kernels' if gpu else 'ops'} (mean "
                    f"{s.mean_kernel_us:.1f} us) at {max(s.flop_util, s.bw_util):.1%} of "
                    "peak: per-launch overhead dominates")
    elif s.flop_util >= s.bw_util:
        s.klass = "compute"
        s.reason = (f"{s.flop_util:.0%} of peak {s.dtype} FLOP/s vs {s.bw_util:.0%} of peak "
                    "bandwidth")
    else:
        s.klass = "memory"
        s.reason = (f"{s.bw_util:.0%} of peak bandwidth vs {s.flop_util:.0%} of peak "
                    f"{s.dtype} FLOP/s")
    if s.klass in ("compute", "memory") and max(s.flop_util, s.bw_util) < th["low_util"]:
        s.reason += ("; far from either peak: the kernels themselves are inefficient (small "
                     "shapes, layout, dtype) or the device is shared")


def verdict_by_time(stages: list[StageStats]) -> dict[str, float]:
    """Share of the stages' wall time per class (the step's make-up)."""
    total = sum(s.wall_us for s in stages) or 1.0
    out: dict[str, float] = {}
    for s in stages:
        out[s.klass] = out.get(s.klass, 0.0) + s.wall_us / total
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))
