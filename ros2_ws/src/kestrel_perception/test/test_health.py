"""The perception node's /diagnostics status (core/health.py, no ROS): values, receivers'
drops and lost messages added to the node's own, and the level (receiver gone -> error, p99
over budget -> warn)."""

from __future__ import annotations

import math
from types import SimpleNamespace

from kestrel_perception.core.health import perception_status


def _parts(p99_total: float, gone: list[str] | None = None):
    core = SimpleNamespace(region=SimpleNamespace(graphs=SimpleNamespace(
        entries={"a": 1, "b": 2}, failed={})), staging=SimpleNamespace(
        prestaged_used=7, prestaged_direct=5))
    receivers = SimpleNamespace(counters=lambda: {"dropped_bad_image": 2, "rx_received": 9},
                                exited=lambda: list(gone or []), lost=lambda: [4, 0, 6])
    counters = SimpleNamespace(get=lambda name: {"dropped_bad_image": 1,
                                                 "lost_camera_1": 2}.get(name, 0))
    summary = {"total": {"p50": 0.05, "p99": p99_total}, "model": {"p50": 0.01, "p99": 0.02}}
    return core, SimpleNamespace(cdr=True), receivers, counters, summary


def test_values_and_levels() -> None:
    level, msg, v = perception_status(*_parts(0.09), target_fps=10.0)
    assert (level, msg) == ("ok", "ok")
    assert v["region_graphs"] == 2 and v["region_graphs_failed"] == 0
    assert v["prestaged_inputs"] == 7 and v["prestaged_direct"] == 5 and v["result_cdr"] == 1.0
    assert v["dropped_bad_image"] == 3  # receivers' 2 + the node's own 1
    assert v["rx_received"] == 9 and v["latency_model_p99_s"] == 0.02
    # per sensor: never taken by its receiver process + lost in the ring (the node's count)
    assert (v["lost_camera_0"], v["lost_camera_1"], v["lost_lidar"]) == (4, 2, 6)
    level, msg, _ = perception_status(*_parts(0.2), target_fps=10.0)
    assert level == "warn" and "p99 latency 0.200 s > 1/target_fps 0.100 s" in msg
    level, msg, _ = perception_status(*_parts(0.2, ["/cam0"]), target_fps=10.0)
    assert level == "error" and "'/cam0'" in msg
    level, _, v = perception_status(None, None, None, None, {"total": {"p50": math.nan,
                                                                       "p99": math.nan}}, 5.0)
    assert level == "ok" and v["result_cdr"] == 0.0 and "prestaged_inputs" not in v
