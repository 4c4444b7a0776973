#!/usr/bin/env python3
"""Decode-kernel microbenchmark (CUDA): the Triton decode kernels of
models/kestrel_models/planner/triton_decode.py vs the compiled step's kernels, and launch-config
sweeps, each timed as a CUDA graph of 24 calls (distinct per-layer data). Moved out of
bench_planner.py (was its --kernels mode; call 3a of docs/benchmarks/planner_h200.md).

  python scripts/bench_planner_kernels.py --config 0.5b --cdt --out $OUT/kernels
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "models"))

import bench_common  # noqa: E402 (scripts/ is on sys.path: this file's folder)
from kestrel_models.planner import get_config  # noqa: E402


def kernel_microbench() -> dict:
    """us per call of each decode kernel variant, median of 20 replays of a CUDA graph of 24
    calls, call i on layer i's own weights/cache (so no weight is served from L2: 24 x w13 =
    418 MB). Reference = what the compiled step runs (torch.compile, --cdt as the engine)."""
    import torch._inductor.config as ic

    from kestrel_models.planner import triton_decode as td
    ic.coordinate_descent_tuning = args.cdt
    out: dict = {"triton": td.triton.__version__ if td.HAVE_TRITON else None, "rows": []}

    def timed(name: str, fn, layers: list[tuple], **info: object) -> None:  # noqa: ANN001
        """fn(*layers[i]) for i in 0..23 captured in one CUDA graph."""
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    fn(*layers[0])
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for la in layers:
                    fn(*la)
            ts = []
            for _ in range(21):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                g.replay()
                e1.record()
                e1.synchronize()
                ts.append(e0.elapsed_time(e1) * 1e3 / len(layers))
            row = dict(name=name, us=round(statistics.median(ts[1:]), 2), **info)
        except Exception as exc:  # noqa: BLE001 - recorded
            traceback.print_exc()
            row = dict(name=name, error=f"{type(exc).__name__}: {exc}"[:300], **info)
        print(f"[kernels] {row}", flush=True)
        out["rows"].append(row)

    torch.manual_seed(0)
    _attn_rows(timed, td)
    _mlp_rows(timed, td)
    return out


def _attn_rows(timed, td) -> None:  # noqa: ANN001
    from kestrel_models.planner.kvmodel import _attn_grouped
    cfg, dev, dt = get_config(args.config), torch.device("cuda"), torch.bfloat16
    h, hkv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    grouped = torch.compile(_attn_grouped, dynamic=False)
    for b in (1, 4):
        for L in (512, 1024):
            pos = torch.full((b,), L - 112, dtype=torch.long, device=dev)
            mask = torch.where(torch.arange(L, device=dev)[None, None] <= pos[:, None, None],
                               0.0, float("-inf"))
            layers = [(torch.randn(b, 1, h, hd, device=dev, dtype=dt),
                       torch.randn(b, hkv, L, hd, device=dev, dtype=dt),
                       torch.randn(b, hkv, L, hd, device=dev, dtype=dt)) for _ in range(24)]
            timed("attn_grouped_compiled", grouped, [(*la, mask) for la in layers], B=b, L=L)
            for chunk, blk in ((0, 32), (0, 64), (0, 128), (32, 32), (64, 64), (128, 64)):
                td.ATTN_BLOCK_L = blk
                timed("attn_triton", td.decode_attention,
                      [(q[:, 0], k, v, pos, chunk) for q, k, v in layers], B=b, L=L,
                      chunk=chunk, block_l=blk)
    td.ATTN_BLOCK_L = 128


def _mlp_rows(timed, td) -> None:  # noqa: ANN001
    import torch.nn.functional as F
    cfg, dev, dt = get_config(args.config), torch.device("cuda"), torch.bfloat16
    d, f = cfg.dim, cfg.ffn_hidden
    w13 = [torch.randn(2 * f, d, device=dev, dtype=dt) / d ** 0.5 for _ in range(24)]
    w2 = [torch.randn(d, f, device=dev, dtype=dt) / f ** 0.5 for _ in range(24)]
    nw = torch.ones(d, device=dev, dtype=dt)

    def down_ref(x13: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        g, u = x13.chunk(2, dim=-1)
        return F.linear(F.silu(g) * u, w)

    def w13_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.linear(F.rms_norm(x, (d,), nw, 1e-6), w)

    def block_ref(x: torch.Tensor, w_13: torch.Tensor, w_2: torch.Tensor) -> torch.Tensor:
        g, u = F.linear(F.rms_norm(x, (d,), nw, 1e-6), w_13).chunk(2, dim=-1)
        return x + F.linear(F.silu(g) * u, w_2)

    def block_down(x: torch.Tensor, w_13: torch.Tensor, w_2: torch.Tensor) -> torch.Tensor:
        return td.mlp_triton(x, nw, 1e-6, w_13, w_2, False)

    def block_fused(x: torch.Tensor, w_13: torch.Tensor, w_2: torch.Tensor) -> torch.Tensor:
        return td.mlp_triton(x, nw, 1e-6, w_13, w_2, True)

    dref, wref = torch.compile(down_ref, dynamic=False), torch.compile(w13_ref, dynamic=False)
    for b in (1, 4):
        x = torch.randn(b, 1, d, device=dev, dtype=dt)
        x13 = torch.randn(b, 2 * f, device=dev, dtype=dt)
        timed("w_down_silu_compiled", dref, [(x13, w) for w in w2], B=b)
        timed("w_down_silu_cublas", down_ref, [(x13, w) for w in w2], B=b)
        for cfg_d in ((32, 128, 8), (16, 128, 8), (16, 256, 16), (32, 256, 4), (64, 128, 16),
                      (8, 256, 16), (16, 128, 32), (32, 128, 16)):
            td.GEMV_CFG["down"] = cfg_d
            timed("w_down_silu_triton", td.silu_gemv, [(x13, w, cfg_d[2], True) for w in w2],
                  B=b, cfg=cfg_d)
        td.GEMV_CFG["down"] = (32, 128, 16)
        timed("rms_w13_compiled", wref, [(x[:, 0], w) for w in w13], B=b)
        for cfg_w in ((16, 128), (8, 128), (32, 128), (16, 256), (8, 256), (4, 256)):
            td.GEMV_CFG["w13"] = cfg_w
            timed("rms_w13_silu_triton", td.rms_w13_silu, [(x[:, 0], nw, 1e-6, w) for w in w13],
                  B=b, cfg=cfg_w)
        td.GEMV_CFG["w13"] = (8, 128)
        if b == 1:  # the whole MLP block with residual, compiled (sum + residual fused)
            for name, fn in (("mlp_block_compiled", block_ref),
                             ("mlp_block_triton_down_compiled", block_down),
                             ("mlp_block_triton_fused_w13_compiled", block_fused)):
                timed(name, torch.compile(fn, dynamic=False),
                      [(x, a, c) for a, c in zip(w13, w2, strict=True)], B=b)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--config", default="0.5b", choices=["tiny", "0.5b"])
    ap.add_argument("--cdt", action="store_true", help="inductor coordinate-descent tuning")
    ap.add_argument("--git-commit", default="")
    ap.add_argument("--out", default="kernels")
    args = ap.parse_args()
    kres = dict(command=" ".join(sys.argv), git_commit=bench_common.git_commit(args.git_commit),
                machine=bench_common.machine_info(torch.cuda.get_device_name()),
                kernels=kernel_microbench())
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).with_suffix(".json").write_text(json.dumps(kres, indent=1))
