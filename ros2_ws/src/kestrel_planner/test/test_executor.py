"""PlanExecutor: plan -> control targets, per-step status, tolerance, timeout, abort, preempt."""

from __future__ import annotations


import pytest

from kestrel_planner.core.executor import (
    ExecutorConfig, PlanExecutor, StepState, TargetMode,
)
from kestrel_planner.core.plan import SceneObject, parse_plan
from kestrel_planner.core.skills import PUSH_BACKOFF_M, PUSH_CONTACT_M

SCENE = [SceneObject("red_cube", "red_cube", (0.4, 0.0, 0.02)),
         SceneObject("bin", "bin", (0.3, 0.3, 0.0)),
         SceneObject("ghost", "ghost", None)]
CFG = ExecutorConfig(position_tolerance=0.01, step_timeout=5.0, gripper_time=0.5,
                     home_joint_positions=(0.0, -0.5, 0.5), joint_tolerance=0.05)


def approx(a, b) -> bool:
    return all(abs(x - y) < 1e-9 for x, y in zip(a, b, strict=True))


def test_pick_place_runs_to_success() -> None:
    ex = PlanExecutor(CFG)
    plan = parse_plan("pick red_cube speed=0.2 height=0.1\nplace bin\nhome\nend")
    ev = ex.start(plan, SCENE, now_s=0.0)
    assert [(e.step_index, e.status) for e in ev] == [(0, StepState.ACTIVE)]
    assert ex.statuses == [StepState.ACTIVE, StepState.PENDING, StepState.PENDING]
    seen = []
    t, ee, joints = 0.0, None, None
    for _ in range(200):
        out = ex.tick(t, ee, joints)
        for e in out.events:
            seen.append((e.step_index, e.status))
        if out.target is None:
            break
        tg = out.target
        # A perfect robot: reaches whatever it was told on the next tick.
        if tg.mode == TargetMode.CARTESIAN:
            ee = tg.position
        elif tg.mode == TargetMode.JOINT:
            joints = tg.joint_positions
        t += 0.05
    assert ex.statuses == [StepState.SUCCEEDED] * 3 and not ex.running
    assert seen == [(0, StepState.SUCCEEDED), (1, StepState.ACTIVE), (1, StepState.SUCCEEDED),
                    (2, StepState.ACTIVE), (2, StepState.SUCCEEDED)]


def test_target_sequence_content() -> None:
    ex = PlanExecutor(CFG)
    ex.start(parse_plan("pick red_cube speed=0.2 height=0.1\nplace bin\nend"), SCENE, 0.0)
    a = ex.tick(0.0, None).target
    assert a.mode == TargetMode.CARTESIAN and approx(a.position, (0.4, 0.0, 0.12))
    assert a.max_speed == 0.2 and a.gripper == 0.0 and a.step_index == 0
    assert a.skill_name == "pick"
    # Within tolerance of the approach point -> next waypoint: down to the object.
    b = ex.tick(0.1, (0.4, 0.005, 0.12)).target
    assert approx(b.position, (0.4, 0.0, 0.02)) and b.gripper == 0.0
    c = ex.tick(0.2, (0.4, 0.0, 0.02)).target
    assert c.mode == TargetMode.HOLD and c.gripper == 1.0  # close, wait gripper_time
    assert ex.tick(0.6, (0.4, 0.0, 0.02)).target.mode == TargetMode.HOLD
    out = ex.tick(0.75, (0.4, 0.0, 0.02))
    assert [(e.step_index, e.status) for e in out.events] == [(0, StepState.SUCCEEDED),
                                                              (1, StepState.ACTIVE)]
    d = out.target  # place: above the bin at the default height, gripper still closed
    assert approx(d.position, (0.3, 0.3, 0.05)) and d.gripper == 1.0 and d.step_index == 1
    assert d.max_speed == 0.1  # the schema default


