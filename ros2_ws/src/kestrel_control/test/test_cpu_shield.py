"""cpu_shield: other tasks leave the shielded CPUs, a task pinned inside the shield stays, a
shield of every CPU or a malformed list fails with the parameter named, and the CLI reports."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kestrel_control.core.cpu_shield import irq_counts, parse_cpus, shield_cpus

# needs the machine to itself (moves the machine's other tasks off CPUs): run one at a time
pytestmark = pytest.mark.serial

CPUS = sorted(os.sched_getaffinity(0))
needs_two = pytest.mark.skipif(len(CPUS) < 2, reason="needs two CPUs in this process's mask")


def _child(cpus: set[int] | None = None) -> subprocess.Popen:
    """A process blocked on stdin (a target task), optionally pinned to `cpus`."""
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                            stdin=subprocess.PIPE)
    if cpus is not None:
        os.sched_setaffinity(proc.pid, cpus)
    return proc


def _stop(proc: subprocess.Popen) -> None:
    proc.stdin.close()
    proc.wait(timeout=10)


@needs_two
def test_moves_others_and_keeps_the_pinned_loop_task() -> None:
    loop_cpu = CPUS[-1]
    free, pinned = _child(), _child({loop_cpu})
    try:
        dry = shield_cpus([loop_cpu], tids=[free.pid, pinned.pid], dry_run=True)
        assert dry.moved == 1 and loop_cpu in os.sched_getaffinity(free.pid)
        report = shield_cpus([loop_cpu], tids=[free.pid, pinned.pid])
        assert (report.moved, report.pinned_kept) == (1, 1)
        assert [e.split()[0] for e in report.examples_pinned_kept] == [str(pinned.pid)]
        assert os.sched_getaffinity(free.pid) == set(CPUS) - {loop_cpu}
        assert os.sched_getaffinity(pinned.pid) == {loop_cpu}
        again = shield_cpus([loop_cpu], tids=[free.pid])
        assert again.already_off == 1 and again.moved == 0
    finally:
        _stop(free)
        _stop(pinned)


def test_a_task_that_is_gone_is_counted_not_raised() -> None:
    proc = _child()
    _stop(proc)
    report = shield_cpus([CPUS[-1]], tids=[proc.pid]) if len(CPUS) > 1 else None
    if report is not None:
        assert report.kernel_or_gone == 1 and report.examples_not_moved


def test_bad_cpu_lists_name_the_parameter() -> None:
    with pytest.raises(ValueError, match="parameter 'cpus'"):
        shield_cpus(CPUS)  # nothing would be left outside the shield
    with pytest.raises(ValueError, match="parameter 'cpus' = 'x'"):
        parse_cpus("x")
    assert parse_cpus("2-4,7") == [2, 3, 4, 7]


@pytest.mark.slow
def test_cli_dry_run_reports_json_and_irq_counts_cover_the_cpus() -> None:
    out = subprocess.run([sys.executable, "-m", "kestrel_control.core.cpu_shield", "--cpus",
                          str(CPUS[-1]), "--dry-run"], capture_output=True, text=True,
                         timeout=60)
    if len(CPUS) < 2:
        assert out.returncode != 0 and "parameter 'cpus'" in out.stderr
        return
    report = json.loads(out.stdout)
    assert report["cpus"] == [CPUS[-1]] and report["moved"] >= 1
    counts = irq_counts()
    assert not counts or set(CPUS) <= set(counts)


def test_irqs_are_steered_off_the_shield_and_refusals_counted(tmp_path) -> None:
    """A fake /proc/irq tree: an IRQ on {0, 2} goes to {0}, one only on {2} goes to every other
    CPU of this process, one already off stays, an unwritable one is counted as refused."""
    from kestrel_control.core.cpu_shield import shield_irqs

    if 2 not in CPUS or len(CPUS) < 2:
        cpus = {0: "0,1", 1: "1", 2: "0"}
        shield = 1
    else:
        cpus = {0: "0,2", 1: "2", 2: "0"}
        shield = 2
    for irq, mask in cpus.items():
        (tmp_path / str(irq)).mkdir()
        (tmp_path / str(irq) / "smp_affinity_list").write_text(mask + "\n")
    (tmp_path / "9").mkdir()  # no smp_affinity_list file: refused
    (tmp_path / "9" / "smp_affinity_list").mkdir()
    counts = shield_irqs([shield], root=str(tmp_path))
    assert counts == {"moved": 2, "already_off": 1, "refused": 1}
    assert (tmp_path / "0" / "smp_affinity_list").read_text() == "0"
    rest = ",".join(str(c) for c in CPUS if c != shield)
    assert (tmp_path / "1" / "smp_affinity_list").read_text() == rest
