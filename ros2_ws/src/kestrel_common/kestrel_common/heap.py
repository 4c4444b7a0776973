"""Python heap after configure: collect once, then freeze (no rclpy).

A node's configure builds models, compiled graphs (torch.compile / inductor leave hundreds of
thousands of Python objects behind) and buffers. Left in the collector's view, every later full
collection walks all of them, which after a torch.compile takes hundreds of milliseconds,
while a frozen heap's collection costs next to nothing. Such pauses stop every thread of the
node (executor included):
inputs queue up, camera sets fall out of sync, results arrive in bursts. So each node collects
once and freezes the heap after a successful configure (base_node, parameter `gc_freeze`),
and thaws it before cleanup and shutdown.

Native heap (`tune_malloc`): every large ROS message a process receives is put in fresh buffers
(the DDS reader's sample, rmw's take, the Python bytes / arrays), freed after the callback. With
glibc's defaults a buffer over the mmap threshold is mmap()ed and munmap()ed again, and freed
memory at the heap top is trimmed, so each message's pages are faulted in anew. Only both
settings together help, and only in the SUBSCRIBING process (docs/benchmarks/transport_h200.md).
So every Kestrel process
(run_node, the perception receivers) keeps allocations up to 32 MiB on the heap and trims only
above 256 MiB, as the ROS 2 real-time guides advise (there: mmap off and trimming off entirely;
these bounds keep a process from holding gigabytes of freed memory after a large CPU-tensor
burst).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import time

# glibc mallopt() parameters (malloc.h) and the values Kestrel uses
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 << 20  # bytes: glibc's maximum (HEAP_MAX_SIZE / 2 on 64-bit)
TRIM_THRESHOLD = 256 << 20  # bytes of free heap top kept before it is returned to the OS
MALLOC_ENV = "KESTREL_MALLOC"  # "default": leave glibc's settings (for A/B measurements)


def freeze_heap() -> tuple[int, float]:
    """gc.collect(), then gc.freeze(). Returns (objects now frozen, ms the collection took)."""
    t0 = time.perf_counter()
    gc.collect()
    ms = (time.perf_counter() - t0) * 1e3
    gc.freeze()
    return gc.get_freeze_count(), ms


def thaw_heap() -> None:
    """gc.unfreeze(): before cleanup / shutdown, so what they release (models, graphs, DDS
    entities in reference cycles) is collected and finalised again."""
    gc.unfreeze()


def tune_malloc(mmap_threshold: int = MMAP_THRESHOLD,
                trim_threshold: int = TRIM_THRESHOLD) -> str:
    """mallopt() the process's glibc heap (module docstring): allocations up to
    `mmap_threshold` bytes from the heap, freed memory kept up to `trim_threshold`. Call once at
    process start, before the first large message. Returns what was done, for the log: applied,
    skipped (KESTREL_MALLOC=default), or not available (not glibc)."""
    if os.environ.get(MALLOC_ENV, "").strip().lower() == "default":
        return f"malloc: glibc defaults ({MALLOC_ENV}=default)"
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return f"malloc: not tuned (no glibc mallopt in {name!r})"
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    refused = [setting for setting, param, value in (
        ("mmap_threshold", _M_MMAP_THRESHOLD, mmap_threshold),
        ("trim_threshold", _M_TRIM_THRESHOLD, trim_threshold)) if mallopt(param, value) != 1]
    if refused:
        return f"malloc: mallopt refused {refused} (the others were set)"
    return (f"malloc: mmap_threshold {mmap_threshold >> 20} MiB, trim_threshold "
            f"{trim_threshold >> 20} MiB (large messages reuse heap pages; {MALLOC_ENV}="
            "default turns this off)")
