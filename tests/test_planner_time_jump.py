"""The planner node in this process (no executor, no DDS traffic) across a backwards time
jump of its clock (sim time, as at a sim restart or a bag played with --loop): the scene from
before the jump is refused with the reason, the plan running at the jump is aborted, the jump
is counted on /diagnostics, and planning goes on once a scene of the new timeline arrives."""

from __future__ import annotations

import array
import contextlib

import numpy as np
from kestrel_interfaces.action import PlanTask
from kestrel_interfaces.msg import PerceptionResult
from rclpy.action import GoalResponse
from rclpy.time import Time

from kestrel_common.conversions import make_header, numpy_to_image
from ros_harness import diagnostics_values

R = PlanTask.Result
S = 1_000_000_000
# input_wait 0: a goal is refused at once (tests/test_planner_input_wait.py has the wait)
PARAMS = {"backend": "plan_text", "max_scene_age": 5.0, "use_sim_time": True,
          "autostart": False, "gc_freeze": False, "diagnostics_period": 0.2, "input_wait": 0.0}
PLAN = "move_to red_cube speed=0.2 height=0.2; end"


class GoalHandle:
    """What PlannerNode._execute uses of rclpy's ServerGoalHandle."""

    def __init__(self, goal: PlanTask.Goal) -> None:
        self.request, self.is_cancel_requested, self.state = goal, False, ""

    def publish_feedback(self, msg: PlanTask.Feedback) -> None:
        pass

    def succeed(self) -> None:
        self.state = "succeeded"

    def abort(self) -> None:
        self.state = "aborted"

    def canceled(self) -> None:
        self.state = "canceled"


class Capture:
    """Stands in for a publisher: keeps what would be published."""

    def __init__(self) -> None:
        self.msgs: list = []

    def publish(self, msg: object) -> None:
        self.msgs.append(msg)


@contextlib.contextmanager
def local_node(ros_domain: int, params: dict | None = None):
    """A PlannerNode in this process with PARAMS (updated by params), not configured."""
    import rclpy
    from rclpy.parameter import Parameter

    from kestrel_planner.planner_node import PlannerNode

    ctx = rclpy.Context()
    rclpy.init(context=ctx, domain_id=ros_domain)
    node = PlannerNode(context=ctx, parameter_overrides=[
        Parameter(k, value=v) for k, v in {**PARAMS, **(params or {})}.items()])
    try:
        yield node
    finally:
        node.stop_workers()
        node.trigger_cleanup()
        node.destroy_node()
        rclpy.try_shutdown(context=ctx)


def set_clock(node, t_ns: int) -> None:  # noqa: ANN001
    """The node's sim time, as /clock would set it."""
    clock = node.get_clock()
    clock._set_ros_time_is_active(True)
    clock.set_ros_time_override(Time(nanoseconds=t_ns))


def scene(node, stamp_ns: int) -> None:  # noqa: ANN001
    msg = PerceptionResult(header=make_header(stamp_ns, "world"),
                           class_names=["red_cube", "bin"])
    msg.camera_index = array.array("I", [0, 0])
    msg.class_index = array.array("H", [0, 1])
    msg.score = array.array("f", [0.9, 0.9])
    msg.bbox = array.array("f", [10.0, 10.0, 4.0, 4.0] * 2)
    msg.position_source = array.array("B", [PerceptionResult.POSITION_LIDAR] * 2)
    msg.position = array.array("d", [0.4, 0.0, 0.02, 0.3, 0.3, 0.0])
    msg.position_variance = array.array("d", [0.0025] * 2)
    node._on_scene(msg)


def plan(node) -> tuple[str, PlanTask.Result]:  # noqa: ANN001
    """One goal through the node's action callbacks: (final state, result)."""
    image = numpy_to_image(np.full((48, 64, 3), 90, np.uint8), "rgb8",
                           make_header(node.get_clock().now().nanoseconds, "camera"))
    goal = PlanTask.Goal(instruction=PLAN, use_image=True, image=image, max_steps=2)
    assert node._on_goal(goal) == GoalResponse.ACCEPT
    handle = GoalHandle(goal)
    result = node._execute(handle)  # bounded by goal_timeout
    return handle.state, result


def diagnostics(node) -> dict[str, str]:  # noqa: ANN001
    capture = Capture()
    node._diag_pub = capture
    node.publish_diagnostics()
    return diagnostics_values(capture.msgs, "planner")


def test_scene_from_before_a_backwards_jump_is_refused_and_the_plan_aborted(ros_domain):
    with local_node(ros_domain) as node:
        set_clock(node, 100 * S)
        node.trigger_configure()
        node.trigger_activate()
        status = Capture()
        node._status_pub = status  # the step statuses the node would publish
        scene(node, 100 * S - S // 10)
        state, result = plan(node)
        assert state == "succeeded", result.reasons
        assert node.executor_core.running  # its first step runs

        set_clock(node, 3 * S)  # the sim restarts: /clock from 100 s back to 3 s
        state, result = plan(node)
        assert state == "aborted" and result.validation_status == R.VALIDATION_ERROR
        assert "time jumped back 97.0 s" in result.reasons[0], result.reasons
        assert "max_scene_age" in result.reasons[0]
        assert not node.executor_core.running  # the plan of before the jump was aborted
        assert "time jumped back" in status.msgs[-1].message
        values = diagnostics(node)
        assert values["time_jumps_back"] == "1" and values["goal_stale_scene"] == "1"

        # a result of before the jump, still on its way: not taken
        scene(node, 100 * S)
        assert diagnostics(node)["perception_stamp_ahead"] == "1"
        assert "time jumped back" in plan(node)[1].reasons[0]

        scene(node, 3 * S + S // 10)  # the new timeline's first scene: planning goes on
        set_clock(node, 3 * S + S // 5)
        state, result = plan(node)
        assert state == "succeeded", result.reasons
        assert diagnostics(node)["time_jumps_back"] == "1"
