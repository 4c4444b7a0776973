"""The result record every subcommand writes (schema "kestrel_bench/1", SCHEMA.md): the
machine and its class, the code (git commit), the exact command, the UTC date, what was
measured (config), one entry per measured path (results), same-run ratios and notes.

    rec = Record("control", config={...}, argv=args.argv)
    rec.add("cuda_graph", "optimized", latency_ms=stats.summary(times_s, 1e3), metrics={...})
    rec.ratio("optimized_vs_baseline_p50", 3.1)
    write(rec, out_stem(args.out, "control", rec.machine_class))  # STEM.json + STEM.md

Commit: an explicit value wins, then $KESTREL_COMMIT, then `git rev-parse --short HEAD` (+
"+dirty" when tracked files differ), "unknown" without git. A copy of the tree whose git
metadata may not match its files (a remote machine) should pass KESTREL_COMMIT.
torch is imported only when already importable; nothing here needs a GPU.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import re
import sys
from pathlib import Path

from kestrel_bench.repo import ensure_paths

SCHEMA = "kestrel_bench/1"
ROOT = Path(__file__).resolve().parents[2]  # the repository (tools/kestrel_bench/record.py)
ensure_paths("kestrel_common")
from kestrel_common.run_info import cpu_model, gpu_class  # noqa: E402,F401 (gpu_class: API)
from kestrel_common.run_info import git_commit as _git_commit  # noqa: E402
ROLES = ("baseline", "optimized", "variant")
DEFAULT_DIR = "docs/benchmarks"


def git_commit(explicit: str = "") -> str:
    """The commit of this repository (run_info.git_commit: explicit, $KESTREL_COMMIT, git)."""
    return _git_commit(ROOT, explicit)


def _torch_info() -> dict:
    try:
        import torch
    except ImportError:
        return {}
    info = {"torch": torch.__version__, "threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["cuda"] = torch.version.cuda
    return info


def machine_info(use_torch: bool = True, **extra: object) -> dict:
    """class (h200 / h100 / ... / cpu), host, cpu_model, cpus, affinity, gpu, torch, cuda,
    python, platform; `extra` added as given."""
    info: dict = {"host": platform.node(), "python": platform.python_version(),
                  "platform": platform.platform(), "cpus": os.cpu_count()}
    try:
        info["cpu_affinity"] = len(os.sched_getaffinity(0))
    except AttributeError:
        pass
    try:
        info["loadavg_1m"] = round(os.getloadavg()[0], 2)  # other work on the machine
    except OSError:
        pass
    if cpu_model():
        info["cpu_model"] = cpu_model()
    if use_torch:
        info.update(_torch_info())
    info["class"] = gpu_class(info["gpu"]) if info.get("gpu") else "cpu"
    info.update(extra)
    return {"class": info.pop("class"), **info}


def utc_now() -> str:
    return _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def command_line(argv: list[str] | None) -> str:
    if argv is None:
        argv = ["python", "-m", "kestrel_bench", *sys.argv[1:]]
    return " ".join(a if a and re.fullmatch(r"[\w@%+=:,./-]+", a) else repr(a) for a in argv)


class Record(dict):
    """A kestrel_bench/1 record (a dict: json.dumps writes it as is)."""

    def __init__(self, benchmark: str, config: dict | None = None,
                 argv: list[str] | None = None, commit: str = "",
                 machine: dict | None = None) -> None:
        super().__init__(schema=SCHEMA, benchmark=benchmark,
                         machine=machine if machine is not None else machine_info(),
                         commit=git_commit(commit), command=command_line(argv),
                         date=utc_now(), config=dict(config or {}), results=[], ratios={},
                         notes=[])

    @property
    def machine_class(self) -> str:
        return self["machine"]["class"]

    def add(self, name: str, role: str = "variant", *, config: dict | None = None,
            latency_ms: dict | None = None, throughput: float | None = None,
            unit: str = "items/s", peak_memory_mb: float | None = None,
            drift: dict | None = None, power: dict | None = None,
            metrics: dict | None = None, **extra: object) -> dict:
        """Append one measured path; returns its entry (fill more keys in place if needed).
        A path that did not run is recorded with extra `skipped=reason` or `error=text`."""
        if role not in ROLES:
            raise ValueError(f"role {role!r} must be one of {ROLES}")
        entry: dict = {"name": name, "role": role}
        if config:
            entry["config"] = config
        if latency_ms is not None:
            entry["latency_ms"] = latency_ms
        if throughput is not None:
            entry["throughput"] = {"value": float(throughput), "unit": unit}
        if peak_memory_mb is not None:
            entry["peak_memory_mb"] = float(peak_memory_mb)
        if drift is not None:
            entry["drift"] = drift
        if power is not None:
            entry["power"] = power
        if metrics:
            entry["metrics"] = metrics
        entry.update(extra)
        self["results"].append(entry)
        return entry

    def result(self, name: str) -> dict | None:
        return next((r for r in self["results"] if r["name"] == name), None)

    def ratio(self, key: str, value: float | None) -> None:
        """A same-run ratio (> 1 = the optimized path is better); None is not stored."""
        if value is not None:
            self["ratios"][key] = float(value)

    def note(self, text: str) -> None:
        self["notes"].append(text)


def validate(record: dict) -> list[str]:
    """The schema's problems with `record` ([] = valid)."""
    errors = []
    for key, kind in (("schema", str), ("benchmark", str), ("machine", dict), ("commit", str),
                      ("command", str), ("date", str), ("config", dict), ("results", list),
                      ("ratios", dict), ("notes", list)):
        if not isinstance(record.get(key), kind):
            errors.append(f"{key}: missing or not a {kind.__name__}")
    if record.get("schema") not in (None, SCHEMA):
        errors.append(f"schema: {record.get('schema')!r} is not {SCHEMA!r}")
    if isinstance(record.get("machine"), dict) and not record["machine"].get("class"):
        errors.append("machine.class: missing")
    for i, r in enumerate(record.get("results") or []):
        if not isinstance(r, dict) or not r.get("name"):
            errors.append(f"results[{i}]: no name")
            continue
        if r.get("role") not in ROLES:
            errors.append(f"results[{i}] {r['name']}: role {r.get('role')!r}")
        lat = r.get("latency_ms")
        if lat is not None and (not isinstance(lat, dict) or "n" not in lat):
            errors.append(f"results[{i}] {r['name']}: latency_ms without n")
        thr = r.get("throughput")
        if thr is not None and not {"value", "unit"} <= set(thr):
            errors.append(f"results[{i}] {r['name']}: throughput needs value and unit")
    for k, v in (record.get("ratios") or {}).items():
        if not isinstance(v, (int, float)):
            errors.append(f"ratios.{k}: not a number")
    return errors


