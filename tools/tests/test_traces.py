"""kestrel_bench.traces: a chrome trace of the control tick with its three stages as top-level
ranges and the profiler's FLOP counts in the ops' args (what the bottleneck identifier reads)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kestrel_bench import traces


def test_control_trace_has_stages_and_flops(tmp_path: Path) -> None:
    path = traces.collect("control", "cpu", tmp_path / "t.json", steps=3)
    events = json.loads(path.read_text())["traceEvents"]
    stages = [e["name"] for e in events if e.get("cat") == "user_annotation"]
    assert stages.count("observation") == stages.count("policy") == stages.count("command") == 3
    flops = [e["args"]["flops"] for e in events if e.get("cat") == "cpu_op"
             and "flops" in e.get("args", {})]
    assert flops and all(f > 0 for f in flops)
    with pytest.raises(ValueError, match="target 'x'"):
        traces.collect("x")
