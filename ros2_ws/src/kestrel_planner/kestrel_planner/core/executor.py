"""Plan execution: an accepted plan -> a sequence of control targets with per-step status.

Each step expands into waypoints (skills.skill_points for the Cartesian geometry, a gripper
command, or the home joint configuration). `tick(now_s, ee_position)` returns the target to
send and the status transitions: a Cartesian waypoint is reached when the end effector is within
`position_tolerance` m; a gripper command after `gripper_time` s; HOME when the joints (or the
end effector, if `home_position` is set) are within tolerance. Each waypoint has the time its
move takes at the step's speed (the distance from where the end effector is when the waypoint
is set, or from the previous waypoint without feedback; the joint distance at `home_speed`
for HOME) plus `step_timeout` s: a waypoint not reached by then FAILS its step and the rest of
the plan is ABORTED. A slow plan over a long path is given its time; a stuck one fails
`step_timeout` s after it should have arrived. A Cartesian waypoint also fails as soon as the
arm has stalled on its way (`stall_timeout` > 0): its distance to the waypoint has not shrunk by
`stall_distance` m for `stall_timeout` s (a finger on an object, the arm against an obstacle or
a joint limit). Without feedback (ee_position None) Cartesian steps can only time out.

A PUSH closes the gripper first (open fingers reach past the tool centre and would land on
the object), comes down behind the object (skills.PUSH_BACKOFF_M, over it at the transit
clearance first), moves along +x until the object has moved about `distance`
(skills.PUSH_CONTACT_M), goes back up and sets the gripper as it was. The stroke along +x, in
contact with the object, runs at most at `push_speed`: a position-servoed arm lags its command
in proportion to its speed, and a tool centre that trails high pushes the object above its
centre (a cylinder tips) or wedges the fingers on its face (friction holds the arm up). The
stroke's end counts as reached only PUSH_SETTLE_S after the stroke's move time, the tool centre
within `position_tolerance` then (the stall watch leaves it alone while it settles there): the
arm lifting as soon as it is within tolerance would end every push short by its trail.

A PLACE lowers the held object to `height` over its target's position: right for a bin, or
for stacking two objects of the same height; onto a taller object (or holding a taller one)
the object lands on the target before the tool centre gets there, and the arm stalls. When the
point a PLACE lowers to fails (stalled or timed out) with the tool centre straight above it
(within `position_tolerance` sideways) and at most `place_contact_height` m over it, the
object rests on what stopped it: the waypoint counts as reached (an ACTIVE StepEvent says so)
and the gripper opens there. Stopped higher up or off to the side (an object caught on the
bin's wall) the step fails as any other.

After a Cartesian waypoint FAILS (with `back_off`, the default) the arm goes back to where the
failed step began its approach (its first Cartesian waypoint, if reached: for a pick, the point
`transit_clearance` over the object; else the last Cartesian waypoint reached), at the step's
speed with the gripper as it is, then holds there: a finger that came down on an object stops
pressing on it. The back-off is given the same time as a waypoint; without a waypoint reached
before, or with back_off False, the arm holds where it stopped.

A PICK whose approach fails before its gripper closes (a finger came down on the object: its
position was off by more than the open gripper leaves beside it) is tried again, up to
`grasp_retries` times: back to where the step began its approach, then the whole approach
again with the object's position moved by `grasp_retry_offset` m along x, then the other way
along x, then both ways along y (in the plan's frame, whose origin is the arm's base; at the
arm's home yaw the fingers close along x, where such an error makes them land on the object).
Each pair starts toward the base: a move away from it could leave the arm's reach at the edge
of the workspace. Each retry is an ACTIVE StepEvent that says why; the step fails only when
its last retry fails.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum

from kestrel_planner.core.executor_config import ExecutorConfig
from kestrel_planner.core.plan import Plan, SceneObject
from kestrel_planner.core.skills import Skill, skill_points

__all__ = ["TargetMode", "StepState", "ControlTargetSpec", "StepEvent", "ExecutorConfig",
           "ExecutorOutput", "PlanExecutor"]

Vec3 = tuple[float, float, float]
# s a push's stroke end waits past its move time, the tool centre within position_tolerance,
# before the arm lifts: the arm trails its command, and lifting as soon as it is within
# tolerance would end every push short by that trail
PUSH_SETTLE_S = 0.3


class TargetMode(IntEnum):
    """ControlTarget.MODE_* values."""

    HOLD = 0
    JOINT = 1
    CARTESIAN = 2


class StepState(IntEnum):
    """StepStatus.STATUS_* values."""

    PENDING = 0
    ACTIVE = 1
    SUCCEEDED = 2
    FAILED = 3
    ABORTED = 4


@dataclass(frozen=True)
class ControlTargetSpec:
    """mode; position xyz m (CARTESIAN); joint_positions rad (JOINT); max_speed m/s or rad/s;
    gripper 0 = open, 1 = closed; the plan step it executes."""

    mode: TargetMode
    position: Vec3 = (0.0, 0.0, 0.0)
    joint_positions: tuple[float, ...] = ()
    max_speed: float = 0.0
    gripper: float = 0.0
    step_index: int = 0
    skill_name: str = ""


@dataclass(frozen=True)
class StepEvent:
    step_index: int
    step_count: int
    status: StepState
    message: str = ""


@dataclass
class ExecutorOutput:
    target: ControlTargetSpec | None
    events: list[StepEvent] = field(default_factory=list)


@dataclass
class _Waypoint:
    kind: str  # "cartesian" | "gripper" | "joint"
    target: ControlTargetSpec
    lands: bool = False  # a PLACE's lowering point: contact short of it releases (module doc)
    # s: reached only once its move time plus this has passed since it was set (a PUSH's
    # stroke end: the arm's lag behind its command is worked off before the arm lifts)
    settle_s: float = 0.0


def _cart(position: Sequence[float], gripper: float, speed: float, step: int, skill: str
          ) -> _Waypoint:
    """A Cartesian waypoint: the tool centre to `position` (m) at `speed` (m/s), the gripper
    commanded to `gripper`, for plan step `step` (skill name `skill`)."""
    return _Waypoint("cartesian", ControlTargetSpec(
        TargetMode.CARTESIAN, tuple(position), (), speed, gripper, step, skill))


def _grip(gripper: float, step: int, skill: str) -> _Waypoint:
    """A gripper waypoint: hold the arm, command the gripper (0 open, 1 closed)."""
    return _Waypoint("gripper", ControlTargetSpec(
        TargetMode.HOLD, (0.0, 0.0, 0.0), (), 0.0, gripper, step, skill))


def _dist(a: Sequence[float], b: Sequence[float]) -> float:
    return math.sqrt(sum((float(x) - float(y)) ** 2 for x, y in zip(a, b, strict=True)))


class PlanExecutor:
    def __init__(self, config: ExecutorConfig) -> None:
        self.config = config
        self.statuses: list[StepState] = []
        self._plan: list[list[_Waypoint]] = []
        self._names: list[str] = []
        self._step = 0
        self._wp = 0
        self._t_wp = 0.0  # s, when the current waypoint was set
        self._move_s: float | None = None  # s its move takes at its speed (None: not yet known)
        self._from: Vec3 | None = None  # m, the last Cartesian waypoint reached
        self._step_from: Vec3 | None = None  # m, the current step's first one, once reached
        self._gripper = 0.0
        self._back: _Waypoint | None = None  # the back-off after a failure, while it runs
        self._picks: dict[int, tuple[Vec3, float, float]] = {}  # step -> object, height, speed
        self._retries = 0  # retries of the current step so far
        # stall watch of the current Cartesian waypoint: the distance to it (m) and when the
        # arm last got stall_distance closer than that (s); None until the first feedback
        self._near: tuple[float, float] | None = None

    # ---- state -----------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return any(s in (StepState.PENDING, StepState.ACTIVE) for s in self.statuses)

    @property
    def active_index(self) -> int | None:
        return self._step if self.running else None

    def _event(self, i: int, st: StepState, msg: str = "") -> StepEvent:
        self.statuses[i] = st
        return StepEvent(i, len(self.statuses), st, msg)

    # ---- plan -> waypoints -----------------------------------------------------------------
    def _pick_waypoints(self, i: int, position: Vec3, height: float, speed: float
                        ) -> list[_Waypoint]:
        """PICK of an object at `position` (m): over it at the transit clearance (if above
        `height`), `height` above it, down to it, close, lift back to the clearance."""
        clear = self.config.transit_clearance
        x, y, z = (float(v) for v in position)
        transit = (x, y, z + clear)
        pts = skill_points(Skill.PICK, (x, y, z), height)
        if clear > height:
            pts = [transit, *pts]  # over the target first, then down
        name = Skill.PICK.text
        wps = [_cart(p, 0.0, speed, i, name) for p in pts]
        wps.append(_grip(1.0, i, name))
        if clear > 0.0:  # lift the object before anything else moves it
            wps.append(_cart(transit, 1.0, speed, i, name))
        return wps

    def _push_waypoints(self, i: int, position: Vec3, height: float, distance: float,
                        speed: float, grip: float) -> list[_Waypoint]:
        """PUSH of an object at `position` (m): over the start point behind it at the transit
        clearance (if above `height`), the gripper closed (open fingers reach past the tool
        centre and would land on the object), down to the start point, along +x to the end
        point (at most at `push_speed`), back up to the clearance, the gripper as it was
        before."""
        clear = self.config.transit_clearance
        start, end = skill_points(Skill.PUSH, position, height, distance)
        z = float(position[2]) + clear
        name = Skill.PUSH.text
        above = clear > height
        wps = [_cart((start[0], start[1], z), grip, speed, i, name)] if above else []
        wps += [_grip(1.0, i, name), _cart(start, 1.0, speed, i, name),
                dataclasses.replace(_cart(end, 1.0, min(speed, self.config.push_speed), i, name),
                                    settle_s=PUSH_SETTLE_S)]
        if above:
            wps.append(_cart((end[0], end[1], z), 1.0, speed, i, name))
        return [*wps, _grip(grip, i, name)]

    def _expand(self, plan: Plan, objects: Sequence[SceneObject]
                ) -> tuple[list[list[_Waypoint]], dict[int, tuple[Vec3, float, float]]]:
        """The plan's waypoints per step, and each PICK step's (object position, height,
        speed) for its retries."""
        scene = {o.name: o for o in objects}
        grip = self._gripper
        steps: list[list[_Waypoint]] = []
        picks: dict[int, tuple[Vec3, float, float]] = {}
        for i, step in enumerate(plan.steps):
            skill = Skill(int(step.skill))
            name = skill.text
            wps: list[_Waypoint] = []

            if skill in (Skill.MOVE_TO, Skill.PICK, Skill.PLACE, Skill.PUSH):
                obj = scene.get(step.target_object)
                if obj is None or obj.position is None:
                    raise ValueError(f"step {i + 1}: target {step.target_object!r} has no "
                                     "position in the scene")
                dist = step.value("distance") if skill == Skill.PUSH else 0.0
                speed = step.value("speed")
                if skill == Skill.PICK:
                    at = tuple(float(v) for v in obj.position)
                    picks[i] = (at, step.value("height"), speed)
                    wps += self._pick_waypoints(i, at, step.value("height"), speed)
                    grip = 1.0
                    steps.append(wps)
                    continue
                if skill == Skill.PUSH:
                    wps += self._push_waypoints(i, tuple(float(v) for v in obj.position),
                                                step.value("height"), dist, speed, grip)
                    steps.append(wps)
                    continue
                pts = skill_points(skill, obj.position, step.value("height"), dist)
                clear = self.config.transit_clearance
                x, y, z = (float(v) for v in obj.position)
                transit = (x, y, z + clear)
                if skill == Skill.PLACE and clear > step.value("height"):
                    pts = [transit, *pts]  # over the target first, then down
                wps += [_cart(p, grip, speed, i, name) for p in pts]
                if skill == Skill.PLACE:
                    wps[-1] = dataclasses.replace(wps[-1], lands=True)
                    grip = 0.0
                    wps.append(_grip(grip, i, name))
                    if clear > 0.0:  # out of the target (the bin) before anything else moves
                        wps.append(_cart(transit, grip, speed, i, name))
            elif skill in (Skill.OPEN_GRIPPER, Skill.CLOSE_GRIPPER):
                grip = 0.0 if skill == Skill.OPEN_GRIPPER else 1.0
                wps.append(_grip(grip, i, name))
            else:  # HOME
                wps.append(_Waypoint("joint", ControlTargetSpec(
                    TargetMode.JOINT, (0.0, 0.0, 0.0), tuple(self.config.home_joint_positions),
                    self.config.home_speed, grip, i, name)))
            steps.append(wps)
        return steps, picks

    # ---- public API ------------------------------------------------------------------------
    def start(self, plan: Plan, objects: Sequence[SceneObject], now_s: float) -> list[StepEvent]:
        """Begin executing an (accepted) plan; a running plan is preempted (its remaining
        steps ABORTED). ValueError if a target has no position (nothing is changed then)."""
        expanded, picks = self._expand(plan, objects)
        events = self.abort("preempted by a new plan") if self.running else []
        self._back, self._picks, self._retries = None, picks, 0
        self._plan = expanded
        self._names = [Skill(int(s.skill)).text for s in plan.steps]
        self.statuses = [StepState.PENDING] * len(expanded)
        self._step, self._wp, self._step_from = 0, 0, None
        if expanded:
            self._from = None
            self._new_waypoint(now_s)
            events.append(self._event(0, StepState.ACTIVE, self._names[0]))
        return events

    def abort(self, reason: str = "aborted") -> list[StepEvent]:
        """Every PENDING/ACTIVE step -> ABORTED (a back-off stops too). The caller should
        command HOLD."""
        self._back = None
        return [self._event(i, StepState.ABORTED, reason) for i, s in enumerate(self.statuses)
                if s in (StepState.PENDING, StepState.ACTIVE)]

    @property
    def backing_off(self) -> bool:
        """True while the arm goes back after a failed waypoint (no plan running)."""
        return self._back is not None

    def hold_target(self) -> ControlTargetSpec:
        return ControlTargetSpec(TargetMode.HOLD, gripper=self._gripper,
                                 step_index=self._step, skill_name="hold")

    def _reached(self, wp: _Waypoint, now_s: float, ee: Sequence[float] | None,
                 joints: Sequence[float] | None) -> bool:
        c = self.config
        if wp.kind == "gripper":
            return now_s - self._t_wp >= c.gripper_time
        if wp.kind == "joint":
            home = wp.target.joint_positions
            # joint states list the arm's joints first; more may follow (the gripper's)
            if joints is not None and home and len(joints) >= len(home):
                return max(abs(float(a) - b) for a, b in zip(joints[:len(home)], home,
                                                             strict=True)) <= c.joint_tolerance
            if ee is not None and c.home_position is not None:
                return _dist(ee, c.home_position) <= c.position_tolerance
            return False
        if wp.settle_s > 0.0 and now_s - self._t_wp < (self._move_s or 0.0) + wp.settle_s:
            return False
        return ee is not None and _dist(ee, wp.target.position) <= c.position_tolerance

    def _move_time(self, wp: _Waypoint, ee: Sequence[float] | None,
                   joints: Sequence[float] | None) -> float:
        """s the waypoint's move takes at its speed, from where the arm is now (or from the
        previous waypoint); 0 when neither is known."""
        c = self.config
        if wp.kind == "gripper":
            return c.gripper_time
        if wp.kind == "joint":
            home = wp.target.joint_positions
            if joints is None or not home or len(joints) < len(home):
                return 0.0
            return max(abs(float(a) - b) for a, b in zip(joints[:len(home)], home,
                                                         strict=True)) / c.home_speed
        start = ee if ee is not None else self._from
        if start is None or not wp.target.max_speed > 0:
            return 0.0
        return _dist(start, wp.target.position) / wp.target.max_speed

    def tick(self, now_s: float, ee_position: Sequence[float] | None = None,
             joint_positions: Sequence[float] | None = None) -> ExecutorOutput:
        """Advance on feedback (ee_position xyz m, joint_positions rad; either may be None).
        Returns the current target (None when no plan is running) and status transitions."""
        events: list[StepEvent] = []
        if ee_position is not None and (len(ee_position) != 3 or
                                        not all(math.isfinite(float(v)) for v in ee_position)):
            ee_position = None  # malformed feedback is treated as no feedback
        while self.running:
            wps = self._plan[self._step]
            wp = wps[self._wp]
            if self._move_s is None:
                self._move_s = self._move_time(wp, ee_position, joint_positions)
            reached, why = self._reached(wp, now_s, ee_position, joint_positions), None
            if not reached:
                why = self._failure(wp, now_s, ee_position, len(wps))
                if why is not None and (landed := self._landed(wp, ee_position)) is not None:
                    events.append(self._event(
                        self._step, StepState.ACTIVE,
                        f"landed: {why}; {100 * landed:.1f} cm over the place point, straight "
                        "above it: the object rests on what stopped it, released there"))
                    reached, why = True, None
            if reached:
                if wp.kind == "gripper":
                    self._gripper = wp.target.gripper
                elif wp.kind == "cartesian":
                    self._from = wp.target.position
                    if self._step_from is None:
                        self._step_from = self._from
                self._wp += 1
                self._new_waypoint(now_s)
                if self._wp < len(wps):
                    continue
                events.append(self._event(self._step, StepState.SUCCEEDED))
                self._step, self._wp, self._step_from = self._step + 1, 0, None
                self._retries = 0
                if self._step < len(self._plan):
                    events.append(self._event(self._step, StepState.ACTIVE,
                                              self._names[self._step]))
                continue
            if why is not None:
                if self._can_retry(wps):
                    events.append(self._retry(now_s, why))
                    continue
                back = self._from is not None and wp.kind == "cartesian" and \
                    self.config.back_off
                events.append(self._event(
                    self._step, StepState.FAILED,
                    why + ("; backing off to where the step began its approach" if back
                           else "")))
                events += self.abort(f"step {self._step} failed")
                if not back:
                    return ExecutorOutput(self.hold_target(), events)
                t = wp.target
                self._back = _cart(self._step_from or self._from, self._gripper,
                                   t.max_speed, t.step_index, "back_off")
                self._new_waypoint(now_s)
                break
            return ExecutorOutput(wp.target, events)
        if self._back is not None:
            return ExecutorOutput(self._back_off(self._back, now_s, ee_position), events)
        return ExecutorOutput(None, events)

    def _new_waypoint(self, now_s: float) -> None:
        """A waypoint (or the back-off) is set now: its clock, move time and stall watch start
        afresh."""
        self._t_wp, self._move_s, self._near = now_s, None, None

    def _failure(self, wp: _Waypoint, now_s: float, ee: Sequence[float] | None,
                 n_wps: int) -> str | None:
        """Why the waypoint `wp` (not reached) fails now: stalled or timed out; else None."""
        why = self._stalled(wp, now_s, ee, n_wps)
        if why is None and now_s - self._t_wp - self._move_s > self.config.step_timeout:
            why = (f"timeout: waypoint {self._wp + 1}/{n_wps} not reached "
                   f"{now_s - self._t_wp:.1f} s after it was set (its move: "
                   f"{self._move_s:.1f} s, step_timeout {self.config.step_timeout:.1f} s)")
        return why

    def _landed(self, wp: _Waypoint, ee: Sequence[float] | None) -> float | None:
        """m the tool centre is over a PLACE's lowering point `wp` when it stopped there
        straight above it (within position_tolerance sideways, at most place_contact_height
        over it): the held object landed on something taller than the plan's height allowed
        for. None otherwise."""
        c = self.config
        if not wp.lands or ee is None or c.place_contact_height <= 0:
            return None
        (x, y, z), (ex, ey, ez) = wp.target.position, ee
        over = float(ez) - z
        if math.hypot(float(ex) - x, float(ey) - y) > c.position_tolerance or \
                not 0.0 <= over <= c.place_contact_height:
            return None
        return over

    def _stalled(self, wp: _Waypoint, now_s: float, ee: Sequence[float] | None,
                 n_wps: int) -> str | None:
        """Why the Cartesian waypoint `wp` counts as stalled (module docstring), else None."""
        c = self.config
        if c.stall_timeout <= 0 or wp.kind != "cartesian" or ee is None:
            return None
        if wp.settle_s > 0.0 and _dist(ee, wp.target.position) <= c.position_tolerance:
            return None  # arrived, settling: nothing left to get closer by
        d = _dist(ee, wp.target.position)
        if self._near is None or d <= self._near[0] - c.stall_distance:
            self._near = (d, now_s)
            return None
        if now_s - self._near[1] <= c.stall_timeout:
            return None
        return (f"stalled: waypoint {self._wp + 1}/{n_wps} still {100 * d:.1f} cm away, no "
                f"{1000 * c.stall_distance:.0f} mm closer for {now_s - self._near[1]:.1f} s "
                f"(stall_timeout {c.stall_timeout:.1f} s)")

    def _can_retry(self, wps: list[_Waypoint]) -> bool:
        """A PICK step with retries left whose gripper has not closed yet."""
        if self._step not in self._picks or self._retries >= self.config.grasp_retries:
            return False
        close = next(k for k, w in enumerate(wps) if w.kind == "gripper")
        return self._wp < close

    def _retry(self, now_s: float, why: str) -> StepEvent:
        """The current PICK again, back over where it began, the object moved by the next
        offset (module docstring)."""
        k = self._retries
        (x, y, z), height, speed = self._picks[self._step]
        d = self.config.grasp_retry_offset
        sx, sy = (-d if x > 0 else d), (-d if y > 0 else d)  # toward the base first
        dx, dy = ((sx, 0.0), (-sx, 0.0), (0.0, sy), (0.0, -sy))[k % 4]
        wps = self._pick_waypoints(self._step, (x + dx, y + dy, z), height, speed)
        start = self._step_from or self._from
        if start is not None and self.config.back_off:
            wps.insert(0, _cart(start, 0.0, speed, self._step, Skill.PICK.text))
        self._plan[self._step] = wps
        self._wp, self._step_from = 0, None
        self._new_waypoint(now_s)
        self._retries = k + 1
        axis = f"{'+' if dx + dy > 0 else '-'}{100 * d:.1f} cm along {'x' if dx else 'y'}"
        return self._event(self._step, StepState.ACTIVE,
                           f"retry {k + 1}/{self.config.grasp_retries}: {why}; the object's "
                           f"position moved {axis}")

    def _back_off(self, back: _Waypoint, now_s: float, ee: Sequence[float] | None
                  ) -> ControlTargetSpec:
        """The back-off's target until it is reached or its time is up, then HOLD (once)."""
        if self._move_s is None:
            self._move_s = self._move_time(back, ee, None)
        if self._reached(back, now_s, ee, None) or \
                now_s - self._t_wp - self._move_s > self.config.step_timeout:
            self._back = None
            return self.hold_target()
        return back.target
