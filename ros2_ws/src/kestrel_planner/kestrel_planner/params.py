"""The planner node's parameters (ParamSpec table, no rclpy) and what is built from them: the
planner core's, the plan executor's and the remote backend's configs, and the configure log
line that describes them. Backend groups are dotted: `hf.*` (a local Hugging Face VLM),
`remote.*` (an OpenAI-compatible server). The key of a remote server is never a parameter:
`remote.api_key_env` names the environment variable that holds it, and a value that is not a
variable name (a key typed there by mistake) is refused without being shown."""

from __future__ import annotations

import os
import re

from ament_index_python.packages import PackageNotFoundError, get_package_share_directory

from kestrel_common.params import ParamSpec
from kestrel_planner.core import BACKENDS, ExecutorConfig, PlannerConfig, PlanLimits
from kestrel_planner.core.constrained_llg import GRAMMAR_ENGINES
from kestrel_planner.core.prompting import OUTPUT_FORMATS
from kestrel_models.planner import get_config
from kestrel_models.planner.config import PRESETS
from kestrel_models.planner.hf import DTYPES
from kestrel_models.planner.remote import RemoteConfig

__all__ = ["SPECS", "remote_config", "resolve_weights", "planner_configs", "configured_text",
           "DEFAULT_WEIGHTS"]

# The planner weights trained on generated scenes (scripts/train_planner.py), for model_config
# 'small'; resolved by the node ('package://' = the package's installed share directory).
DEFAULT_WEIGHTS = "package://kestrel_planner/weights/planner_small.pt"


def _positive(v: float) -> str | None:
    return None if v > 0 else "must be > 0"


ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _env_name(v: str) -> str | None:
    if v == "" or ENV_NAME_RE.match(v):
        return None
    return "must be an environment variable NAME (letters, digits, _), or '' for no key"


