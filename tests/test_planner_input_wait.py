"""The planner node in this process (no executor, no DDS traffic): a goal that arrives before
the node has a camera frame, a usable scene or sim time (right after start-up) waits for them,
bounded by input_wait, and is planned when they come; when they do not, it is refused after
the wait with the reason, and every wait is counted on /diagnostics. input_wait must be less
than goal_timeout, or configure fails naming it."""

from __future__ import annotations

import threading
import time

import numpy as np
from kestrel_interfaces.action import PlanTask
from rclpy.action import GoalResponse
from test_planner_time_jump import PLAN, S, GoalHandle, diagnostics, local_node, scene, set_clock

from kestrel_common.conversions import make_header, numpy_to_image

R = PlanTask.Result


def frame(node) -> None:  # noqa: ANN001
    """One camera frame through the node's subscription callback."""
    node._on_image(numpy_to_image(np.full((48, 64, 3), 90, np.uint8), "rgb8",
                                  make_header(node.get_clock().now().nanoseconds, "camera")))


def watch_waits(node) -> threading.Event:  # noqa: ANN001
    """An event set once a goal waits on the node's input condition."""
    waiting = threading.Event()
    wait = node._inputs_cond.wait

    def wait_and_say(timeout: float) -> bool:
        waiting.set()
        return wait(timeout)

    node._inputs_cond.wait = wait_and_say
    return waiting


def goal_without_image(node) -> tuple[str, PlanTask.Result]:  # noqa: ANN001
    """A goal that plans on the node's own camera frame (use_image False): (state, result)."""
    goal = PlanTask.Goal(instruction=PLAN, use_image=False, max_steps=2)
    assert node._on_goal(goal) == GoalResponse.ACCEPT
    handle = GoalHandle(goal)
    result = node._execute(handle)  # bounded by goal_timeout
    return handle.state, result


def test_a_goal_before_the_first_inputs_waits_for_them_and_is_planned(ros_domain):
    with local_node(ros_domain, {"input_wait": 20.0}) as node:
        node.trigger_configure()
        node.trigger_activate()
        # sim time not started (no /clock yet), no frame, no scene: the goal waits
        waiting = watch_waits(node)
        out: list = []
        goal = threading.Thread(target=lambda: out.append(goal_without_image(node)))
        goal.start()
        assert waiting.wait(10.0), "the goal did not wait for its inputs"
        set_clock(node, 100 * S)  # the first /clock
        frame(node)
        assert goal.is_alive()  # a frame, but no scene yet: still waiting
        scene(node, 100 * S - S // 10)
        goal.join(15.0)
        assert not goal.is_alive() and out, "the goal did not end once its inputs came"
        state, result = out[0]
        assert state == "succeeded", result.reasons
        assert result.validation_status == R.VALIDATION_ACCEPTED
        assert diagnostics(node)["goals_waited_for_inputs"] == "1"

        # inputs there: the next goal does not wait
        set_clock(node, 100 * S + S // 5)
        assert goal_without_image(node)[0] == "succeeded"
        assert diagnostics(node)["goals_waited_for_inputs"] == "1"


def test_a_goal_whose_inputs_do_not_come_is_refused_after_input_wait(ros_domain):
    with local_node(ros_domain, {"input_wait": 0.3}) as node:
        set_clock(node, 100 * S)
        node.trigger_configure()
        node.trigger_activate()
        t0 = time.monotonic()
        state, result = goal_without_image(node)
        assert time.monotonic() - t0 >= 0.3  # it waited its input_wait
        assert state == "aborted" and result.validation_status == R.VALIDATION_ERROR
        assert "no camera frame" in result.reasons[0], result.reasons
        assert "waited input_wait 0.3 s" in result.reasons[0]

        frame(node)  # a frame but no scene: refused for the scene, after the wait
        state, result = goal_without_image(node)
        assert state == "aborted"
        assert "no perception result received yet" in result.reasons[0], result.reasons
        assert "waited input_wait 0.3 s" in result.reasons[0]
        values = diagnostics(node)
        assert values["goals_waited_for_inputs"] == "2"
        assert values["goal_no_image"] == "1" and values["goal_stale_scene"] == "1"


def test_a_cancel_ends_the_wait_as_a_cancelled_goal(ros_domain):
    with local_node(ros_domain, {"input_wait": 20.0}) as node:
        set_clock(node, 100 * S)
        node.trigger_configure()
        node.trigger_activate()
        goal = PlanTask.Goal(instruction=PLAN, use_image=False, max_steps=2)
        handle = GoalHandle(goal)
        waiting = watch_waits(node)
        out: list = []
        worker = threading.Thread(target=lambda: out.append(node._execute(handle)))
        worker.start()
        assert waiting.wait(10.0), "the goal did not wait for its inputs"
        handle.is_cancel_requested = True
        worker.join(10.0)  # woken within 0.1 s by the cancel, not after input_wait
        assert not worker.is_alive() and out
        assert handle.state == "canceled" and out[0].reasons == ["cancelled"]
        assert diagnostics(node)["goals_cancelled"] == "1"


def test_input_wait_not_below_goal_timeout_fails_configure(ros_domain):
    with local_node(ros_domain, {"input_wait": 30.0, "goal_timeout": 30.0}) as node:
        node.trigger_configure()
        assert node.core is None  # not configured: the check comes before the backend
