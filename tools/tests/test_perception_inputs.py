"""The perception node benchmark's input side (kestrel_bench.perception_inputs): the trigger
schedule, the trigger wait, the merge of the per-sensor processes' records, and one live
per-sensor run (2 cameras + LiDAR, one process each) received by a plain rclpy subscriber:
every message of a frame carries the same stamp, the scheduled trigger time."""

from __future__ import annotations

import pytest
from kestrel_bench.perception_inputs import (InputConfig, merge_sensor_runs, publish_inputs,
                                             rate_period_ns, trigger_schedule, wait_until_ns)

START = 1_700_000_000_123_456_789  # ns, a wall-clock time


def test_trigger_schedule_is_start_plus_i_periods_without_drift() -> None:
    assert trigger_schedule(START, 100_000_000, 3) == [START, START + 100_000_000,
                                                       START + 200_000_000]
    # warm-up frames come first: the timed frames continue the same schedule
    assert trigger_schedule(START, 100_000_000, 2, first=5) == [START + 500_000_000,
                                                                START + 600_000_000]
    p = rate_period_ns(3.0)
    assert p == 333_333_333  # integer ns: every process derives the same period
    sched = trigger_schedule(START, p, 10_000)
    assert sched[-1] == START + 9_999 * 333_333_333  # exact, no accumulated float error
    assert all(b - a == p for a, b in zip(sched[:-1], sched[1:], strict=True))
    assert trigger_schedule(START, p, 0) == []
    with pytest.raises(ValueError, match="'period_ns' = 0"):
        trigger_schedule(START, 0, 3)
    with pytest.raises(ValueError, match="'frames' = -1"):
        trigger_schedule(START, p, -1)


def test_wait_until_sleeps_to_one_ms_before_then_spins_to_the_trigger() -> None:
    t = [START]
    sleeps: list[float] = []

    def clock() -> int:
        t[0] += 20_000  # each clock read takes 20 us
        return t[0]

    def sleep(s: float) -> None:
        sleeps.append(s)
        t[0] += int(s * 1e9) + 150_000  # the sleep wakes up 150 us late

    target = START + 50_000_000
    got = wait_until_ns(target, spin_ns=1_000_000, clock=clock, sleep=sleep)
    assert got >= target and got - target < 20_000  # the first reading at/after the target
    assert len(sleeps) == 1  # one sleep, then spinning on the clock
    assert sleeps[0] == pytest.approx((target - START - 20_000 - 1_000_000) / 1e9)
    assert wait_until_ns(START - 1, clock=clock, sleep=sleep) > START  # late: returns at once
    assert len(sleeps) == 1


def _run(sensor: str, stamps: list[int], late: list[int], dur: list[int]) -> dict:
    return {"sensor": sensor, "stamps_ns": stamps, "start_lateness_ns": late,
            "publish_ns": dur}


def test_merge_takes_per_frame_max_over_sensors() -> None:
    st = trigger_schedule(START, 100_000_000, 3)
    runs = [_run("0", st, [10_000, 20_000, 5_000], [1_000_000, 1_000_000, 1_000_000]),
            _run("1", st, [30_000, 10_000, 5_000], [900_000, 2_000_000, 1_000_000]),
            _run("cloud", st, [0, 0, 400_000], [2_500_000, 500_000, 200_000])]
    m = merge_sensor_runs(runs)
    assert m["stamps_ns"] == st
    assert m["sensors"] == ["0", "1", "cloud"]
    # publish_set = max over sensors of (start lateness + publish duration) = end - trigger
    assert m["publish_s"] == pytest.approx([2.5e-3, 2.01e-3, 1.005e-3])
    assert m["trigger_lateness_s"] == pytest.approx([30e-6, 20e-6, 400e-6])
    assert m["publish_end_by_sensor_s"]["cloud"] == pytest.approx([2.5e-3, 0.5e-3, 0.6e-3])


def test_merge_rejects_disagreeing_or_malformed_records() -> None:
    st = trigger_schedule(START, 100_000_000, 3)
    other = [st[0], st[1] + 1, st[2]]
    with pytest.raises(ValueError, match=r"stamps disagree at frame 1: sensor 'cloud'"):
        merge_sensor_runs([_run("0", st, [0] * 3, [1] * 3), _run("cloud", other, [0] * 3,
                                                                  [1] * 3)])
    with pytest.raises(ValueError, match="reported 2 frames"):
        merge_sensor_runs([_run("0", st, [0] * 3, [1] * 3), _run("1", st[:2], [0] * 2,
                                                                  [1] * 2)])
    with pytest.raises(ValueError, match="different lengths"):
        merge_sensor_runs([_run("0", st, [0] * 2, [1] * 3)])
    with pytest.raises(ValueError, match="reported twice"):
        merge_sensor_runs([_run("0", st, [0] * 3, [1] * 3)] * 2)
    with pytest.raises(ValueError, match="no sensor runs"):
        merge_sensor_runs([])