SPECS = [
    ParamSpec("model_config", "tiny", "VLM preset (the default weights are for 'small').",
              choices=("tiny", "small", "0.5b"), read_only=True),
    ParamSpec("weights_path", "", "State dict file, or package://<package>/<path> "
              "(a file installed with a ROS package); '' = random weights from seed.",
              read_only=True),
    ParamSpec("demo_plan", "", "Non-empty: instead of weights_path, bigram demo weights that "
              "make the model write this plan text (lines separated by newlines or ';').",
              read_only=True),
    ParamSpec("device", "cpu", "torch device.", read_only=True,
              check=lambda v: None if v == "cpu" or v.startswith("cuda") else "cpu or cuda[:n]"),
    ParamSpec("seed", 0, "Seed of the random weights.", min=0, read_only=True),
    ParamSpec("num_threads", 1, "torch CPU threads.", min=1, max=64, read_only=True),
    ParamSpec("image_size", 0, "Model input size, px; 0 = the preset's.", min=0, max=1024,
              read_only=True),
    ParamSpec("max_new_tokens", 160, "Decode budget per plan, tokens.", min=8, max=8192,
              read_only=True),
    ParamSpec("max_batch", 4, "Goals decoded together.", min=1, max=16, read_only=True),
    ParamSpec("backend", "generate", "Decoder: generate (our VLM, batch per call), engine "
              "(our VLM, DecodeEngine: KV-cache slots, CUDA-graph decode on GPU), hf (a local "
              "Hugging Face VLM directory), remote (an OpenAI-compatible server: vLLM, SGLang, "
              "TensorRT-LLM), plan_text (no model: the instruction is the plan text, lines "
              "separated by ';').", choices=BACKENDS, read_only=True),
    ParamSpec("engine_compile", False, "backends engine and hf (a checkpoint on the engine) on "
              "CUDA: compile the whole decode step "
              "(inductor, coordinate-descent tuned) under the CUDA graph; compiles every "
              "batch/length bucket at configure (docs/benchmarks/planner_h200.md).",
              read_only=True),
    ParamSpec("prefix_cache_entries", 8, "backend engine: goals whose KV of the camera frame "
              "and object line is kept; a goal on the same frame (pixels) and objects then "
              "prefills only its task line (the same plan); 0 = off.", min=0, max=256,
              read_only=True),
    ParamSpec("speculative.k", 0, "backends generate and engine: tokens a draft model "
              "proposes per round, all checked by the model in one pass (the plan stays the "
              "model's own); acceptance on /diagnostics and in each PlanTask result; 0 = off.",
              min=0, max=16, read_only=True),
    ParamSpec("speculative.draft_weights_path", "", "State dict of the draft model (preset "
              "speculative.draft_model_config, trained on the same task and tokenizer: "
              "scripts/train_planner.py --preset draft), or package://<package>/<path>; '' = "
              "the model's first speculative.draft_layers decoder layers.", read_only=True),
    ParamSpec("speculative.draft_model_config", "draft", "VLM preset of "
              "speculative.draft_weights_path.", choices=tuple(PRESETS), read_only=True),
    ParamSpec("speculative.draft_layers", 1, "Without draft weights: the model's first N "
              "decoder layers are the draft (N < the model's layers).", min=1, max=64,
              read_only=True),
    ParamSpec("hf.model_path", "", "backend hf: local directory saved with save_pretrained "
              "(config.json, weights, tokenizer).", read_only=True),
    ParamSpec("hf.dtype", "auto", "backend hf: weight dtype ('auto' = as saved).",
              choices=tuple(DTYPES), read_only=True),
    ParamSpec("hf.tokenizer", "auto", "backend hf: 'auto' = the directory's tokenizer (and "
              "chat template); 'byte' = Kestrel's byte tokenizer.", choices=("auto", "byte"),
              read_only=True),
    ParamSpec("hf.grammar", True, "backend hf: constrain decoding to the plan grammar (with "
              "grammar_engine automaton: needs single-character tokens); false = prompt + "
              "parser + validator only.", read_only=True),
    ParamSpec("hf.warmup_image_size", [0, 0], "backend hf on the engine with CUDA: camera "
              "frame size [width, height], px, whose CUDA graphs (prefill per batch size and "
              "prompt bucket, decode step per batch and kv bucket; with engine_compile their "
              "compiles) configure captures; [0, 0] = none: the first goal of each frame "
              "size captures its own.", length=2, min=0, max=8192, read_only=True),
    ParamSpec("grammar_engine", "llguidance", "Plan-grammar engine of backends generate, engine "
              "and hf: llguidance (maintained grammar library: Lark grammar, token masks for "
              "any tokenizer incl. BPE) or automaton (the hand-written character automaton, "
              "single-character tokens only).", choices=GRAMMAR_ENGINES, read_only=True),
    ParamSpec("remote.base_url", "", "backend remote: server URL, e.g. http://127.0.0.1:8000/v1.",
              read_only=True),
    ParamSpec("remote.model", "", "backend remote: the served model name.", read_only=True),
    ParamSpec("remote.api_key_env", "", "backend remote: NAME of the environment variable that "
              "holds the API key ('' = none). Never the key itself.", read_only=True,
              check=_env_name, redact=True),
    ParamSpec("remote.timeout_s", 10.0, "backend remote: timeout per attempt, s.",
              read_only=True, check=lambda v: None if 0 < v <= 600 else "must be in (0, 600]"),
    ParamSpec("remote.max_retries", 2, "backend remote: retries on timeouts, connection "
              "errors, HTTP 429 and 5xx.", min=0, max=10, read_only=True),
    ParamSpec("remote.send_image", True, "backend remote: send the frame (PNG data URL).",
              read_only=True),
    ParamSpec("remote.response_format", "json_schema", "backend remote: json_schema = ask for "
              "schema-constrained JSON (response_format); text = the plan text form.",
              choices=OUTPUT_FORMATS, read_only=True),
    ParamSpec("remote.max_reply_bytes", 65536, "backend remote: a reply larger than this is "
              "refused as soon as its size is known (read in chunks, never whole), bytes.",
              min=1024, max=16 * 1024 * 1024, read_only=True),
    ParamSpec("max_pending_goals", 6, "Goals waiting or decoding; more are rejected.",
              min=1, max=6, read_only=True),
    ParamSpec("temperature", 0.0, "0 = greedy.", min=0.0, max=5.0),
    ParamSpec("max_steps", 8, "Default and maximum plan length.", min=1, max=64),
    ParamSpec("max_speed", 0.5, "End-effector speed limit, m/s.", check=_positive),
    ParamSpec("default_speed", 0.3, "End-effector speed of a plan step that names none (pick, "
              "place, move_to, push), m/s; at most max_speed; 0 = the skills' own default. "
              "Filled into the plan before validation, so results show it.", min=0.0,
              max=5.0),
    ParamSpec("min_height", 0.0, "Minimum clearance above a target, m."),
    ParamSpec("max_height", 0.4, "Maximum clearance above a target, m."),
    ParamSpec("workspace_min", [-1.0, -1.0, -0.05], "Workspace box min (x, y, z), m.", length=3),
    ParamSpec("workspace_max", [1.0, 1.0, 1.0], "Workspace box max (x, y, z), m.", length=3),
    ParamSpec("step_timeout", 10.0, "A waypoint not reached this long after its move at the "
              "step's speed should have ended FAILS its step, s.", check=_positive),
    ParamSpec("stall_timeout", 1.0, "A Cartesian waypoint the arm got no stall_distance "
              "closer to for this long FAILS its step before step_timeout (a finger on an "
              "object, the arm against an obstacle), so that back_off and grasp_retries start "
              "at once; 0 = off, s.", min=0.0, max=60.0),
    ParamSpec("stall_distance", 0.005, "Progress toward a Cartesian waypoint that counts as "
              "moving for stall_timeout, m.", min=0.001, max=0.1),
    ParamSpec("push_speed", 0.05, "Top speed of a push's stroke (the move along +x with the "
              "object in contact), m/s; the step's speed where lower. A position-servoed arm "
              "lags its command in proportion to its speed: a tool centre trailing high tips "
              "tall objects and wedges the fingers on a cube's face.", min=0.01, max=5.0),
    ParamSpec("place_contact_height", 0.05, "A place whose lowering stops (stalled or timed "
              "out) with the tool centre straight above its point and at most this far over it "
              "opens the gripper there: the held object rests on a target taller than the "
              "plan's height allowed for (stacking on a cylinder); 0 = off: such a place fails, "
              "m.", min=0.0, max=0.2),
    ParamSpec("position_tolerance", 0.01, "Waypoint reached within, m.", check=_positive),
    ParamSpec("gripper_time", 0.5, "Wait after a gripper command, s.", min=0.0, max=30.0),
    ParamSpec("transit_clearance", 0.12, "A pick or a place first goes this far above its "
              "target, then down to its height; a pick lifts the object this far once "
              "closed, a place goes back up this far once open: moves between targets clear "
              "the bin's walls and the objects; 0 = off, m.", min=0.0, max=1.0),
    ParamSpec("back_off", True, "When a Cartesian waypoint fails, go back to where its "
              "step began its approach (a pick: transit_clearance over the object) at the "
              "step's speed with the gripper as it is, then hold; false: hold where the arm "
              "stopped (a finger that came down on an object keeps pressing on it)."),
    ParamSpec("grasp_retries", 2, "A pick whose approach fails before its gripper closes is "
              "tried again this often, from over the object, with the object's position "
              "moved by grasp_retry_offset along x toward the arm's base, then away from it, "
              "then the same along y (0 = off).", min=0, max=4),
    ParamSpec("grasp_retry_offset", 0.015, "How far each grasp retry moves the object's "
              "position, m.", min=0.0, max=0.1),
    ParamSpec("home_joint_positions", [], "HOME target, rad (control joint order).",
              element_type=float),
    ParamSpec("execution_rate", 20.0, "Executor tick / target rate, Hz.", min=1.0, max=200.0),
    ParamSpec("goal_timeout", 30.0, "Bound on one goal's wait for its plan, from its arrival, "
              "s.", min=0.1),
    ParamSpec("input_wait", 5.0, "A goal that finds no camera frame (and brings no image) or "
              "no perception result it may plan against waits for them up to this long from "
              "its arrival, then is refused with the reason: right after start-up the first "
              "frame, result and /clock message may still be on their way. Within "
              "goal_timeout; 0 = refuse at once, s.", min=0.0, max=60.0),
    ParamSpec("max_scene_age", 5.0, "A goal is refused when the latest perception result "
              "(its header stamp, on this node's clock) is older than this, or when none came; "
              "0 = plan against any scene, s.", min=0.0),
    ParamSpec("feedback_age", 1.0, "Ignore ee/joint feedback older than this, s.", min=0.0),
    # CPython's default is 5 ms. With the stack's joint states and TCP positions on the
    # MultiThreadedExecutor and a plan decoding, many threads want the GIL; at 5 ms per hand-over
    # a perception result can wait long enough for the best-effort keep-last-1 reader to
    # replace it (docs/benchmarks/transport_h200.md)
    ParamSpec("gil_switch_interval_us", 200, "sys.setswitchinterval of the node process, us "
              "(0 = leave CPython's 5 ms).", min=0, max=100000, read_only=True),
]


