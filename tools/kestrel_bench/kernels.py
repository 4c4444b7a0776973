"""`kestrel_bench kernels`: GPU kernel micro-benchmarks of the kernels Kestrel ships (CUDA and
Triton; on a machine without them every row is recorded as skipped).

  box_median  LiDAR box medians (perception box_median_triton.lidar_box_medians) at the node's
              sizes (6 cameras, a 131072-point bucket, 20 and 100 box slots per camera): modes
              prebin (the default: points binned into the boxes first), compact, scan; each
              mode's medians checked equal to the first's
  nms         dense class-wise NMS (perception nms_triton.nms_dense), 6 x 1000 candidates: the
              round kernel's default tiling against the original 64x128; keep masks equal
  decode      the planner's Triton decode kernels (planner triton_decode) against what the
              compiled step runs (torch.compile): attention over the KV cache, the MLP's SiLU
              down projection, RMSNorm + w13, the whole MLP block; each timed as a CUDA graph of
              24 calls on distinct per-layer data (no weight served from L2)
Every row: device time per call from CUDA events around CUDA-graph replays (no power figure:
the timed windows are shorter than NVML's update period). Roles: the
original / reference path = baseline, the shipped default = optimized. ratios:
<group>_optimized_vs_baseline_p50[_<case>].
Left out: one-off studies whose outcome is recorded in docs/benchmarks and that test no
shipped kernel (FP8/INT8 convs, inductor vs cuDNN conv epilogues, torch vs Triton fusion of
the box medians), and the decode kernels' launch-configuration sweeps.

  python -m kestrel_bench kernels
  python -m kestrel_bench kernels --groups nms box_median --iters 200
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from kestrel_bench import record as rec_mod
from kestrel_bench import stats
from kestrel_bench.repo import ensure_paths

GROUPS = ("box_median", "nms", "decode")
BOX_MODES = {"scan": {"prebin": False, "compact": False},
             "compact": {"prebin": False, "compact": True}, "prebin": {"prebin": True}}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--groups", nargs="+", choices=GROUPS, default=list(GROUPS))
    ap.add_argument("--iters", type=int, default=500)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--planner-config", default="0.5b", choices=["tiny", "0.5b"])
    ap.add_argument("--cdt", action="store_true",
                    help="inductor coordinate-descent tuning for the compiled references")
    rec_mod.add_common_arguments(ap)


def _graph_row(record: rec_mod.Record, name: str, role: str, fn: Callable, iters: int,
               warmup: int, per_call: int = 1, **cfg: object) -> tuple[dict | None, object]:
    from kestrel_bench.timing import cuda_graph_ms

    try:
        ms, out, _ = cuda_graph_ms(fn, iters, warmup)
    except Exception as exc:  # noqa: BLE001 (recorded as a row)
        record.add(name, role, config=cfg, error=f"{type(exc).__name__}: {exc}"[:300])
        return None, None
    s = stats.summary(ms / per_call)
    record.add(name, role, config=cfg, latency_ms=s)
    print(f"  {name:44s} p50 {s['p50'] * 1e3:8.1f} us", flush=True)
    return s, out


def box_median(record: rec_mod.Record, args: argparse.Namespace) -> None:
    import torch
    from kestrel_models.perception import box_median_triton as bmt

    c, n, (h, w) = 6, 131072, (640, 640)
    for d in (20, 100):
        g = torch.Generator().manual_seed(d)
        uv = torch.rand(c, n, 2, generator=g) * torch.tensor([w, h]) - 0.5
        z = 0.5 + 49.5 * torch.rand(c, n, generator=g)
        ok = torch.rand(c, n, generator=g) < 0.3  # ~ a 360 deg LiDAR's share in one camera
        xy = torch.rand(c, d, 2, generator=g) * torch.tensor([w - 20, h - 20])
        boxes = torch.cat([xy, xy + 20 + 180 * torch.rand(c, d, 2, generator=g)], 2)
        z, uv, ok, boxes = (t.cuda() for t in (z, uv, ok, boxes))
        first, lat = None, {}
        for mode, kw in BOX_MODES.items():
            role = {"scan": "baseline", "prebin": "optimized"}.get(mode, "variant")
            s, out = _graph_row(record, f"box_median:{mode}@{d}", role,
                                lambda kw=kw, t=(z, uv, ok, boxes): bmt.lidar_box_medians(*t, **kw),
                                args.iters, args.warmup, mode=mode, boxes_per_camera=d,
                                cameras=c, points=n)
            if s is None:
                continue
            lat[mode] = s["p50"]
            med, cnt = out[0].clone(), out[1].clone()
            first = first or (med, cnt)
            same = bool(torch.equal(cnt, first[1]) and torch.equal(
                torch.where(cnt > 0, med, 0), torch.where(first[1] > 0, first[0], 0)))
            record["results"][-1]["metrics"] = {"equal_to_first": same}
        record.ratio(f"box_median_optimized_vs_baseline_p50_{d}",
                     stats.ratio(lat.get("scan"), lat.get("prebin")))


def nms(record: rec_mod.Record, args: argparse.Namespace) -> None:
    import torch
    from kestrel_models.perception import nms_triton as nt

    g = torch.Generator().manual_seed(0)
    c, n = 6, 1000
    xy = torch.rand(c, n, 2, generator=g) * 600
    boxes = torch.cat([xy, xy + 10 + 190 * torch.rand(c, n, 2, generator=g)], 2)
    cls = torch.randint(0, 6, (c, n), generator=g).float()
    boxes = (boxes + (cls * 1000.0)[..., None]).cuda()  # classes never overlap
    valid = (torch.rand(c, n, generator=g) < 0.9).cuda()
    default = (nt.RI, nt.RJ)
    lat, first = {}, None
    try:
        for role, (ri, rj) in (("baseline", (64, 128)), ("optimized", default)):
            nt.RI, nt.RJ = ri, rj
            s, out = _graph_row(record, f"nms:{ri}x{rj}", role,
                                lambda: nt.nms_dense(boxes, valid, 0.6, 8), args.iters,
                                args.warmup, tiling=f"{ri}x{rj}", images=c, candidates=n)
            if s is None:
                continue
            lat[role] = s["p50"]
            keep = out[0].clone()
            first = keep if first is None else first
            record["results"][-1]["metrics"] = {"equal_to_first": bool(torch.equal(keep, first)),
                                                "kept": int(keep.sum())}
    finally:
        nt.RI, nt.RJ = default
    record.ratio("nms_optimized_vs_baseline_p50",
                 stats.ratio(lat.get("baseline"), lat.get("optimized")))


def decode(record: rec_mod.Record, args: argparse.Namespace) -> None:
    import torch
    import torch._inductor.config as ic
    import torch.nn.functional as F
    from kestrel_models.planner import get_config
    from kestrel_models.planner import triton_decode as td
    from kestrel_models.planner import triton_mlp as tm
    from kestrel_models.planner.kvmodel import _attn_grouped

    ic.coordinate_descent_tuning = args.cdt
    cfg, dev, dt = get_config(args.planner_config), torch.device("cuda"), torch.bfloat16
    layers = 24

    def stacked(fn: Callable, inputs: list[tuple]) -> Callable:
        return lambda: [fn(*a) for a in inputs]

    def pair(group: str, ref: tuple[str, Callable], opts: list[tuple[str, Callable]],
             inputs: list[tuple], **cfg_row: object) -> None:
        base, _ = _graph_row(record, f"decode:{ref[0]}", "baseline", stacked(ref[1], inputs),
                             args.iters // 10 or 1, 5, layers, group=group, **cfg_row)
        for i, (name, fn) in enumerate(opts):
            s, _ = _graph_row(record, f"decode:{name}", "optimized" if i == 0 else "variant",
                              stacked(fn, inputs), args.iters // 10 or 1, 5, layers,
                              group=group, **cfg_row)
            if i == 0 and base and s:
                record.ratio(f"decode_{group}_optimized_vs_baseline_p50",
                             stats.ratio(base["p50"], s["p50"]))

    h, hkv, hd, L = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, 1024
    pos = torch.full((1,), L - 112, dtype=torch.long, device=dev)
    mask = torch.where(torch.arange(L, device=dev)[None, None] <= pos[:, None, None], 0.0,
                       float("-inf"))
    kv = [(torch.randn(1, 1, h, hd, device=dev, dtype=dt),
           torch.randn(1, hkv, L, hd, device=dev, dtype=dt),
           torch.randn(1, hkv, L, hd, device=dev, dtype=dt)) for _ in range(layers)]
    grouped = torch.compile(_attn_grouped, dynamic=False)
    pair("attention", ("attention_compiled@L1024", lambda q, k, v: grouped(q, k, v, mask)),
         [("attention_triton@L1024", lambda q, k, v: td.decode_attention(q[:, 0], k, v, pos, 0))],
         kv, cache_len=L)
    d, f = cfg.dim, cfg.ffn_hidden
    w13 = [torch.randn(2 * f, d, device=dev, dtype=dt) / d ** 0.5 for _ in range(layers)]
    w2 = [torch.randn(d, f, device=dev, dtype=dt) / f ** 0.5 for _ in range(layers)]
    nw = torch.ones(d, device=dev, dtype=dt)
    x = torch.randn(1, 1, d, device=dev, dtype=dt)
    x13 = torch.randn(1, 2 * f, device=dev, dtype=dt)

    def down_ref(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        g_, u = a.chunk(2, dim=-1)
        return F.linear(F.silu(g_) * u, w)

    def w13_ref(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.linear(F.rms_norm(a, (d,), nw, 1e-6), w)

    def block_ref(a: torch.Tensor, w_13: torch.Tensor, w_2: torch.Tensor) -> torch.Tensor:
        g_, u = F.linear(F.rms_norm(a, (d,), nw, 1e-6), w_13).chunk(2, dim=-1)
        return a + F.linear(F.silu(g_) * u, w_2)

    n_split = tm.GEMV_CFG["down"][2]
    pair("w_down", ("w_down_silu_compiled", torch.compile(down_ref, dynamic=False)),
         [("w_down_silu_triton", lambda a, w: tm.silu_gemv(a, w, n_split, True)),
          ("w_down_silu_cublas", down_ref)], [(x13, w) for w in w2])
    pair("w13", ("rms_w13_compiled", torch.compile(w13_ref, dynamic=False)),
         [("rms_w13_silu_triton", lambda a, w: tm.rms_w13_silu(a, nw, 1e-6, w))],
         [(x[:, 0], w) for w in w13])
    pair("mlp_block", ("mlp_block_compiled", torch.compile(block_ref, dynamic=False)),
         [("mlp_block_triton_down_compiled", torch.compile(
             lambda a, b, c: tm.mlp_triton(a, nw, 1e-6, b, c, False), dynamic=False)),
          ("mlp_block_triton_fused_w13_compiled", torch.compile(
              lambda a, b, c: tm.mlp_triton(a, nw, 1e-6, b, c, True), dynamic=False))],
         [(x, a, c) for a, c in zip(w13, w2, strict=True)])


def run(args: argparse.Namespace) -> int:
    ensure_paths("kestrel_models")
    import torch

    config = {"groups": args.groups, "iters": args.iters, "warmup": args.warmup,
              "planner_config": args.planner_config, "cdt": args.cdt}
    record = rec_mod.Record("kernels", config, getattr(args, "argv", None), args.commit)
    for group in args.groups:
        print(f"kernels: {group}", flush=True)
        if not torch.cuda.is_available():
            record.add(group, "variant", skipped="needs a CUDA GPU")
            continue
        try:
            import triton  # noqa: F401
        except ImportError:
            record.add(group, "variant", skipped="needs triton")
            continue
        {"box_median": box_median, "nms": nms, "decode": decode}[group](record, args)
    rec_mod.finish(record, args)
    return 0
