"""The control node: a learned policy run at up to 2 kHz on a dedicated real-time thread.

Data flow (all numerics in kestrel_control.core, no ROS there):
  ~/input/joint_states (JointState, SENSOR_QOS) --callback--> LatestValueBuffer [2, n]
  ~/input/target (ControlTarget, COMMAND_QOS)   --callback--> LatestValueBuffer [n]
  RealtimeLoop thread, every 1/loop.rate_hz: PolicyRunner.step_all(node-clock now)
      -> commands [R, n] -> ~/output/joint_command (JointState, COMMAND_QOS, position =
      command, stamp = now)
  ~/output/loop_stats (LoopStatistics) every loop.stats_period (steady clock); /diagnostics.
Parameters (control_params.py): `safety.*`, `policy.*`, `loop.*`.
With `robots: [a, b, ...]` the R robots are batched into one inference (padded to a power of
two) and each has its own topics: ~/<ns>/input/joint_states, ~/<ns>/input/target,
~/<ns>/output/joint_command. The policy is the reference ActorCritic (dims +
policy.weights_path) or a user's TorchScript / ONNX file (`policy.model_*`); `policy.backend`
picks the runtime (kestrel_models.control.registry). ControlTarget: MODE_JOINT sets the joint
target, approached at most at the target's max_speed (rad/s, 0 = no limit); MODE_HOLD keeps
the current one. MODE_CARTESIAN (position, world frame = the arm's base frame, m): with
`controller: ik` the differential-IK reference controller (core/ik_runner.py, cartesian.*)
tracks it at the target's max_speed (m/s) in the same loop, safety filter and deadlines; with
the policy, a layout with ee_* terms receives it, else it is held (target_cartesian_held).
ControlTarget.gripper (0 open .. 1 closed) is the `gripper.joint` entry appended to every joint
command (0 .. gripper.closed_position, the URDF's limit by default). Joint states may name more
joints than the node's (e.g. the fingers): the node's joints are taken by name.
Callbacks (control_inputs.py) only check the message's structure (length, joint names:
counted drops) and write into the buffers; values (NaN/inf, staleness, joint limits) are the
SafetyFilter's job, counted in the loop statistics. Observation age = node clock now - header
stamp, so it works on wall time and on /clock (use_sim_time; the node clock stands still while
the sim is paused, so a paused sim is not "stale"). A zero header stamp is replaced by the node
clock at receipt.
Activation clears the input buffers: nothing from before a deactivation is acted on, and no
command is sent before the first joint state received after the activation. The same after a
backwards jump of the node clock by more than safety.max_obs_age (a sim restart, a bag played
with --loop): the loop forgets the joint states, targets and policy state of before
(core/policy_runner.py check_time), the callbacks their speed-limited targets and gripper
state (control_inputs.py); counted as loop_time_jumps_back on /diagnostics (WARN once),
logged; commands resume with the first joint state of after the jump.

loop.mode (read-only): 'thread' runs PolicyRunner + RealtimeLoop on a thread of this process;
'process' runs them in a child interpreter (kestrel_control.core.loop_process / loop_child, no
rclpy there) that shares the input, command and statistics buffers with this node through
shared memory: the callbacks write there, a publisher thread woken by the loop (eventfd)
publishes the commands, and the executor no longer competes with the loop for one GIL. 'auto'
(default): 'process' for the cuda_* backends and with loop.rt_priority > 0, 'thread' otherwise
(a second interpreter + torch import per node is not worth it on small CPU machines).

Publishing (thread mode): directly from the loop thread, one preallocated message with the
stamp and positions updated in place; a publisher thread in the same interpreter would add a
wake-up and one more GIL contender per cycle (docs/benchmarks/control_cpu.md). In
process mode the publisher thread is outside the loop's interpreter, so there it costs the loop
only an eventfd write.
"""

from __future__ import annotations

import array
import dataclasses
import functools
import math
import time
from typing import Any