def remote_config(p: dict) -> RemoteConfig:
    """The remote backend's config from the node parameters; the API key is read from the
    environment variable named by remote_api_key_env (ValueError naming it when unset)."""
    key, name = "", p["remote.api_key_env"]
    if name:
        key = os.environ.get(name, "")
        if not key:
            raise ValueError(f"parameter 'remote.api_key_env' = {name!r}: the environment "
                             "variable is not set or empty")
    return RemoteConfig(base_url=p["remote.base_url"], model=p["remote.model"], api_key=key,
                        timeout_s=p["remote.timeout_s"], max_retries=p["remote.max_retries"],
                        max_tokens=p["max_new_tokens"], temperature=p["temperature"],
                        max_reply_bytes=p["remote.max_reply_bytes"])


def resolve_weights(path: str, name: str = "weights_path") -> str:
    """'package://<package>/<path>' (a file installed with a ROS package) -> a file path;
    other paths unchanged. ValueError naming the parameter `name` when the package is
    unknown."""
    if not path.startswith("package://"):
        return path
    package, _, rel = path[len("package://"):].partition("/")
    try:
        share = get_package_share_directory(package)
    except (PackageNotFoundError, ValueError) as exc:
        raise ValueError(f"parameter '{name}' = {path!r}: package {package!r} not "
                         f"found: {exc}") from exc
    return os.path.join(share, rel)