def test_push_geometry_and_home_joint_target() -> None:
    """PUSH: the gripper closes (open fingers reach past the tool centre and would land on
    the object), down behind the object, along +x to `distance` past the closed fingers'
    contact, then the gripper as it was; without transit clearance no moves over them."""
    ex = PlanExecutor(CFG)
    ex.start(parse_plan("push red_cube height=0 distance=0.1\nhome\nend"), SCENE, 0.0)
    close = ex.tick(0.0, None).target
    assert close.mode == TargetMode.HOLD and close.gripper == 1.0
    p1 = ex.tick(0.6, None).target
    assert approx(p1.position, (0.4 - PUSH_BACKOFF_M, 0.0, 0.02)) and p1.gripper == 1.0
    p2 = ex.tick(0.7, p1.position).target
    assert approx(p2.position, (0.4 - PUSH_CONTACT_M + 0.1, 0.0, 0.02)) and p2.gripper == 1.0
    # the stroke's end holds until its move time (0.13 m at push_speed) and PUSH_SETTLE_S
    assert ex.tick(0.8, p2.position).target is p2
    opened = ex.tick(3.7, p2.position).target
    assert opened.mode == TargetMode.HOLD and opened.gripper == 0.0
    h = ex.tick(4.3, p2.position).target
    assert h.mode == TargetMode.JOINT and h.joint_positions == (0.0, -0.5, 0.5)
    assert ex.tick(4.4, None, (0.0, -0.4, 0.5)).target is h  # 0.1 rad off: not yet
    out = ex.tick(4.5, None, (0.01, -0.49, 0.5))
    assert out.target is None and ex.statuses[-1] == StepState.SUCCEEDED


def test_a_push_goes_over_its_start_and_end_at_the_transit_clearance() -> None:
    ex = PlanExecutor(ExecutorConfig(transit_clearance=0.12, gripper_time=0.5))
    ex.start(parse_plan("push red_cube speed=0.2\nend"), SCENE, 0.0)
    t, ee, seen = 0.0, None, []
    while (tg := ex.tick(t, ee).target) is not None:
        seen.append((tg.mode, tg.position if tg.mode == TargetMode.CARTESIAN else None,
                     tg.gripper))
        ee = tg.position if tg.mode == TargetMode.CARTESIAN else ee
        t += 0.6
    x0, x1, z = 0.4 - PUSH_BACKOFF_M, 0.4 - PUSH_CONTACT_M + 0.05, 0.02 + 0.01  # defaults
    cart = [(round(p[0], 6), round(p[2], 6), g) for m, p, g in dict.fromkeys(seen) if p]
    want = [(x0, 0.14, 0.0), (x0, z, 1.0), (x1, z, 1.0), (x1, 0.14, 1.0)]
    assert cart == [(round(x, 6), round(h, 6), g) for x, h, g in want], seen
    assert seen[-1] == (TargetMode.HOLD, None, 0.0)  # the gripper as before the push


def test_a_push_stroke_runs_at_most_at_push_speed() -> None:
    """The stroke (the move along +x with the object in contact) runs at min(step speed,
    push_speed); the other moves at the step's speed. A bad push_speed names the parameter."""
    for step_speed, push_speed, want in ((0.3, 0.05, 0.05), (0.03, 0.05, 0.03)):
        ex = PlanExecutor(ExecutorConfig(transit_clearance=0.12, push_speed=push_speed))
        ex.start(parse_plan(f"push red_cube speed={step_speed}\nend"), SCENE, 0.0)
        t, ee, speeds = 0.0, None, {}
        while (tg := ex.tick(t, ee).target) is not None:
            if tg.mode == TargetMode.CARTESIAN:
                speeds[tg.position] = tg.max_speed
                ee = tg.position
            t += 0.6
        stroke_end = (0.4 - PUSH_CONTACT_M + 0.05, 0.0, 0.03)
        ends = {tuple(round(v, 6) for v in p): s for p, s in speeds.items()}
        assert ends.pop(tuple(round(v, 6) for v in stroke_end)) == want, speeds
        assert set(ends.values()) == {step_speed}, speeds
    for bad in (0.0, -0.1, float("nan")):
        with pytest.raises(ValueError, match="parameter 'push_speed'"):
            ExecutorConfig(push_speed=bad)


