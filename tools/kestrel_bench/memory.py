"""Peak memory of a measured path: CUDA's allocator peak on a GPU, the process's peak resident
set size (RSS) on the CPU. The RSS peak is the process's since its start (Linux keeps no
resettable peak), so on the CPU compare rows only in the order they ran."""

from __future__ import annotations

import resource
import sys


def reset_peak(cuda: bool) -> None:
    """Start a new peak window (CUDA only; the RSS peak cannot be reset)."""
    if cuda:
        import gc

        import torch

        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_mb(cuda: bool) -> float:
    """MiB: torch.cuda.max_memory_allocated() since reset_peak on a GPU, else the process's
    peak RSS."""
    if cuda:
        import torch

        return torch.cuda.max_memory_allocated() / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**20 if sys.platform == "darwin" else 2**10)


def memory_kind(cuda: bool) -> str:
    return "cuda_max_allocated" if cuda else "process_peak_rss"
