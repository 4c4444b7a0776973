"""Bags as rosbag2 writes and reads them: rosbags (an independent reader of rosbag2's format)
reads Kestrel's bags and Kestrel reads and plays rosbags' bags; recordings cut short are
recovered by reindex; empty, random and truncated files give a clear BagError."""

from __future__ import annotations

import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from mcap.reader import make_reader
from mcap_ros2.decoder import DecoderFactory
from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy
from rclpy.serialization import deserialize_message, serialize_message
from rosbags.rosbag2 import Reader as RosbagsReader
from rosbags.rosbag2 import StoragePlugin
from rosbags.rosbag2 import Writer as RosbagsWriter
from rosbags.typesys import Stores, get_typestore
from ros_harness import NodeProcess
from sensor_msgs.msg import JointState
from std_msgs.msg import String

from kestrel_bringup import bag_qos
from kestrel_bringup.bag import BagError, BagReader, BagWriter, message_definition, reindex
from kestrel_bringup.bag_node import clock_source, main, message_class, qos_to_profiles
from kestrel_interfaces.action import PlanTask

LATCHED = QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE,
                     durability=DurabilityPolicy.TRANSIENT_LOCAL)


def _js(i: int, width: int = 2) -> JointState:
    m = JointState()
    m.header.stamp.sec = i
    m.name = [f"j{k}" for k in range(width)]
    m.position = [0.01 * i] * width
    return m


def _write_bag(path: Path, n: int = 5, width: int = 2) -> list[bytes]:
    datas = [serialize_message(_js(i, width)) for i in range(n)]
    fb = PlanTask.Impl.FeedbackMessage()
    fb.feedback.partial_text = "pick red_cube"
    with BagWriter(path) as w:
        w.add_topic("/js", "sensor_msgs/msg/JointState", qos_to_profiles([LATCHED]))
        w.add_topic("/planner/plan_task/_action/feedback",
                    "kestrel_interfaces/action/PlanTask_FeedbackMessage",
                    qos_to_profiles([QoSProfile(depth=10)]))
        for i, d in enumerate(datas):
            w.write("/js", d, 1_000_000 + 1000 * i)
        w.write("/planner/plan_task/_action/feedback", serialize_message(fb), 1_000_500)
    return datas


def test_rosbags_reads_kestrel_bags(tmp_path: Path) -> None:
    _write_bag(tmp_path / "b")
    with BagWriter(tmp_path / "s") as w:
        w.add_topic("/text", "std_msgs/msg/String", qos_to_profiles([QoSProfile(depth=5)]))
        w.write("/text", serialize_message(String(data="hello")), 1_000)
    with RosbagsReader(tmp_path / "b") as reader:
        conns = {c.topic: c for c in reader.connections}
        assert set(conns) == {"/js", "/planner/plan_task/_action/feedback"}
        qos = conns["/js"].ext.offered_qos_profiles[0]
        assert qos.reliability.name.lower() == "reliable"
        assert qos.durability.name.lower() == "transient_local"
        js = [deserialize_message(raw, JointState) for c, _, raw in reader.messages()
              if c.topic == "/js"]
    assert [float(m.position[0]) for m in js] == pytest.approx([0.0, 0.01, 0.02, 0.03, 0.04])
    store = get_typestore(Stores.ROS2_KILTED)
    with RosbagsReader(tmp_path / "s") as reader:
        (text,) = [store.deserialize_cdr(raw, c.msgtype) for c, _, raw in reader.messages()]
    assert text.data == "hello"
    meta = yaml.safe_load((tmp_path / "b" / "metadata.yaml").read_text())
    topic = meta["rosbag2_bagfile_information"]["topics_with_message_count"][0]
    assert topic["topic_metadata"]["offered_qos_profiles"][0]["history"] == "keep_last"


def test_action_feedback_topics_are_recordable(tmp_path: Path) -> None:
    cls = message_class("kestrel_interfaces/action/PlanTask_FeedbackMessage")
    assert cls is PlanTask.Impl.FeedbackMessage
    text = message_definition("kestrel_interfaces/action/PlanTask_FeedbackMessage")
    assert text.startswith("unique_identifier_msgs/UUID goal_id\nPlanTask_Feedback feedback")
    _write_bag(tmp_path / "b")
    (m,) = BagReader(tmp_path / "b").messages({"/planner/plan_task/_action/feedback"})
    assert m.type_name == "kestrel_interfaces/action/PlanTask_FeedbackMessage"
    assert deserialize_message(m.data, cls).feedback.partial_text == "pick red_cube"
    # plain message types keep their ros2msg schema that Foxglove's decoder reads
    with open(next((tmp_path / "b").glob("*.mcap")), "rb") as f:
        decoded = [d for _, c, _, d in make_reader(
            f, decoder_factories=[DecoderFactory()]).iter_decoded_messages(topics=["/js"])]
    assert [list(d.name) for d in decoded[:1]] == [["j0", "j1"]]


def _rosbags_bag(path: Path, n: int = 10) -> None:
    store = get_typestore(Stores.ROS2_KILTED)
    String_ = store.types["std_msgs/msg/String"]
    with RosbagsWriter(path, version=9, storage_plugin=StoragePlugin.MCAP) as w:
        conn = w.add_connection("/chatter", "std_msgs/msg/String", typestore=store)
        for i in range(n):
            w.write(conn, 10**9 + i * 10**7, store.serialize_cdr(String_(data=f"hi {i}"),
                                                                 "std_msgs/msg/String"))