def test_a_push_stroke_end_waits_for_the_arm_to_work_off_its_trail() -> None:
    """The arm trails its command: within position_tolerance of the stroke's end before the
    stroke's move time plus PUSH_SETTLE_S, the arm keeps pushing; after that it lifts. Other
    waypoints count as reached as soon as the tool centre is within tolerance."""
    from kestrel_planner.core.executor import PUSH_SETTLE_S

    ex = PlanExecutor(ExecutorConfig(transit_clearance=0.0, gripper_time=0.0, push_speed=0.05))
    ex.start(parse_plan("push red_cube speed=0.3\nend"), SCENE, 0.0)
    start = (0.4 - PUSH_BACKOFF_M, 0.0, 0.03)
    end = (0.4 - PUSH_CONTACT_M + 0.05, 0.0, 0.03)
    t, ee = 0.0, start
    while ex.tick(t, ee).target.position != end:  # the gripper, then down to start
        t += 0.05
    t_set, move_s = t, (end[0] - start[0]) / 0.05  # the stroke's end was set now, from start
    near = (end[0] - 0.006, 0.0, 0.03)  # 6 mm short: within tolerance
    assert ex.tick(t_set + 0.1, near).target.position == end  # too early: still pushing
    assert ex.tick(t_set + move_s + PUSH_SETTLE_S - 0.05, near).target.position == end
    # then the gripper as before (gripper_time 0: at once) and the push is done
    assert ex.tick(t_set + move_s + PUSH_SETTLE_S + 0.05, near).target is None
    assert ex.statuses == [StepState.SUCCEEDED]


def test_a_settling_stroke_end_is_not_a_stall() -> None:
    """The stall watch leaves a stroke's end alone once the tool centre is within tolerance of
    it (settling: nothing is left to get closer by), even when the arm got there well before
    the stroke's move time; the end is then reached after its move time and PUSH_SETTLE_S."""
    from kestrel_planner.core.executor import PUSH_SETTLE_S

    ex = PlanExecutor(ExecutorConfig(transit_clearance=0.0, gripper_time=0.0, push_speed=0.05,
                                     stall_timeout=1.0, step_timeout=5.0))
    ex.start(parse_plan("push red_cube speed=0.3\nend"), SCENE, 0.0)
    start = (0.4 - PUSH_BACKOFF_M, 0.0, 0.03)
    end = (0.4 - PUSH_CONTACT_M + 0.05, 0.0, 0.03)
    t, ee = 0.0, start
    while ex.tick(t, ee).target.position != end:
        t += 0.05
    t_set, move_s = t, (end[0] - start[0]) / 0.05
    t += 0.05
    while t < t_set + move_s + PUSH_SETTLE_S - 0.05:  # there at once, held there
        out = ex.tick(t, end)
        assert out.target.position == end and not out.events, out.events
        t += 0.05
    assert ex.tick(t_set + move_s + PUSH_SETTLE_S + 0.05, end).target is None
    assert ex.statuses == [StepState.SUCCEEDED]


def test_timeout_fails_step_and_aborts_rest() -> None:
    ex = PlanExecutor(CFG)
    ex.start(parse_plan("move_to bin\nhome\nend"), SCENE, 10.0)
    assert ex.tick(14.9, None).target.mode == TargetMode.CARTESIAN  # no feedback yet
    out = ex.tick(15.1, (0.0, 0.0, 0.5))  # far from the target, past step_timeout
    assert [(e.step_index, e.status) for e in out.events] == [(0, StepState.FAILED),
                                                              (1, StepState.ABORTED)]
    assert "timeout" in out.events[0].message
    assert out.target.mode == TargetMode.HOLD
    assert ex.statuses == [StepState.FAILED, StepState.ABORTED] and not ex.running
    assert ex.tick(16.0, None).target is None


def test_a_slow_long_move_gets_its_time_and_a_stuck_one_fails() -> None:
    """The time a waypoint may take is its move at the step's speed + step_timeout (5 s): a
    0.5 m move at 0.05 m/s takes 10 s, so it is no failure 10.5 s in (more than step_timeout)
    and arrives at about 11 s; stuck, it fails 15 s after it was set."""
    for stuck in (False, True):
        ex = PlanExecutor(CFG)
        ex.start(parse_plan("move_to bin speed=0.05\nend"), SCENE, 0.0)
        t = 0.0
        while ex.running and t < 15.0:
            # 0.5 m above the bin target (0.3, 0.3, 0.05), going down at 0.045 m/s
            ee = (0.3, 0.3, 0.55 if stuck else max(0.05, 0.55 - 0.045 * t))
            out = ex.tick(t, ee)
            if t == 10.5:
                assert ex.statuses == [StepState.ACTIVE], out.events
            t = round(t + 0.05, 2)
        if stuck:
            out = ex.tick(15.1, (0.3, 0.3, 0.55))
            assert ex.statuses == [StepState.FAILED], ex.statuses
            assert "not reached 15.1 s after it was set (its move: 10.0 s" in \
                out.events[0].message
        else:
            assert ex.statuses == [StepState.SUCCEEDED] and 10.5 < t < 11.5, t