import numpy as np
from diagnostic_msgs.msg import DiagnosticStatus
from kestrel_interfaces.msg import ControlTarget, LoopStatistics
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup
from rclpy.clock import Clock, ClockType
from rclpy.lifecycle import LifecycleState, TransitionCallbackReturn
from rosgraph_msgs.msg import Clock as ClockMsg
from sensor_msgs.msg import JointState

from kestrel_common.base_node import COMMAND_QOS, SENSOR_QOS, KestrelLifecycleNode, run_node
from kestrel_common.conversions import stamp_to_ns
from kestrel_common.params import ParamError
from kestrel_common.time_jump import ClockJumps
from kestrel_control.control_inputs import ControlInputs
from kestrel_control.control_params import RENAMED, SPECS, qualify, resolve_loop_mode
from kestrel_control.core import LoopStats, PolicyRunner, RealtimeLoop, RunnerConfig
from kestrel_control.core.description import joint_limits, read_description
from kestrel_control.core.loop_process import LoopProcess, LoopSettings
from kestrel_control.core.miss_cause import CAUSES as MISS_CAUSES
from kestrel_control.core.stats import window_end_ns
from kestrel_control.core.target_limit import TargetRamp
from kestrel_models.control.external import ModelSpec
from kestrel_models.control.policy import PolicyConfig


