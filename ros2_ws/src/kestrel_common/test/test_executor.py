"""make_executor (kestrel_common.base_node): the executor a node's `executor` parameter picks."""

from __future__ import annotations

import pytest


def test_executor_parameter_picks_the_executor():
    """make_executor: a node's read-only `executor` parameter picks single / multi, a node
    without one gets the MultiThreadedExecutor, a bad value names the parameter (perception
    declares it, default 'single'). A stand-in node: no DDS entities needed."""
    import rclpy
    from rclpy.context import Context
    from rclpy.executors import MultiThreadedExecutor, SingleThreadedExecutor

    from kestrel_common.base_node import make_executor

    class _Node:
        def __init__(self, context: Context, value: str | None) -> None:
            self.context, self.value = context, value

        def has_parameter(self, name: str) -> bool:
            return name == "executor" and self.value is not None

        def get_parameter(self, name: str):  # noqa: ANN202
            return type("P", (), {"value": self.value})()

    ctx = Context()
    rclpy.init(context=ctx)
    try:
        for value, expected in ((None, MultiThreadedExecutor), ("single", SingleThreadedExecutor),
                                ("multi", MultiThreadedExecutor)):
            executor = make_executor(_Node(ctx, value))
            assert type(executor) is expected, value
            executor.shutdown(timeout_sec=1.0)
        with pytest.raises(ValueError, match="parameter 'executor' = 'events'"):
            make_executor(_Node(ctx, "events"))
    finally:
        rclpy.shutdown(context=ctx)
