"""Fixtures of the benchmark harness's DDS tests: a ROS domain of their own, its environment
and a probe node (as tests/conftest.py provides for the stack's tests)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Iterator

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmark_run, the tests' helper


def _ros_available() -> str | None:
    if "AMENT_PREFIX_PATH" not in os.environ:
        return "ROS environment not sourced (run through `make test` / scripts/env.sh)"
    try:
        import kestrel_interfaces.msg  # noqa: F401
        import rclpy  # noqa: F401
    except ImportError as exc:
        return f"ROS packages not importable: {exc}"
    return None


@pytest.fixture
def ros_domain() -> Iterator[int]:
    reason = _ros_available()
    if reason:
        pytest.skip(reason)
    from ros_harness import DomainLease

    lease = DomainLease()
    try:
        yield lease.domain_id
    finally:
        lease.release()


@pytest.fixture
def env(ros_domain: int, tmp_path: Path) -> dict[str, str]:
    from ros_harness import ros_env

    return ros_env(ros_domain, tmp_path)


@pytest.fixture
def probe(ros_domain: int) -> Iterator:
    from ros_harness import Probe

    p = Probe(ros_domain)
    try:
        yield p
    finally:
        p.close()
