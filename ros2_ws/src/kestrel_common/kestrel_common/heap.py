"""Python heap after configure: collect once, then freeze (no rclpy).

A node's configure builds models, compiled graphs (torch.compile / inductor leave hundreds of
thousands of Python objects behind) and buffers. Left in the collector's view, every later full
collection walks all of them: measured here after one torch.compile of the tiny perception
model, 631k objects and a 240-420 ms `gc.collect()` on the dev CPU; with gc.freeze() the same
collection takes < 0.1 ms. Such pauses stop every thread of the node (executor included):
inputs queue up, camera sets fall out of sync, results arrive in bursts. So each node collects
once and freezes the heap after a successful configure (base_node, parameter `gc_freeze`),
and thaws it before cleanup and shutdown.
"""

from __future__ import annotations

import gc
import time


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
