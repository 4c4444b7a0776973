"""The simulator contract (kestrel_bringup/config/sim_contract.yaml) agrees with the stack
table (which node role-named topic is remapped to which contract topic, who consumes it) and
with the Gazebo and Isaac Sim bridge descriptions (no ROS graph needed)."""

from __future__ import annotations

from pathlib import Path

import yaml

from kestrel_bringup.stack import STACK, entry

CONFIG = Path(__file__).resolve().parents[1] / "ros2_ws/src/kestrel_bringup/config"


def contract() -> dict:
    return yaml.safe_load((CONFIG / "sim_contract.yaml").read_text())


def all_topics(c: dict) -> dict[str, str]:
    """contract name -> ROS type, for topics, the clock and services."""
    out = {name: spec["type"] for name, spec in {**c["publishes"], **c["subscribes"],
                                                 **c["services"]}.items()}
    out[c["clock"]["topic"]] = c["clock"]["type"]
    return out


def test_embedded_sim_remaps_exactly_the_contract() -> None:
    c = contract()
    sim = dict(entry("sim").remappings)
    for name, spec in {**c["publishes"], **c["subscribes"]}.items():
        assert sim.get(spec["role"]) == name, (name, spec["role"])
        assert spec["qos"] in c["qos"]
    roles = {spec["role"] for spec in {**c["publishes"], **c["subscribes"]}.values()}
    assert set(sim) == roles  # nothing the sim publishes outside the contract
    assert c["services"]["/sim/reset"]["role"] == "~/reset"  # /sim/reset: node name "sim"


def test_every_contract_topic_has_its_consumers_and_producers() -> None:
    c = contract()
    inputs = {dst for e in STACK if e.name != "sim" for src, dst in e.remappings
              if src.startswith("~/input/")}
    outputs = {dst for e in STACK if e.name != "sim" for src, dst in e.remappings
               if src.startswith("~/output/")}
    for name, spec in c["publishes"].items():
        # what the nodes consume; evaluation topics are for the evaluator only
        assert name in inputs or spec.get("evaluation") or spec.get("optional") or \
            spec.get("external"), name
    for name in c["subscribes"]:
        assert name in outputs, name
    assert "/joint_states" in inputs and "/camera/image_raw" in inputs


def test_gazebo_bridge_carries_the_contract() -> None:
    c = contract()
    bridge = yaml.safe_load((CONFIG / c["bridges"]["gazebo"]["file"]).read_text())
    assert isinstance(bridge, list)  # ros_gz_bridge's config format: a list of topics
    topics = all_topics(c)
    pub = {**c["publishes"], c["clock"]["topic"]: c["clock"]}
    bridged = {}
    for b in bridge:
        assert set(b) == {"ros_topic_name", "gz_topic_name", "ros_type_name", "gz_type_name",
                          "direction"}, b
        bridged[b["ros_topic_name"]] = b
        if b["ros_topic_name"] in pub:
            assert b["direction"] == "GZ_TO_ROS", b
            assert b["ros_type_name"] == topics[b["ros_topic_name"]], b
    adapter = set(c["bridges"]["gazebo"]["adapter"])
    contract_names = set(topics)
    assert (set(bridged) & contract_names) | adapter == contract_names
    assert not set(bridged) & adapter
    # the joint command reaches every commanded joint through the adapter's per-joint topics
    joints = [*c["joints"]["arm"], c["joints"]["gripper"]]
    assert {f"/kestrel_arm/{j}/cmd_pos" for j in joints} <= set(bridged)


def test_isaac_bridge_carries_the_contract() -> None:
    c = contract()
    desc = yaml.safe_load((CONFIG / c["bridges"]["isaac_sim"]["file"]).read_text())
    topics = all_topics(c)
    nodes = {n["topic"]: n for n in desc["nodes"]}
    for topic, n in nodes.items():
        assert n["node"].startswith("isaacsim.ros2.bridge."), n
        assert n["ros_type"] == topics[topic], n
        want = "subscribe" if topic in c["subscribes"] else "publish"
        assert n["direction"] == want, n
    adapter = set(c["bridges"]["isaac_sim"]["adapter"])
    assert set(nodes) | adapter == set(topics) and not set(nodes) & adapter
