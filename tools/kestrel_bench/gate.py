"""`kestrel_bench gate NEW.json --baseline OLD.json`: the regression gate.

Compares like with like: both records must be the same benchmark, machine class and config
(else it refuses, exit 2, naming the difference; `--skip-mismatch` makes that exit 0), and
each result is compared with the baseline's result of the same name and config. Every figure is
compared by ratio against a stated tolerance (TOLERANCES, overridable with `--tolerance`):

  metric                    better   tolerance (default)
  latency_ms.p50 / mean     lower    +10 %
  latency_ms.p90            lower    +15 %
  latency_ms.p99            lower    +25 %
  latency_ms.p999           lower    +50 %
  throughput.value          higher   -10 %
  peak_memory_mb            lower    +10 %
  power.energy_j_per_item   lower    +15 %
  drift.max_abs             lower    +100 % (2x)
  metrics.misses            lower    +0 (absolute: any new miss)
  metrics.deadline_misses   lower    +0 (absolute: the control loop's)
  ratios.*                  higher   -15 % (same-run ratios, > 1 = the optimized path wins)

Prints the table; exit 1 when any gated figure regressed, or a baseline result is missing
from NEW. `--only PATTERN` (repeatable, fnmatch on "result.metric" / "ratios.key") gates a
subset: on shared CI machines only the same-run ratios hold whatever the machine's speed:

  python -m kestrel_bench gate new.json --baseline docs/benchmarks/gate_cpu.json \
      --only 'ratios.*' --tolerance ratios=0.4

A re-run overwrites the committed record; `--baseline git:REV` compares it with the same file at
a git revision:

  python -m kestrel_bench control && python -m kestrel_bench gate \
      docs/benchmarks/control_h200.json --baseline git:HEAD
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

# metric (path inside a result, or "ratios") -> (better, kind, tolerance)
#   kind "rel": lower-better fails above baseline * (1 + tol), higher-better below * (1 - tol)
#   kind "abs": lower-better fails above baseline + tol
TOLERANCES: dict[str, tuple[str, str, float]] = {
    "latency_ms.mean": ("lower", "rel", 0.10),
    "latency_ms.p50": ("lower", "rel", 0.10),
    "latency_ms.p90": ("lower", "rel", 0.15),
    "latency_ms.p99": ("lower", "rel", 0.25),
    "latency_ms.p999": ("lower", "rel", 0.50),
    "throughput.value": ("higher", "rel", 0.10),
    "peak_memory_mb": ("lower", "rel", 0.10),
    "power.energy_j_per_item": ("lower", "rel", 0.15),
    "drift.max_abs": ("lower", "rel", 1.0),
    "metrics.misses": ("lower", "abs", 0.0),
    "metrics.deadline_misses": ("lower", "abs", 0.0),
    "ratios": ("higher", "rel", 0.15),
}
EXIT_PASS, EXIT_REGRESSION, EXIT_MISMATCH = 0, 1, 2


@dataclass
class Row:
    key: str            # "result.metric" or "ratios.name"
    metric: str         # the TOLERANCES key
    baseline: float | None
    new: float | None
    verdict: str        # "ok" | "REGRESSION" | "MISSING" | "better"
    limit: str          # the tolerance in words

    @property
    def change(self) -> str:
        if self.baseline is None or self.new is None:
            return "-"
        if TOLERANCES[self.metric][1] == "abs" or not self.baseline:
            return f"{self.new - self.baseline:+.3g}"
        return f"{self.new / self.baseline - 1:+.1%}"


def _get(d: dict, path: str) -> float | None:
    for part in path.split("."):
        if not isinstance(d, dict) or part not in d:
            return None
        d = d[part]
    return float(d) if isinstance(d, (int, float)) and not isinstance(d, bool) else None


def parse_tolerances(items: list[str]) -> dict[str, tuple[str, str, float]]:
    """['ratios=0.4', 'latency_ms.p99=0.5'] -> TOLERANCES with those values replaced."""
    table = dict(TOLERANCES)
    for item in items:
        key, _, value = item.partition("=")
        if key not in table or not value:
            raise ValueError(f"--tolerance {item!r}: needs METRIC=VALUE, METRIC one of "
                             f"{', '.join(table)}")
        better, kind, _ = table[key]
        table[key] = (better, kind, float(value))
    return table


def mismatch(new: dict, old: dict, ignore: tuple[str, ...] = ()) -> list[str]:
    """Why NEW and the baseline are not like with like ([] = comparable)."""
    why = []
    if new.get("benchmark") != old.get("benchmark"):
        why.append(f"benchmark {new.get('benchmark')!r} vs {old.get('benchmark')!r}")
    nc, oc = (r.get("machine", {}).get("class") for r in (new, old))
    if nc != oc:
        why.append(f"machine class {nc!r} vs baseline {oc!r}")
    a, b = new.get("config") or {}, old.get("config") or {}
    for k in sorted(set(a) | set(b)):
        if k not in ignore and a.get(k) != b.get(k):
            why.append(f"config.{k}: {a.get(k)!r} vs baseline {b.get(k)!r}")
    return why


def _judge(value: float | None, base: float | None, rule: tuple[str, str, float]
           ) -> tuple[str, str]:
    better, kind, tol = rule
    if kind == "abs":
        limit = f"<= baseline + {tol:g}"
        bound = None if base is None else base + tol
    elif better == "lower":
        limit = f"<= +{tol:.0%}"
        bound = None if base is None else base * (1 + tol)
    else:
        limit = f">= -{tol:.0%}"
        bound = None if base is None else base * (1 - tol)
    if base is None:
        return "new", limit
    if value is None:
        return "MISSING", limit
    if (value > bound) if better == "lower" else (value < bound):
        return "REGRESSION", limit
    improved = value < base if better == "lower" else value > base
    return ("better" if improved else "ok"), limit


def compare(new: dict, old: dict, tolerances: dict | None = None,
            only: list[str] | None = None) -> list[Row]:
    """One Row per gated figure of the baseline (and per figure only NEW has, as 'new')."""
    table = tolerances or TOLERANCES
    rows: list[Row] = []

    def wanted(key: str) -> bool:
        return not only or any(fnmatch.fnmatch(key, p) for p in only)

    new_results = {r["name"]: r for r in new.get("results", [])}
    for res in old.get("results", []):
        if res.get("skipped") or res.get("error"):
            continue
        other = new_results.get(res["name"])
        if other is not None and (other.get("config") or {}) != (res.get("config") or {}):
            continue  # a different setting of the same name: not like with like
        for metric, rule in table.items():
            if metric == "ratios":
                continue
            key = f"{res['name']}.{metric}"
            base = _get(res, metric)
            if base is None or not wanted(key):
                continue
            value = None if other is None else _get(other, metric)
            verdict, limit = _judge(value, base, rule)
            rows.append(Row(key, metric, base, value, verdict, limit))
    old_r, new_r = old.get("ratios") or {}, new.get("ratios") or {}
    for name in sorted(set(old_r) | set(new_r)):
        key = f"ratios.{name}"
        if not wanted(key):
            continue
        base, value = _get(old_r, name), _get(new_r, name)
        verdict, limit = _judge(value, base, table["ratios"])
        rows.append(Row(key, "ratios", base, value, verdict, limit))
    return rows


def format_rows(rows: list[Row]) -> str:
    def num(v: float | None) -> str:
        return "-" if v is None else f"{v:.4g}"

    lines = ["| figure | baseline | new | change | tolerance | verdict |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r.key} | {num(r.baseline)} | {num(r.new)} | {r.change} | {r.limit} | "
              f"{r.verdict} |" for r in rows]
    return "\n".join(lines)


def gate(new: dict, old: dict, tolerances: dict | None = None, only: list[str] | None = None,
         ignore_config: tuple[str, ...] = ()) -> tuple[int, str]:
    """(exit code, printed text) of the gate; see the module docstring."""
    why = mismatch(new, old, ignore_config)
    if why:
        return EXIT_MISMATCH, ("gate: not like with like, nothing compared:\n  "
                               + "\n  ".join(why))
    rows = compare(new, old, tolerances, only)
    if not rows:
        return EXIT_MISMATCH, "gate: no figure of the baseline matched (--only?)"
    bad = [r for r in rows if r.verdict in ("REGRESSION", "MISSING")]
    text = format_rows(rows) + "\n\n"
    for key in ("cpu_model", "gpu", "torch"):
        a, b = (r.get("machine", {}).get(key) for r in (new, old))
        if a != b:
            text += (f"note: machine.{key} {a!r} vs baseline {b!r} (same class; figures may "
                     "shift: re-record the baseline on this machine if they do)\n")
    if bad:
        text += (f"gate: FAIL, {len(bad)} of {len(rows)} figures regressed: "
                 + ", ".join(r.key for r in bad))
        return EXIT_REGRESSION, text
    return EXIT_PASS, text + f"gate: PASS ({len(rows)} figures within tolerance)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("new", help="the new record (kestrel_bench/1 JSON)")
    parser.add_argument("--baseline", required=True,
                        help="the baseline record, or git:REV (NEW's file at that revision)")
    parser.add_argument("--tolerance", action="append", default=[], metavar="METRIC=VALUE",
                        help="override a tolerance, e.g. ratios=0.4, latency_ms.p99=0.5, "
                             "metrics.misses=2 (repeatable)")
    parser.add_argument("--only", action="append", default=[], metavar="PATTERN",
                        help="gate only figures matching (fnmatch), e.g. 'ratios.*' "
                             "(repeatable)")
    parser.add_argument("--ignore-config", default="",
                        help="comma list of config keys that may differ")
    parser.add_argument("--skip-mismatch", action="store_true",
                        help="exit 0 (with the message) when the records are not comparable")


def load_baseline(spec: str, new_path: str) -> dict:
    """A baseline file, or `git:REV`: the file NEW at git revision REV."""
    if not spec.startswith("git:"):
        return json.loads(Path(spec).read_text())
    path = Path(new_path).resolve()
    top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=path.parent,
                         capture_output=True, text=True, timeout=30)
    if top.returncode:
        raise ValueError(f"--baseline {spec}: {path} is not in a git repository")
    rel = path.relative_to(Path(top.stdout.strip()).resolve())
    shown = subprocess.run(["git", "show", f"{spec[4:]}:{rel.as_posix()}"], cwd=path.parent,
                           capture_output=True, text=True, timeout=30)
    if shown.returncode:
        raise ValueError(f"--baseline {spec}: {shown.stderr.strip()}")
    return json.loads(shown.stdout)


def run(args: argparse.Namespace) -> int:
    new = json.loads(Path(args.new).read_text())
    try:
        old = load_baseline(args.baseline, args.new)
    except (ValueError, OSError, subprocess.SubprocessError) as exc:
        print(f"gate: {exc}")
        return EXIT_MISMATCH
    try:
        table = parse_tolerances(args.tolerance)
    except ValueError as exc:
        print(f"gate: {exc}")
        return EXIT_MISMATCH
    ignore = tuple(k for k in args.ignore_config.split(",") if k)
    code, text = gate(new, old, table, args.only, ignore)
    print(f"gate: {args.new} vs baseline {args.baseline}")
    print(text)
    if code == EXIT_MISMATCH and args.skip_mismatch:
        print("gate: skipped (--skip-mismatch)")
        return EXIT_PASS
    return code
