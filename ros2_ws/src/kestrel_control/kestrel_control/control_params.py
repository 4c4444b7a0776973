"""The control node's parameters (ParamSpec list, no rclpy): see control_node.py for what they
drive. Every one is declared once by the node and validated at configure. Grouped by what they
govern: `safety.*` (what the loop refuses, the command limits), `policy.*` (the model, its
backend, its observation and action mapping) and `loop.*` (the real-time loop)."""

from __future__ import annotations

import re

from kestrel_common.params import ParamSpec
from kestrel_control.core.policy_io import ACTION_MODES, TERMS
from kestrel_models.control.external import FORMATS
from kestrel_models.control.registry import AUTO, BACKENDS, REGISTRY, cuda_available

# The sim arm (kestrel_sim.core.scene.JOINT_NAMES and the joint ranges of tabletop.xml).
SIM_JOINTS = ["shoulder_pan", "shoulder_lift", "elbow", "wrist_1", "wrist_2", "wrist_3"]
SIM_LOWER = [-3.14159, -2.0, -2.6, -2.6, -2.6, -3.14159]
SIM_UPPER = [3.14159, 2.0, 2.6, 2.6, 2.6, 3.14159]


def _unique_names(names: list[str]) -> str | None:
    if not names:
        return "must not be empty"
    if len(set(names)) != len(names) or any(not n for n in names):
        return "names must be unique and non-empty"
    return None