def test_abort_and_preempt() -> None:
    ex = PlanExecutor(CFG)
    ex.start(parse_plan("move_to bin\nmove_to red_cube\nend"), SCENE, 0.0)
    ev = ex.start(parse_plan("home\nend"), SCENE, 1.0)
    assert [(e.step_index, e.step_count, e.status) for e in ev] == [
        (0, 2, StepState.ABORTED), (1, 2, StepState.ABORTED), (0, 1, StepState.ACTIVE)]
    assert ex.statuses == [StepState.ACTIVE]
    ev = ex.abort("cancelled")
    assert [(e.status, e.message) for e in ev] == [(StepState.ABORTED, "cancelled")]
    assert ex.abort() == [] and ex.tick(2.0, None).target is None


def test_malformed_feedback_and_bad_plan() -> None:
    ex = PlanExecutor(CFG)
    ex.start(parse_plan("move_to bin\nend"), SCENE, 0.0)
    out = ex.tick(0.1, (float("nan"), 0.3, 0.05))  # treated as no feedback
    assert out.events == [] and ex.statuses == [StepState.ACTIVE]
    with pytest.raises(ValueError, match="'ghost' has no position"):
        ex.start(parse_plan("pick ghost\nend"), SCENE, 0.0)
    assert ex.statuses == [StepState.ACTIVE]  # the running plan is untouched
    with pytest.raises(ValueError, match="parameter 'step_timeout'"):
        ExecutorConfig(step_timeout=0.0)


def test_home_reached_with_gripper_joints_after_the_arm() -> None:
    """Joint states carry the arm's joints first, then the gripper's fingers (m)."""
    ex = PlanExecutor(CFG)
    ex.start(parse_plan("home\nend"), SCENE, 0.0)
    h = ex.tick(0.0, None).target
    assert h.mode == TargetMode.JOINT
    out = ex.tick(0.1, None, (0.01, -0.49, 0.5, 0.045, 0.045))
    assert out.target is None and ex.statuses == [StepState.SUCCEEDED]


def test_transit_clearance_approaches_and_leaves_from_above() -> None:
    cfg = ExecutorConfig(position_tolerance=0.01, step_timeout=5.0, gripper_time=0.0,
                         transit_clearance=0.15)
    ex = PlanExecutor(cfg)
    ex.start(parse_plan("pick red_cube\nplace bin\nend"), SCENE, 0.0)
    seen, t, ee = [], 0.0, None
    for _ in range(50):
        out = ex.tick(t, ee)
        if out.target is None:
            break
        tg = out.target
        if tg.mode == TargetMode.CARTESIAN:
            if not seen or seen[-1] != (tg.position, tg.gripper):
                seen.append((tg.position, tg.gripper))
            ee = tg.position
        t += 0.05
    points = [tuple(round(v, 6) for v in p) for p, _ in seen]
    # every move between the two targets runs at the clearance: a straight line from where
    # the arm is to 5 cm above the object would sweep through what stands in between (the
    # bin's walls, when the previous place left the fingers in it)
    assert points == [(0.4, 0.0, 0.17),  # over the object first
                      (0.4, 0.0, 0.07), (0.4, 0.0, 0.02),  # approach, grasp
                      (0.4, 0.0, 0.17),  # lifted with the gripper closed
                      (0.3, 0.3, 0.15), (0.3, 0.3, 0.05),  # over the bin, then down
                      (0.3, 0.3, 0.15)]  # released: back up out of the bin
    assert [g for _, g in seen] == [0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0]
    assert ex.statuses == [StepState.SUCCEEDED] * 2
    with pytest.raises(ValueError, match="transit_clearance"):
        ExecutorConfig(transit_clearance=-0.1)


