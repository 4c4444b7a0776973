"""The deployment checklist's ROS side: read the parameters of the stack's running nodes
(`kestrel_bench doctor --live`), through each node's parameter services. The only module of the
doctor that imports rclpy."""

from __future__ import annotations

import time
from typing import Any

STACK_NODES = ("sim", "perception", "planner", "control")


def read_live_params(names: tuple[str, ...] = STACK_NODES, discovery_s: float = 5.0,
                     timeout_s: float = 5.0) -> dict[str, dict[str, Any]]:
    """{node name: {parameter: value}} of every running node whose name (last part) is in
    `names`. Waits at most `discovery_s` for the nodes to be discovered (returns early once
    all of them are), then at most `timeout_s` per service call."""
    import rclpy
    from rclpy.parameter import parameter_value_to_python
    from rclpy.parameter_client import AsyncParameterClient

    own_context = not rclpy.ok()
    if own_context:
        rclpy.init()
    node = rclpy.create_node("kestrel_doctor")
    out: dict[str, dict[str, Any]] = {}
    try:
        found: dict[str, str] = {}
        deadline = time.monotonic() + discovery_s
        while time.monotonic() < deadline and len(found) < len(names):
            rclpy.spin_once(node, timeout_sec=0.1)  # discovery runs while we spin
            for name, ns in node.get_node_names_and_namespaces():
                if name in names:
                    found[name] = f"{ns.rstrip('/')}/{name}"
        for name, full in sorted(found.items()):
            client = AsyncParameterClient(node, full)
            if not client.wait_for_services(timeout_sec=timeout_s):
                continue
            listed = client.list_parameters([], 0)
            rclpy.spin_until_future_complete(node, listed, timeout_sec=timeout_s)
            if listed.result() is None:
                continue
            keys = list(listed.result().result.names)
            got = client.get_parameters(keys)
            rclpy.spin_until_future_complete(node, got, timeout_sec=timeout_s)
            if got.result() is None:
                continue
            out[name] = {k: parameter_value_to_python(v)
                         for k, v in zip(keys, got.result().values, strict=True)}
    finally:
        node.destroy_node()
        if own_context:
            rclpy.shutdown()
    return out
