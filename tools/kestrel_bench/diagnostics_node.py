"""A /diagnostics listener for the soak run: the latest numeric values each node reports
(its counters: deadline misses, drops, rejections). The only rclpy user of `soak`."""

from __future__ import annotations

import threading


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
        self._executor = SingleThreadedExecutor()
        self._executor.add_node(self._node)
        self._thread = threading.Thread(target=self._spin, daemon=True)
        self._stop = threading.Event()
        self._thread.start()

    def _spin(self) -> None:
        while not self._stop.is_set() and self._rclpy.ok():
            self._executor.spin_once(timeout_sec=0.1)

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
        self._stop.set()
        self._thread.join(timeout=2.0)
        self._executor.shutdown(timeout_sec=1.0)
        self._node.destroy_node()
        self._rclpy.try_shutdown()
