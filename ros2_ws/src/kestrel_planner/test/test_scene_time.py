"""Whether the latest scene may be planned against (core/scene_time.py): too old, from before
a backwards time jump, stamped ahead of the clock."""

from __future__ import annotations

from kestrel_planner.core.scene_time import JUMP_BACK_S, SceneTime

S = 1_000_000_000


def test_fresh_old_and_missing_scenes() -> None:
    t = SceneTime(5.0)
    assert "no perception result received yet" in t.refusal(100 * S)
    assert t.take(99 * S, 100 * S) == ""
    assert t.refusal(100 * S) == ""
    why = t.refusal(110 * S)
    assert "11.0 s old, more than max_scene_age 5.0 s" in why


def test_a_scene_from_before_a_backwards_jump_is_refused() -> None:
    """A sim restart: the clock goes from 100 s back to 3 s; the scene stamped 99.9 s (or one
    that looks fresh on the new timeline, at 2.9 s) describes the world before it."""
    for stamp in (99_900_000_000, 2_900_000_000):
        t = SceneTime(5.0)
        t.observe(100 * S)
        assert t.take(stamp, 100 * S) == ""
        assert t.observe(3 * S)  # the jump: the node forgets its other inputs too
        why = t.refusal(3 * S)
        assert "since time jumped back 97.0 s" in why and "max_scene_age" in why
        assert t.refusal(3 * S + S // 10) == why  # until a scene arrives after the jump
        assert t.take(3 * S + S // 5, 3 * S + S // 4) == ""  # a scene of the new timeline
        assert t.refusal(3 * S + S // 2) == ""
        assert t.clock.jumps == 1


def test_a_jump_seen_first_by_the_goal_is_refused_too() -> None:
    t = SceneTime(5.0)
    t.take(99 * S, 100 * S)
    assert "since time jumped back" in t.refusal(4 * S)  # no other reading in between


def test_a_scene_stamped_ahead_of_the_clock_is_not_taken() -> None:
    """Still on its way when the clock went back, or from another clock."""
    t = SceneTime(5.0)
    t.observe(3 * S)
    why = t.take(100 * S, 3 * S)
    assert "97.0 s after this node's clock" in why and t.stamp_ns is None
    assert t.take(3 * S + int(0.5 * JUMP_BACK_S * S), 3 * S) == ""  # small skew: taken
    t = SceneTime(5.0)
    t.take(10 * S, 10 * S)
    t.clock.front_ns = None  # a clock that went back unseen (e.g. right after a restart)
    assert "after this node's clock" in t.refusal(5 * S)


def test_checks_off_with_max_scene_age_0_but_a_jump_still_forgets() -> None:
    t = SceneTime(0.0)
    assert t.refusal(100 * S) == ""
    assert t.take(500 * S, 100 * S) == "" and t.stamp_ns == 500 * S  # another clock: taken
    t.take(99 * S, 100 * S)
    assert t.observe(3 * S) and t.stamp_ns is None and t.refusal(3 * S) == ""


def test_clear() -> None:
    t = SceneTime(5.0)
    t.take(99 * S, 100 * S)
    t.clear()
    assert t.stamp_ns is None and not t.observe(1 * S)
    assert "no perception result received yet" in t.refusal(1 * S)