class ControlNode(ControlInputs, KestrelLifecycleNode):
    """Lifecycle shell around PolicyRunner + RealtimeLoop (see the module docstring)."""

    def __init__(self, **kwargs: Any) -> None:  # kwargs: rclpy Node's (context, overrides)
        super().__init__("control", SPECS, **kwargs)
        self._runner: PolicyRunner | None = None
        self._stats: LoopStats | None = None
        self._loop: RealtimeLoop | None = None
        self._proc: LoopProcess | None = None  # loop.mode 'process'
        self.loop_mode = "thread"
        self.backend_name = ""  # the backend configured (policy.backend auto: the one chosen)
        self._applied: dict[str, str] = {}  # real-time settings the loop applied
        self._js_bufs: list[Any] = []  # per robot: joint-state buffer [2, n] (callbacks write)
        self._tgt_bufs: list[Any] = []  # per robot: target buffer [n] rad
        self._mode_bufs: list[Any] = []  # controller ik, per robot: (x, y, z, max_speed, mode)
        self._mode_rows: list[np.ndarray] = []
        self._gripper_closed = 0.0  # gripper joint's closed position (0: no gripper command)
        self._active = False
        self._pubs: list[Any] = []
        self._subs: list[Any] = []
        self._stats_timer = None
        self._ramp_timer = None
        self._ramps: list[TargetRamp] = []
        self._steady = Clock(clock_type=ClockType.STEADY_TIME)
        self._clock_jumps = ClockJumps(1.0)  # the callbacks' view (configure: max_obs_age)
        # Per robot: joint-name order of the last accepted message, message index per joint.
        self._perm_names: list[list[str]] = []
        self._perm: list[np.ndarray] = []
        self.published = 0  # commands published (loop thread)
        self.no_clock_cycles = 0  # cycles skipped: node clock at 0 (sim time, no /clock yet)
        self._last_diag = dict.fromkeys(LoopStats.COUNTERS, 0)

    # ---- configuration ----------------------------------------------------------------------
    def load_params(self) -> dict[str, Any] | None:
        """The base node's validation, after refusing a parameter under its name from before
        the grouping (ROS would ignore it and run with the default)."""
        for name, param in getattr(self, "_parameter_overrides", {}).items():
            if name in RENAMED:
                self.get_logger().error(
                    f"configure failed: parameter '{name}' = {param.value!r}: renamed to "
                    f"'{RENAMED[name]}'")
                return None
        return super().load_params()

    def validate_extra(self, values: dict[str, Any]) -> None:
        n = len(values["joint_names"])
        for name in ("safety.joint_lower", "safety.joint_upper"):
            if len(values[name]) != n:
                raise ParamError(name, values[name], f"needs one value per joint ({n})")
        for name in ("policy.default_joint_positions", "policy.action_scales"):
            if values[name] and len(values[name]) != n:
                raise ParamError(name, values[name], f"needs one value per joint ({n}) or none")
        lower, upper = values["safety.joint_lower"], values["safety.joint_upper"]
        for i, (lo, hi) in enumerate(zip(lower, upper, strict=True)):
            if lo > hi:
                raise ParamError("safety.joint_lower", lower,
                                 f"joint {i} ({values['joint_names'][i]}): lower {lo} > upper "
                                 f"{hi} (safety.joint_upper)")
        robots = values["robots"]
        if len(set(robots)) != len(robots) or any(
                not r or not r.replace("_", "a").isalnum() or r[0].isdigit() for r in robots):
            raise ParamError("robots", robots, "namespaces must be unique identifiers "
                             "(letters, digits, '_'; not starting with a digit)")
        if values["loop.spin_us"] * 1e-6 >= 1.0 / values["loop.rate_hz"]:
            raise ParamError("loop.spin_us", values["loop.spin_us"],
                             "must be shorter than the period (loop.rate_hz)")

    @staticmethod
    def runner_config(p: dict[str, Any]) -> RunnerConfig:
        """The core's configuration from the validated parameters (ValueError naming the
        core's argument by its short name: see control_params.qualify)."""
        policy = PolicyConfig(obs_dim=p["policy.obs_dim"],
                              hidden_dims=tuple(p["policy.hidden_dims"]),
                              num_actions=p["policy.num_actions"],
                              lstm_hidden=p["policy.lstm_hidden"], history=p["policy.history"])
        model = None
        if p["policy.model_path"]:
            states = p["policy.model_state_inputs"]
            shape = tuple(p["policy.model_state_shape"])
            model = ModelSpec(
                path=p["policy.model_path"], format=p["policy.model_format"],
                obs_name=p["policy.model_input"], actions_name=p["policy.model_output"],
                state_in_names=tuple(states),
                state_out_names=tuple(p["policy.model_state_outputs"]),
                state_shapes=(shape,) * len(states) if shape else (),
                obs_dim=p["policy.obs_dim"], num_actions=0)
        return RunnerConfig(
            joint_lower=p["safety.joint_lower"], joint_upper=p["safety.joint_upper"],
            policy=policy, action_scale=p["policy.action_scale"],
            max_obs_age_s=p["safety.max_obs_age"],
            obs_position_margin=p["safety.obs_position_margin"],
            max_obs_velocity=p["safety.max_obs_velocity"], backend=p["policy.backend"],
            weights_path=p["policy.weights_path"], seed=p["policy.seed"], model=model,
            num_robots=max(1, len(p["robots"])),
            latency_compensation=p["policy.latency_compensation"],
            gpu_programs=p["policy.gpu_programs"], obs_layout=tuple(p["policy.obs_layout"]),
            action_mode=p["policy.action_mode"], action_clip=p["policy.action_clip"] or math.inf,
            default_joint_positions=tuple(p["policy.default_joint_positions"]),
            action_scales=tuple(p["policy.action_scales"]))

    def on_configure(self, state: LifecycleState) -> TransitionCallbackReturn:
        p = self.load_params()
        if p is None:
            return TransitionCallbackReturn.FAILURE
        try:
            self._stats = LoopStats(1.0 / p["loop.rate_hz"])
            config = self.runner_config(p)
            self.loop_mode = resolve_loop_mode(p["loop.mode"], p["policy.backend"],
                                               p["loop.rt_priority"])
            gripper = self._gripper_setup(p)  # (joint name, closed position) or None
            self._mode_bufs = []
            if p["controller"] == "ik":
                if p["loop.mode"] == "process":
                    raise ValueError("parameter 'loop.mode' = 'process': controller 'ik' runs "
                                     "in the node's process (thread or auto)")
                self.loop_mode = "thread"
                self._runner = self._ik_runner(p, config)
                self._js_bufs = [r.joint_states for r in self._runner.robots]
                self._tgt_bufs = [r.target for r in self._runner.robots]
                self._mode_bufs = [r.mode for r in self._runner.robots]
                batch, source = self._runner.batch, self._runner.policy.source
                self.backend_name = "none (controller ik)"
            elif self.loop_mode == "process":
                self._proc = LoopProcess(
                    config, self._loop_settings(p), start_timeout_s=p["loop.start_timeout"],
                    sim_time=bool(self.get_parameter("use_sim_time").value),
                    log=self.get_logger().info, warn=self.get_logger().warning)
                info = self._proc.start()  # LoopProcessError (a ValueError): child's message
                self._stats = self._proc.stats
                self._js_bufs, self._tgt_bufs = self._proc.joint_states, self._proc.targets
                batch, source = info["batch"], info["source"]
                self.backend_name = info["backend"]
            else:
                self._runner = PolicyRunner(config, counters=self._stats)
                self._js_bufs = [r.joint_states for r in self._runner.robots]
                self._tgt_bufs = [r.target for r in self._runner.robots]
                batch, source = self._runner.batch, self._runner.policy.source
                self.backend_name = self._runner.backend.name
        except ValueError as exc:  # names the parameter and value
            self.get_logger().error(f"configure failed: {qualify(str(exc))}")
            self._close_process()
            self._runner = self._stats = None
            return TransitionCallbackReturn.FAILURE
        names = list(p["joint_names"])
        self._index = {name: i for i, name in enumerate(names)}
        # the gripper's entry after the arm's joints in every command (ControlTarget.gripper)
        self._gripper_closed = gripper[1] if gripper else 0.0
        cmd_names = names + [gripper[0]] if gripper else names
        prefixes = [f"~/{ns}/" for ns in p["robots"]] or ["~/"]
        self._cmd_msgs, self._cmd_views, self._cmd_pubs = [], [], []
        group = MutuallyExclusiveCallbackGroup()
        self._subs = []
        self._perm_names = [[] for _ in prefixes]
        self._mode_rows = [np.zeros(5) for _ in prefixes]
        self._perm = [np.zeros(0, dtype=np.intp) for _ in prefixes]
        # speed-limited joint targets (ControlTarget.max_speed): per robot, advanced by a timer
        # in the callbacks' group; the latest joint positions start a ramp
        self._ramps = [TargetRamp(len(names)) for _ in prefixes]
        self._clock_jumps = ClockJumps(p["safety.max_obs_age"])  # as the loop's runner
        self._ramp_stamps = [0] * len(prefixes)
        self._last_pos = np.zeros((len(prefixes), len(names)))  # rad, node joint order
        self._have_pos = [False] * len(prefixes)
        self._group = group
        for r, prefix in enumerate(prefixes):
            msg = JointState()  # reused every cycle (loop thread only)
            msg.name = cmd_names
            msg.position = array.array("d", [0.0] * len(cmd_names))  # gripper 0: open
            self._cmd_msgs.append(msg)
            # [n] rad, the arm's part (the gripper's entry is written by the target callback)
            self._cmd_views.append(np.frombuffer(msg.position, dtype=np.float64)[:len(names)])
            self._cmd_pubs.append(self.create_publisher(
                JointState, prefix + "output/joint_command", COMMAND_QOS))
            self._subs += [
                self.create_subscription(JointState, prefix + "input/joint_states",
                                         functools.partial(self._on_joint_state, r),
                                         SENSOR_QOS, callback_group=group),
                self.create_subscription(ControlTarget, prefix + "input/target",
                                         functools.partial(self._on_target, r),
                                         COMMAND_QOS, callback_group=group),
            ]
        self._stats_pub = self.create_publisher(LoopStatistics, "~/output/loop_stats",
                                                COMMAND_QOS)
        self._pubs = [*self._cmd_pubs, self._stats_pub]
        if self._proc is not None and self._proc.sim_time:  # the child's clock: /clock via shm
            self._subs.append(self.create_subscription(
                ClockMsg, "/clock", lambda m: self._proc.set_sim_time(stamp_to_ns(m.clock)),
                SENSOR_QOS, callback_group=group))
        self._clock = self.get_clock()
        self.get_logger().info(
            f"configured: {len(names)} joints {names}, {len(prefixes)} robot(s) (batch "
            f"{batch}), {p['loop.rate_hz']:g} Hz, backend {self.backend_name}, loop in a "
            f"{self.loop_mode}, policy {source if p['policy.model_path'] else config.policy}, "
            f"latency compensation {'on' if p['policy.latency_compensation'] else 'off'}"
            + (f", native tick {self._proc.info.get('native_tick', '?')}"
               if self._proc is not None else ""))
        return TransitionCallbackReturn.SUCCESS

    @staticmethod
    def _loop_settings(p: dict[str, Any]) -> LoopSettings:
        return LoopSettings(
            period_s=1.0 / p["loop.rate_hz"], spin_s=p["loop.spin_us"] * 1e-6,
            rt_priority=p["loop.rt_priority"], cpu_affinity=tuple(p["loop.cpu_affinity"]),
            lock_memory=p["loop.lock_memory"], manage_gc=p["loop.disable_gc"],
            switch_interval_s=(p["loop.gil_switch_interval_us"] * 1e-6) or None,
            native_tick=p["loop.native_tick"], miss_attribution=p["loop.miss_attribution"])

    def _close_process(self) -> None:
        if self._proc is not None:
            self._proc.close()
            self._proc = None

    def on_activate(self, state: LifecycleState) -> TransitionCallbackReturn:
        p, stats = self.params, self._stats
        self._last_diag = dict.fromkeys(LoopStats.COUNTERS, 0)
        # nothing from before: the loop clears its input buffers (PolicyRunner.reset) before it
        # starts, and the callbacks write again only once it runs
        for ramp in self._ramps:
            ramp.reset()
        self._have_pos = [False] * len(self._ramps)
        self._clock_jumps.reset()
        try:
            if self._proc is not None:  # the child resets the policy and the statistics
                self._applied = self._proc.activate(self._publish_command)
            else:
                self._runner.reset()
                stats.reset()
                s = self._loop_settings(p)
                self._loop = RealtimeLoop(
                    s.period_s, self._tick, stats, spin_s=s.spin_s, rt_priority=s.rt_priority,
                    cpu_affinity=s.cpu_affinity, lock_memory=s.lock_memory,
                    manage_gc=s.manage_gc, switch_interval_s=s.switch_interval_s,
                    miss_attribution=s.miss_attribution, name="kestrel-control",
                    log=self.get_logger().info)
                self._applied = self._loop.start()
        except (RuntimeError, ValueError) as exc:
            self.get_logger().error(f"activate failed: {qualify(str(exc))}")
            return TransitionCallbackReturn.FAILURE
        fifo = self._applied.get("sched_fifo", "not requested")
        if fifo != "not requested":  # real-time scheduling is never applied silently
            self.get_logger().warning(
                f"loop thread SCHED_FIFO (loop.rt_priority {p['loop.rt_priority']}): {fifo}; "
                "loop.rt_priority 0 turns it off")
        self._active = True
        self._ramp_period = 1.0 / p["safety.target_rate_hz"]
        self._ramp_last_ns = 0
        self._ramp_timer = self.create_timer(self._ramp_period, self._advance_targets,
                                             callback_group=self._group)
        self._ramp_timer.cancel()  # started by a speed-limited target
        self._stats_timer = self.create_timer(p["loop.stats_period"], self._publish_stats,
                                              clock=self._steady)
        self.start_diagnostics(self._diagnostic_status)
        return TransitionCallbackReturn.SUCCESS

    def on_cleanup(self, state: LifecycleState) -> TransitionCallbackReturn:
        self.stop_workers()
        for sub in self._subs:
            self.destroy_subscription(sub)
        for pub in self._pubs:
            self.destroy_publisher(pub)
        self._subs, self._pubs = [], []
        self._close_process()
        if self._runner is not None:
            self._runner.close()  # cuda_persistent (thread mode): end the resident kernel
        self._runner = self._stats = None
        self._js_bufs, self._tgt_bufs, self._mode_bufs = [], [], []
        return TransitionCallbackReturn.SUCCESS

    def stop_workers(self) -> None:
        self._active = False
        if self._loop is not None:
            self._loop.stop(timeout_s=1.0)
            self._loop = None
        if self._proc is not None:
            self._proc.deactivate()
        for name in ("_stats_timer", "_ramp_timer"):
            timer = getattr(self, name)
            if timer is not None:
                self.destroy_timer(timer)
                setattr(self, name, None)

    def _gripper_setup(self, p: dict[str, Any]) -> tuple[str, float] | None:
        """(gripper joint, closed position) from gripper.* and the robot description."""
        joint = p["gripper.joint"]
        if not joint:
            return None
        if joint in p["joint_names"]:
            raise ValueError(f"parameter 'gripper.joint' = '{joint}': is one of joint_names")
        closed = p["gripper.closed_position"]
        if closed <= 0.0:
            lower, closed = joint_limits(read_description(p["cartesian.urdf_file"]), joint)
            if closed <= lower:
                raise ValueError(f"parameter 'gripper.joint' = '{joint}': its URDF limit "
                                 f"[{lower}, {closed}] has no closing range")
        return joint, float(closed)

    def _ik_runner(self, p: dict[str, Any], config: RunnerConfig) -> Any:
        """The differential-IK reference controller (Pinocchio imported only here)."""
        from kestrel_control.core.cartesian import CartesianConfig
        from kestrel_control.core.ik_runner import IkRunner
        from kestrel_control.core.kinematics import ArmKinematics

        kin = ArmKinematics(read_description(p["cartesian.urdf_file"]),
                            joint_names=tuple(p["joint_names"]),
                            tcp_frame=p["cartesian.tcp_frame"])
        cart = CartesianConfig(
            rate_hz=p["loop.rate_hz"], position_gain=p["cartesian.position_gain"],
            orientation_gain=p["cartesian.orientation_gain"], damping=p["cartesian.damping"],
            default_speed=p["cartesian.default_speed"], max_speed=p["cartesian.max_speed"],
            velocity_scale=p["cartesian.velocity_scale"],
            limit_margin=p["cartesian.limit_margin"], top_down=p["cartesian.top_down"],
            ik_lower=tuple(p["cartesian.ik_lower"]), ik_upper=tuple(p["cartesian.ik_upper"]))
        return IkRunner(config, kin, cart, counters=self._stats)

    # ---- the real-time loop's step (loop thread) ---------------------------------------------
    def _tick(self, deadline_ns: int) -> None:
        now_ns = self._clock.now().nanoseconds
        if now_ns <= 0:  # use_sim_time and no /clock yet: no time, no command
            self.no_clock_cycles += 1
            return
        commands, infos = self._runner.step_all(now_ns)
        for r, info in enumerate(infos):
            if not info.valid:
                continue
            msg = self._cmd_msgs[r]
            np.copyto(self._cmd_views[r], commands[r])
            stamp = msg.header.stamp
            stamp.sec = now_ns // 1_000_000_000
            stamp.nanosec = now_ns % 1_000_000_000
            self._cmd_pubs[r].publish(msg)
            self.published += 1

    def _publish_command(self, r: int, command: np.ndarray, stamp_ns: int) -> None:
        """loop.mode 'process': the publisher thread hands over robot r's newest command."""
        msg = self._cmd_msgs[r]
        np.copyto(self._cmd_views[r], command)
        msg.header.stamp.sec, msg.header.stamp.nanosec = divmod(stamp_ns, 1_000_000_000)
        self._cmd_pubs[r].publish(msg)

    # ---- reporting (executor threads) --------------------------------------------------------
    def _publish_stats(self) -> None:
        if self._stats is None:
            return
        stats = self._stats
        snap = stats.snapshot()
        msg = LoopStatistics()
        now_ns = self._clock.now().nanoseconds
        if not self._clock.ros_time_is_active:  # wall time: the wake-up of the window's last
            # cycle, from the same count as the window (a stall anywhere here cannot skew it)
            now_ns = window_end_ns(now_ns, time.monotonic_ns(), stats.window_end_wake_ns)
        msg.header.stamp.sec, msg.header.stamp.nanosec = divmod(now_ns, 1_000_000_000)
        for field in dataclasses.fields(snap):
            setattr(msg, field.name, getattr(snap, field.name))
        self._stats_pub.publish(msg)

    def _diagnostic_status(self) -> tuple[int, str, dict]:
        stats = self._stats
        if stats is None:
            return DiagnosticStatus.STALE, "not configured", {}
        counters = stats.counters()
        values: dict[str, Any] = {f"loop_{k}": v for k, v in counters.items()}
        window = max(1, int(self.params["diagnostics_period"] * self.params["loop.rate_hz"]))
        values.update({f"loop_{k}": v for k, v in stats.percentiles(window).items()})
        proc = self._proc
        values["loop_mode"] = self.loop_mode
        values["backend"] = self.backend_name
        values["commands_published"] = proc.published if proc else self.published
        values["no_clock_cycles"] = proc.no_clock_cycles if proc else self.no_clock_cycles
        values["buffer_locked_reads"] = sum(b.locked_reads for b in self._js_bufs)
        values["compute_latency_ema_s"] = (proc or self._runner).compute_latency_s
        values.update({f"rt_{k}": v for k, v in self._applied.items()})
        if proc is not None:
            values["commands_coalesced"] = proc.coalesced
            values["publisher_scheduling"] = proc.publisher_priority
            values["publish_errors"] = proc.publish_errors
        if self._loop is not None:
            if self._loop.last_error:
                values["last_step_error"] = self._loop.last_error
        new = {k: counters[k] - self._last_diag.get(k, 0) for k in counters}
        self._last_diag = counters
        problems = [k for k in ("step_errors", "deadline_misses", "stale_inputs",
                                "rejected_nonfinite", "rejected_implausible",
                                "time_jumps_back") if new[k] > 0]
        if proc is not None and proc.proc.poll() is not None:
            return DiagnosticStatus.ERROR, (f"loop process exited (code {proc.proc.returncode}):"
                                            " no commands"), values
        if new["step_errors"]:
            return DiagnosticStatus.ERROR, "policy step raised (see last_step_error)", values
        if problems:
            message = "since last report: " + ", ".join(f"{k} +{new[k]}" for k in problems)
            causes = [f"{k[len('misses_'):]} +{new[k]}" for k in MISS_CAUSES if new.get(k)]
            if causes:  # what made them late (core/miss_cause.py)
                message += f" ({', '.join(causes)})"
            self.get_logger().warning(message, throttle_duration_sec=5.0)
            return DiagnosticStatus.WARN, message, values
        return DiagnosticStatus.OK, "ok", values


def main(args: list[str] | None = None) -> int:
    # Two executor threads: the callbacks are short, and every extra Python thread is one more
    # contender for the GIL the real-time loop needs.
    return run_node(ControlNode, args, num_threads=2)


if __name__ == "__main__":
    raise SystemExit(main())
