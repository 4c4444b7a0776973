"""Branched forward: the model's independent parts as compiled regions on their own CUDA streams.

The whole-forward region (`whole_*` variants) runs every kernel one after the other. After the
trunk (backbone + FPN), the parts of the forward are independent: the FCOS head on each FPN
level, the dense neck with the segmentation and depth heads, and the LiDAR projection (which
needs only the points, so it need not even wait for the trunk). Small levels leave most of the
GPU idle (at 6 x 640x640 a P5 conv is 2,400 output pixels, a fraction of one wave of tiles on
a large GPU), and the P3 chain is the longest. Run on separate streams inside the
one CUDA graph, the short chains fill the SMs the long one leaves idle.

A plan (`BranchPlan.branches`) is a tuple of branches, each a tuple of parts run in order on
one stream: "det0".."det2" (FCOS on P3..P5), "dense" (neck + seg + depth), "bev". The first
branch runs on the calling stream (inside a graph capture, the capture stream); the others
fork from it after the trunk and join it before the forward returns. "lidar" (the projection)
always gets a stream of its own, forked before the trunk. Each kind of part is its own
torch.compile region (static shapes, fullgraph), shared by every head set (`BranchParts`); the
outputs are the same dict as the model's forward + the runtime's LiDAR projection, in the same
order.

The streams overlap, but the big P3 kernels already fill the GPU, so the overlap mostly
stretches the kernels it pairs: the gain is small (docs/benchmarks/perception_h200.md).

Off CUDA (CPU tests, CI), the same parts run one after the other on the host: the code path is
the same, only the stream contexts are no-ops. Memory: each tensor stays referenced until the
join, and the caching allocator keeps a freed block for the stream it was allocated on, so no
block is reused while another stream still reads it (also inside a capture: the side streams
join the capture and allocate from its pool).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .model import DET_STRIDES, MultiTaskPerceptionModel, image_hw

Outputs = dict[str, "torch.Tensor | list[torch.Tensor]"]
PARTS = ("det0", "det1", "det2", "dense", "bev")
_DET = {f"det{i}": i for i in range(len(DET_STRIDES))}


@dataclass(frozen=True)
class BranchPlan:
    """Which parts run on which stream (see the module doc). priority: the first branch runs
    on a stream of the highest priority instead of the calling stream (its kernels are
    scheduled first when several streams have work ready: the first branch should be the
    critical path)."""

    branches: tuple[tuple[str, ...], ...] = (("det0",), ("det1", "det2"), ("dense",))
    priority: bool = False

    def __post_init__(self) -> None:
        seen = [p for b in self.branches for p in b]
        bad = [p for p in seen if p not in PARTS]
        if not self.branches or not all(self.branches) or bad or len(seen) != len(set(seen)):
            raise ValueError(f"parameter 'branches' = {self.branches!r}: a non-empty tuple of "
                             f"non-empty tuples of distinct parts from {PARTS}")

    def for_heads(self, heads: frozenset[str], bev: bool) -> tuple[tuple[str, ...], ...]:
        """The plan restricted to the parts a head set runs (empty branches dropped), plus
        every needed part the plan does not name, appended to the first branch."""
        need = set()
        if "detection" in heads:
            need |= set(_DET)
        if heads & {"segmentation", "depth"}:
            need.add("dense")
        if bev:
            need.add("bev")
        out = [tuple(p for p in b if p in need) for b in self.branches]
        named = {p for b in out for p in b}
        missing = tuple(p for p in PARTS if p in need and p not in named)
        out[0] = out[0] + missing
        return tuple(b for b in out if b)


def own_code(fn: Callable) -> Callable:
    """`fn` (a plain function, closures included) with a code object of its own. Dynamo keeps
    its compiled entries per code object, and a function defined inside another shares one
    code object with every other instance of it: each runtime built in one process (other
    shapes, other models) added its entries to the same list, and the fourth runtime of the
    branched variant hit the recompile limit (8). A copy of the code starts an empty list."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__,
                              fn.__defaults__, fn.__closure__)


