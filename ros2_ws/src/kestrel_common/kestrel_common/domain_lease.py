"""An exclusive ROS_DOMAIN_ID for a process on this machine (no rclpy).

Stacks that must not hear each other (parallel evaluations, tests, the demo next to a running
stack) each take a lease: an flock held on /tmp/kestrel_ros_domains/<id>.lock for as long as the
lease (or the process) lives, so concurrent runs on one machine never share a domain. The lock
goes with the process: a crashed run frees its id.
"""

from __future__ import annotations

import fcntl
import os
import random
from pathlib import Path

LOCK_DIR = Path("/tmp/kestrel_ros_domains")


class DomainLease:
    """An exclusive ROS_DOMAIN_ID in [low, high] (ROS 2 allows 0..232 on Linux)."""

    def __init__(self, low: int = 1, high: int = 100) -> None:
        LOCK_DIR.mkdir(parents=True, exist_ok=True)
        ids = list(range(low, high + 1))
        random.shuffle(ids)
        for domain in ids:
            fd = os.open(LOCK_DIR / f"{domain}.lock", os.O_CREAT | os.O_RDWR, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self.domain_id = domain
            self._fd: int | None = fd
            return
        raise RuntimeError(f"no free ROS_DOMAIN_ID in {low}..{high}")

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