def test_a_blocked_descent_fails_and_backs_off_to_the_last_waypoint_reached() -> None:
    """A finger comes down on the object: the grasp point (waypoint 3/5) is never reached.
    The step fails step_timeout after its move, the rest of the plan is aborted, and the arm
    goes back to where the pick began its approach (transit_clearance over the object,
    gripper open) at the step's speed, then holds; with back_off False it holds where it
    stopped (its finger on the object)."""
    for back_off in (True, False):
        cfg = ExecutorConfig(position_tolerance=0.01, step_timeout=2.0, gripper_time=0.0,
                             transit_clearance=0.15, back_off=back_off)
        ex, events, targets = _blocked_pick(cfg, None)
        failed = [e for e in events if e.status == StepState.FAILED]
        assert ex.statuses == [StepState.FAILED, StepState.ABORTED] and len(failed) == 1
        assert "waypoint 3/5 not reached" in failed[0].message
        after = targets[next(i for i, tg in enumerate(targets) if tg.skill_name != "pick"):]
        if back_off:
            assert "backing off" in failed[0].message
            assert after[0].mode == TargetMode.CARTESIAN and after[0].skill_name == "back_off"
            assert approx(after[0].position, (0.4, 0.0, 0.17))  # over the object
            assert after[0].gripper == 0.0 and after[0].max_speed == 0.1
            assert after[-1].mode == TargetMode.HOLD and len(after) >= 2
            assert not ex.backing_off
        else:
            assert [tg.mode for tg in after] == [TargetMode.HOLD]
        assert ex.tick(1000.0, None).target is None


def test_a_new_plan_or_an_abort_ends_a_back_off() -> None:
    cfg = ExecutorConfig(position_tolerance=0.01, step_timeout=1.0, gripper_time=0.0)
    ex = PlanExecutor(cfg)
    ex.start(parse_plan("move_to red_cube\nmove_to bin\nend"), SCENE, 0.0)
    ex.tick(0.0, (0.4, 0.0, 0.07))  # the first waypoint is reached
    out = ex.tick(30.0, (0.0, 0.0, 0.9))  # the second is not, long past its time
    assert out.target.skill_name == "back_off" and ex.backing_off
    assert approx(out.target.position, (0.4, 0.0, 0.07))  # the last waypoint reached
    assert ex.abort() == [] and not ex.backing_off  # nothing running, the back-off stops
    assert ex.tick(30.1, None).target is None
    ex.start(parse_plan("move_to red_cube\nmove_to bin\nend"), SCENE, 40.0)
    ex.tick(40.0, (0.4, 0.0, 0.07))
    assert ex.tick(70.0, (0.0, 0.0, 0.9)).target.skill_name == "back_off"
    ex.start(parse_plan("move_to bin\nend"), SCENE, 70.1)
    assert not ex.backing_off and ex.tick(70.1, None).target.skill_name == "move_to"


def _blocked_pick(cfg: ExecutorConfig, true_x: float | None
                  ) -> tuple[PlanExecutor, list, list]:
    """Runs 'pick red_cube; place bin' with the arm stopped 3 cm over the table whenever its
    pick target is more than 1 cm from the object's true x (a finger lands on the object: the
    scene says x 0.4; true_x None: always). Returns the executor, its events and every target
    sent."""
    ex = PlanExecutor(cfg)
    ex.start(parse_plan("pick red_cube speed=0.1\nplace bin speed=0.1\nend"), SCENE, 0.0)
    t, ee, events, targets = 0.0, None, [], []
    for _ in range(2000):
        out = ex.tick(t, ee)
        events += out.events
        if out.target is None:
            break
        tg = out.target
        targets.append(tg)
        if tg.mode == TargetMode.CARTESIAN:
            blocked = tg.skill_name == "pick" and (
                true_x is None or abs(tg.position[0] - true_x) > 0.01)
            ee = (tg.position[0], tg.position[1], max(tg.position[2], 0.05 if blocked else 0))
        t = round(t + 0.05, 2)
    return ex, events, targets


