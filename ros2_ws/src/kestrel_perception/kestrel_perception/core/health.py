"""The perception node's /diagnostics status from its parts (no ROS): counters of the core,
the result publisher and the input receivers, per-stage latency percentiles, and the level;
and the names of the node's own counters.

The node maps the level ("ok" / "warn" / "error") to DiagnosticStatus and publishes the values.
"""

from __future__ import annotations

from typing import Any

from kestrel_models.perception import compiled

# counters shown on /diagnostics from the start (value 0)
COUNTERS = ("processed", "dropped_bad_encoding", "dropped_bad_image", "dropped_size_mismatch",
            "dropped_bad_camera_info", "dropped_bad_pose", "dropped_bad_cloud",
            "dropped_too_many_points", "out_of_sync", "skipped_stale", "processing_error",
            "nan_points", "truncated_points", "runtime_shape_fallbacks", "nms_slow_path",
            "missing_cloud", "cloud_out_of_sync", "dropped_input_overwritten", "empty_cloud",
            "unrectified_camera_info", "time_jumps_back")
# core InputError reason code (types.REASON_CODES) -> the counter its frame is dropped under
REASON_COUNTER = {"bad_image": "dropped_bad_image", "size_mismatch": "dropped_size_mismatch",
                  "mixed_sizes": "dropped_size_mismatch", "bad_camera": "dropped_bad_camera_info",
                  "bad_points": "dropped_bad_cloud", "too_many_points": "dropped_too_many_points",
                  "no_images": "dropped_bad_image"}


def perception_status(core: Any, results: Any, receivers: Any, counters: Any,
                      summary: dict[str, dict[str, float]], target_fps: float
                      ) -> tuple[str, str, dict[str, float]]:
    """(level, message, values). core: PerceptionCore or None; results: ResultPublisher or
    None; receivers: InputReceivers or None; counters: the node's (get(name)); summary:
    StageTimer.summary((50, 99)), which must have "total"."""
    values: dict[str, float] = {}
    graphs = core.region.graphs if core is not None else None
    if graphs is not None:  # captured region graphs / signatures left eager
        values["region_graphs"] = len(graphs.entries)
        values["region_graphs_failed"] = len(graphs.failed)
    if core is not None and getattr(core.region, "compile", False):  # 1: compile failed
        values["region_compile_failed"] = float(bool(compiled.errors))
    if core is not None:  # inputs copied on arrival and used by their frame
        values["prestaged_inputs"] = core.staging.prestaged_used
        # of those, straight from the receivers' page-locked slots (receive: processes)
        values["prestaged_direct"] = core.staging.prestaged_direct
    # 1: results published as CDR bytes (result_cdr.py)
    values["result_cdr"] = float(results is not None and results.cdr)
    if receivers is not None:  # receive == "processes": drops in the receivers
        for name, n in receivers.counters().items():  # added to the node's own
            values[name] = n + (counters.get(name) if name.startswith("dropped_") else 0)
        lost = receivers.lost()  # per sensor: never taken by its receiver, + lost in the ring
        names = [f"lost_camera_{i}" for i in range(len(lost) - 1)] + ["lost_lidar"]
        for name, n in zip(names, lost, strict=True):
            values[name] = n + counters.get(name)
    for stage, q in summary.items():
        values[f"latency_{stage}_p50_s"] = q["p50"]
        values[f"latency_{stage}_p99_s"] = q["p99"]
    gone = receivers.exited() if receivers is not None else []
    if gone:  # those inputs no longer arrive: no set can form
        return "error", f"input receiver process exited for {gone}", values
    budget = 1.0 / float(target_fps)
    p99 = summary["total"]["p99"]
    if p99 == p99 and p99 > budget:  # not NaN
        return "warn", f"p99 latency {p99:.3f} s > 1/target_fps {budget:.3f} s", values
    return "ok", "ok", values