def executor_config(p: dict) -> ExecutorConfig:
    """The plan executor's config from the node parameters (or from SPECS' defaults: the
    loop through the cores, kestrel_bringup.core_loop). ValueError naming a bad one."""
    return ExecutorConfig(
        p["position_tolerance"], p["step_timeout"], p["gripper_time"],
        tuple(p["home_joint_positions"]), transit_clearance=p["transit_clearance"],
        back_off=p["back_off"], grasp_retries=p["grasp_retries"],
        grasp_retry_offset=p["grasp_retry_offset"], stall_timeout=p["stall_timeout"],
        stall_distance=p["stall_distance"], push_speed=p["push_speed"],
        place_contact_height=p["place_contact_height"])


def planner_configs(p: dict) -> tuple[PlannerConfig, ExecutorConfig]:
    """The planner core's and the plan executor's configs from the node parameters (the plan
    limits are the core config's `limits`). ValueError naming the first parameter found bad."""
    limits = PlanLimits(p["max_speed"], p["min_height"], p["max_height"],
                        tuple(p["workspace_min"]), tuple(p["workspace_max"]), p["max_steps"])
    cfg = get_config(p["model_config"])
    if p["image_size"]:
        cfg = cfg.with_overrides(image_size=p["image_size"])
    need = cfg.num_image_tokens + p["max_new_tokens"] + 64
    if p["backend"] in ("generate", "engine") and need > cfg.max_seq_len:
        raise ValueError(f"parameter 'max_new_tokens' = {p['max_new_tokens']}: image "
                         f"tokens + budget + prompt exceed max_seq_len {cfg.max_seq_len}")
    remote = remote_config(p) if p["backend"] == "remote" else None
    executor = executor_config(p)
    planner = PlannerConfig(
        model=cfg, weights_path=resolve_weights(p["weights_path"]),
        demo_plan="\n".join(x.strip() for x in p["demo_plan"].split(";")),
        device=p["device"], seed=p["seed"], max_new_tokens=p["max_new_tokens"],
        max_batch=p["max_batch"], temperature=p["temperature"], limits=limits,
        default_speed=p["default_speed"],
        backend=p["backend"], engine_compile=p["engine_compile"],
        hf_model_path=p["hf.model_path"], hf_dtype=p["hf.dtype"],
        hf_tokenizer=p["hf.tokenizer"], hf_grammar=p["hf.grammar"],
        hf_warmup_image_size=tuple(p["hf.warmup_image_size"]),
        grammar_engine=p["grammar_engine"], remote=remote,
        remote_send_image=p["remote.send_image"],
        remote_response_format=p["remote.response_format"],
        prefix_cache_entries=p["prefix_cache_entries"], speculative_k=p["speculative.k"],
        draft_weights_path=resolve_weights(p["speculative.draft_weights_path"],
                                           "speculative.draft_weights_path"),
        draft_model=p["speculative.draft_model_config"],
        draft_layers=p["speculative.draft_layers"])
    return planner, executor


def configured_text(p: dict, limits: PlanLimits) -> str:
    """The configure log line: the backend, what decodes plans (its model, and the weights of
    our VLM), max_batch, the speculative draft when speculative.k > 0, and the plan limits."""
    weights = ("demo_plan weights" if p["demo_plan"]
               else p["weights_path"] or "random weights")
    model = {"hf": p["hf.model_path"], "remote": f"{p['remote.model']} at "
             f"{p['remote.base_url']}", "plan_text": "no model: the instruction is the "
             "plan"}.get(p["backend"], f"{p['model_config']} model ({weights})")
    draft = (p["speculative.draft_weights_path"]
             or f"the first {p['speculative.draft_layers']} layer(s)")
    spec = f", speculative k {p['speculative.k']} (draft {draft})" if p["speculative.k"] else ""
    return (f"configured: backend {p['backend']}, {model}, max_batch {p['max_batch']}{spec}, "
            f"limits {limits}")
