"""The planner node shell: PlanTask goals -> PlannerCore (batched) -> validated plan -> executor.

  ~/input/image (Image rgb8/bgr8, SENSOR_QOS)           -> latest frame
  ~/input/perception (PerceptionResult, best effort)     -> latest scene objects (class, xyz m);
      counted (perception_results) and its age at receipt (stamp -> callback) on /diagnostics
  ~/input/joint_states (JointState, SENSOR_QOS), ~/input/ee_position (PointStamped): optional
      execution feedback (HOME check; Cartesian waypoints reached within position_tolerance)
  ~/plan_task (action PlanTask): goals wait on a batching worker thread that serves up to
      max_batch goals in one decode; feedback streams tokens; cancel is checked every token
  ~/output/plan (TaskPlan, LATCHED_QOS), ~/output/control_target (ControlTarget, COMMAND_QOS,
      at execution_rate while a plan runs), ~/output/step_status (StepStatus, COMMAND_QOS)
A rejected plan sends nothing to control; a new accepted plan preempts the running one.

Decoding backends (`backend`, read-only): generate | engine (our VLM: model_config,
weights_path or demo_plan, decoding constrained to the plan grammar), hf (a Hugging Face VLM
from a local directory, `hf.*`), remote (an OpenAI-compatible server such as vLLM, SGLang or
TensorRT-LLM, `remote.*`; tests use tests/planner_openai_stub.py). Whatever decodes, the text
goes through the SAME plan parser and validator (skills enum, targets in the current
perception result, the numeric limits); a reply that is not a plan or breaks a limit gives
VALIDATION_REJECTED with reasons, and nothing reaches control.

Goals: a goal is refused (VALIDATION_ERROR, with the reason) when the scene is older than
max_scene_age, or from before a backwards time jump (core/scene_time.py: a sim restart, a bag
loop; the jump also forgets the camera frame and feedback and aborts a running plan, counted
as time_jumps_back); REJECTED and ERROR results finish the goal ABORTED, accepted ones SUCCEEDED, a
cancelled one CANCELED. goal_timeout bounds the wait for a plan; time_to_first_token and
total_time are measured from the goal's arrival. A rejected plan is not sent back when it has
more steps than max_steps (it is refused before parsing).

Lifecycle: publishers, subscriptions, the action server and the timers are created once (the
first configure / activate) and never destroyed while the executor spins (a multi-threaded
executor may hold them in its wait set); cleanup releases the model and the inputs, and goals
are refused while the node is not active.
"""

from __future__ import annotations

import sys
import threading
import time

import torch
from diagnostic_msgs.msg import DiagnosticStatus
from geometry_msgs.msg import PointStamped
from kestrel_interfaces.action import PlanTask
from kestrel_interfaces.msg import (ControlTarget, PerceptionResult, StepStatus,
                                    TaskPlan)
from rclpy._rclpy_pybind11 import RCLError
from rclpy.action import ActionServer, CancelResponse, GoalResponse
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup, ReentrantCallbackGroup
from rclpy.lifecycle import LifecycleState, TransitionCallbackReturn
from rclpy.qos import QoSProfile, ReliabilityPolicy
from sensor_msgs.msg import Image, JointState

from kestrel_common.base_node import (COMMAND_QOS, LATCHED_QOS, SENSOR_QOS, KestrelLifecycleNode,
                                      run_node)
from kestrel_common.conversions import ConversionError, image_to_numpy, make_header
from kestrel_common.counters import LatencyWindow
from kestrel_planner.core import (PlanExecutor, PlanLimits, PlannerCore, PlanRequest, PlanResult,
                                  SceneObject, StepEvent, ValidationReport)
from kestrel_planner.core.scene_time import SceneTime
from kestrel_planner.batcher import Batcher, Job
from kestrel_planner.params import SPECS, configured_text, planner_configs
from kestrel_planner.plan_msg import plan_to_msg
from kestrel_planner.planner_inputs import PlannerInputs

R = PlanTask.Result
MAX_REASONS = 32  # reasons in one result; the rest are counted in a last line