SPECS = [
    ParamSpec("joint_names", SIM_JOINTS, "Joints in command order.", read_only=True,
              check=_unique_names),
    ParamSpec("robots", [], "Robot namespaces batched into one inference (empty = one robot on "
              "~/input/..., ~/output/...; else ~/<ns>/input/joint_states, ~/<ns>/input/target, "
              "~/<ns>/output/joint_command).", element_type=str, read_only=True),
    # replaces the base spec: the loop statistics on /diagnostics as often as on loop_stats
    ParamSpec("diagnostics_period", 0.1, "Period of /diagnostics publication (and of the "
              "loop-stats window), s.", min=0.01, max=60.0, read_only=True),
    # ---- safety.*: what the loop refuses to act on, and the limits of every command ----------
    ParamSpec("safety.joint_lower", SIM_LOWER, "Lower joint limits, rad (commands clamped).",
              read_only=True),
    ParamSpec("safety.joint_upper", SIM_UPPER, "Upper joint limits, rad (commands clamped).",
              read_only=True),
    ParamSpec("safety.max_obs_age", 0.02, "Older joint states -> hold, s.", min=1e-4, max=10.0),
    ParamSpec("safety.obs_position_margin", 0.5, "Joint states with a position outside the "
              "joint limits by more than this are implausible -> hold (never a command from "
              "that position), counted as rejected_implausible, rad.", min=0.0, max=1000.0),
    ParamSpec("safety.max_obs_velocity", 100.0, "Joint states with a speed above this are "
              "implausible -> hold, counted as rejected_implausible, rad/s.", min=1e-3,
              max=1e6),
    ParamSpec("safety.target_rate_hz", 100.0, "Rate at which a speed-limited joint target "
              "(ControlTarget.max_speed > 0, rad/s per joint) is moved toward its goal, Hz.",
              min=1.0, max=1000.0, read_only=True),
    # ---- policy.*: the model, where it runs, what it sees and what its actions mean ----------
    ParamSpec("policy.backend", AUTO, "Inference backend: auto (the first of these that runs "
              "here for the policy, in this order by device and policy kind); "
              + "; ".join(f"{b.name}: {b.when}" for b in REGISTRY.values()) + ".",
              choices=(AUTO, *BACKENDS), read_only=True),
    ParamSpec("policy.model_path", "", "A user's policy file (TorchScript .pt or ONNX .onnx, "
              "Isaac Lab export style); overrides the reference policy and "
              "policy.weights_path.", read_only=True),
    ParamSpec("policy.model_format", "auto", "Format of policy.model_path.", choices=FORMATS,
              read_only=True),
    ParamSpec("policy.model_input", "obs", "Observation input name (ONNX).", read_only=True),
    ParamSpec("policy.model_output", "actions", "Action output name (ONNX).", read_only=True),
    ParamSpec("policy.model_state_inputs", [], "Recurrent state input names, e.g. [h_in, c_in].",
              element_type=str, read_only=True),
    ParamSpec("policy.model_state_outputs", [], "Recurrent state output names, e.g. [h_out, "
              "c_out].", element_type=str, read_only=True),
    ParamSpec("policy.model_state_shape", [], "Batch-1 shape of every recurrent state, e.g. "
              "[1, 1, 256] (empty = from the ONNX file).", min=1, max=65536, element_type=int,
              read_only=True),
    ParamSpec("policy.weights_path", "", "Reference policy: state_dict file; empty = seeded "
              "random weights.", read_only=True),
    ParamSpec("policy.seed", 0, "Reference policy: seed of the random weights.", min=0,
              max=2**31 - 1, read_only=True),
    ParamSpec("policy.obs_dim", 256, "Policy observation size.", min=1, max=65536,
              read_only=True),
    ParamSpec("policy.hidden_dims", [512, 256], "Reference policy: encoder widths.", min=1,
              max=65536, read_only=True),
    ParamSpec("policy.num_actions", 12, "Reference policy: action size (>= number of joints).",
              min=1, max=4096, read_only=True),
    ParamSpec("policy.lstm_hidden", 256, "Reference policy: LSTM state size.", min=1,
              max=65536, read_only=True),
    ParamSpec("policy.history", 8, "Reference policy: window length (window form; the loop "
              "steps the LSTM).", min=1, max=4096, read_only=True),
    # what the policy sees and what its actions mean (core/policy_io.py): the defaults are the
    # reference policy's; an Isaac Lab policy sets them to its env's terms and action term
    ParamSpec("policy.obs_layout", [], "Observation terms in order (empty = joint_pos, "
              f"joint_vel, target, last_action): {', '.join(sorted(TERMS))}, each optionally "
              "'name*scale', or 'zeros:K' for K zero columns; for a model file it must cover "
              "policy.obs_dim exactly.", element_type=str, read_only=True),
    ParamSpec("policy.action_mode", ACTION_MODES[0], "Command from action a: "
              "position_delta_tanh q + scale*tanh(a) (reference policy); position_delta "
              "q + scale*a (Isaac Lab RelativeJointPositionAction); position_offset "
              "default_q + scale*a (Isaac Lab JointPositionAction, use_default_offset).",
              choices=ACTION_MODES, read_only=True),
    ParamSpec("policy.action_scale", 0.05, "rad per unit of action: of tanh(action) in "
              "position_delta_tanh, of the action in position_delta / position_offset (Isaac "
              "Lab's JointPositionAction scale).", min=1e-6, max=10.0, read_only=True),
    ParamSpec("policy.action_scales", [], "Per-joint action scales, joint_names order (Isaac "
              "Lab's scale dict); empty = policy.action_scale for every joint.", min=1e-6,
              max=10.0, element_type=float, read_only=True),
    ParamSpec("policy.action_clip", 0.0, "Raw actions clamped to [-c, c] before the mapping "
              "and the last_action term (rsl_rl's clip_actions); 0 = off.", min=0.0, max=1e6,
              read_only=True),
    ParamSpec("policy.default_joint_positions", [], "default_q per joint, rad, in joint_names "
              "order (Isaac Lab's default joint positions; joint_pos_rel, target_rel and "
              "position_offset); empty = zeros.", element_type=float, read_only=True),
    ParamSpec("policy.latency_compensation", True, "Predict joint positions forward by "
              "observation age + compute latency (linear).", read_only=True),
    ParamSpec("policy.gpu_programs", 64, "cuda_persistent: resident kernel programs, one SM "
              "each, held while ticks come (more: a faster step, less of the GPU left to other "
              "work).", min=1, max=1024, read_only=True),
    # ---- controller, cartesian.*, gripper.*: what turns targets into commands ---------------
    ParamSpec("controller", "policy", "What computes the joint commands: 'policy' (the learned "
              "policy, policy.*) or 'ik' (the differential-IK reference controller, cartesian.*: "
              "MODE_CARTESIAN targets tracked at their max_speed with the tool pointing down; "
              "loop.mode thread).", choices=("policy", "ik"), read_only=True),
    ParamSpec("cartesian.urdf_file", "", "Robot description (URDF) of the arm, read with "
              "Pinocchio for the IK and the gripper's travel; '' = kestrel_description's "
              "kestrel_arm.urdf (the one the simulator loads).", read_only=True),
    ParamSpec("cartesian.tcp_frame", "tcp", "URDF link or frame that Cartesian targets "
              "position (the tool centre point).", read_only=True),
    ParamSpec("cartesian.position_gain", 8.0, "Tool-centre-point error to velocity, 1/s.",
              min=0.1, max=100.0, read_only=True),
    ParamSpec("cartesian.orientation_gain", 4.0, "Tool-axis error (rad) to angular velocity, "
              "1/s (the top-down task, in the position task's null space).", min=0.0,
              max=100.0, read_only=True),
    ParamSpec("cartesian.damping", 0.02, "Damped least squares damping (m; rad for the "
              "orientation task).", min=1e-4, max=1.0, read_only=True),
    ParamSpec("cartesian.default_speed", 0.25, "Tool speed when a target's max_speed is 0, "
              "m/s.", min=1e-3, max=2.0, read_only=True),
    ParamSpec("cartesian.max_speed", 1.0, "No target moves the tool faster, m/s.", min=1e-3,
              max=5.0, read_only=True),
    ParamSpec("cartesian.velocity_scale", 0.8, "Fraction of the URDF's joint velocity limits "
              "the IK may use.", min=0.01, max=1.0, read_only=True),
    ParamSpec("cartesian.limit_margin", 0.02, "Distance the IK keeps from the joint position "
              "limits, rad.", min=0.0, max=0.5, read_only=True),
    ParamSpec("cartesian.top_down", True, "Hold the tool axis pointing down (the grasp "
              "approach); false: position only.", read_only=True),
    ParamSpec("cartesian.ik_lower", [-3.14159, -2.0, 0.2, -2.6, -2.6, -3.14159], "Joint "
              "ranges' lower ends the IK keeps to, rad, within the URDF's (empty = the URDF's): "
              "the default keeps the elbow bent, away from the straight-arm singularity.",
              element_type=float, read_only=True),
    ParamSpec("cartesian.ik_upper", [], "Joint ranges' upper ends the IK keeps to, rad, within "
              "the URDF's (empty = the URDF's).", element_type=float, read_only=True),
    ParamSpec("gripper.joint", "finger_left", "Gripper joint appended to every joint command "
              "(ControlTarget.gripper 0..1 -> 0..gripper.closed_position; the URDF's other "
              "finger mimics it); '' = no gripper command.", read_only=True),
    ParamSpec("gripper.closed_position", 0.0, "Gripper joint position when closed (m for a "
              "prismatic finger); 0 = the joint's upper limit in the URDF.", min=0.0, max=10.0,
              read_only=True),
    # ---- loop.*: the real-time loop ----------------------------------------------------------
    ParamSpec("loop.rate_hz", 1000.0, "Control loop rate, Hz.", min=10.0, max=2000.0,
              read_only=True),
    ParamSpec("loop.mode", "auto", "Where the real-time loop runs: 'thread' (this process), "
              "'process' (a child process sharing memory with the node) or 'auto' (process for "
              "the cuda_* backends and whenever loop.rt_priority > 0, thread otherwise).",
              choices=("auto", "thread", "process"), read_only=True),
    ParamSpec("loop.rt_priority", 0, "SCHED_FIFO priority of the loop thread (0 = none; "
              "refused -> nice -20, reported as rt_sched_fifo on /diagnostics).", min=0,
              max=99, read_only=True),
    ParamSpec("loop.cpu_affinity", [], "CPUs for the loop thread (empty = any).", min=0,
              max=4095, element_type=int, read_only=True),
    ParamSpec("loop.lock_memory", False, "mlockall the process at activation.",
              read_only=True),
    ParamSpec("loop.spin_us", 200.0, "Busy-wait before each deadline, us.", min=0.0,
              max=5000.0, read_only=True),
    ParamSpec("loop.gil_switch_interval_us", 50.0, "sys.setswitchinterval while the loop runs, "
              "us (bounds how long another thread can keep the GIL from the loop; in loop.mode "
              "process also in this node's process, from its command publisher thread; 0 = "
              "unchanged).", min=0.0, max=100000.0, read_only=True),
    ParamSpec("loop.start_timeout", 120.0, "Bound on the loop process start (policy load, "
              "warm-up, graph capture / compile), s.", min=1.0, max=3600.0, read_only=True),
    ParamSpec("loop.native_tick", True, "loop.mode process: run the tick's common case "
              "(inputs, checks, the graph or resident-kernel step, command, clamp) in C, "
              "compiled once with the system C compiler (CC, else cc) into "
              "~/.cache/kestrel/native; without a compiler the Python tick runs and the loop "
              "process logs why. Same commands (host-side tanh: within 1e-12 rad) and counters "
              "either way.", read_only=True),
    ParamSpec("loop.miss_attribution", True, "Count each deadline miss by cause (preempted / "
              "blocked / late wake / slow step) from the loop thread's schedstat and getrusage: "
              "two reads per cycle, one of them between the wake-up and the step "
              "(core/miss_cause.py).", read_only=True),
    ParamSpec("loop.disable_gc", True, "gc.freeze + gc.disable (process-wide) while the loop "
              "runs.", read_only=True),
    ParamSpec("loop.stats_period", 0.1, "Period of ~/output/loop_stats, s.", min=0.01,
              max=60.0, read_only=True),
]

