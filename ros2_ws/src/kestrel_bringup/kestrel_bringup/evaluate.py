"""Closed-loop evaluation: seeded episodes with random instructions through the running stack.

    python -m kestrel_bringup.evaluate --episodes 50 --seed 0 --out docs/benchmarks/closed_loop_cpu
    python -m kestrel_bringup.evaluate --no-stack ...   # against a stack / simulator already up
    python -m kestrel_bringup.evaluate --device cuda --workers 5 \
        --out docs/benchmarks/closed_loop_h100   # a 16-core GPU machine: 5 stacks at once

The nodes run as separate processes over DDS on sim time (kestrel_bringup.run_stack's
StackRunner, the stack's table and YAML; `--controller` sets the control node's controller).
The evaluator speaks only the simulator contract (config/sim_contract.yaml) and the planner's
action, so it runs against any simulator that publishes the contract:
  per episode: /sim/reset (seed, goal object) -> the objects present; the goal is drawn from
  them and the instruction from templates; /planner/plan_task (PlanTask) with the instruction;
  then /sim/episode (EpisodeStatus: held, success), /sim/ground_truth (is the goal over the
  bin) and /control/loop_stats (deadline misses) until success or --timeout s of sim time;
  /perception/result says whether the goal's class was detected (perception_miss) and how far
  its position (and the bin's) is from the ground truth; /planner/step_status how each plan
  step ended (a step's timeout names it).
`--task stack`: the instruction asks to stack the goal on another task object, the base ('stack
the red cube on the blue cylinder'); the embedded simulator is started with at least two task
objects on the table (episode.min_objects), and with --no-stack a layout with one is skipped.
`--task push`: the instruction asks to push the goal ('push the red cube'). When each task is
done, by the ground truth: kestrel_bringup.episode_tasks. An episode ends at its success, at
--timeout, or PLAN_END_GRACE_S of sim time after its plan ended without one.
`--oracle-plan`: the planner node runs backend plan_text and is sent the correct plan for the
goal ('pick <goal>; place bin', or 'place <base>') instead of the instruction. That measures
everything but the planner's model (perception's scene, validation, execution, control, the
robot) and the output says so in its first lines.
`--device cuda`: the GPU variants (evaluation.gpu_params: perception and the planner's decode
engine on the GPU). `--workers N`: N stacks at once, each on its own ROS domain and share of the
seeds, one merged table (evaluate_runs).
Output: the summary of kestrel_bringup.evaluation (success rate with a Wilson 95 % interval,
failures by stage, time to success, deadline misses, the sim-time speed: sim seconds per wall
second over the run) as <out>.json and <out>.md, the outcomes
as <out>.png, and the first episode's video (<out>.mp4 or `--video`) from /camera/image_raw
with the instruction and the plan step (/planner/plan, /planner/step_status) written over it
(episode_media).
"""

from __future__ import annotations

import argparse
import math
import random
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from kestrel_bringup.episode_tasks import (TASKS, TaskJudge, Truth, instruction_for, oracle_plan,
                                           over_target)
from kestrel_bringup.evaluation import (ORACLE_NOTE, EpisodeTrace, markdown, plan_text, run_record,
                                        sim_speed, summarize)
from kestrel_common.spin_thread import SpinThread

# sim s an episode goes on after its plan ended without success: the object settles in the bin
# or on the base, a push's object comes to rest; nothing moves the robot after that
PLAN_END_GRACE_S = 3.0