def measured(row: dict) -> bool:
    """A result row with figures (not skipped, not failed)."""
    return "skipped" not in row and "error" not in row


def merge_unmeasured(record: dict, old: dict) -> list[str]:
    """Append to `record` the rows of `old` (an earlier record of the same benchmark on the
    same machine class) that it did not measure, and old's ratios it has no value for. A row
    this run skipped or failed counts as not measured: old's measured row of that name
    replaces it. Each kept row gets `run`: old's commit, date and command (or the run the row
    already names). Baseline and optimized stay a same-run pair: a run without a baseline row
    has no optimized row either, and the kept rows keep those roles only when both are kept
    and the run holds neither; otherwise they become 'variant'. A note per run names its
    rows. Returns the names of the rows kept."""
    now = {r["name"] for r in record["results"] if measured(r)}
    redo = {r.get("name") for r in old.get("results", []) if measured(r)} - now
    record["results"] = [r for r in record["results"] if r["name"] not in redo]
    have = {r["name"] for r in record["results"]}
    if not any(r["role"] == "baseline" for r in record["results"]):
        for r in record["results"]:
            if r["role"] == "optimized":
                r["role"] = "variant"
    run = {k: old.get(k) for k in ("commit", "date", "command")}
    kept = [dict(r, run=r.get("run") or run) for r in old.get("results", [])
            if r.get("name") not in have]
    pair = sorted(row["role"] for row in kept if row["role"] != "variant")
    if pair != ["baseline", "optimized"] or any(r["role"] != "variant"
                                                for r in record["results"]):
        for row in kept:
            row["role"] = "variant"
    record["results"].extend(kept)
    for k, v in old.get("ratios", {}).items():
        record["ratios"].setdefault(k, v)
    by_run: dict[tuple, list[str]] = {}
    for row in kept:
        by_run.setdefault((row["run"].get("commit"), row["run"].get("date")), []).append(
            row["name"])
    for (commit, date), names in by_run.items():
        record["notes"].append(f"not measured by this command, kept from the run at commit "
                               f"{commit} on {date}: rows {', '.join(names)}")
    if kept:
        record["notes"].append("ratios not measured by this command are the earlier runs'")
    return [row["name"] for row in kept]


def out_stem(out: str | None, benchmark: str, machine_class: str) -> Path:
    """--out as given, else docs/benchmarks/<benchmark>_<class> in the repository ('-' in the
    benchmark name becomes '_')."""
    if out:
        return Path(out)
    return ROOT / DEFAULT_DIR / f"{benchmark.replace('-', '_')}_{machine_class}"


def paths(path_stem: str | Path) -> tuple[Path, Path]:
    """STEM.json and STEM.md of a stem (a .json or .md suffix on it is dropped)."""
    stem = Path(path_stem)
    if stem.suffix in (".json", ".md"):
        stem = stem.with_suffix("")
    return Path(f"{stem}.json"), Path(f"{stem}.md")


def write(record: dict, path_stem: str | Path) -> tuple[Path, Path]:
    """STEM.json (the record) and STEM.md (render.markdown), overwriting; returns both."""
    from kestrel_bench.render import markdown

    js, md = paths(path_stem)
    js.parent.mkdir(parents=True, exist_ok=True)
    js.write_text(json.dumps(record, indent=1, default=_jsonable) + "\n")
    md.write_text(markdown(record))
    return js, md


def load(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())


def _jsonable(obj: object) -> object:
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if isinstance(obj, (set, tuple)):
        return list(obj)
    return str(obj)


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """--out, --commit, --note: every subcommand takes them."""
    parser.add_argument("--out", default=None,
                        help="path stem of the record: writes STEM.json and STEM.md "
                             "(default docs/benchmarks/<benchmark>_<machine class>)")
    parser.add_argument("--commit", default="",
                        help="commit to record (default $KESTREL_COMMIT, then git)")
    parser.add_argument("--note", action="append", default=[],
                        help="a one-line note for the record (repeatable)")


def finish(record: Record, args: argparse.Namespace) -> Path:
    """Add --note lines, write the record where --out says, print the table; returns the
    JSON path."""
    from kestrel_bench.render import markdown

    for n in getattr(args, "note", []) or []:
        record.note(n)
    js, _ = write(record, out_stem(getattr(args, "out", None), record["benchmark"],
                                   record.machine_class))
    print(markdown(record), flush=True)
    print(f"wrote {js} (+ .md)", flush=True)
    return js