# The names before the parameters were grouped: a params file or command line that still uses
# one fails configure naming its new name; errors from the core (which names its arguments by
# their short names) are reported under the node's parameter names.
RENAMED = {s.name.partition(".")[2]: s.name for s in SPECS if "." in s.name}
RENAMED.update({"loop_mode": "loop.mode", "loop_start_timeout": "loop.start_timeout",
                "rate_hz": "loop.rate_hz", "stats_period": "loop.stats_period"})
RENAMED.pop("mode")
RENAMED.pop("start_timeout")
_PARAM_RE = re.compile(r"parameter '([A-Za-z_][A-Za-z0-9_]*)'")


def qualify(message: str) -> str:
    """`message` with every "parameter 'short'" of a grouped parameter as "parameter
    'group.short'" (the core and kestrel_models name their arguments by the short names)."""
    return _PARAM_RE.sub(lambda m: f"parameter '{RENAMED.get(m.group(1), m.group(1))}'",
                         message)


def resolve_loop_mode(loop_mode: str, backend: str, rt_priority: int,
                      machine: str | None = None) -> str:
    """'auto' -> 'process' for the cuda_* backends and for backend 'auto' where CUDA is
    available (the loop shares no GIL with the executor)
    and whenever the loop gets SCHED_FIFO; else 'thread' (without the priority, a second busy
    process on a small CPU costs about what the GIL contention it removes does; measurements in
    docs/benchmarks/control_*.md). Explicit 'thread' / 'process' are kept.

    On a weakly ordered CPU (ARM: a Jetson, most robot computers that are not x86) the node's
    Python writes into the shared-memory seqlocks have no fences, so a reader could see a
    new sequence number before the data: 'auto' is 'thread' there (in-process buffers, where
    the GIL orders everything) and an explicit 'process' fails with ValueError."""
    from kestrel_control.core.shm_control import require_ordered_stores, stores_ordered

    if loop_mode == "process":
        require_ordered_stores(machine)
    if loop_mode != "auto":
        return loop_mode
    if not stores_ordered(machine):
        return "thread"
    on_gpu = backend.startswith("cuda") or (backend == AUTO and cuda_available())
    return "process" if on_gpu or rt_priority > 0 else "thread"
