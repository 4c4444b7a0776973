"""The shared record: machine class, commit, schema validation, the .json/.md writer, the
renderer, the percentile summary and the NVML power meter without NVML."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from kestrel_bench import power, record, render, stats


def test_summary_percentiles_and_scale() -> None:
    s = stats.summary(np.arange(1, 1001, dtype=float), scale=1e3)
    assert set(s) == set(stats.KEYS)
    assert s["n"] == 1000 and s["max"] == 1e6
    assert s["p50"] == pytest.approx(500.5e3) and s["p90"] == pytest.approx(900.1e3)
    assert s["p99"] < s["p999"] < s["max"]
    assert stats.summary([]) == {"n": 0}
    assert stats.summary([float("nan"), 2.0])["n"] == 1
    assert stats.ratio(3.0, 1.5) == 2.0 and stats.ratio(None, 1.0) is None


@pytest.mark.parametrize("name, cls", [("NVIDIA H200", "h200"), ("NVIDIA H100 80GB HBM3", "h100"),
                                       ("NVIDIA A100-SXM4-40GB", "a100"),
                                       ("NVIDIA GeForce RTX 4090", "rtx4090"),
                                       ("NVIDIA L4", "l4")])
def test_gpu_class(name: str, cls: str) -> None:
    assert record.gpu_class(name) == cls


def test_commit_env_wins_and_explicit_wins_over_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KESTREL_COMMIT", "feedbee")
    assert record.git_commit() == "feedbee"
    assert record.git_commit("abc1234") == "abc1234"


def _record() -> record.Record:
    rec = record.Record("control", config={"cycles": 10}, argv=["python", "-m", "kestrel_bench",
                                                                 "control", "--quick"],
                        machine=record.machine_info(use_torch=False))
    rec.add("cpu_eager", "baseline", latency_ms=stats.summary([0.1, 0.2, 0.3]),
            throughput=1000.0, unit="Hz", metrics={"misses": 0},
            power={"skipped": "no GPU"})
    rec.add("onnxruntime", "optimized", latency_ms=stats.summary([0.05, 0.06]),
            drift={"max_abs": 1e-6, "reference": "fp32"}, peak_memory_mb=12.5)
    rec.add("tensorrt", "variant", skipped="needs CUDA")
    rec.ratio("optimized_vs_baseline_p50", 3.6)
    rec.ratio("missing", None)
    rec.note("one line")
    return rec


def test_record_is_valid_and_round_trips(tmp_path: Path) -> None:
    rec = _record()
    assert rec.machine_class == "cpu"
    assert rec["schema"] == "kestrel_bench/1" and rec["date"].endswith("Z")
    assert rec["command"] == "python -m kestrel_bench control --quick"
    assert record.validate(rec) == []
    assert "missing" not in rec["ratios"]
    js, md = record.write(rec, tmp_path / "sub" / "control_cpu")
    back = json.loads(js.read_text())
    assert back == json.loads(json.dumps(rec)) and record.validate(back) == []
    text = md.read_text()
    assert "| cpu_eager | baseline |" in text and "skipped: needs CUDA" in text
    assert "optimized_vs_baseline_p50" in text and "- one line" in text
    assert "Power not measured: no GPU." in text


def test_validate_names_what_is_wrong() -> None:
    rec = _record()
    rec["results"][0]["role"] = "fastest"
    rec["results"][1]["throughput"] = {"value": 1.0}
    rec["ratios"]["x"] = "big"
    del rec["date"]
    errs = record.validate(rec)
    assert any("date" in e for e in errs) and any("role 'fastest'" in e for e in errs)
    assert any("throughput" in e for e in errs) and any("ratios.x" in e for e in errs)
    with pytest.raises(ValueError, match="role"):
        rec.add("x", "best")


def test_out_stem_default_is_docs_benchmarks_name_class() -> None:
    assert record.out_stem(None, "perception-node", "h200") == (
        record.ROOT / "docs/benchmarks/perception_node_h200")
    assert record.out_stem("/tmp/x", "control", "cpu") == Path("/tmp/x")


def test_render_extra_tables() -> None:
    rec = _record()
    rec["tables"] = [{"title": "Top kernels", "columns": ["kernel", "us"],
                      "rows": [["gemm", 1.5]]}]
    assert "## Top kernels" in render.markdown(rec) and "| gemm | 1.5" in render.markdown(rec)


def test_power_is_skipped_without_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    meter = power.PowerMeter()
    with meter:
        pass
    assert "nvidia-ml-py" in meter.result(10, "inference")["skipped"]

    class Err(Exception):
        pass

    def init() -> None:
        raise Err("NVML Shared Library Not Found")

    monkeypatch.setitem(sys.modules, "pynvml", types.SimpleNamespace(nvmlInit=init))
    assert "NVML unavailable" in power.PowerMeter().result()["skipped"]


def test_power_from_energy_counter(monkeypatch: pytest.MonkeyPatch) -> None:
    energy = iter([1_000_000, 1_000_000 + 300_000])  # mJ: 300 J over the window
    fake = types.SimpleNamespace(
        nvmlInit=lambda: None, nvmlDeviceGetHandleByIndex=lambda i: "h",
        nvmlDeviceGetPowerUsage=lambda h: 300_000,  # mW
        nvmlDeviceGetTotalEnergyConsumption=lambda h: next(energy))
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    meter = power.PowerMeter()
    meter.start()
    meter._t0 -= 1.0  # a 1 s window without sleeping
    meter.stop()
    r = meter.result(items=1000, item="control step")
    assert r["method"] == "energy_counter" and r["energy_j"] == pytest.approx(300.0)
    assert r["energy_j_per_item"] == pytest.approx(0.3) and r["item"] == "control step"
    assert 250 < r["avg_w"] < 301


def test_merge_keeps_the_unmeasured_rows_with_their_run() -> None:
    """A run of some sections keeps the others from the earlier record: each kept row names
    its run (also through a second merge), baseline and optimized stay a same-run pair, the
    new run's rows and ratios win."""
    def rec(date: str, rows: list[tuple[str, str]], ratios: dict) -> record.Record:
        r = record.Record("planner", {}, ["--x"], commit=f"c{date}", machine={"class": "h100"})
        r["date"] = date
        for name, role in rows:
            r.add(name, role, throughput=1.0, unit="tok/s")
        r["ratios"].update(ratios)
        return r

    old = rec("d1", [("hf", "baseline"), ("eng", "optimized"), ("spec", "variant"),
                     ("prefix", "variant")], {"eng_vs_hf": 3.0, "spec_vs_eng": 0.1})
    new = rec("d2", [("spec", "optimized"), ("prefix", "variant")], {"spec_vs_eng": 0.7})
    assert record.merge_unmeasured(new, old) == ["hf", "eng"]
    roles = {r["name"]: (r["role"], r.get("run", {}).get("date")) for r in new["results"]}
    assert roles == {"spec": ("variant", None), "prefix": ("variant", None),
                     "hf": ("baseline", "d1"), "eng": ("optimized", "d1")}
    assert new["ratios"] == {"spec_vs_eng": 0.7, "eng_vs_hf": 3.0}
    assert any("cd1 on d1: rows hf, eng" in n for n in new["notes"])
    assert record.validate(new) == []
    third = rec("d3", [("prefix", "variant")], {})
    record.merge_unmeasured(third, new)
    runs = {r["name"]: r.get("run", {}).get("date") for r in third["results"]}
    assert runs == {"prefix": None, "spec": "d2", "hf": "d1", "eng": "d1"}
    # the optimized row measured again without its baseline: no pair across runs
    again = rec("d4", [("eng", "optimized")], {})
    record.merge_unmeasured(again, old)
    assert {r["name"]: r["role"] for r in again["results"]} == {
        "eng": "variant", "hf": "variant", "spec": "variant", "prefix": "variant"}


