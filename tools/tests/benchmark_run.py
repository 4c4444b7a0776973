"""Run `python -m kestrel_bench ...` in a subprocess and load its record (test helper)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kestrel_bench.record import validate

ROOT = Path(__file__).resolve().parents[2]


def run_bench(out: Path, *args: str, timeout: float = 300.0, ok: bool = True,
              env: dict[str, str] | None = None) -> dict:
    """The record the subcommand wrote to `out` (.json beside .md), checked against the
    schema; the run must exit 0 unless ok is False."""
    res = subprocess.run([sys.executable, "-m", "kestrel_bench", *args, "--out", str(out)],
                         capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    if ok:
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert out.with_suffix(".md").is_file(), res.stderr[-3000:]
    record = json.loads(out.with_suffix(".json").read_text())
    assert validate(record) == [], validate(record)
    return record


def row(record: dict, name: str) -> dict:
    return next(r for r in record["results"] if r["name"] == name)
