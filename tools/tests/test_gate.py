"""The regression gate: passes on identical records, fails on an injected 2x slowdown, refuses
records that are not like with like."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from kestrel_bench import gate
from kestrel_bench.__main__ import main

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "docs" / "benchmarks" / "gate_cpu.json"


def record(p50_base: float = 1.0, p50_opt: float = 0.2, misses: int = 0) -> dict:
    def lat(p50: float) -> dict:
        return {"n": 1000, "mean": p50 * 1.1, "p50": p50, "p90": p50 * 1.5, "p99": p50 * 2,
                "p999": p50 * 3, "max": p50 * 5}

    return {
        "schema": "kestrel_bench/1", "benchmark": "control",
        "machine": {"class": "cpu", "host": "x"}, "commit": "abc", "command": "c",
        "date": "2026-01-01T00:00:00Z", "config": {"quick": True, "step_iters": 2000},
        "results": [
            {"name": "cpu_eager", "role": "baseline", "latency_ms": lat(p50_base),
             "throughput": {"value": 1e3 / p50_base, "unit": "Hz"}},
            {"name": "onnxruntime", "role": "optimized", "latency_ms": lat(p50_opt),
             "throughput": {"value": 1e3 / p50_opt, "unit": "Hz"},
             "metrics": {"misses": misses}},
        ],
        "ratios": {"optimized_vs_baseline_tick_p50": p50_base / p50_opt},
        "notes": [],
    }


def slowed(rec: dict, factor: float = 2.0) -> dict:
    """The record with its optimized path `factor` times slower: latencies x factor,
    throughputs and same-run ratios / factor."""
    out = copy.deepcopy(rec)
    for r in out["results"]:
        if r.get("role") != "optimized":
            continue
        r["latency_ms"] = {k: (v if k == "n" else v * factor)
                           for k, v in r.get("latency_ms", {}).items()}
        if "throughput" in r:
            r["throughput"]["value"] /= factor
    out["ratios"] = {k: v / factor for k, v in out.get("ratios", {}).items()}
    return out


def test_identical_passes() -> None:
    code, text = gate.gate(record(), record())
    assert code == gate.EXIT_PASS, text
    assert "gate: PASS" in text and "| onnxruntime.latency_ms.p50 |" in text


def test_other_cpu_model_is_noted() -> None:
    other = record()
    other["machine"]["cpu_model"] = "another CPU"
    code, text = gate.gate(other, record())
    assert code == gate.EXIT_PASS and "note: machine.cpu_model 'another CPU'" in text


def test_injected_2x_slowdown_fails() -> None:
    code, text = gate.gate(slowed(record()), record())
    assert code == gate.EXIT_REGRESSION
    assert "onnxruntime.latency_ms.p50" in text.split("FAIL")[1]
    assert "ratios.optimized_vs_baseline_tick_p50" in text.split("FAIL")[1]
    # ratios only, with the CI's wide tolerance: still caught
    code, _ = gate.gate(slowed(record()), record(), gate.parse_tolerances(["ratios=0.4"]),
                        only=["ratios.*"])
    assert code == gate.EXIT_REGRESSION


def test_within_tolerance_and_improvement_pass() -> None:
    code, text = gate.gate(slowed(record(), 1.05), record())
    assert code == gate.EXIT_PASS, text
    code, text = gate.gate(slowed(record(), 0.5), record())
    assert code == gate.EXIT_PASS and "better" in text


def test_new_misses_fail_absolute() -> None:
    code, text = gate.gate(record(misses=1), record(misses=0))
    assert code == gate.EXIT_REGRESSION and "onnxruntime.metrics.misses" in text
    table = gate.parse_tolerances(["metrics.misses=2"])
    assert gate.gate(record(misses=1), record(misses=0), table)[0] == gate.EXIT_PASS


def test_missing_result_fails() -> None:
    new = record()
    new["results"] = new["results"][:1]
    code, text = gate.gate(new, record())
    assert code == gate.EXIT_REGRESSION and "MISSING" in text


def test_not_like_with_like_is_refused() -> None:
    other = record()
    other["machine"]["class"] = "h200"
    code, text = gate.gate(other, record())
    assert code == gate.EXIT_MISMATCH and "machine class 'h200'" in text
    other = record()
    other["config"]["step_iters"] = 10
    code, text = gate.gate(other, record())
    assert code == gate.EXIT_MISMATCH and "config.step_iters" in text
    assert gate.gate(other, record(), ignore_config=("step_iters",))[0] == gate.EXIT_PASS


def test_bad_tolerance_names_the_metric() -> None:
    with pytest.raises(ValueError, match="latency_ms.p99"):
        gate.parse_tolerances(["p99=0.5"])


def test_cli_exit_codes(tmp_path, capsys) -> None:
    base, same, slow = (tmp_path / f"{n}.json" for n in ("base", "same", "slow"))
    base.write_text(json.dumps(record()))
    same.write_text(json.dumps(record()))
    slow.write_text(json.dumps(slowed(record())))
    assert main(["gate", str(same), "--baseline", str(base)]) == 0
    assert main(["gate", str(slow), "--baseline", str(base)]) == 1
    assert "gate: FAIL" in capsys.readouterr().out
    other = record()
    other["benchmark"] = "planner"
    same.write_text(json.dumps(other))
    assert main(["gate", str(same), "--baseline", str(base)]) == 2
    assert main(["gate", str(same), "--baseline", str(base), "--skip-mismatch"]) == 0


def test_baseline_from_git_revision(tmp_path, capsys) -> None:
    import subprocess

    def git(*args: str) -> None:
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    rec = tmp_path / "control_cpu.json"
    rec.write_text(json.dumps(record()))
    git("add", "control_cpu.json")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "result")
    rec.write_text(json.dumps(slowed(record())))   # a re-run overwrote it
    assert main(["gate", str(rec), "--baseline", "git:HEAD"]) == 1
    assert "gate: FAIL" in capsys.readouterr().out
    assert main(["gate", str(rec), "--baseline", "git:nosuchrev"]) == 2


@pytest.mark.skipif(not COMMITTED.exists(), reason="no committed CPU gate baseline")
def test_committed_cpu_baseline_catches_2x_slowdown() -> None:
    """The CI gate's own baseline and settings (scripts/test.sh): identical passes, the
    optimized path made 2x slower fails."""
    base = json.loads(COMMITTED.read_text())
    only, table = ["ratios.*"], gate.parse_tolerances(["ratios=0.4"])
    assert gate.gate(copy.deepcopy(base), base, table, only)[0] == gate.EXIT_PASS
    code, text = gate.gate(slowed(base), base, table, only)
    assert code == gate.EXIT_REGRESSION, text


@pytest.mark.slow
def test_paired_interleaves_and_alternates_the_order() -> None:
    from kestrel_bench.paired import interleaved

    calls: list[str] = []
    tb, to, ratio = interleaved(lambda: calls.append("b"), lambda: calls.append("o"),
                                blocks=4, per_block=3, warmup=0)
    assert tb.shape == to.shape == (12,) and ratio > 0
    assert "".join(calls) == "bbbooo" "ooobbb" "bbbooo" "ooobbb"
