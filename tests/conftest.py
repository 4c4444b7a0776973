"""Fixtures for multi-process DDS tests (see ros_harness.py)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ros_harness import (DomainLease, NodeProcess, Probe, dds_shm_files,  # noqa: E402
                         orphaned_shm_files, ros_env, shm_owners, spawn_node)


def _ros_available() -> str | None:
    if "AMENT_PREFIX_PATH" not in os.environ:
        return "ROS environment not sourced (run through `make test` / scripts/env.sh)"
    try:
        import kestrel_interfaces.msg  # noqa: F401
        import rclpy  # noqa: F401
    except ImportError as exc:
        return f"ROS packages not importable: {exc}"
    return None


@pytest.hookimpl(tryfirst=True)  # before -m selects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that starts node processes or checks /dev/shm (the fixtures below, and the
    benchmark harness's in tools/tests) is a DDS test, marked or not: scripts/test.sh runs those
    one at a time, after the tests that share the machine."""
    for item in items:
        if {"launch_node", "dds_guard", "probe"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.dds)


@pytest.fixture
def ros_domain() -> Iterator[int]:
    reason = _ros_available()
    if reason:
        pytest.skip(reason)
    lease = DomainLease()
    try:
        yield lease.domain_id
    finally:
        lease.release()


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path


@pytest.fixture
def env(ros_domain: int, run_dir: Path) -> dict[str, str]:
    return ros_env(ros_domain, run_dir)


class ShmWatch:
    """dds_guard's value: `snapshot()` (launch_node calls it before stopping its processes)
    notes which process maps each new Fast DDS file, so that an orphan names its owner."""

    def __init__(self) -> None:
        self.before = dds_shm_files()
        self.owners: dict[str, str] = {}

    def snapshot(self) -> None:
        self.owners.update(shm_owners(dds_shm_files() - self.before))


@pytest.fixture
def dds_guard(ros_domain: int) -> Iterator[ShmWatch]:
    """After the test's processes and probe are gone, no Fast DDS shared-memory file that
    appeared during the test may be left orphaned in /dev/shm."""
    watch = ShmWatch()
    yield watch
    new = dds_shm_files() - watch.before  # participants' segments (dds_shm_files: why only those)
    orphans = orphaned_shm_files(new)
    # a participant being destroyed closes a file before it unlinks it: wait for the unlink
    deadline = time.monotonic() + 3.0
    while orphans and time.monotonic() < deadline:
        time.sleep(0.05)  # polling the condition below, bounded by the deadline
        orphans = orphaned_shm_files(orphans)
    assert not orphans, "orphaned Fast DDS files left in /dev/shm: " + ", ".join(
        f"{name} (mapped by {watch.owners.get(name, 'no process seen')})"
        for name in sorted(orphans))


@pytest.fixture
def probe(ros_domain: int, dds_guard: ShmWatch) -> Iterator[Probe]:
    p = Probe(ros_domain)
    try:
        yield p
    finally:
        p.close()


@pytest.fixture
def launch_node(env: dict[str, str], run_dir: Path, dds_guard: ShmWatch) -> Iterator:
    """launch_node(module, node_name, params=None, remaps=None) -> NodeProcess.

    On teardown every process is stopped (bounded) and its process group must be gone; a
    process that stopped with an error prints its output (what an orphaned file came from).
    """
    procs: list[NodeProcess] = []

    def _launch(module: str, node_name: str, params: dict | None = None,
                remaps: dict | None = None, params_files: list | None = None) -> NodeProcess:
        p = spawn_node(module, node_name, env, run_dir, params, remaps, params_files)
        procs.append(p)
        return p

    yield _launch
    dds_guard.snapshot()
    for p in procs:
        if p.stop() != 0:
            print(f"--- {p.name} stopped with an error; its output:\n{p.output()[-4000:]}")
    for p in procs:
        assert p.group_gone(), f"stray processes left by {p.name}"
