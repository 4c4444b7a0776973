"""The planner node in this process (no executor, no DDS traffic): a goal decoded with
speculative decoding reports its draft acceptance rate in the PlanTask result and on
/diagnostics; without it the result says -1 and /diagnostics has no rate; a speculative
setting the node cannot serve fails configure naming the parameter.

The model is the tiny VLM with demo weights (a bigram model of the plan text: only its first
decoder layer is non-zero), so a draft made of that first layer agrees on every token."""

from __future__ import annotations

import array
import contextlib
import time

import numpy as np
from kestrel_interfaces.action import PlanTask
from kestrel_interfaces.msg import PerceptionResult
from rclpy.action import GoalResponse

from kestrel_common.conversions import make_header, numpy_to_image
from ros_harness import diagnostics_values

R = PlanTask.Result
PARAMS = {"model_config": "tiny", "demo_plan": "move_to red_cube speed=0.2 height=0.2; end",
          "max_new_tokens": 160, "max_steps": 2, "max_scene_age": 0.0, "autostart": False,
          "gc_freeze": False, "diagnostics_period": 0.2}


class GoalHandle:
    """What PlannerNode._execute uses of rclpy's ServerGoalHandle."""

    def __init__(self, goal: PlanTask.Goal) -> None:
        self.request, self.is_cancel_requested = goal, False
        self.feedback: list[PlanTask.Feedback] = []
        self.state = ""

    def publish_feedback(self, msg: PlanTask.Feedback) -> None:
        self.feedback.append(msg)

    def succeed(self) -> None:
        self.state = "succeeded"

    def abort(self) -> None:
        self.state = "aborted"

    def canceled(self) -> None:
        self.state = "canceled"


class Capture:
    """Stands in for the /diagnostics publisher: keeps what would be published."""

    def __init__(self) -> None:
        self.msgs: list = []

    def publish(self, msg: object) -> None:
        self.msgs.append(msg)


@contextlib.contextmanager
def local_node(ros_domain: int, **extra: object):
    import rclpy
    from rclpy.parameter import Parameter

    from kestrel_planner.planner_node import PlannerNode

    ctx = rclpy.Context()
    rclpy.init(context=ctx, domain_id=ros_domain)
    node = PlannerNode(context=ctx, parameter_overrides=[
        Parameter(k, value=v) for k, v in {**PARAMS, **extra}.items()])
    try:
        yield node
    finally:
        node.stop_workers()
        node.trigger_cleanup()
        node.destroy_node()
        rclpy.try_shutdown(context=ctx)


def _scene(node) -> None:  # noqa: ANN001
    msg = PerceptionResult(header=make_header(time.time_ns(), "world"),
                           class_names=["red_cube", "bin"])
    msg.camera_index = array.array("I", [0, 0])
    msg.class_index = array.array("H", [0, 1])
    msg.score = array.array("f", [0.9, 0.9])
    msg.bbox = array.array("f", [10.0, 10.0, 4.0, 4.0] * 2)
    msg.position_source = array.array("B", [PerceptionResult.POSITION_LIDAR] * 2)
    msg.position = array.array("d", [0.4, 0.0, 0.02, 0.3, 0.3, 0.0])
    msg.position_variance = array.array("d", [0.0025] * 2)
    node._on_scene(msg)


def _plan(node) -> tuple[PlanTask.Result, dict[str, str]]:  # noqa: ANN001
    """One goal through the node's action callbacks, then one /diagnostics message."""
    image = numpy_to_image(np.full((48, 64, 3), 90, np.uint8), "rgb8",
                           make_header(time.time_ns(), "camera"))
    goal = PlanTask.Goal(instruction="go to the red cube", use_image=True, image=image,
                         max_steps=2)
    assert node._on_goal(goal) == GoalResponse.ACCEPT
    handle = GoalHandle(goal)
    result = node._execute(handle)  # bounded by goal_timeout
    assert handle.state == "succeeded", result.reasons
    capture = Capture()
    node._diag_pub = capture
    node.publish_diagnostics()
    return result, diagnostics_values(capture.msgs, "planner")


def test_speculative_goal_reports_acceptance_rate(ros_domain: int) -> None:
    with local_node(ros_domain, **{"speculative.k": 3, "speculative.draft_layers": 1}) as node:
        node.trigger_configure()
        node.trigger_activate()
        assert node.core is not None and node.core.backend.spec is not None
        _scene(node)
        result, diag = _plan(node)
        assert result.validation_status == R.VALIDATION_ACCEPTED
        assert result.plan.steps[0].skill_name == "move_to"
        assert result.draft_acceptance_rate == 1.0  # the first layer is the whole bigram model
        assert float(diag["draft_acceptance_rate"]) == 1.0
        assert int(diag["draft_tokens_proposed"]) >= 3
        assert diag["draft_tokens_accepted"] == diag["draft_tokens_proposed"]


def test_plain_goal_has_no_acceptance_rate(ros_domain: int) -> None:
    with local_node(ros_domain, backend="engine") as node:
        node.trigger_configure()
        node.trigger_activate()
        _scene(node)
        result, diag = _plan(node)
        assert result.validation_status == R.VALIDATION_ACCEPTED
        assert result.draft_acceptance_rate == -1.0
        assert "draft_acceptance_rate" not in diag and "draft_tokens_proposed" not in diag
        assert diag["prefix_cache_misses"] == "1"  # the engine's prefix cache is on
        result, diag = _plan(node)  # the same frame and objects: reused
        assert diag["prefix_cache_hits"] == "1"


def test_speculative_without_our_vlm_fails_configure(ros_domain: int, capfd) -> None:  # noqa: ANN001
    from rclpy.lifecycle import TransitionCallbackReturn

    with local_node(ros_domain, backend="plan_text", **{"speculative.k": 2}) as node:
        assert node.trigger_configure() == TransitionCallbackReturn.FAILURE
        assert node.core is None
    assert "parameter 'speculative.k' = 2" in capfd.readouterr().err
    with local_node(ros_domain, **{"speculative.k": 2, "speculative.draft_layers": 4}) as node:
        assert node.trigger_configure() == TransitionCallbackReturn.FAILURE
    assert "parameter 'speculative.draft_layers' = 4" in capfd.readouterr().err
