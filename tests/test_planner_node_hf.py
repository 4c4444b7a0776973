"""The planner node in this process with backend hf (no executor, no DDS traffic): a tiny
Qwen2-VL checkpoint saved here (tests/tiny_hf_vlm.py: its own tokenizer and chat template,
nothing downloaded) runs on the decode engine and the node says so at configure; a goal with an
image is decoded under the plan grammar and goes through the parser and validator; a checkpoint
whose decoder the engine does not run falls back to transformers with the reason logged; a
corrupted weights file fails configure naming the parameter and the cause."""

from __future__ import annotations

import contextlib
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers", reason="transformers is not installed")

from kestrel_interfaces.action import PlanTask  # noqa: E402
from kestrel_interfaces.msg import PerceptionResult  # noqa: E402
from rclpy.action import GoalResponse  # noqa: E402

from kestrel_common.conversions import make_header, numpy_to_image  # noqa: E402
from tiny_hf_vlm import config, save_tiny  # noqa: E402

R = PlanTask.Result
PARAMS = {"backend": "hf", "max_new_tokens": 96, "max_steps": 2, "max_scene_age": 0.0,
          "autostart": False, "gc_freeze": False, "max_batch": 2}


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


@contextlib.contextmanager
def local_node(ros_domain: int, path: Path):
    import rclpy
    from rclpy.parameter import Parameter

    from kestrel_planner.planner_node import PlannerNode

    ctx = rclpy.Context()
    rclpy.init(context=ctx, domain_id=ros_domain)
    params = {**PARAMS, "hf.model_path": str(path)}
    node = PlannerNode(context=ctx, parameter_overrides=[Parameter(k, value=v)
                                                         for k, v in params.items()])
    try:
        yield node
    finally:
        node.stop_workers()
        node.trigger_cleanup()
        node.destroy_node()
        rclpy.try_shutdown(context=ctx)


def _scene(node) -> None:  # noqa: ANN001
    import array
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


@pytest.mark.slow
def test_hf_checkpoint_plans_on_the_engine(ros_domain: int, tmp_path: Path, capfd) -> None:  # noqa: ANN001
    from kestrel_models.planner.hf_engine.runner import EngineRunner
    from rclpy.lifecycle import TransitionCallbackReturn

    path = save_tiny("qwen2_vl", tmp_path / "qwen", sharpen=4.0, max_position_embeddings=4096)
    with local_node(ros_domain, path) as node:
        assert node.trigger_configure() == TransitionCallbackReturn.SUCCESS
        err = capfd.readouterr().err
        assert "backend hf: engine: qwen2_vl (Qwen2VLForConditionalGeneration)" in err
        assert "qkv bias" in err and "M-RoPE" in err
        backend = node.core.backend
        assert isinstance(backend.vlm, EngineRunner) and not backend.fallback
        node.trigger_activate()
        _scene(node)
        rgb = np.random.default_rng(0).integers(0, 256, (56, 84, 3), dtype=np.uint8)
        image = numpy_to_image(rgb, "rgb8", make_header(time.time_ns(), "camera"))
        goal = PlanTask.Goal(instruction="put the red cube in the bin", use_image=True,
                             image=image, max_steps=2)
        assert node._on_goal(goal) == GoalResponse.ACCEPT
        handle = GoalHandle(goal)
        result = node._execute(handle)  # bounded by goal_timeout
        # grammar-constrained: the reply always parses; the validator decides
        assert result.validation_status in (R.VALIDATION_ACCEPTED, R.VALIDATION_REJECTED)
        assert result.plan.steps and result.time_to_first_token > 0, result.reasons
        assert handle.feedback  # tokens streamed
        # the image sat inside the user turn of the model's chat template
        from kestrel_planner.core.backend import DecodeJob
        ids = backend.prompt_ids(DecodeJob("x", ["bin"], 2, rgb))
        text = backend.tokenizer.tok.decode(ids, skip_special_tokens=False)
        assert "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>objects:" in text


@pytest.mark.slow
def test_unsupported_decoder_falls_back_with_reason(ros_domain: int, tmp_path: Path,
                                                    capfd) -> None:  # noqa: ANN001
    from rclpy.lifecycle import TransitionCallbackReturn
    from transformers import AutoModelForImageTextToText

    from tiny_hf_vlm import tokenizer

    cfg = config("llava", max_position_embeddings=4096)
    cfg.text_config.hidden_act = "gelu"  # not the engine's SwiGLU
    AutoModelForImageTextToText.from_config(cfg).save_pretrained(str(tmp_path / "gelu"))
    tokenizer("llava").save_pretrained(str(tmp_path / "gelu"))
    with local_node(ros_domain, tmp_path / "gelu") as node:
        assert node.trigger_configure() == TransitionCallbackReturn.SUCCESS
        assert node.core.backend.fallback
    err = capfd.readouterr().err
    assert "backend hf: transformers, row by row (the engine does not run it: text decoder " \
           "activation 'gelu'" in err


def test_corrupted_checkpoint_fails_configure_naming_it(ros_domain: int, tmp_path: Path,
                                                        capfd) -> None:  # noqa: ANN001
    from rclpy.lifecycle import TransitionCallbackReturn

    path = save_tiny("smolvlm", tmp_path / "smol")
    (path / "model.safetensors").write_bytes(b"\x10" * 64)
    with local_node(ros_domain, path) as node:
        assert node.trigger_configure() == TransitionCallbackReturn.FAILURE
        assert node.core is None
    err = capfd.readouterr().err
    assert f"configure failed: parameter 'hf.model_path' = '{path}': cannot load the " \
           "checkpoint: SafetensorError" in err
    shutil.rmtree(path)
