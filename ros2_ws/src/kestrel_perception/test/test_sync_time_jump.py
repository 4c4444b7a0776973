"""The synchroniser goes on after time goes backwards (a bag loop or replay, a sim restart)."""

from __future__ import annotations

import pytest
from kestrel_perception.core.sync import FrameSynchronizer, Stamped

MS = 1_000_000


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _sync(**kw):
    counts: dict[str, int] = {}
    jumps: list[tuple[int, int]] = []

    def count(name: str, k: int) -> None:
        counts[name] = counts.get(name, 0) + k

    clock = Clock()
    sync = FrameSynchronizer(2, 0.01, 4, count=count, clock=clock,
                             on_jump=lambda a, b: jumps.append((a, b)), **kw)
    return sync, counts, jumps, clock


def _frame(sync, clock, stamp_ms: int, cloud: bool = True):
    """Camera infos, images and (optionally) the cloud of one stamp, received 'now'."""
    clock.now += 0.1
    for c in range(2):
        sync.add_info(c, Stamped(stamp_ms * MS, clock.now, f"info{c}@{stamp_ms}"))
        sync.add_image(c, Stamped(stamp_ms * MS, clock.now, f"img{c}@{stamp_ms}"))
    if cloud:
        sync.add_cloud(Stamped(stamp_ms * MS, clock.now, f"cloud@{stamp_ms}"))
    return sync.pop_newest_set()


def test_sets_form_again_after_time_jumps_back() -> None:
    sync, counts, jumps, clock = _sync()
    for t in range(10_000, 12_000, 100):  # 10 s .. 11.9 s: one set each
        s = _frame(sync, clock, t)
        assert s is not None and s.stamp_ns == t * MS and s.cloud is not None
    # the bag starts over at 10 s: every stamp is below the last set's
    for t in range(10_000, 10_500, 100):
        s = _frame(sync, clock, t)
        assert s is not None and s.stamp_ns == t * MS, t
        assert s.cloud is not None and s.cloud.data == f"cloud@{t}"  # still waits for clouds
    assert counts.get("time_jumps_back") == 1
    assert jumps == [(11_900 * MS, 10_000 * MS)]
    assert counts.get("missing_cloud", 0) == 0


def test_sim_restart_to_zero_and_small_reorders_are_not_jumps() -> None:
    sync, counts, jumps, clock = _sync()
    assert _frame(sync, clock, 5_000) is not None
    sync.add_image(0, Stamped(4_500 * MS, clock.now, "late"))  # 0.5 s late: not a jump
    assert counts.get("time_jumps_back", 0) == 0 and counts["skipped_stale"] == 1
    s = _frame(sync, clock, 0)  # sim restarted: time 0
    assert s is not None and s.stamp_ns == 0
    assert counts["time_jumps_back"] == 1 and len(jumps) == 1


def test_old_timeline_leftovers_after_a_jump_are_not_a_second_jump() -> None:
    """A cloud of the last frame before the loop arrives after the first image of the new
    loop: dropped, not taken for the front of time (which would make the next message a
    second jump)."""
    sync, counts, jumps, clock = _sync()
    assert _frame(sync, clock, 20_000) is not None
    clock.now += 0.1
    sync.add_info(0, Stamped(10_000 * MS, clock.now, None))  # the loop starts
    sync.add_cloud(Stamped(20_100 * MS, clock.now, "leftover"))  # of the old timeline
    sync.add_image(0, Stamped(10_000 * MS, clock.now, None))
    s = _frame(sync, clock, 10_000)
    assert s is not None and s.stamp_ns == 10_000 * MS and s.cloud.data == "cloud@10000"
    assert counts["time_jumps_back"] == 1 and len(jumps) == 1
    # later than JUMP_LEFTOVER_S after the jump, a stamp ahead is a forward jump, accepted
    clock.now += 2.0
    s = _frame(sync, clock, 30_000)
    assert s is not None and s.stamp_ns == 30_000 * MS


def test_jump_back_must_exceed_slop() -> None:
    with pytest.raises(ValueError, match="sync.jump_back"):
        FrameSynchronizer(1, 0.05, 4, jump_back_s=0.05)


def test_parameter_jump_back_must_exceed_slop() -> None:
    from kestrel_common.params import ParamError
    from kestrel_perception.core.params import SPECS, validate_perception_params

    values = {s.name: s.default for s in SPECS}
    validate_perception_params(values)
    values["sync.jump_back"] = values["sync.slop"]
    with pytest.raises(ParamError, match="sync.jump_back"):
        validate_perception_params(values)