class PlannerNode(PlannerInputs, KestrelLifecycleNode):
    """Lifecycle shell: parameters -> PlannerCore + PlanExecutor; goals, plans, targets and
    step status. The input callbacks are PlannerInputs' (planner_inputs.py)."""

    def __init__(self, **kwargs: object) -> None:  # kwargs: rclpy Node's (context, overrides)
        super().__init__("planner", SPECS, **kwargs)
        self.core: PlannerCore | None = None
        self.executor_core: PlanExecutor | None = None
        self._lock = threading.Lock()  # latest inputs + executor
        # notified (under _lock) when a camera frame or a scene is kept: goals wait on it
        self._inputs_cond = threading.Condition(self._lock)
        self._pending_lock = threading.Lock()
        self._pending = 0
        self._batcher = Batcher(self.counters.inc, self.get_logger().error)
        self._active = False
        self._image = None  # latest camera frame, HxWx3 uint8 RGB
        self._scene: list[SceneObject] = []
        self._frame_id = ""
        self._ee: tuple[tuple[float, float, float], float] | None = None
        self._joints: tuple[list[float], float] | None = None
        self._plan_frame = ""
        self._ttft = LatencyWindow(256)
        self._scene_age = LatencyWindow(256)  # perception result stamp -> its callback, s
        self._total = LatencyWindow(256)
        self._scene_time = SceneTime(0.0)  # the latest scene's stamp, the clock's jumps
        self._handles: list = []
        self._plan_pub = self._target_pub = self._status_pub = None
        self._timer = None
        self._action = None

    # ---- lifecycle -------------------------------------------------------------------------
    def on_configure(self, state: LifecycleState) -> TransitionCallbackReturn:
        p = self.load_params()
        if p is None:
            return TransitionCallbackReturn.FAILURE
        if p["input_wait"] >= p["goal_timeout"]:
            self.get_logger().error(
                f"configure failed: parameter 'input_wait' = {p['input_wait']}: must be less "
                f"than goal_timeout ({p['goal_timeout']} s), which bounds the whole goal")
            return TransitionCallbackReturn.FAILURE
        with self._lock:
            self._scene_time = SceneTime(p["max_scene_age"])
        self.counters.inc("time_jumps_back", 0)
        try:
            limits = self._build(p)
        except ValueError as exc:  # a parameter's value (the message names it)
            self.get_logger().error(f"configure failed: {exc}")
            return self._configure_failed()
        except Exception as exc:  # noqa: BLE001 - whatever the backend raises, say what
            self.get_logger().error(f"configure failed: backend {p['backend']!r}: "
                                    f"{type(exc).__name__}: {exc}")
            return self._configure_failed()
        remote = self.core.config.remote
        if remote is not None and remote.max_wait_s() > p["goal_timeout"]:
            self.get_logger().warning(
                f"goal_timeout {p['goal_timeout']} s is shorter than the remote worst case "
                f"{remote.max_wait_s():.1f} s (remote.timeout_s, remote.max_retries): slow "
                "goals end as 'planning timed out'")
        if p["gil_switch_interval_us"] > 0:  # process-wide: this process is the node
            sys.setswitchinterval(p["gil_switch_interval_us"] * 1e-6)
        self._create_entities()
        self.get_logger().info(configured_text(p, limits))
        if self.core.graphs_at_configure:
            self.get_logger().info(f"{self.core.graphs_at_configure} CUDA graphs captured at "
                                   f"configure in {self.core.graphs_capture_s:.1f} s (prefill "
                                   "and decode buckets; engine_compile compiles each)")
        note = getattr(self.core.backend, "note", "")  # hf: engine, or transformers and why
        if note:
            log = self.get_logger()
            (log.warning if getattr(self.core.backend, "fallback", False) else log.info)(
                f"backend {p['backend']}: {note}")
        return TransitionCallbackReturn.SUCCESS

    def _configure_failed(self) -> TransitionCallbackReturn:
        if self.core is not None:
            self.core.close()
        self.core, self.executor_core = None, None
        return TransitionCallbackReturn.FAILURE

    def _build(self, p: dict) -> PlanLimits:
        """The executor and the planner core from the parameters (may raise anything)."""
        torch.set_num_threads(p["num_threads"])
        planner, executor = planner_configs(p)
        self.executor_core = PlanExecutor(executor)
        self.core = PlannerCore(planner)
        return planner.limits

    def _create_entities(self) -> None:
        """Publishers, subscriptions and the action server, once (see the module doc)."""
        if self._plan_pub is not None:
            return
        io = MutuallyExclusiveCallbackGroup()
        best_effort = QoSProfile(depth=1, reliability=ReliabilityPolicy.BEST_EFFORT)
        self._plan_pub = self.create_publisher(TaskPlan, "~/output/plan", LATCHED_QOS)
        self._target_pub = self.create_publisher(ControlTarget, "~/output/control_target",
                                                 COMMAND_QOS)
        self._status_pub = self.create_publisher(StepStatus, "~/output/step_status",
                                                 COMMAND_QOS)
        self._handles = [
            self.create_subscription(Image, "~/input/image", self._on_image, SENSOR_QOS,
                                     callback_group=io),
            self.create_subscription(PerceptionResult, "~/input/perception", self._on_scene,
                                     best_effort, callback_group=io),
            self.create_subscription(JointState, "~/input/joint_states", self._on_joints,
                                     SENSOR_QOS, callback_group=io),
            self.create_subscription(PointStamped, "~/input/ee_position", self._on_ee,
                                     SENSOR_QOS, callback_group=io),
        ]
        self._action = ActionServer(
            self, PlanTask, "~/plan_task", self._execute, callback_group=ReentrantCallbackGroup(),
            goal_callback=self._on_goal, cancel_callback=lambda _g: CancelResponse.ACCEPT)

    def on_activate(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._batcher.start(self.core, self.params["max_batch"])
        period = 1.0 / self.params["execution_rate"]
        if self._timer is None:
            self._timer = self.create_timer(period, self._tick,
                                            callback_group=MutuallyExclusiveCallbackGroup())
        else:
            self._timer.timer_period_ns = int(period * 1e9)
            self._timer.reset()
        self.start_diagnostics(self._diag)
        self._active = True
        self.get_logger().info("active: serving ~/plan_task")
        return TransitionCallbackReturn.SUCCESS

    def on_cleanup(self, state: LifecycleState) -> TransitionCallbackReturn:
        self.stop_workers()
        core, self.core, self.executor_core = self.core, None, None
        if core is not None:
            core.close()
        with self._lock:
            self._image, self._scene, self._frame_id = None, [], ""
            self._ee, self._joints = None, None
            self._scene_time.clear()
        return TransitionCallbackReturn.SUCCESS

    def stop_workers(self) -> None:
        was_active, self._active = self._active, False
        self._batcher.stop()
        if self._timer is not None:
            self._timer.cancel()
        self.stop_diagnostics()
        ex = self.executor_core
        if was_active and ex is not None:
            with self._lock:
                events = ex.abort("node deactivated")
            try:  # at process exit the context may already be (or be being) shut down
                self._publish_events(events, hold=bool(events))
            except RCLError:
                pass

    # ---- goals -----------------------------------------------------------------------------
    def _on_goal(self, goal: PlanTask.Goal) -> GoalResponse:
        with self._pending_lock:
            if not self._active or self._pending >= self.params["max_pending_goals"]:
                self.counters.inc("goals_refused")
                return GoalResponse.REJECT
            self._pending += 1
        return GoalResponse.ACCEPT

    def _execute(self, handle) -> PlanTask.Result:
        try:
            return self._serve(handle)
        finally:
            with self._pending_lock:
                self._pending -= 1

    def _finish(self, handle, status: int, reasons: list[str], res: PlanResult | None = None,
                frame_id: str = "", t_goal: float | None = None) -> PlanTask.Result:
        """The result; the goal ends SUCCEEDED (accepted), ABORTED (rejected, error, or
        stopped by deactivation) or CANCELED. Times are the goal's own, from its arrival."""
        key = {R.VALIDATION_ACCEPTED: "goals_accepted", R.VALIDATION_REJECTED: "goals_rejected",
               R.VALIDATION_ERROR: "goals_error"}[status]
        out = R(validation_status=status, reasons=reasons[:MAX_REASONS])
        if len(reasons) > MAX_REASONS:
            out.reasons.append(f"... and {len(reasons) - MAX_REASONS} more")
        if res is not None:
            out.plan = plan_to_msg(res, self.get_clock().now().nanoseconds, frame_id)
            if res.drafted:
                out.draft_acceptance_rate = res.accepted / res.drafted
        if t_goal is not None:
            out.total_time = time.monotonic() - t_goal
            if res is not None and res.started is not None:
                out.time_to_first_token = res.started - t_goal + res.ttft_s
        try:
            if res is not None and res.cancelled:
                self.counters.inc("goals_cancelled")
                if handle.is_cancel_requested:
                    handle.canceled()
                else:  # stopped by deactivation / shutdown
                    handle.abort()
                return out
            self.counters.inc(key)
            if status == R.VALIDATION_ACCEPTED:
                handle.succeed()
            else:
                handle.abort()
        except RCLError:  # the node is shutting down under this goal: nothing left to tell
            pass
        return out

    def _serve(self, handle) -> PlanTask.Result:
        t_goal = time.monotonic()
        goal = handle.request
        def give_up() -> bool:  # a cancel or the node stopping ends a wait for inputs
            return handle.is_cancel_requested or self._batcher.stopping

        image, scene, frame, stale, waited = self._goal_inputs(goal.use_image, t_goal, give_up)
        if waited and give_up():  # ends CANCELED (a cancel) or ABORTED (stopping)
            gone = PlanResult(None, ValidationReport(False, ["cancelled"]), 0.0, 0.0, 0,
                              cancelled=True)
            return self._finish(handle, R.VALIDATION_ERROR, ["cancelled"], gone, t_goal=t_goal)

        def error(reason: str, counter: str = "") -> PlanTask.Result:
            if counter:
                self.counters.inc(counter)
            return self._finish(handle, R.VALIDATION_ERROR, [reason], t_goal=t_goal)

        waited_text = f" (waited input_wait {self.params['input_wait']} s)" if waited else ""
        if waited:
            self.counters.inc("goals_waited_for_inputs")
            stale = stale and stale + waited_text
        if goal.use_image:
            try:
                image = image_to_numpy(goal.image)
            except ConversionError as exc:
                return error(f"goal image: {exc}", f"goal_image_{exc.reason}")
        elif image is None:
            return error("no image: the goal has use_image=false and no camera frame was "
                         f"received{waited_text}", "goal_no_image")
        if not goal.instruction.strip():
            return error("instruction is empty")
        if stale:
            return error(stale, "goal_stale_scene")
        last = [0.0]

        def feedback(n: int, text: str) -> None:
            now = time.monotonic()
            if n == 1 or now - last[0] >= 0.05:
                last[0] = now
                handle.publish_feedback(PlanTask.Feedback(
                    progress=min(1.0, n / self.params["max_new_tokens"]), tokens_generated=n,
                    partial_text=text))

        job = Job(PlanRequest(goal.instruction, image, scene, int(goal.max_steps), feedback))
        job.request.should_cancel = (lambda: job.abandoned or handle.is_cancel_requested
                                     or self._batcher.stopping)
        self._batcher.submit(job)
        left = self.params["goal_timeout"] - (time.monotonic() - t_goal)
        if not job.done.wait(max(left, 0.0)):
            job.abandoned = True  # queued: skipped; decoding: stops at the next token / poll
            return error(f"planning timed out (goal_timeout {self.params['goal_timeout']} s)",
                         "goals_timed_out")
        if job.result is None:
            return error(job.error or "planning failed")
        res = job.result
        if res.drafted:  # speculative decoding: the draft's tokens and the accepted ones
            self.counters.inc("draft_tokens_proposed", res.drafted)
            self.counters.inc("draft_tokens_accepted", res.accepted)
        if res.prefix_hit is not None:
            self.counters.inc("prefix_cache_hits" if res.prefix_hit else "prefix_cache_misses")
        if res.cancelled:
            return self._finish(handle, R.VALIDATION_ERROR, ["cancelled"], res, frame, t_goal)
        if res.error:  # no reply from the backend (e.g. the server is unreachable)
            self.counters.inc("backend_errors")
            self.get_logger().warning(f"planning failed: {res.error}", throttle_duration_sec=5.0)
            return self._finish(handle, R.VALIDATION_ERROR, [res.error], res, frame, t_goal)
        self._ttft.add(res.ttft_s)
        self._total.add(time.monotonic() - t_goal)
        if res.plan is None:
            self.counters.inc("plans_unparsed")  # the model's text is not a plan
        if not res.report.accepted:
            return self._finish(handle, R.VALIDATION_REJECTED, res.report.reasons, res, frame,
                                t_goal)
        return self._accept(handle, res, scene, frame, t_goal)

    def _clock_now(self) -> int:
        """The node clock, ns. After a backwards jump (core/scene_time.py) nothing received
        before is used: scene, camera frame and feedback are forgotten and a running plan is
        aborted (control told to hold); counted as time_jumps_back and logged."""
        now = self.get_clock().now().nanoseconds
        with self._lock:
            if not self._scene_time.observe(now):
                return now
            back = self._scene_time.clock.last_jump_s
            self._image, self._scene, self._frame_id = None, [], ""
            self._ee, self._joints = None, None
            ex = self.executor_core
            events = ex.abort(f"time jumped back {back:.1f} s") if ex is not None else []
        n = self.counters.inc("time_jumps_back")
        self.get_logger().warning(
            f"time jumped back {back:.1f} s (a sim restart, a bag loop?; total {n}): scene, "
            f"camera frame and feedback from before are forgotten"
            + (", the running plan aborted" if events else ""))
        if events:
            self._publish_events(events, hold=True)
        return now

    def _accept(self, handle, res: PlanResult, scene, frame: str,
                t_goal: float) -> PlanTask.Result:
        plan_msg = plan_to_msg(res, self.get_clock().now().nanoseconds, frame)
        try:
            with self._lock:
                events = self.executor_core.start(res.plan, scene, self._now())
                self._plan_frame = frame
        except ValueError as exc:  # cannot happen for a validated plan; never crash on it
            return self._finish(handle, R.VALIDATION_ERROR, [f"execution: {exc}"], res, frame,
                                t_goal)
        self._plan_pub.publish(plan_msg)
        self._publish_events(events)
        out = self._finish(handle, R.VALIDATION_ACCEPTED, [], res, frame, t_goal)
        out.plan = plan_msg
        return out

    # ---- execution -------------------------------------------------------------------------
    def _now(self) -> float:
        return self.get_clock().now().nanoseconds * 1e-9

    def _tick(self) -> None:
        ex = self.executor_core
        if not self._active or ex is None:
            return
        now = self._clock_now()  # (a backwards jump aborts the plan first)
        now_m, age = time.monotonic(), self.params["feedback_age"]
        with self._lock:
            ee = self._ee[0] if self._ee and now_m - self._ee[1] <= age else None
            q = self._joints[0] if self._joints and now_m - self._joints[1] <= age else None
            out = ex.tick(now * 1e-9, ee, q)
            frame = self._plan_frame
        if out.target is not None:
            self._publish_target(out.target, frame)
        self._publish_events(out.events)

    def _publish_target(self, t, frame: str) -> None:
        msg = ControlTarget(header=make_header(self.get_clock().now().nanoseconds, frame))
        msg.mode = int(t.mode)
        msg.position.x, msg.position.y, msg.position.z = (float(v) for v in t.position)
        msg.joint_positions = [float(v) for v in t.joint_positions]
        msg.max_speed, msg.gripper = float(t.max_speed), float(t.gripper)
        msg.step_index, msg.skill_name = int(t.step_index), t.skill_name
        self._target_pub.publish(msg)

    def _publish_events(self, events: list[StepEvent], hold: bool = False) -> None:
        stamp = self.get_clock().now().nanoseconds
        for e in events:
            self._status_pub.publish(StepStatus(
                header=make_header(stamp, self._plan_frame), step_index=e.step_index,
                step_count=e.step_count, status=int(e.status), message=e.message))
        if hold and self.executor_core is not None:
            self._publish_target(self.executor_core.hold_target(), self._plan_frame)

    def _diag(self) -> tuple[int, str, dict]:
        with self._lock:
            values: dict[str, object] = {"pending_goals": self._pending,
                                         "scene_objects": len(self._scene),
                                         "have_image": self._image is not None}
        for name, w in (("ttft", self._ttft), ("total", self._total),
                        ("perception_age", self._scene_age)):
            for k, v in w.percentiles((50.0, 99.0)).items():
                values[f"{name}_{k}_s"] = v
        ex = self.executor_core
        values["executing_step"] = -1 if ex is None or ex.active_index is None \
            else ex.active_index
        if self.params.get("speculative.k"):  # accepted / proposed draft tokens, all goals
            n = self.counters.get("draft_tokens_proposed")
            values["draft_acceptance_rate"] = (
                round(self.counters.get("draft_tokens_accepted") / n, 4) if n else -1.0)
        return DiagnosticStatus.OK, "ok" if self._active else "inactive", values


def main(args: list[str] | None = None) -> int:
    return run_node(PlannerNode, args, num_threads=8)


if __name__ == "__main__":
    raise SystemExit(main())
