"""Messages lost before the node saw them, counted from stamp gaps (core/loss.py)."""

from __future__ import annotations

import pytest
from kestrel_perception.core.loss import MIN_DELTAS, RELEARN, StampGaps

MS = 1_000_000
P = 33 * MS  # a 30 Hz camera


def _gaps():
    counts: dict[str, int] = {}

    def count(name: str, k: int) -> None:
        counts[name] = counts.get(name, 0) + k

    return StampGaps("camera_0", 1.0, count), counts


def test_gaps_of_k_periods_are_k_minus_1_lost() -> None:
    g, counts = _gaps()
    stamps = [i * P for i in range(10)]  # learns the period
    stamps += [stamps[-1] + 3 * P, stamps[-1] + 4 * P, stamps[-1] + 8 * P]  # 2 + 0 + 3 lost
    for s in stamps:
        g.add(s)
    assert g.period_ns == P
    assert g.lost == 5 and counts == {"lost_camera_0": 5}


def test_jitter_is_not_loss_and_nothing_counts_before_the_period_is_learned() -> None:
    g, _ = _gaps()
    t = 0
    for i in range(MIN_DELTAS):  # a gap among the first deltas: not yet countable
        t += 3 * P if i == 1 else P
        g.add(t)
    assert g.lost == 0
    for i in range(50):
        t += P + (4 if i % 2 else -4) * MS  # +-4 ms jitter
        g.add(t)
    assert g.lost == 0 and abs(g.period_ns - P) <= 4 * MS


def test_overload_counts_what_depth_1_overwrote() -> None:
    """3x the rate the node keeps up with: it sees one message in three; every unseen one is
    counted, as long as the period was learned while it kept up."""
    g, _ = _gaps()
    seen = list(range(20)) + list(range(21, 21 + 3 * 20, 3))  # keeps up, then 1 in 3
    for i in seen:
        g.add(i * P)
    unseen = (seen[-1] + 1) - len(seen)
    assert g.lost == unseen == 39


def test_backwards_time_silence_and_rate_change() -> None:
    g, _ = _gaps()
    for i in range(10):
        g.add(i * P)
    g.add(0)  # time went backwards (bag loop): not a gap, restarts from here
    g.add(P)
    g.add(P + 5_000 * MS)  # 5 s of silence (> max_gap_s): a discontinuity, not a loss
    assert g.lost == 0
    t = P + 5_000 * MS
    for _ in range(RELEARN):  # the sensor now runs at a third of its rate
        t += 3 * P
        g.add(t)
    lost = g.lost
    assert lost == 2 * RELEARN  # taken for loss until RELEARN gaps in a row
    for _ in range(10):
        t += 3 * P
        g.add(t)
    assert g.lost == lost and g.period_ns == 3 * P  # then the new period


def test_restart_forgets_the_last_stamp() -> None:
    g, _ = _gaps()
    for i in range(10):
        g.add(i * P)
    g.restart()
    g.add(20 * P)
    assert g.lost == 0 and g.period_ns == P


def test_bad_max_gap() -> None:
    with pytest.raises(ValueError, match="max_gap_s"):
        StampGaps("lidar", 0.0)