def test_kestrel_reads_rosbags_bags(tmp_path: Path) -> None:
    _rosbags_bag(tmp_path / "r")
    reader = BagReader(tmp_path / "r")
    assert reader.topics() == {"/chatter": "std_msgs/msg/String"}
    texts = [deserialize_message(m.data, String).data for m in reader.messages()]
    assert texts == [f"hi {i}" for i in range(10)]


def test_cut_short_recording_is_recovered(tmp_path: Path) -> None:
    datas = _write_bag(tmp_path / "full", n=3000, width=60)   # ~3 MB: several 1 MB chunks
    cut = tmp_path / "cut"
    shutil.copytree(tmp_path / "full", cut)
    mcap_file = next(cut.glob("*.mcap"))
    mcap_file.write_bytes(mcap_file.read_bytes()[: int(mcap_file.stat().st_size * 0.7)])
    (cut / "metadata.yaml").unlink()   # as after SIGKILL: metadata.yaml is written at close
    with pytest.raises(BagError, match="reindex"):
        BagReader(cut)
    kept = reindex(cut)
    assert 0 < kept < len(datas)
    got = [m.data for m in BagReader(cut).messages({"/js"})]
    assert got == datas[: len(got)]   # every kept message is whole, in order
    with RosbagsReader(cut) as r:      # and the repaired bag is a rosbag2 bag again
        assert r.message_count == kept
    # the command line does the same
    shutil.copytree(tmp_path / "full", tmp_path / "cut2")
    f2 = next((tmp_path / "cut2").glob("*.mcap"))
    f2.write_bytes(f2.read_bytes()[:-100])   # footer and summary lost
    assert main(["bag_node", "reindex", str(tmp_path / "cut2")]) == 0
    assert len(list(BagReader(tmp_path / "cut2").messages())) == len(datas) + 1


@pytest.mark.parametrize("kind", ["empty", "random", "30 bytes"])
def test_damaged_files_give_a_clear_error(tmp_path: Path, kind: str, capsys) -> None:
    _write_bag(tmp_path / "ok")
    good = next((tmp_path / "ok").glob("*.mcap")).read_bytes()
    content = {"empty": b"", "random": random.Random(0).randbytes(4096),
               "30 bytes": good[:30]}[kind]
    bag = tmp_path / "bad"
    bag.mkdir()
    (bag / "bad_0.mcap").write_bytes(content)
    for call in (lambda: list(BagReader(bag / "bad_0.mcap").messages()),
                 lambda: BagReader(bag / "bad_0.mcap").topics(), lambda: reindex(bag)):
        with pytest.raises(BagError, match="empty|not an MCAP file|nothing to recover|cut short"):
            call()
    assert main(["bag_node", "info", str(bag / "bad_0.mcap")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("info: ") and "Traceback" not in err


def test_metadata_is_checked(tmp_path: Path) -> None:
    _write_bag(tmp_path / "b")
    meta_path = tmp_path / "b" / "metadata.yaml"
    meta = yaml.safe_load(meta_path.read_text())
    info = meta["rosbag2_bagfile_information"]
    for key, value, match in [("storage_identifier", "sqlite3", "only 'mcap'"),
                              ("relative_file_paths", ["gone_0.mcap"], "missing"),
                              ("version", 99, "version 99")]:
        bad = {**info, key: value}
        meta_path.write_text(yaml.safe_dump({"rosbag2_bagfile_information": bad}))
        with pytest.raises(BagError, match=match):
            BagReader(tmp_path / "b")
    meta_path.write_text("{not: [yaml")
    with pytest.raises(BagError, match="not valid YAML"):
        BagReader(tmp_path / "b")


def test_qos_profiles_in_rosbag2_form() -> None:
    (p,) = qos_to_profiles([LATCHED])
    assert set(p) == {"history", "depth", "reliability", "durability", "deadline", "lifespan",
                      "liveliness", "liveliness_lease_duration",
                      "avoid_ros_namespace_conventions"}
    assert (p["reliability"], p["durability"], p["liveliness"]) == (
        "reliable", "transient_local", "system_default")
    assert p["deadline"] == {"sec": 9223372036, "nsec": 854775807}   # rmw's infinite
    # version <= 8 bags wrote integers; both parse to the same profile
    old = bag_qos.parse_profiles("- {history: 1, depth: 1, reliability: 1, durability: 1}")
    assert old[0]["reliability"] == "reliable" and old[0]["durability"] == "transient_local"
    assert bag_qos.parse_profiles("::: not yaml") == []


def test_play_never_publishes_a_second_clock() -> None:
    assert clock_source({"/js"}, 100.0) == (True, "")
    publish, warning = clock_source({"/clock", "/js"}, 100.0)
    assert not publish and "ignored" in warning
    assert clock_source({"/clock"}, 0.0) == (False, "")


@pytest.mark.dds
def test_play_a_rosbags_bag_over_dds(env, run_dir, probe, dds_guard) -> None:
    _rosbags_bag(run_dir / "r", n=10)
    out = probe.subscribe(String, "/out/chatter", 50)
    log = run_dir / "play.log"
    fh = open(log, "w")
    proc = subprocess.Popen([sys.executable, "-m", "kestrel_bringup.bag_node", "play",
                             str(run_dir / "r"), "--remap", "/chatter:=/out/chatter",
                             "--rate", "4", "--wait-subscribers", "10"], env=env, stdout=fh,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True, cwd=str(run_dir))
    play = NodeProcess("play", proc, log, fh)
    try:
        got = out.wait_for(lambda m: len(m) >= 10, timeout=20.0)
        assert got, play.output()
        assert [m.data for m in got] == [f"hi {i}" for i in range(10)]
        assert play.proc.wait(20) == 0, play.output()
    finally:
        play.stop()
