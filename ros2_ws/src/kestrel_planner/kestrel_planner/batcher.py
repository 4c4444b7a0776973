"""The planner node's batching worker (no rclpy): goals queue as jobs; one thread serves up to
max_batch of them per PlannerCore.plan_batch call, and never lets a model failure escape."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kestrel_planner.core import PlannerCore, PlannerInputError, PlanRequest, PlanResult

__all__ = ["Job", "Batcher"]


@dataclass
class Job:
    request: PlanRequest
    done: threading.Event = field(default_factory=threading.Event)
    result: PlanResult | None = None
    error: str = ""
    abandoned: bool = False  # the goal gave up waiting (goal_timeout): stop decoding it


class Batcher:
    """start(core, max_batch) / submit(job) / stop(). count(name) and log_error(text) are the
    node's counters and logger. Jobs left at stop() end with error 'node deactivated'."""

    def __init__(self, count: Callable[[str], object], log_error: Callable[[str], None]) -> None:
        self._count, self._log_error = count, log_error
        self._cv = threading.Condition()
        self._jobs: list[Job] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._core: PlannerCore | None = None
        self._max_batch = 1

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def start(self, core: PlannerCore, max_batch: int) -> None:
        self._core, self._max_batch = core, max_batch
        self._stop.clear()
        self._thread = threading.Thread(target=self._work, name="planner_worker", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._cv:
            self._jobs.append(job)
            self._cv.notify()

    def stop(self, timeout: float = 5.0) -> None:
        """Idempotent: the thread ends after its current batch (decoding polls cancel)."""
        self._stop.set()
        with self._cv:
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=timeout)
            self._thread = None

    def _work(self) -> None:
        while not self._stop.is_set():
            with self._cv:
                if not self._jobs:
                    self._cv.wait(timeout=0.2)
                    continue
                batch = self._jobs[: self._max_batch]
                del self._jobs[: len(batch)]
            self._run(batch)
        with self._cv:
            left, self._jobs = self._jobs, []
        for job in left:
            job.error = "node deactivated"
            job.done.set()

    def _run(self, batch: list[Job]) -> None:
        started = time.monotonic()
        self._count("batches")
        self._count(f"batch_size_{len(batch)}")
        core = self._core
        assert core is not None
        try:
            results = core.plan_batch([j.request for j in batch])
            for job, res in zip(batch, results, strict=True):
                job.result = res
        except PlannerInputError:  # one bad request: serve them one by one
            for job in batch:
                try:
                    job.result = core.plan_batch([job.request])[0]
                except PlannerInputError as exc:
                    job.error = f"bad request: {exc}"
        except Exception as exc:  # noqa: BLE001 - a model failure must not kill the node
            self._count("planner_errors")
            self._log_error(f"planning failed: {exc!r}")
            for job in batch:
                job.error = f"internal error: {exc!r}"
        for job in batch:
            if job.result is not None:
                job.result.started = started
            job.done.set()
