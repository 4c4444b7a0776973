"""A /diagnostics listener for the soak run: the latest numeric values each node reports
(its counters: deadline misses, drops, rejections). The only rclpy user of `soak`."""

from __future__ import annotations

import threading

from kestrel_bench.repo import ensure_paths

ensure_paths("kestrel_common")
from kestrel_common.spin_thread import SpinThread  # noqa: E402


class DiagnosticsListener:
    """Spins its own node in a thread; `latest()` -> {node name: {key: number}}."""

    def __init__(self) -> None:
        import rclpy
        from diagnostic_msgs.msg import DiagnosticArray
        from rclpy.executors import SingleThreadedExecutor

        self._rclpy = rclpy
        if not rclpy.ok():
            rclpy.init()
        self._node = rclpy.create_node("kestrel_soak_diagnostics")
        self._values: dict[str, dict[str, float]] = {}
        self._lock = threading.Lock()
        self._node.create_subscription(DiagnosticArray, "/diagnostics", self._on_diag, 50)
        executor = SingleThreadedExecutor()
        executor.add_node(self._node)
        self._spin = SpinThread(executor, name="diagnostics_spin")

    def _on_diag(self, msg) -> None:  # noqa: ANN001 (DiagnosticArray)
        for status in msg.status:
            values = {}
            for kv in status.values:
                try:
                    values[kv.key] = float(kv.value)
                except ValueError:
                    continue
            with self._lock:
                self._values.setdefault(status.name, {}).update(values)

    def latest(self) -> dict[str, dict[str, float]]:
        with self._lock:
            return {k: dict(v) for k, v in self._values.items()}

    def close(self) -> None:
        if self._spin.stop(timeout_s=2.0):
            self._node.destroy_node()
        self._rclpy.try_shutdown()