def test_a_blocked_pick_is_retried_with_the_object_moved() -> None:
    """The object is really 1.5 cm beyond where the scene says (x 0.415, not 0.4): the first
    approach is blocked, the first retry (1.5 cm along x toward the base, to 0.385) too, the
    second (away from it, to 0.415) grasps. Each retry starts back over where the pick began
    and says why; the step then succeeds and the plan goes on."""
    cfg = ExecutorConfig(position_tolerance=0.01, step_timeout=2.0, gripper_time=0.0,
                         transit_clearance=0.15, grasp_retries=2, grasp_retry_offset=0.015)
    ex, events, targets = _blocked_pick(cfg, 0.415)
    assert ex.statuses == [StepState.SUCCEEDED] * 2
    retries = [e.message for e in events if e.status == StepState.ACTIVE and e.step_index == 0
               and e.message.startswith("retry")]
    assert len(retries) == 2
    assert retries[0].startswith("retry 1/2: timeout: waypoint 3/5 not reached")
    assert retries[0].endswith("the object's position moved -1.5 cm along x")
    assert retries[1].endswith("the object's position moved +1.5 cm along x")
    grasps = sorted({round(t.position[0], 4) for t in targets
                     if t.skill_name == "pick" and abs(t.position[2] - 0.02) < 1e-9})
    assert grasps == [0.385, 0.4, 0.415]  # the scene's, then each retry's
    assert any(approx(t.position, (0.4, 0.0, 0.17)) for t in targets)  # back over the start


def test_a_pick_fails_when_its_retries_are_used_up() -> None:
    cfg = ExecutorConfig(position_tolerance=0.01, step_timeout=2.0, gripper_time=0.0,
                         transit_clearance=0.15, grasp_retries=1)
    ex, events, targets = _blocked_pick(cfg, 0.36)  # 4 cm off: no retry reaches it
    assert ex.statuses == [StepState.FAILED, StepState.ABORTED]
    assert sum(e.message.startswith("retry") for e in events) == 1
    failed = next(e for e in events if e.status == StepState.FAILED)
    assert "backing off" in failed.message and targets[-2].skill_name == "back_off"
    assert targets[-1].mode == TargetMode.HOLD
    for bad in (dict(grasp_retries=5), dict(grasp_retries=1.5), dict(grasp_retry_offset=-0.01)):
        name = next(iter(bad))
        with pytest.raises(ValueError, match=f"parameter '{name}'"):
            ExecutorConfig(**bad)


def _creep(cfg: ExecutorConfig, speed: float, seconds: float) -> tuple[PlanExecutor, list]:
    """'move_to red_cube', the end effector starting 10 cm over its waypoint and coming down
    at `speed` m/s (ticks of 0.05 s). Returns the executor and its (time, event) pairs."""
    ex = PlanExecutor(cfg)
    ex.start(parse_plan("move_to red_cube speed=0.1\nend"), SCENE, 0.0)
    goal = ex.tick(0.0, None).target.position
    events = []
    for k in range(int(seconds / 0.05)):
        t = round(0.05 * k, 2)
        ee = (goal[0], goal[1], goal[2] + max(0.0, 0.1 - speed * t))
        out = ex.tick(t, ee)
        events += [(t, e) for e in out.events]
        if not ex.running:
            break
    return ex, events


def test_an_arm_that_stops_getting_closer_fails_its_step_at_once() -> None:
    """stall_timeout 1 s, stall_distance 5 mm: an arm creeping at 4 mm/s has stalled (its step
    fails just over 1 s after it set out, not after step_timeout); one at 6 mm/s is moving and
    gets there; with the stall watch off the creeping arm is given step_timeout."""
    cfg = ExecutorConfig(position_tolerance=0.01, step_timeout=30.0, stall_timeout=1.0,
                         stall_distance=0.005)
    ex, events = _creep(cfg, 0.004, 20.0)
    t, failed = next((t, e) for t, e in events if e.status == StepState.FAILED)
    assert ex.statuses == [StepState.FAILED] and 1.0 < t <= 1.1
    assert failed.message.startswith("stalled: waypoint 1/1 still 9.6 cm away, no 5 mm closer")
    ex, events = _creep(cfg, 0.006, 20.0)
    assert ex.statuses == [StepState.SUCCEEDED]
    done = next(t for t, e in events if e.status == StepState.SUCCEEDED)
    assert done == pytest.approx(15.0, abs=0.06)  # 9 cm at 6 mm/s
    off = ExecutorConfig(position_tolerance=0.01, step_timeout=30.0)
    assert off.stall_timeout == 0.0  # the library's default: off (the node's: on)
    ex, events = _creep(off, 0.004, 30.0)
    assert ex.statuses == [StepState.SUCCEEDED]  # 9 cm at 4 mm/s: 22.5 s < 1 s + 30 s
    for bad in (dict(stall_timeout=-1.0), dict(stall_distance=0.0),
                dict(stall_distance=float("nan"))):
        name = next(iter(bad))
        with pytest.raises(ValueError, match=f"parameter '{name}'"):
            ExecutorConfig(**bad)


