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

Decoding backends (`backend`, read-only). Whatever decodes, the text goes through the SAME plan
parser and validator (skills enum, targets in the current perception result, the numeric
limits below); a reply that is not a plan or breaks a limit gives VALIDATION_REJECTED with
reasons, and nothing reaches control.
  generate | engine  our VLM (model_config, weights_path or demo_plan), decoding constrained to
                     the plan grammar. engine = static KV-cache slots, CUDA-graph decode.
                     grammar_engine: llguidance (default; token masks for any tokenizer) |
                     automaton (the hand-written character automaton, constrained.py).
  hf       a Hugging Face image-text-to-text checkpoint from a LOCAL directory, through
           transformers (nothing is downloaded; LLaVA-style configs):
               backend: hf
               hf_model_path: /models/my-llava      # save_pretrained output: config.json,
                                                    # weights, tokenizer, preprocessor_config
               hf_dtype: bfloat16                   # auto | float32 | bfloat16 | float16
               device: cuda:0
               hf_tokenizer: auto                   # the directory's tokenizer + chat template
               hf_grammar: true                     # plan grammar (BPE too, llguidance);
                                                    # false = prompt + parser + validator
  remote   an OpenAI-compatible chat-completions server serving a large VLM, e.g. vLLM:
               vllm serve Qwen/Qwen2.5-VL-72B-Instruct --tensor-parallel-size 8 \
                   --served-model-name planner --api-key "$PLANNER_KEY"
           then
               backend: remote
               remote_base_url: http://gpu-host:8000/v1
               remote_model: planner
               remote_api_key_env: PLANNER_KEY      # the variable's NAME; never the key itself
               remote_timeout_s: 10.0               # per attempt (connect, read)
               remote_max_retries: 2                # on timeouts, connection errors, 429, 5xx
               remote_send_image: true              # the frame as a PNG data URL
               remote_response_format: json_schema  # sends response_format json_schema: vLLM,
                                                    # SGLang, TensorRT-LLM constrain it;
                                                    # 'text' where a server answers HTTP 400
           SGLang (`python -m sglang.launch_server ... --port 30000`, base_url .../v1) and
           TensorRT-LLM (`trtllm-serve <model>`) work the same way. No reply after the retries
           -> VALIDATION_ERROR (counted: backend_errors); the node keeps serving.