def test_merge_replaces_the_rows_this_run_skipped() -> None:
    """A section this run skipped (a time budget) or failed is not measured: the earlier
    record's measured row of that name takes its place, naming its run; a row skipped in
    both stays this run's."""
    old = record.Record("planner", {}, ["--x"], commit="c1", machine={"class": "h100"})
    old["date"] = "d1"
    old.add("hf", "baseline", throughput=1.0, unit="tok/s")
    old.add("eng", "optimized", throughput=2.0, unit="tok/s")
    old.add("c16", "variant", skipped="budget")
    new = record.Record("planner", {}, ["--x"], commit="c2", machine={"class": "h100"})
    new.add("hf", "baseline", throughput=1.5, unit="tok/s")
    new.add("eng", "optimized", skipped="budget: 190 s spent")
    new.add("c16", "variant", error="RuntimeError: out of memory")
    assert record.merge_unmeasured(new, old) == ["eng"]
    rows = {r["name"]: r for r in new["results"]}
    assert rows["hf"]["throughput"]["value"] == 1.5 and "run" not in rows["hf"]
    assert rows["eng"]["throughput"]["value"] == 2.0 and rows["eng"]["run"]["date"] == "d1"
    assert rows["eng"]["role"] == "variant"  # no baseline/optimized pair across runs
    assert "error" in rows["c16"] and "run" not in rows["c16"]
    assert record.validate(new) == []