class Evaluator:
    """The ROS side: clients and subscriptions on the contract's names (one rclpy node)."""

    def __init__(self, plan_timeout_s: float, echo: bool = False) -> None:
        """echo: print each plan step's start and end as it happens (the demo)."""
        import rclpy
        from kestrel_interfaces.action import PlanTask
        from kestrel_interfaces.msg import EpisodeStatus, GroundTruth, LoopStatistics
        from kestrel_interfaces.msg import PerceptionResult, StepStatus, TaskPlan
        from sensor_msgs.msg import Image
        from kestrel_interfaces.srv import ResetWorld
        from lifecycle_msgs.msg import Transition
        from lifecycle_msgs.srv import ChangeState
        from rclpy.action import ActionClient
        from rclpy.executors import SingleThreadedExecutor

        from kestrel_common.base_node import COMMAND_QOS, LATCHED_QOS, SENSOR_QOS

        self.owns_context = not rclpy.ok()  # a caller (the demo) may have initialised it
        if self.owns_context:
            rclpy.init()
        self.echo = echo
        self.rclpy = rclpy
        self.PlanTask, self.ResetWorld = PlanTask, ResetWorld
        self.node = rclpy.create_node("evaluator")
        self.plan_timeout_s = plan_timeout_s
        self.lock = threading.Lock()
        self.status = None  # latest EpisodeStatus
        # (sim s, wall s) of the first and the latest EpisodeStatus: the sim-time speed
        self.clock_first: tuple[float, float] | None = None
        self.clock_last: tuple[float, float] | None = None
        self.truth = None  # latest GroundTruth
        self.misses = 0  # latest LoopStatistics.deadline_misses
        self.detected: set[str] = set()  # classes in the latest perception result
        self.detected_stamp = 0.0  # its header stamp, s (sim time)
        self.results = 0  # perception results received
        self.positions: dict[str, tuple[float, float, float]] = {}  # class -> its 3D position
        self.step_events: list[str] = []  # the current plan's step ends, with their messages
        self.retry_events: list[str] = []  # and its grasp retries (ACTIVE, "retry k/n: ...")
        self.recording = False  # camera frames of the current episode into `frames`
        self.frames: list = []  # (rgb [H, W, 3] uint8, caption)
        self.caption = ""
        self.plan_steps: list[str] = []  # "pick red_cube", ...
        self.step = ""
        self.reset = self.node.create_client(ResetWorld, "/sim/reset")
        self.ChangeState, self.Transition = ChangeState, Transition
        self.control_state = self.node.create_client(ChangeState, "/control/change_state")
        self.plan_ended = False  # the current plan's last step ended (or one failed)
        self.plan = ActionClient(self.node, PlanTask, "/planner/plan_task")
        sub = self.node.create_subscription
        sub(EpisodeStatus, "/sim/episode", self._on_status, LATCHED_QOS)
        sub(GroundTruth, "/sim/ground_truth", self._on_truth, LATCHED_QOS)
        sub(LoopStatistics, "/control/loop_stats", self._on_stats, COMMAND_QOS)
        # best effort, as the perception node publishes it
        from rclpy.qos import qos_profile_sensor_data
        sub(PerceptionResult, "/perception/result", self._on_perception, qos_profile_sensor_data)
        sub(Image, "/camera/image_raw", self._on_image, SENSOR_QOS)
        sub(TaskPlan, "/planner/plan", self._on_plan, LATCHED_QOS)
        sub(StepStatus, "/planner/step_status", self._on_step, COMMAND_QOS)
        executor = SingleThreadedExecutor(context=self.node.context)
        executor.add_node(self.node)
        # its own thread; stopped before the node and the context go (kestrel_common.spin_thread)
        self.spin = SpinThread(executor, name="evaluator_spin")

    def close(self) -> None:
        from kestrel_common.base_node import destroy_waitables

        if not self.spin.stop(timeout_s=30.0):
            print("[evaluate] the executor did not stop within 30 s: the node is left to the "
                  "process exit", file=sys.stderr)
            return
        self.node.destroy_node()
        destroy_waitables(self.node)  # the PlanTask client: else it keeps the participant up
        if self.owns_context:
            self.rclpy.try_shutdown()

    # ---- inputs -------------------------------------------------------------------------------
    def _on_status(self, msg: Any) -> None:
        sample = (msg.header.stamp.sec + msg.header.stamp.nanosec * 1e-9, time.monotonic())
        with self.lock:
            self.status = msg
            if self.clock_first is None:
                self.clock_first = sample
            self.clock_last = sample

    def sim_since(self, t0: float) -> float | None:
        """Sim s from t0 to the latest EpisodeStatus stamp (None before one)."""
        with self.lock:
            last = self.clock_last
        return None if last is None else round(last[0] - t0, 3)

    def sim_speed(self) -> dict[str, float] | None:
        """Sim seconds per wall second since the first EpisodeStatus (None before two)."""
        with self.lock:
            return sim_speed(self.clock_first, self.clock_last)

    def _on_truth(self, msg: Any) -> None:
        with self.lock:
            self.truth = msg

    def _on_stats(self, msg: Any) -> None:
        with self.lock:
            self.misses = int(msg.deadline_misses)

    def _on_perception(self, msg: Any) -> None:
        from kestrel_common.conversions import ConversionError, detection_arrays
        try:
            d = detection_arrays(msg)
        except ConversionError:
            return
        names, best = set(), {}
        for k, score, src, p in zip(d["class_index"].tolist(), d["score"].tolist(),
                                    d["position_source"].tolist(), d["position"].tolist(),
                                    strict=True):
            if k >= len(msg.class_names):
                continue
            name = msg.class_names[k]
            names.add(name)
            # as the planner's scene: the detection with a position, then the best score
            if src and (name not in best or score > best[name][0]):
                best[name] = (score, tuple(p))
        with self.lock:
            self.detected = names
            self.positions = {n: p for n, (_, p) in best.items()}
            self.detected_stamp = msg.header.stamp.sec + msg.header.stamp.nanosec * 1e-9
            self.results += 1

    def _on_plan(self, msg: Any) -> None:
        with self.lock:
            self.plan_steps = [f"{st.skill_name} {st.target_object}".strip()
                               for st in msg.steps]

    def _on_step(self, msg: Any) -> None:
        names = {0: "pending", 1: "active", 2: "succeeded", 3: "failed", 4: "aborted"}
        with self.lock:
            i = int(msg.step_index)
            what = self.plan_steps[i] if i < len(self.plan_steps) else ""
            self.step = f"step {i + 1}/{msg.step_count} {what} ({names.get(msg.status, '?')})"
            if self.echo:
                print(f"[episode] {self.step}" + (f": {msg.message}" if msg.message else ""),
                      flush=True)
            if msg.status == 1 and msg.message.startswith("retry"):
                self.retry_events.append(f"{self.step}: {msg.message}")
            if msg.status >= 2:  # succeeded, failed, aborted
                self.step_events.append(self.step + (f": {msg.message}" if msg.message else ""))
                self.plan_ended |= msg.status > 2 or i + 1 >= msg.step_count

    def _on_image(self, msg: Any) -> None:
        if not self.recording:
            return
        from kestrel_common.conversions import image_to_numpy
        rgb = image_to_numpy(msg, accept=("rgb8",)).copy()
        with self.lock:
            self.frames.append((rgb, f"{self.caption}\n{self.step}"))

    # ---- helpers ------------------------------------------------------------------------------
    def _wait(self, fn, timeout_s: float) -> Any:  # noqa: ANN001
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = fn()
            if value:
                return value
            time.sleep(0.05)
        return None

    def wait_ready(self, timeout_s: float) -> bool:
        """The sim's reset service and the planner's action (False: not within timeout_s), then
        the first perception result, within what is left (a GPU runtime compiles at configure:
        an episode before it would be refused for want of a scene; without one, say so)."""
        deadline = time.monotonic() + timeout_s
        if not (self.reset.wait_for_service(timeout_sec=timeout_s)
                and self.plan.wait_for_server(timeout_sec=max(0.1, deadline -
                                                              time.monotonic()))):
            return False
        if self._wait(lambda: self.results > 0, max(0.1, deadline - time.monotonic())) is None:
            print("[evaluate] no perception result yet: the episodes start anyway",
                  file=sys.stderr)
        return True

    def control_transition(self, transition: str) -> bool:
        """'deactivate' | 'activate' the control node (lifecycle); False when it is not there
        or refused."""
        tid = {"deactivate": self.Transition.TRANSITION_DEACTIVATE,
               "activate": self.Transition.TRANSITION_ACTIVATE}[transition]
        if not self.control_state.service_is_ready():
            return False
        fut = self.control_state.call_async(
            self.ChangeState.Request(transition=self.Transition(id=tid)))
        # bounded, and generous: 10 s ran out once with 6 stacks on 16 cores, each control
        # loop under SCHED_FIFO (the arm then never moved: a counted reach timeout)
        res = self._wait(lambda: fut.result() if fut.done() else None, 30.0)
        return bool(res is not None and res.success)

    def call_reset(self, seed: int, goal: str) -> Any:
        fut = self.reset.call_async(self.ResetWorld.Request(seed=seed, goal_object=goal))
        return self._wait(lambda: fut.result() if fut.done() else None, 30.0)

    def position_error(self, name: str) -> float | None:
        """m between perception's latest position of `name` and the ground truth's centre."""
        with self.lock:
            seen = self.positions.get(name)
        truth = self.truth_now().get(name)
        if seen is None or truth is None:
            return None
        return round(math.dist(seen, truth[0]), 4)

    def truth_now(self) -> Truth:
        """The latest ground truth: name -> (centre, full size), m ({} before one)."""
        with self.lock:
            truth = self.truth
        if truth is None:
            return {}
        return {o.name: ((o.pose.position.x, o.pose.position.y, o.pose.position.z),
                         (o.size.x, o.size.y, o.size.z)) for o in truth.objects}

    # ---- one episode --------------------------------------------------------------------------
    def episode(self, seed: int, rng: random.Random, timeout_s: float,
                oracle_speed: float = 0.0, goal: str = "",
                instruction: str = "", task: str = "bin") -> EpisodeTrace | None:
        """One episode of `task` (episode_tasks.TASKS); oracle_speed > 0: send the planner
        (backend plan_text) the correct plan at that speed, m/s, instead of the instruction.
        goal / instruction: these instead of ones drawn with rng (a goal must be on the table
        in the seed's layout). None: the episode could not start (a stack needs two objects
        on the table)."""
        notes = []  # EpisodeTrace.evaluator_notes
        # The reset puts the arm back at home. The control node would drive it back to the
        # previous episode's last target (it holds that target, as it should on a robot
        # nothing teleports): it is deactivated across the reset and activated after it,
        # which forgets its targets and holds the arm where it now is (its activation).
        stopped = self.control_transition("deactivate")
        try:
            first = self.call_reset(seed, "")
            if first is None or not first.success or not first.objects:
                print(f"[evaluate] reset {seed} failed: "
                      f"{getattr(first, 'message', 'no answer')}", file=sys.stderr)
                return None
            if goal and goal not in first.objects:
                print(f"[evaluate] seed {seed}: no {goal} on the table "
                      f"({', '.join(first.objects)})", file=sys.stderr)
                return None
            if task == "stack" and len(first.objects) < 2:
                print(f"[evaluate] seed {seed}: one object on the table, nothing to stack "
                      "it on", file=sys.stderr)
                return None
            goal = goal or rng.choice(list(first.objects))
            base = rng.choice([o for o in first.objects if o != goal]) \
                if task == "stack" else ""
            text = instruction or instruction_for(task, goal, rng, base)
            resp = self.call_reset(seed, goal)  # the same layout, with its goal
            if resp is None or not resp.success:
                return None
        finally:
            if stopped and not self.control_transition("activate"):
                notes.append("the control node did not activate again after the reset")
                print(f"[evaluate] {notes[-1]}", file=sys.stderr)
        trace = EpisodeTrace(seed=seed, goal=goal, instruction=text, base=base, task=task,
                             evaluator_notes=notes)
        with self.lock:
            self.caption, self.step, self.plan_steps = f"seed {seed}: {text}", "", []

        def current():
            with self.lock:
                s = self.status
            return s if s is not None and s.seed == seed and s.goal_object == goal and \
                s.episode >= 1 else None

        start = self._wait(current, 30.0)
        if start is None:
            return None
        t0 = start.header.stamp.sec + start.header.stamp.nanosec * 1e-9
        with self.lock:
            misses0 = self.misses
        # the goal's class in a perception result of the new layout (bounded wait)
        fresh = self._wait(lambda: self.detected_stamp > t0, 20.0)
        # The planner plans against ITS latest result of the same best-effort topic; right
        # after a reset that may still be the previous layout's (or none, while discovery
        # completes at start-up). One more result of the new layout before the goal: the
        # planner would have to lose both to plan on a stale scene.
        if fresh:
            with self.lock:
                seen = self.results
            self._wait(lambda: self.results > seen, 20.0)
        else:
            notes.append("no perception result of the new layout within 20 s")
        with self.lock:
            trace.goal_detected = (goal in self.detected) if fresh else None
            self.step_events, self.retry_events, self.plan_ended = [], [], False
        trace.position_error_m = {n: self.position_error(n) for n in (
            (goal,) if task == "push" else (goal, base or "bin"))}
        # where the objects stood (the new layout's ground truth, as for the position errors)
        judge = TaskJudge(task, goal, base, self.truth_now())
        goal_msg = self.PlanTask.Goal(instruction=oracle_plan(task, goal, oracle_speed, base)
                                      if oracle_speed > 0 else text)
        trace.plan_asked_s = self.sim_since(t0)
        send = self.plan.send_goal_async(goal_msg)
        handle = self._wait(lambda: send.result() if send.done() else None, 30.0)
        result = None
        if handle is not None and handle.accepted:
            res = handle.get_result_async()
            result = self._wait(lambda: res.result() if res.done() else None,
                                self.plan_timeout_s)
        if result is not None:
            r = result.result
            trace.plan_answered_s = self.sim_since(t0)
            trace.plan_wall_s = round(float(r.total_time), 3)
            trace.plan = plan_text([(st.skill_name, st.target_object,
                                     [(a.name, a.value) for a in st.arguments])
                                    for st in r.plan.steps])
            trace.plan_status = {0: "accepted", 1: "rejected"}.get(r.validation_status, "error")
            trace.plan_reasons = list(r.reasons)
        if trace.plan_status == "accepted":
            while True:
                s = self._wait(current, 5.0)
                if s is None:
                    break
                t = s.header.stamp.sec + s.header.stamp.nanosec * 1e-9 - t0
                held, truth = goal in s.objects_held, self.truth_now()
                with self.lock:
                    ended = self.plan_ended
                if ended and trace.plan_ended_s is None:
                    trace.plan_ended_s = round(t, 3)
                done = judge.observe(t, held, bool(s.success), truth, ended)
                if task == "stack":
                    trace.stack_offsets_m = judge.offsets
                elif task == "push":
                    trace.push_offsets_m = judge.offsets
                trace.observe(t, held=held, success=done,
                              over_bin=over_target(truth, goal, base or "bin"))
                if t > timeout_s or (trace.plan_ended_s is not None and trace.success_s is None
                                     and t - trace.plan_ended_s > PLAN_END_GRACE_S):
                    break
                if trace.success_s is not None:
                    # the plan's last moves (out of the bin) end before the next reset
                    self._wait(lambda: self.plan_ended, 10.0)
                    break
                time.sleep(0.1)
        with self.lock:
            trace.deadline_misses = max(0, self.misses - misses0)
            trace.steps = list(self.step_events)
            trace.retries = list(self.retry_events)
        return trace


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0, help="seed of the episode seeds")
    parser.add_argument("--seeds", default="", help="comma-separated episode seeds to run "
                        "instead (e.g. the failed ones of a run: its table lists them)")
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="sim s an episode may take after its plan")
    parser.add_argument("--plan-timeout", type=float, default=120.0, help="wall s per plan")
    parser.add_argument("--task", default="bin", choices=TASKS,
                        help="bin: put an object in the bin; stack: stack one task object on "
                        "another (the simulator puts at least two on the table); push: push "
                        "an object")
    parser.add_argument("--controller", default="ik", choices=("ik", "policy"))
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="cuda: the GPU variants of the models (gpu_params)")
    parser.add_argument("--workers", type=int, default=1,
                        help="stacks at once, each on its own ROS domain and share of the "
                        "seeds (evaluate_runs); about 2 cores per stack")
    parser.add_argument("--oracle-plan", action="store_true",
                        help="the planner runs backend plan_text and is sent the correct plan "
                        "('pick <goal>; place bin') instead of the instruction: measures "
                        "perception, validation, execution, control and the robot, NOT the "
                        "planner's model (reported as such)")
    parser.add_argument("--oracle-speed", type=float, default=0.3,
                        help="m/s, the oracle plan's speed")
    parser.add_argument("--no-stack", action="store_true",
                        help="do not start the stack: evaluate the one already running")
    parser.add_argument("--log-dir", type=Path, default=None,
                        help="write each node's output to <dir>/<node>.log")
    parser.add_argument("--out", default="", help="write <out>.json, <out>.md and <out>.png")
    parser.add_argument("--video", default=None, help="record the first episode: .mp4 or "
                        ".gif (default with --out: <out>.mp4; 'none': no video)")
    args = parser.parse_args(argv)
    if args.episodes < 1:
        parser.error("--episodes must be >= 1")
    if not args.oracle_speed > 0:
        parser.error("--oracle-speed must be > 0")
    if args.workers < 1:
        parser.error("--workers must be >= 1")
    if args.workers > 1 and args.no_stack:
        parser.error("--workers > 1 starts its own stacks: not with --no-stack")
    if args.video is None:
        args.video = str(Path(args.out).with_suffix(".mp4")) if args.out else ""
    elif args.video == "none":
        args.video = ""
    try:
        seeds = [int(x) for x in args.seeds.split(",")] if args.seeds else \
            [args.seed * 100_003 + i + 1 for i in range(args.episodes)]  # never 0 (default)
    except ValueError:
        parser.error(f"--seeds must be comma-separated integers, got {args.seeds!r}")
    record = run_record(args.device)  # at the start: the load before the stack, the start date
    t_start = time.monotonic()
    # SIGTERM (`timeout`, `kill`) as SIGINT: the stacks stop in order and the episodes that
    # ended are written
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        from kestrel_bringup import evaluate_runs
        if args.workers > 1:
            traces, speed, errors = evaluate_runs.run_workers(args, seeds, args.video,
                                                              args.log_dir)
            for line in errors:
                print(f"[evaluate] {line}", file=sys.stderr)
        else:
            traces, speed, code = evaluate_runs.run_here(args, seeds)
            if code:
                return code
    finally:
        signal.signal(signal.SIGTERM, previous)
    command = "python -m kestrel_bringup.evaluate " + " ".join(sys.argv[1:] if argv is None
                                                                 else argv)
    summary = summarize(traces, {**vars(args), "wall_s": round(time.monotonic() - t_start, 1)})
    summary["schema"] = "kestrel_eval/1"
    summary["episodes_planned"] = len(seeds)
    summary["command"] = command
    summary.update(record)
    summary["sim_speed"] = speed
    if args.oracle_plan:
        summary["plan_source"] = ORACLE_NOTE
    print(markdown(summary, command))
    if args.out:
        from kestrel_bringup.episode_media import write_outputs
        write_outputs(summary, command, Path(args.out), Path(args.video) if args.video else None)
    return 0 if summary["successes"] > 0 else 2


if __name__ == "__main__":
    raise SystemExit(main())