class BranchParts:
    """The compiled parts, shared by the `BranchedForward` of every head set.

    One function (so one Dynamo code object) per kind of part: its guards on the int / tuple
    arguments tell the levels and head sets apart, at most 3 entries each (Dynamo's recompile
    limit is 8 per code object; one generic wrapper for every part and head set hit it with
    the node's 7 head sets). compile_fn wraps each function (torch.compile with the variant's
    options, or the identity); autocast: the variant's autocast context factory (geometry
    runs outside it); lidar_fn(points, T, K) -> the LiDAR outputs dict."""

    def __init__(self, model: MultiTaskPerceptionModel,
                 compile_fn: Callable[[Callable], Callable],
                 autocast: Callable[[], contextlib.AbstractContextManager],
                 lidar_fn: Callable[..., Outputs]) -> None:
        self.has_bev = model.bev is not None

        def trunk(images: torch.Tensor) -> dict[str, torch.Tensor]:
            with autocast():
                return model.trunk(images)

        def det(p: torch.Tensor, level: int) -> dict[str, list[torch.Tensor]]:
            with autocast():
                return model.detection({f"p{3 + level}": p}, (level,))

        def dense(pyramid: dict[str, torch.Tensor], heads: tuple[str, ...],
                  hw: tuple[int, int]) -> dict[str, torch.Tensor]:
            with autocast():
                return model.dense(pyramid, frozenset(heads), hw)

        def bev(points: torch.Tensor, p5: torch.Tensor, T: torch.Tensor | None,
                K: torch.Tensor | None, hw: tuple[int, int]) -> dict[str, torch.Tensor]:
            cams = None if T is None or K is None else (T, K)
            with autocast():
                return {"bev_occ": model.bev_occupancy(points, p5, cams, hw)}

        def lidar(points: torch.Tensor, T: torch.Tensor, K: torch.Tensor) -> Outputs:
            return lidar_fn(points, T, K)  # (inlined by Dynamo: the entries sit on `lidar`)

        self.trunk, self.det, self.dense, self.bev, self.lidar = (
            compile_fn(own_code(f)) for f in (trunk, det, dense, bev, lidar))


class BranchedForward:
    """(images, points, T, K) -> Outputs of one head set, the parts on their streams."""

    def __init__(self, parts: BranchParts, heads: frozenset[str], plan: BranchPlan,
                 device: torch.device) -> None:
        self.heads = heads
        self._dense_heads = tuple(sorted(heads & {"segmentation", "depth"}))
        self.branches = plan.for_heads(heads, parts.has_bev)
        self._p = parts
        self._cuda = device.type == "cuda"
        self._streams: list[torch.cuda.Stream | None] = [None] * (len(self.branches) + 1)
        if self._cuda:
            lo, hi = torch.cuda.Stream.priority_range()
            first = torch.cuda.Stream(device, priority=hi) if plan.priority else None
            self._streams = [first] + [torch.cuda.Stream(device, priority=lo)
                                       for _ in range(len(self.branches))]

    def _run_part(self, part: str, pyramid: dict[str, torch.Tensor], hw: tuple[int, int],
                  points: torch.Tensor | None, T: torch.Tensor | None,
                  K: torch.Tensor | None) -> Outputs:
        if part in _DET:
            level = _DET[part]
            return self._p.det(pyramid[f"p{3 + level}"], level)
        if part == "dense":
            return self._p.dense(pyramid, self._dense_heads, hw)
        if points is None:  # bev without LiDAR points: the model's forward skips it too
            return {}
        return self._p.bev(points, pyramid["p5"], T, K, hw)

    def __call__(self, images: torch.Tensor, points: torch.Tensor | None,
                 T: torch.Tensor | None, K: torch.Tensor | None) -> Outputs:
        cur = torch.cuda.current_stream() if self._cuda else None
        forked: list[torch.cuda.Stream] = []  # every stream forked here is joined below

        def fork(i: int) -> contextlib.AbstractContextManager:
            s = self._streams[i]
            if s is None:
                return contextlib.nullcontext()
            s.wait_stream(cur)
            forked.append(s)
            return torch.cuda.stream(s)

        lidar: Outputs = {}
        if points is not None:  # needs only the points: forked before the trunk
            with fork(len(self._streams) - 1):
                lidar = self._p.lidar(points, T, K)
        pyramid = self._p.trunk(images)
        hw = image_hw(images)
        results: dict[str, Outputs] = {}
        # side branches first, so their kernels are queued while the first branch runs
        for i in list(range(1, len(self.branches))) + [0]:
            with fork(i):
                for part in self.branches[i]:
                    results[part] = self._run_part(part, pyramid, hw, points, T, K)
        for s in forked:
            cur.wait_stream(s)
        return merge_outputs(results, lidar)


def merge_outputs(results: dict[str, Outputs], lidar: Outputs) -> Outputs:
    """The parts' dicts ({part name: its outputs}) in the layout of the model's forward: the
    detection lists in level order (P3 first), seg / depth / bev_occ, then the LiDAR
    outputs."""
    out: Outputs = {}
    det = [results[p] for p in _DET if p in results]  # _DET is in level order
    if det:
        for key in ("det_cls", "det_ltrb", "det_ctr"):
            out[key] = [t for d in det for t in d[key]]
    for part in PARTS:
        if part in results and part not in _DET:
            out.update(results[part])
    out.update(lidar)
    return out
