"""PerceptionCore with a prepared runtime variant (runtime_variant parameter)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kestrel_common.params import ParamError, validate_value
from kestrel_models.perception import PerceptionConfig
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


def test_runtime_variant_matches_eager_and_falls_back_on_other_shapes() -> None:
    eager = PerceptionCore(_config())
    rt = PerceptionCore(_config(runtime_variant="eager_fp32_cl"))
    assert eager.runtime is None and rt.runtime is not None
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


def test_runtime_variant_is_validated() -> None:
    with pytest.raises(ValueError, match="runtime_variant"):
        _config(runtime_variant="fastest")
    with pytest.raises(ValueError, match="runtime_variant"):
        _config(runtime_variant="compile_bf16_graph", device="cpu")
    with pytest.raises(ValueError, match="runtime_variant"):
        _config(runtime_variant="eager_fp32_cl", warmup_image_hw=None)
    spec = next(s for s in SPECS if s.name == "runtime_variant")
    assert spec.default == "eager" and "compile_bf16_graph" in spec.choices
    with pytest.raises(ParamError, match="runtime_variant"):
        validate_value(spec, "fastest")


def test_params_map_runtime_variant_to_core_config() -> None:
    values = {s.name: s.default for s in SPECS}
    values["runtime_variant"] = "eager_bf16_cl"
    assert core_config(values).runtime_variant == "eager_bf16_cl"
