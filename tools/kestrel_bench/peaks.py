"""Device peaks for the bottleneck identifier: FLOP/s per dtype and memory bytes/s.

GPUs: the vendor's datasheet figures for dense math (no sparsity) per machine class
(`record.gpu_class`), or a probe (`probe("cuda")`: a large matmul and a device copy) when the
class is unknown or `--peaks probe` asks. CPUs have no table: the probe (`probe("cpu")`: a
matmul and a copy, ~0.5 s) measures what this machine reaches with torch's threads, which is
the ceiling the profiled code could reach too. `--peaks flops=...,bw=...` overrides both.
"""

from __future__ import annotations

import time

from kestrel_bench.bottleneck import Peaks

T = 1e12
# class -> (FLOP/s per dtype, bytes/s of HBM/GDDR): datasheet values, dense.
DATASHEET: dict[str, tuple[dict[str, float], float]] = {
    "h200": ({"fp32": 67 * T, "tf32": 495 * T, "bf16": 989 * T, "fp16": 989 * T,
              "fp8": 1979 * T, "int8": 1979 * T}, 4.8 * T),
    "h100": ({"fp32": 67 * T, "tf32": 495 * T, "bf16": 989 * T, "fp16": 989 * T,
              "fp8": 1979 * T, "int8": 1979 * T}, 3.35 * T),
    "a100": ({"fp32": 19.5 * T, "tf32": 156 * T, "bf16": 312 * T, "fp16": 312 * T,
              "int8": 624 * T}, 2.0 * T),
    "l4": ({"fp32": 30.3 * T, "tf32": 60 * T, "bf16": 121 * T, "fp16": 121 * T,
            "fp8": 242 * T, "int8": 242 * T}, 0.3 * T),
    "rtx4090": ({"fp32": 82.6 * T, "tf32": 82.6 * T, "bf16": 165 * T, "fp16": 165 * T,
                 "fp8": 330 * T, "int8": 330 * T}, 1.0 * T),
}


def from_table(machine_class: str) -> Peaks | None:
    entry = DATASHEET.get(machine_class)
    if entry is None:
        return None
    flops, bw = entry
    return Peaks(machine_class, dict(flops), bw, "datasheet")


def parse(text: str, device: str = "custom") -> Peaks:
    """'flops=2e12,bw=5e10[,bf16=4e12,...]' -> Peaks (flops = the default for every dtype)."""
    flops: dict[str, float] = {}
    bw = 0.0
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, _, value = part.partition("=")
        if not value:
            raise ValueError(f"--peaks: {part!r} is not key=value")
        if key == "bw":
            bw = float(value)
        else:
            flops["default" if key == "flops" else key] = float(value)
    if bw <= 0 or not flops:
        raise ValueError(f"--peaks {text!r}: needs flops=<FLOP/s> and bw=<bytes/s>")
    return Peaks(device, flops, bw, "option")


def probe(device: str = "cpu", seconds: float = 0.5) -> Peaks:
    """Measure a matmul's FLOP/s (fp32; bf16 too on CUDA) and a copy's bytes/s on `device`
    (the best of a few repetitions)."""
    import torch

    cuda = device.startswith("cuda")
    n = 4096 if cuda else 512
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def best_rate(fn, work: float) -> float:
        fn()
        sync()
        best, t_end = 0.0, time.perf_counter() + seconds
        while time.perf_counter() < t_end:
            t0 = time.perf_counter()
            fn()
            sync()
            best = max(best, work / max(time.perf_counter() - t0, 1e-9))
        return best

    flops: dict[str, float] = {}
    dtypes = [("fp32", torch.float32)] + ([("bf16", torch.bfloat16)] if cuda else [])
    for name, dt in dtypes:
        a = torch.randn(n, n, device=device, dtype=dt)
        b = torch.randn(n, n, device=device, dtype=dt)
        out = torch.empty(n, n, device=device, dtype=dt)
        flops[name] = best_rate(lambda a=a, b=b, out=out: torch.mm(a, b, out=out),
                                2.0 * n ** 3)
    flops["default"] = max(flops.values())
    numel = (256 if cuda else 16) * 2 ** 20 // 4
    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    bw = best_rate(lambda: dst.copy_(src), 2.0 * numel * 4)  # read + write
    return Peaks(device, flops, bw, f"probe on {device}")


def resolve(option: str, machine_class: str, device: str) -> Peaks:
    """--peaks value -> Peaks: 'auto' (datasheet for a known GPU class, else a probe of
    `device`), 'probe', or explicit 'flops=...,bw=...'."""
    if option == "probe":
        return probe(device)
    if option not in ("", "auto"):
        return parse(option, machine_class)
    if device.startswith("cuda"):
        table = from_table(machine_class)
        if table is not None:
            return table
        try:
            import torch
            have_cuda = torch.cuda.is_available()
        except ImportError:
            have_cuda = False
        if not have_cuda:
            raise ValueError(f"no peaks for a GPU of class {machine_class!r} and no GPU here to "
                             f"probe: pass --machine-class ({', '.join(DATASHEET)}) or "
                             "--peaks flops=<FLOP/s>,bw=<bytes/s>")
    return probe(device)
