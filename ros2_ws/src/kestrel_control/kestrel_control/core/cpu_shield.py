"""A user-space CPU shield for the real-time loop: move every other task off the loop's CPUs.

Why: without SCHED_FIFO (refused in most containers) the loop thread is an ordinary fair-class
thread, and any runnable task the scheduler places on the loop's CPU takes its share of it: a
busy-waiting loop thread then loses a whole scheduler slice (milliseconds) and
misses deadlines. The kernel's answers are `isolcpus=` / `nohz_full=` on the boot command line or
a cpuset partition (`cset shield`); this module is what an unprivileged process can do in their
place: rewrite the CPU affinity of every task it may touch (same user, or root in a container)
so that only threads pinned to the shielded CPUs (the loop thread pins itself there) run on them.
New processes inherit the reduced mask from their (moved) parents.

What it cannot move: per-CPU kernel threads (EINVAL), tasks of other users without
CAP_SYS_NICE (EPERM), the scheduler tick, and interrupts whose affinity is managed by the kernel
(`--irqs` steers the others, with root). Each refusal is counted in the report, never hidden.

CLI (run once before starting the stack or the benchmark; root in the container is enough):
    python -m kestrel_control.core.cpu_shield --cpus 2 [--irqs] [--dry-run]
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

__all__ = ["ShieldReport", "shield_cpus", "shield_irqs", "parse_cpus", "irq_counts"]


@dataclass
class ShieldReport:
    cpus: list[int]  # the shielded CPUs
    moved: int = 0  # tasks whose affinity no longer includes a shielded CPU
    already_off: int = 0  # tasks that did not run there anyway
    pinned_kept: int = 0  # tasks whose whole mask is inside the shield (the loop thread)
    not_permitted: int = 0  # EPERM: another user's task and no CAP_SYS_NICE
    kernel_or_gone: int = 0  # EINVAL (per-CPU kernel thread) or the task exited meanwhile
    examples_not_moved: list[str] = field(default_factory=list)  # "tid comm: reason", <= 10
    # "tid comm": tasks pinned inside the shield that are not the loop (a VM agent's worker
    # pinned per CPU, per-CPU kernel threads); they keep running there, <= 10
    examples_pinned_kept: list[str] = field(default_factory=list)


def parse_cpus(text: str) -> list[int]:
    """'2' / '2,3' / '2-4' -> sorted CPU ids; ValueError naming the parameter otherwise."""
    cpus: set[int] = set()
    try:
        for part in filter(None, (p.strip() for p in text.split(","))):
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise ValueError(f"parameter 'cpus' = {text!r}: must be a list like '2' or '2,3' "
                         "or '2-4'") from None
    if not cpus:
        raise ValueError(f"parameter 'cpus' = {text!r}: names no CPU")
    return sorted(cpus)


def _comm(tid: int) -> str:
    try:
        with open(f"/proc/{tid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def _all_tids() -> Iterable[int]:
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:  # exited meanwhile
            continue
        yield from (int(t) for t in tids)


def shield_cpus(cpus: Iterable[int], tids: Iterable[int] | None = None,
                dry_run: bool = False) -> ShieldReport:
    """Remove `cpus` from the affinity of every task in `tids` (default: all tasks in /proc)
    that runs elsewhere too. Tasks pinned entirely inside `cpus` are kept (they chose it: the
    loop thread). Never raises for a task it may not touch: it counts it."""
    shield = set(int(c) for c in cpus)
    online = set(os.sched_getaffinity(0)) | shield
    if not shield or shield >= online:
        raise ValueError(f"parameter 'cpus' = {sorted(shield)}: must leave at least one of "
                         f"the CPUs {sorted(online)} outside the shield")
    report = ShieldReport(cpus=sorted(shield))
    for tid in (_all_tids() if tids is None else tids):
        try:
            mask = os.sched_getaffinity(tid)
            if not mask & shield:
                report.already_off += 1
                continue
            if mask <= shield:
                report.pinned_kept += 1
                if len(report.examples_pinned_kept) < 10:
                    report.examples_pinned_kept.append(f"{tid} {_comm(tid)}")
                continue
            if not dry_run:
                os.sched_setaffinity(tid, mask - shield)
            report.moved += 1
        except PermissionError:
            report.not_permitted += 1
            _note(report, tid, "not permitted")
        except (OSError, ValueError) as exc:  # EINVAL: per-CPU kthread; ESRCH: exited
            report.kernel_or_gone += 1
            _note(report, tid, type(exc).__name__)
    return report


def _note(report: ShieldReport, tid: int, why: str) -> None:
    if len(report.examples_not_moved) < 10:
        report.examples_not_moved.append(f"{tid} {_comm(tid)}: {why}")


def shield_irqs(cpus: Iterable[int], root: str = "/proc/irq") -> dict[str, int]:
    """Steer every interrupt whose affinity includes a shielded CPU to the other CPUs of its
    mask (all other online CPUs when its mask is inside the shield): what irqbalance's banned
    CPUs do. Needs root outside a restricted container; refusals (managed / per-CPU IRQs, EIO,
    EPERM) are counted."""
    shield = set(int(c) for c in cpus)
    others = sorted(set(os.sched_getaffinity(0)) - shield) or None
    counts = {"moved": 0, "already_off": 0, "refused": 0}
    try:
        irqs = [d for d in os.listdir(root) if d.isdigit()]
    except OSError:
        return counts
    for irq in irqs:
        path = os.path.join(root, irq, "smp_affinity_list")
        try:
            with open(path) as f:
                mask = set(parse_cpus(f.read().strip()))
            if not mask & shield:
                counts["already_off"] += 1
                continue
            target = sorted(mask - shield) or others
            if target is None:
                raise OSError("no CPU outside the shield")
            with open(path, "w") as f:
                f.write(",".join(map(str, target)))
            counts["moved"] += 1
        except (OSError, ValueError):
            counts["refused"] += 1
    return counts


def irq_counts() -> dict[int, int]:
    """Interrupts served so far per CPU (sum over /proc/interrupts rows), {} if unreadable:
    for picking the quietest CPU for the loop and for reporting what still lands on it."""
    try:
        with open("/proc/interrupts") as f:
            header = f.readline().split()
            totals = [0] * len(header)
            for line in f:
                cols = line.split()[1:1 + len(header)]
                for i, col in enumerate(cols):
                    if col.isdigit():
                        totals[i] += int(col)
    except OSError:
        return {}
    return {int(name[3:]): n for name, n in zip(header, totals, strict=True)
            if name.startswith("CPU")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Move every other task off the loop's CPUs.")
    ap.add_argument("--cpus", required=True, help="CPUs to shield, e.g. 2 or 2,3 or 2-3")
    ap.add_argument("--dry-run", action="store_true", help="count, change nothing")
    ap.add_argument("--irqs", action="store_true",
                    help="also steer interrupts off the CPUs (/proc/irq/*/smp_affinity_list)")
    args = ap.parse_args(argv)
    cpus = parse_cpus(args.cpus)
    report = asdict(shield_cpus(cpus, dry_run=args.dry_run))
    if args.irqs and not args.dry_run:
        report["irqs"] = shield_irqs(cpus)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
