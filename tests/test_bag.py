"""MCAP bags (kestrel_bringup.bag / bag_node): rosbag2-compatible files written and read without
rosbag2; record from live topics and replay them, over DDS."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from mcap.reader import make_reader
from mcap_ros2.decoder import DecoderFactory
from rclpy.serialization import deserialize_message, serialize_message
from ros_harness import NodeProcess
from sensor_msgs.msg import JointState
from std_msgs.msg import String

from kestrel_bringup.bag import BagError, BagReader, BagWriter, message_definition
from kestrel_interfaces.msg import TaskPlan, TaskStep


def _joint_state(i: int) -> JointState:
    m = JointState()
    m.header.stamp.sec, m.header.frame_id = i, "base"
    m.name = ["a", "b"]
    m.position = [0.1 * i, -0.2 * i]
    return m


def test_roundtrip_and_foreign_decoder(tmp_path: Path) -> None:
    plan = TaskPlan()
    plan.header.frame_id = "world"
    plan.steps = [TaskStep(skill=TaskStep.SKILL_PICK, target_object="red_cube")]
    with BagWriter(tmp_path / "b") as w:
        w.add_topic("/js", "sensor_msgs/JointState")
        w.add_topic("/plan", "kestrel_interfaces/msg/TaskPlan")
        for i in range(5):
            w.write("/js", serialize_message(_joint_state(i)), 1_000 + 10 * i)
        w.write("/plan", serialize_message(plan), 1_025)
    reader = BagReader(tmp_path / "b")
    assert reader.topics() == {"/js": "sensor_msgs/msg/JointState",
                               "/plan": "kestrel_interfaces/msg/TaskPlan"}
    msgs = list(reader.messages())
    assert [m.log_time_ns for m in msgs] == sorted(m.log_time_ns for m in msgs)
    js = [deserialize_message(m.data, JointState) for m in msgs if m.topic == "/js"]
    assert [list(m.position) for m in js] == [[0.1 * i, -0.2 * i] for i in range(5)]
    # The schema text is complete: mcap_ros2 (Foxglove's decoder) decodes our nested types.
    with open(next((tmp_path / "b").glob("*.mcap")), "rb") as f:
        decoded = {c.topic: d for _, c, _, d in
                   make_reader(f, decoder_factories=[DecoderFactory()]).iter_decoded_messages()}
    assert decoded["/plan"].steps[0].target_object == "red_cube"
    assert decoded["/plan"].steps[0].skill == TaskStep.SKILL_PICK
    meta = (tmp_path / "b" / "metadata.yaml").read_text()
    assert "storage_identifier: mcap" in meta and "message_count: 6" in meta


def test_definition_has_each_nested_type_once() -> None:
    text = message_definition("kestrel_interfaces/msg/TaskPlan")
    assert text.count("MSG: std_msgs/Header") == 1
    assert text.count("MSG: builtin_interfaces/Time") == 1
    assert "MSG: kestrel_interfaces/TaskStep" in text


def test_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(BagError, match="pkg/msg/Type"):
        message_definition("JointState")
    with pytest.raises(BagError, match="no definition"):
        message_definition("no_such_pkg/msg/Foo")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(BagError, match="not empty"):
        BagWriter(tmp_path / "full")
    with pytest.raises(BagError, match="does not exist"):
        BagReader(tmp_path / "missing")
    bad = tmp_path / "bad.mcap"
    bad.write_bytes(b"\x89MCAP0\r\n" + b"\x00" * 64)
    with pytest.raises(BagError):
        list(BagReader(bad).messages())


def _bag_proc(env: dict, run_dir: Path, name: str, *args: str) -> NodeProcess:
    log = run_dir / f"{name}.log"
    fh = open(log, "w")
    proc = subprocess.Popen([sys.executable, "-m", "kestrel_bringup.bag_node", *args], env=env,
                            stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True, cwd=str(run_dir))
    return NodeProcess(name, proc, log, fh)


@pytest.mark.dds
def test_record_then_play_over_dds(env, run_dir, probe, dds_guard) -> None:
    bag = run_dir / "live"
    # depth 50 > the burst: reliable delivery of all 20 even if the recorder's side of the
    # match completes after our side (the writer keeps unacknowledged samples up to its depth)
    pub_js = probe.publisher(JointState, "/in/js", 50)
    pub_txt = probe.publisher(String, "/in/text", 50)
    # --max-messages: the recorder finishes by itself once it has all 40 (a bounded wait below)
    rec = _bag_proc(env, run_dir, "rec", "record", "-o", str(bag), "/in/js", "/in/text",
                    "--max-messages", "40")
    try:
        assert probe.wait_for_subscribers(pub_js) and probe.wait_for_subscribers(pub_txt), \
            rec.output()
        for i in range(20):
            pub_js.publish(_joint_state(i))
            pub_txt.publish(String(data=f"msg {i}"))
        code = rec.proc.wait(20)
    finally:
        rec.stop()
    assert code == 0, rec.output()
    assert "recorded 40 messages on 2 topics" in rec.output(), rec.output()
    texts = [deserialize_message(m.data, String).data
             for m in BagReader(bag).messages({"/in/text"})]
    assert texts == [f"msg {i}" for i in range(20)]

    out = probe.subscribe(JointState, "/out/js", 50)  # the replayed burst fits the queue
    play = _bag_proc(env, run_dir, "play", "play", str(bag), "--topics", "/in/js", "--remap",
                     "/in/js:=/out/js", "--rate", "4", "--wait-subscribers", "10")
    try:
        got = out.wait_for(lambda m: len(m) >= 20, timeout=20.0)
        assert got, play.output()
        assert [list(m.position) for m in got] == [[0.1 * i, -0.2 * i] for i in range(20)]
        assert play.proc.wait(20) == 0, play.output()
    finally:
        play.stop()
    assert "played 20 messages" in play.output()