The tests use a small stub server speaking the same protocol (tests/planner_openai_stub.py),
not a real vLLM (vLLM needs its own torch build; not installable on the CPU test machines).
"""

from __future__ import annotations

import math
import sys
import threading
import time
from dataclasses import dataclass, field

import torch
from diagnostic_msgs.msg import DiagnosticStatus
from geometry_msgs.msg import PointStamped
from kestrel_interfaces.action import PlanTask
from kestrel_interfaces.msg import (ControlTarget, PerceptionResult, StepArgument, StepStatus,
                                    TaskPlan, TaskStep)
from rclpy._rclpy_pybind11 import RCLError
from rclpy.action import ActionServer, CancelResponse, GoalResponse
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup, ReentrantCallbackGroup
from rclpy.lifecycle import LifecycleState, TransitionCallbackReturn
from rclpy.qos import QoSProfile, ReliabilityPolicy
from sensor_msgs.msg import Image, JointState

from kestrel_common.base_node import (COMMAND_QOS, LATCHED_QOS, SENSOR_QOS, KestrelLifecycleNode,
                                      run_node)
from kestrel_common.conversions import (ConversionError, detection_arrays, image_to_numpy,
                                         make_header, stamp_to_ns)
from kestrel_common.counters import LatencyWindow
from kestrel_planner.core import (SKILLS, ExecutorConfig, PlanExecutor, PlanLimits,
                                  PlannerConfig, PlannerCore, PlannerInputError, PlanRequest,
                                  PlanResult, SceneObject, Skill, StepEvent)
from kestrel_planner.core.scene import scene_from_detections
from kestrel_planner.params import SPECS, remote_config
from kestrel_models.planner import get_config

R = PlanTask.Result


@dataclass
class _Job:
    request: PlanRequest
    done: threading.Event = field(default_factory=threading.Event)
    result: PlanResult | None = None
    error: str = ""
    abandoned: bool = False  # the goal gave up waiting (goal_timeout): stop decoding it


def plan_to_msg(result: PlanResult, stamp_ns: int, frame_id: str) -> TaskPlan:
    """Steps with the effective value of every argument (given or default), SI units."""
    msg = TaskPlan(header=make_header(stamp_ns, frame_id))
    if result.plan is None:
        return msg
    msg.instruction = result.plan.instruction
    for s in result.plan.steps:
        spec = SKILLS[Skill(int(s.skill))]
        msg.steps.append(TaskStep(
            skill=int(s.skill), skill_name=spec.name, target_object=s.target_object,
            arguments=[StepArgument(name=a.name, value=s.value(a.name), unit=a.unit)
                       for a in spec.args]))
    return msg


class PlannerNode(KestrelLifecycleNode):
    def __init__(self) -> None:
        super().__init__("planner", SPECS)
        self.core: PlannerCore | None = None
        self.executor_core: PlanExecutor | None = None
        self._lock = threading.Lock()  # latest inputs + executor
        self._cv = threading.Condition()
        self._jobs: list[_Job] = []
        self._pending = 0
        self._worker: threading.Thread | None = None
        self._stop = threading.Event()
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
        self._handles: list = []
        self._timer = None
        self._action = None

    # ---- lifecycle -------------------------------------------------------------------------
    def on_configure(self, state: LifecycleState) -> TransitionCallbackReturn:
        p = self.load_params()
        if p is None:
            return TransitionCallbackReturn.FAILURE
        try:
            torch.set_num_threads(p["num_threads"])
            limits = PlanLimits(p["max_speed"], p["min_height"], p["max_height"],
                                tuple(p["workspace_min"]), tuple(p["workspace_max"]),
                                p["max_steps"])
            cfg = get_config(p["model_config"])
            if p["image_size"]:
                cfg = cfg.with_overrides(image_size=p["image_size"])
            need = cfg.num_image_tokens + p["max_new_tokens"] + 64
            if p["backend"] in ("generate", "engine") and need > cfg.max_seq_len:
                raise ValueError(f"parameter 'max_new_tokens' = {p['max_new_tokens']}: image "
                                 f"tokens + budget + prompt exceed max_seq_len {cfg.max_seq_len}")
            remote = remote_config(p) if p["backend"] == "remote" else None
            self.executor_core = PlanExecutor(ExecutorConfig(
                p["position_tolerance"], p["step_timeout"], p["gripper_time"],
                tuple(p["home_joint_positions"])))
            self.core = PlannerCore(PlannerConfig(
                model=cfg, weights_path=p["weights_path"],
                demo_plan="\n".join(x.strip() for x in p["demo_plan"].split(";")),
                device=p["device"], seed=p["seed"], max_new_tokens=p["max_new_tokens"],
                max_batch=p["max_batch"], temperature=p["temperature"], limits=limits,
                backend=p["backend"], engine_compile=p["engine_compile"],
                hf_model_path=p["hf_model_path"], hf_dtype=p["hf_dtype"],
                hf_tokenizer=p["hf_tokenizer"], hf_grammar=p["hf_grammar"],
                grammar_engine=p["grammar_engine"], remote=remote,
                remote_send_image=p["remote_send_image"],
                remote_response_format=p["remote_response_format"]))
        except ValueError as exc:
            self.get_logger().error(f"configure failed: {exc}")
            return TransitionCallbackReturn.FAILURE
        except (OSError, RuntimeError, ImportError) as exc:  # e.g. a broken HF checkpoint
            self.get_logger().error(f"configure failed: backend {p['backend']!r}: {exc!r}")
            return TransitionCallbackReturn.FAILURE
        if remote is not None and remote.max_wait_s() > p["goal_timeout"]:
            self.get_logger().warning(
                f"goal_timeout {p['goal_timeout']} s is shorter than the remote worst case "
                f"{remote.max_wait_s():.1f} s (remote_timeout_s, remote_max_retries): slow "
                "goals end as 'planning timed out'")
        if p["gil_switch_interval_us"] > 0:  # process-wide: this process is the node
            sys.setswitchinterval(p["gil_switch_interval_us"] * 1e-6)
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
        model = {"hf": p["hf_model_path"], "remote": f"{p['remote_model']} at "
                 f"{p['remote_base_url']}"}.get(p["backend"], f"{p['model_config']} model")
        self.get_logger().info(f"configured: backend {p['backend']}, {model}, max_batch "
                               f"{p['max_batch']}, limits {limits}")
        return TransitionCallbackReturn.SUCCESS

    def on_activate(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._stop.clear()
        self._worker = threading.Thread(target=self._work, name="planner_worker", daemon=True)
        self._worker.start()
        self._timer = self.create_timer(1.0 / self.params["execution_rate"], self._tick,
                                        callback_group=MutuallyExclusiveCallbackGroup())
        self.start_diagnostics(self._diag)
        self._active = True
        self.get_logger().info("active: serving ~/plan_task")
        return TransitionCallbackReturn.SUCCESS

    def on_cleanup(self, state: LifecycleState) -> TransitionCallbackReturn:
        self.stop_workers()
        for h in self._handles:
            self.destroy_subscription(h)
        for pub in (self._plan_pub, self._target_pub, self._status_pub):
            self.destroy_publisher(pub)
        if self._action is not None:
            self._action.destroy()
        if self.core is not None:
            self.core.close()
        self._handles, self._action, self.core = [], None, None
        return TransitionCallbackReturn.SUCCESS

    def stop_workers(self) -> None:
        was_active, self._active = self._active, False
        self._stop.set()
        with self._cv:
            self._cv.notify_all()
        if self._worker is not None:
            self._worker.join(timeout=5.0)
            self._worker = None
        if self._timer is not None:
            self.destroy_timer(self._timer)
            self._timer = None
        self.stop_diagnostics()
        if was_active and self.executor_core is not None:
            with self._lock:
                events = self.executor_core.abort("node deactivated")
            try:  # at process exit the context may already be (or be being) shut down
                self._publish_events(events, hold=bool(events))
            except RCLError:
                pass

    # ---- inputs ----------------------------------------------------------------------------
    def _on_image(self, msg: Image) -> None:
        try:
            arr = image_to_numpy(msg)
        except ConversionError as exc:
            self.drop(f"image_{exc.reason}", str(exc))
            return
        with self._lock:
            self._image = arr

    def _on_scene(self, msg: PerceptionResult) -> None:
        self._scene_age.add((self.get_clock().now().nanoseconds
                             - stamp_to_ns(msg.header.stamp)) * 1e-9)
        self.counters.inc("perception_results")
        try:
            d = detection_arrays(msg)
        except ConversionError as exc:
            self.drop(exc.reason, str(exc))
            return
        objects, skipped = scene_from_detections(list(msg.class_names), d["class_index"],
                                                 d["score"], d["position_source"],
                                                 d["position"])
        for reason, n in skipped.items():
            if n:
                self.drop(reason, f"{n} detection(s) in the perception result")
        with self._lock:
            self._scene, self._frame_id = objects, msg.header.frame_id

    def _on_joints(self, msg: JointState) -> None:
        with self._lock:
            self._joints = (list(msg.position), time.monotonic())

    def _on_ee(self, msg: PointStamped) -> None:
        p = msg.point
        if not all(math.isfinite(v) for v in (p.x, p.y, p.z)):
            self.drop("ee_nonfinite", f"ee position {p}")
            return
        with self._lock:
            self._ee = ((p.x, p.y, p.z), time.monotonic())

    # ---- goals -----------------------------------------------------------------------------
    def _on_goal(self, goal: PlanTask.Goal) -> GoalResponse:
        with self._cv:
            if not self._active or self._pending >= self.params["max_pending_goals"]:
                self.counters.inc("goals_refused")
                return GoalResponse.REJECT
            self._pending += 1
        return GoalResponse.ACCEPT

    def _execute(self, handle) -> PlanTask.Result:
        try:
            return self._serve(handle)
        finally:
            with self._cv:
                self._pending -= 1

    def _finish(self, handle, status: int, reasons: list[str], res: PlanResult | None = None,
                frame_id: str = "") -> PlanTask.Result:
        key = {R.VALIDATION_ACCEPTED: "goals_accepted", R.VALIDATION_REJECTED: "goals_rejected",
               R.VALIDATION_ERROR: "goals_error"}[status]
        out = R(validation_status=status, reasons=reasons)
        if res is not None:
            out.plan = plan_to_msg(res, self.get_clock().now().nanoseconds, frame_id)
            out.time_to_first_token, out.total_time = res.ttft_s, res.total_s
        try:
            if res is not None and res.cancelled:
                self.counters.inc("goals_cancelled")
                if handle.is_cancel_requested:
                    handle.canceled()
                else:  # stopped by deactivation / shutdown
                    handle.abort()
                return out
            self.counters.inc(key)
            handle.succeed()
        except RCLError:  # the node is shutting down under this goal: nothing left to tell
            pass
        return out

    def _serve(self, handle) -> PlanTask.Result:
        goal = handle.request
        with self._lock:
            image, scene, frame = self._image, list(self._scene), self._frame_id
        if goal.use_image:
            try:
                image = image_to_numpy(goal.image)
            except ConversionError as exc:
                self.counters.inc(f"goal_image_{exc.reason}")
                return self._finish(handle, R.VALIDATION_ERROR, [f"goal image: {exc}"])
        elif image is None:
            self.counters.inc("goal_no_image")
            return self._finish(handle, R.VALIDATION_ERROR, [
                "no image: the goal has use_image=false and no camera frame was received"])
        if not goal.instruction.strip():
            return self._finish(handle, R.VALIDATION_ERROR, ["instruction is empty"])
        last = [0.0]

        def feedback(n: int, text: str) -> None:
            now = time.monotonic()
            if n == 1 or now - last[0] >= 0.05:
                last[0] = now
                handle.publish_feedback(PlanTask.Feedback(
                    progress=min(1.0, n / self.params["max_new_tokens"]), tokens_generated=n,
                    partial_text=text))

        job = _Job(PlanRequest(goal.instruction, image, scene, int(goal.max_steps), feedback))
        job.request.should_cancel = (lambda: job.abandoned or handle.is_cancel_requested
                                     or self._stop.is_set())
        with self._cv:
            self._jobs.append(job)
            self._cv.notify()
        if not job.done.wait(self.params["goal_timeout"]):
            job.abandoned = True  # queued: skipped; decoding: stops at the next token / poll
            return self._finish(handle, R.VALIDATION_ERROR, ["planning timed out"])
        if job.result is None:
            return self._finish(handle, R.VALIDATION_ERROR, [job.error or "planning failed"])
        res = job.result
        if res.cancelled:
            return self._finish(handle, R.VALIDATION_ERROR, ["cancelled"], res, frame)
        if res.error:  # no reply from the backend (e.g. the server is unreachable)
            self.counters.inc("backend_errors")
            self.get_logger().warning(f"planning failed: {res.error}", throttle_duration_sec=5.0)
            return self._finish(handle, R.VALIDATION_ERROR, [res.error], res, frame)
        self._ttft.add(res.ttft_s)
        self._total.add(res.total_s)
        if res.plan is None:
            self.counters.inc("plans_unparsed")  # the model's text is not a plan
        if not res.report.accepted:
            return self._finish(handle, R.VALIDATION_REJECTED, res.report.reasons, res, frame)
        return self._accept(handle, res, scene, frame)

    def _accept(self, handle, res: PlanResult, scene, frame: str) -> PlanTask.Result:
        plan_msg = plan_to_msg(res, self.get_clock().now().nanoseconds, frame)
        try:
            with self._lock:
                events = self.executor_core.start(res.plan, scene, self._now())
                self._plan_frame = frame
        except ValueError as exc:  # cannot happen for a validated plan; never crash on it
            return self._finish(handle, R.VALIDATION_ERROR, [f"execution: {exc}"], res, frame)
        self._plan_pub.publish(plan_msg)
        self._publish_events(events)
        out = self._finish(handle, R.VALIDATION_ACCEPTED, [], res, frame)
        out.plan = plan_msg
        return out

    # ---- batching worker -------------------------------------------------------------------
    def _work(self) -> None:
        while not self._stop.is_set():
            with self._cv:
                if not self._jobs:
                    self._cv.wait(timeout=0.2)
                    continue
                batch = self._jobs[: self.params["max_batch"]]
                del self._jobs[: len(batch)]
            self._run_batch(batch)
        with self._cv:
            left, self._jobs = self._jobs, []
        for job in left:
            job.error = "node deactivated"
            job.done.set()

    def _run_batch(self, batch: list[_Job]) -> None:
        self.counters.inc("batches")
        self.counters.inc(f"batch_size_{len(batch)}")
        try:
            results = self.core.plan_batch([j.request for j in batch])
            for job, res in zip(batch, results, strict=True):
                job.result = res
        except PlannerInputError:  # one bad request: serve them one by one
            for job in batch:
                try:
                    job.result = self.core.plan_batch([job.request])[0]
                except PlannerInputError as exc:
                    job.error = f"bad request: {exc}"
        except Exception as exc:  # a model failure must not kill the node
            self.counters.inc("planner_errors")
            self.get_logger().error(f"planning failed: {exc!r}")
            for job in batch:
                job.error = f"internal error: {exc!r}"
        for job in batch:
            job.done.set()

    # ---- execution -------------------------------------------------------------------------
    def _now(self) -> float:
        return self.get_clock().now().nanoseconds * 1e-9

    def _tick(self) -> None:
        if not self._active or self.executor_core is None:
            return
        now_m, age = time.monotonic(), self.params["feedback_age"]
        with self._lock:
            ee = self._ee[0] if self._ee and now_m - self._ee[1] <= age else None
            q = self._joints[0] if self._joints and now_m - self._joints[1] <= age else None
            out = self.executor_core.tick(self._now(), ee, q)
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
        return DiagnosticStatus.OK, "ok" if self._active else "inactive", values


def main(args: list[str] | None = None) -> int:
    return run_node(PlannerNode, args, num_threads=8)


if __name__ == "__main__":
    raise SystemExit(main())
