"""PerceptionCore with a prepared runtime (the runtime.* options)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kestrel_common.params import ParamError, validate_params
from kestrel_models.perception import PerceptionConfig
from kestrel_models.perception.runtime import VARIANTS
from kestrel_perception.core import CameraModel, FrameSet, PerceptionCore, PerceptionCoreConfig
from kestrel_perception.core.params import SPECS, core_config

torch.set_num_threads(1)

H, W = 64, 96
K = np.array([[80.0, 0.0, 48.0], [0.0, 80.0, 32.0], [0.0, 0.0, 1.0]])


def _config(**kw: object) -> PerceptionCoreConfig:
    model = PerceptionConfig.tiny(base_width=8, fpn_channels=32, score_threshold=0.0,
                                  max_detections=8)
    base: dict[str, object] = dict(model=model, warmup_image_hw=(H, W), warmup_cameras=2)
    base.update(kw)
    return PerceptionCoreConfig(**base)  # type: ignore[arg-type]


def _frames(h: int = H, w: int = W, n: int = 2) -> FrameSet:
    rng = np.random.default_rng(7)
    cams = [CameraModel(K, w, h, f"cam{i}") for i in range(n)]
    return FrameSet(1, [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for _ in cams], cams,
                    None)


@pytest.mark.slow
def test_a_runtime_matches_the_plain_model_and_falls_back_on_other_shapes() -> None:
    eager = PerceptionCore(_config())
    rt = PerceptionCore(_config(optimize=True))  # exact rewrites: a prepared runtime
    assert eager.runtime is None and rt.runtime is not None
    assert rt.runtime.spec.fold_bn and rt.runtime.optimized
    assert rt.runtime.input_shape == (2, 3, H, W)
    assert len(rt.runtime.head_sets) == 7  # every non-empty head subset is prepared
    a, b = eager.process(_frames()), rt.process(_frames())
    assert not b.runtime_fallback
    np.testing.assert_allclose(b.depths[0], a.depths[0], atol=1e-4)
    assert (b.masks[1] == a.masks[1]).mean() > 0.999
    assert [d.class_index for d in b.detections] == [d.class_index for d in a.detections]
    sub = rt.process(_frames(), frozenset({"depth"}))
    assert sub.masks == [] and len(sub.depths) == 2 and not sub.runtime_fallback
    other = rt.process(_frames(h=32, w=64))  # not the prepared shape: eager, flagged
    assert other.runtime_fallback and other.depths[0].shape == (32, 64)


def test_bf16_on_the_cpu_runs_the_fallback_in_bf16_too() -> None:
    core = PerceptionCore(_config(precision="bf16"))
    assert core.runtime is not None and core.runtime.spec.precision == "bf16"
    assert core._fallback_dtype == torch.bfloat16
    assert core.process(_frames(h=32, w=64)).runtime_fallback


def test_runtime_options_are_validated() -> None:
    with pytest.raises(ValueError, match="parameter 'runtime.precision' = 'fastest'"):
        _config(precision="fastest")
    with pytest.raises(ValueError, match="parameter 'runtime.cuda_graph' = True: CUDA graphs "
                                         "need device 'cuda'"):
        _config(cuda_graph=True, device="cpu")
    with pytest.raises(ValueError, match="parameter 'runtime.compile' = 'whole'.*tensorrt"):
        _config(engine="tensorrt", compile="whole", device="cuda")
    with pytest.raises(ValueError, match="parameter 'warmup_size'.*static input shape"):
        _config(optimize=True, warmup_image_hw=None)
    _config(warmup_image_hw=None)  # the plain model needs no static shape
    with pytest.raises(ValueError, match="parameter 'variant' = 'fastest'"):
        _config(variant="fastest")
    with pytest.raises(ValueError, match="parameter 'variant'.*needs device 'cuda'"):
        _config(variant="compile_bf16_graph")


def test_a_benchmark_variant_replaces_the_options() -> None:
    core = PerceptionCore(_config(variant="eager_fp32_cl", warmup_cameras=1))
    assert core.runtime is not None and core.runtime.spec == VARIANTS["eager_fp32_cl"]


def test_params_map_the_runtime_options_to_the_core_config() -> None:
    values = validate_params(SPECS, {"runtime": {"precision": "bf16", "optimize": True,
                                                 "cuda_graph": False}})
    cfg = core_config(values)
    assert (cfg.precision, cfg.optimize, cfg.cuda_graph, cfg.compile, cfg.engine) == \
        ("bf16", True, False, "auto", "auto")
    assert cfg.options.describe() == "torch bf16, compile off, cuda_graph off, optimize on"
    for name, bad in (("runtime.cuda_graph", "yes"), ("runtime.precision", "fp64"),
                      ("runtime.compile", "max")):
        with pytest.raises(ParamError, match=f"parameter '{name}'"):
            validate_params(SPECS, {name: bad})
    defaults = {s.name: s.default for s in SPECS}
    assert {k: defaults[f"runtime.{k}"] for k in ("engine", "precision", "compile",
                                                   "cuda_graph", "optimize")} == dict.fromkeys(
        ("engine", "precision", "compile", "cuda_graph", "optimize"), "auto")
    assert "amp" not in defaults and "runtime_variant" not in defaults