def test_input_config_validates_and_names_the_sensors() -> None:
    cfg = InputConfig(2, (64, 64), 1000, 10.0, 3, warmup_s=0.5, publishers="per-sensor")
    assert cfg.sensors() == ["0", "1", "cloud"]
    assert cfg.warmup_frames == 5 and cfg.period_ns == 100_000_000
    assert InputConfig(1, (8, 8), 0, 10.0, 1).sensors() == ["0"]  # no points: no cloud process
    with pytest.raises(ValueError, match=r"parameter 'rate' = 0\.0"):
        InputConfig(1, (8, 8), 0, 0.0, 1)
    with pytest.raises(ValueError, match="parameter 'publishers' = 'two'"):
        InputConfig(1, (8, 8), 0, 10.0, 1, publishers="two")


@pytest.mark.dds
def test_per_sensor_processes_stamp_every_message_with_the_trigger_time(probe, env,
                                                                          tmp_path) -> None:
    from rclpy.qos import HistoryPolicy, QoSProfile, ReliabilityPolicy
    from sensor_msgs.msg import CameraInfo, Image, PointCloud2

    from kestrel_common.conversions import stamp_to_ns

    qos = QoSProfile(depth=10, reliability=ReliabilityPolicy.BEST_EFFORT,
                     history=HistoryPolicy.KEEP_LAST)
    pre = "/perception/input"
    cols = {"cloud": probe.subscribe(PointCloud2, f"{pre}/points", qos)}
    for c in range(2):
        cols[f"info{c}"] = probe.subscribe(CameraInfo, f"{pre}/camera_{c}/camera_info", qos)
        cols[f"image{c}"] = probe.subscribe(Image, f"{pre}/camera_{c}/image", qos)
    cfg = InputConfig(2, (64, 64), 1000, 10.0, 3, warmup_s=0.0, publishers="per-sensor")
    pub = publish_inputs(cfg, env, tmp_path)  # bounded: ready <= 60 s, run <= 30.8 s

    sched = trigger_schedule(pub["start_ns"], 100_000_000, 3)
    assert pub["stamps_ns"] == sched and pub["sensors"] == ["0", "1", "cloud"]
    assert len(pub["publish_s"]) == 3 and all(0 < x < 1.0 for x in pub["publish_s"])
    assert all(0 <= x < 0.1 for x in pub["trigger_lateness_s"])
    # sent before the processes exited; best effort on localhost: wait (bounded) for all 3
    for name, col in cols.items():
        got = col.wait_for(lambda m: len(m) >= 3, timeout=5.0)
        assert got, f"{name}: {len(got)} of 3 messages"
    for name, col in cols.items():
        stamps = [stamp_to_ns(m.header.stamp) for m in col.snapshot()]
        assert stamps == sched, f"{name}: stamps {stamps} != triggers {sched}"
    assert [m.width for m in cols["cloud"].snapshot()] == [1000] * 3
    for c in range(2):
        imgs = cols[f"image{c}"].snapshot()
        assert {(m.height, m.width, m.encoding, m.header.frame_id) for m in imgs} == {
            (64, 64, "rgb8", f"cam{c}_optical")}
        assert {m.header.frame_id for m in cols[f"info{c}"].snapshot()} == {f"cam{c}_optical"}


def test_messages_in_latency_leaves_out_the_drivers_lateness() -> None:
    """summarise: per frame, result receipt - (trigger + the set's publish() start lateness);
    the trigger-based latency stays as it was."""
    from kestrel_bench.perception_node import summarise

    st = trigger_schedule(START, 100_000_000, 3)
    rows = [{"stamp_ns": s, "recv_ns": s + (10 + k) * 1_000_000, "node_latency_s": 5e-3,
             "detections": 1, "timings": {"input_age": 3e-3}} for k, s in enumerate(st)]
    pub = {"stamps_ns": st, "publish_s": [1e-3] * 3, "trigger_lateness_s": [1e-3, 2e-3, 0.5e-3]}
    out = summarise(rows, pub)
    assert max(out["e2e"]) == pytest.approx(12.0)
    assert sorted(out["from_publish"]) == pytest.approx(sorted([10.0 - 1.0, 11.0 - 2.0,
                                                                12.0 - 0.5]))
    assert out["result_transport"] == pytest.approx([2.0, 3.0, 4.0])
    assert summarise(rows, {"stamps_ns": st, "publish_s": [1e-3] * 3})["from_publish"] == []
    assert out["dropped"] == 0 and out["results"] == 3
