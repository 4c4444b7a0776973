"""The running embedded sim node, with the stack's remappings, publishes and subscribes exactly
the simulator contract (sim_contract.yaml): names, types, QoS; the control node subscribes and
publishes its part under the same names and types."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml
from rclpy.qos import DurabilityPolicy, ReliabilityPolicy

from kestrel_bringup.stack import entry

pytestmark = pytest.mark.dds

CONFIG = Path(__file__).resolve().parents[1] / "ros2_ws/src/kestrel_bringup/config"
RELIABILITY = {"reliable": ReliabilityPolicy.RELIABLE,
               "best_effort": ReliabilityPolicy.BEST_EFFORT}
DURABILITY = {"volatile": DurabilityPolicy.VOLATILE,
              "transient_local": DurabilityPolicy.TRANSIENT_LOCAL}


def _wait(fn, timeout: float = 60.0):
    """fn() until truthy (a node not yet discovered counts as not yet), bounded."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = fn()
        except Exception:  # NodeNameNonExistentError: not discovered yet
            value = None
        if value:
            return value
        time.sleep(0.2)
    return None


def test_running_nodes_speak_the_contract(probe, launch_node):
    c = yaml.safe_load((CONFIG / "sim_contract.yaml").read_text())
    sim_params = {"publish_depth": True, "camera_rate_hz": 1.0, "lidar_rate_hz": 1.0,
                  "lidar_n_vertical": 8}
    sim = launch_node("kestrel_sim.sim_node", "sim", params=sim_params,
                      remaps=dict(entry("sim").remappings))
    ctl = launch_node("kestrel_control.control_node", "control",
                      remaps=dict(entry("control").remappings))
    node = probe.node
    pubs = {**c["publishes"], c["clock"]["topic"]: c["clock"]}

    def sim_pubs():
        found = dict(node.get_publisher_names_and_types_by_node("sim", "/"))
        return found if set(pubs) <= set(found) else None

    found = _wait(sim_pubs)
    assert found, sim.output()
    for name, spec in pubs.items():
        assert found[name] == [spec["type"]], name
        qos = c["qos"][spec["qos"]]

        def matching(name=name, qos=qos):  # noqa: ANN202 - bound per topic
            return any(i.node_name == "sim" and i.qos_profile.reliability ==
                       RELIABILITY[qos["reliability"]] and i.qos_profile.durability ==
                       DURABILITY[qos["durability"]]
                       for i in node.get_publishers_info_by_topic(name))

        assert _wait(matching, 20.0), (name, node.get_publishers_info_by_topic(name))
    extra = {t for t in found if not t.startswith(("/rosout", "/parameter_events",
                                                   "/diagnostics", "/sim/transition_event"))}
    assert extra == set(pubs), extra - set(pubs)
    subs = dict(_wait(lambda: node.get_subscriber_names_and_types_by_node("sim", "/")))
    for name, spec in c["subscribes"].items():
        assert subs.get(name) == [spec["type"]], (name, subs)
    services = dict(node.get_service_names_and_types_by_node("sim", "/"))
    for name, spec in c["services"].items():
        assert services.get(name) == [spec["type"]], (name, services)

    # the control node: the contract's joint states in, the joint command out
    def ctl_graph():
        s = dict(node.get_subscriber_names_and_types_by_node("control", "/"))
        p = dict(node.get_publisher_names_and_types_by_node("control", "/"))
        return (s, p) if "/joint_states" in s and "/control/joint_command" in p else None

    graph = _wait(ctl_graph, timeout=120.0)
    assert graph, ctl.output()
    s, p = graph
    assert s["/joint_states"] == [c["publishes"]["/joint_states"]["type"]]
    assert p["/control/joint_command"] == [c["subscribes"]["/control/joint_command"]["type"]]
    assert sim.alive() and ctl.alive()