def test_a_stalled_pick_is_retried_without_waiting_for_its_timeout() -> None:
    """The blocked pick of test_a_blocked_pick_is_retried_with_the_object_moved with
    step_timeout 10 s: the stall watch starts each retry within stall_timeout of the block."""
    cfg = ExecutorConfig(position_tolerance=0.01, step_timeout=10.0, gripper_time=0.0,
                         transit_clearance=0.15, grasp_retries=2, grasp_retry_offset=0.015,
                         stall_timeout=0.5)
    ex, events, targets = _blocked_pick(cfg, 0.415)
    assert ex.statuses == [StepState.SUCCEEDED] * 2
    retries = [e.message for e in events if e.message.startswith("retry")]
    assert len(retries) == 2 and all(m.startswith(("retry 1/2: stalled: waypoint 3/5 still "
                                                   "3.0 cm away", "retry 2/2: stalled"))
                                     for m in retries)
    # every target was sent on a 0.05 s tick: 2 stalls of ~0.55 s, not 2 timeouts of > 10 s
    assert len(targets) * 0.05 < 6.0


def _place_stopped_at(cfg: ExecutorConfig, stop: tuple[float, float, float]
                      ) -> tuple[PlanExecutor, list, list]:
    """'place red_cube' (the held object onto the cube, no transit clearance: the lowering
    point is the step's first waypoint): the arm moves until `stop` (offset, m, from the
    lowering point) and stays there. Returns the executor, its events and the targets."""
    ex = PlanExecutor(cfg)
    ex.start(parse_plan("place red_cube speed=0.1\nend"), SCENE, 0.0)
    point = ex.tick(0.0, None).target.position
    ee = tuple(p + s for p, s in zip(point, stop, strict=True))
    events, targets = [], []
    for k in range(200):
        out = ex.tick(round(0.05 * k, 2), ee)
        events += out.events
        targets.append(out.target)
        if not ex.running:
            break
    return ex, events, targets


def test_a_place_stopped_straight_over_its_point_releases_there() -> None:
    """The held object lands on a taller target 2 cm before the tool centre reaches the
    place point: the stall counts as the point reached (an ACTIVE 'landed' event) and the
    gripper opens there. Stopped 2 cm to the side, 6 cm over it, or with
    place_contact_height 0, the place fails as before."""
    cfg = ExecutorConfig(position_tolerance=0.01, step_timeout=30.0, stall_timeout=1.0,
                         place_contact_height=0.05)
    ex, events, targets = _place_stopped_at(cfg, (0.0, 0.0, 0.02))
    assert ex.statuses == [StepState.SUCCEEDED]
    landed = [e for e in events if e.message.startswith("landed")]
    assert len(landed) == 1 and landed[0].status == StepState.ACTIVE
    assert "2.0 cm over the place point" in landed[0].message, landed[0].message
    assert any(t is not None and t.mode == TargetMode.HOLD and t.gripper == 0.0
               for t in targets)  # the gripper opened
    for stop, c in (((0.02, 0.0, 0.02), cfg), ((0.0, 0.0, 0.06), cfg),
                    ((0.0, 0.0, 0.02), ExecutorConfig(position_tolerance=0.01,
                                                      step_timeout=30.0, stall_timeout=1.0))):
        ex, events, _ = _place_stopped_at(c, stop)
        assert ex.statuses == [StepState.FAILED], (stop, events)
        assert not any(e.message.startswith("landed") for e in events)
    for bad in (-0.01, 0.3, float("nan")):
        with pytest.raises(ValueError, match="parameter 'place_contact_height'"):
            ExecutorConfig(place_contact_height=bad)
