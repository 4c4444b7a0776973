"""PerceptionRuntime: variants, static buffers, head sets, accuracy report (CPU; GPU marked)."""

from __future__ import annotations

import pytest
import torch
from tiny_perception import tiny_model

from kestrel_models.perception.accuracy import compare_outputs, match_detections
from kestrel_models.perception.postprocess import ImageDetections
from kestrel_models.perception.runtime import (
    VARIANTS,
    PerceptionRuntime,
    RuntimeInputError,
    VariantSpec,
)

HW = (64, 96)
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")




def _images(n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 256, (n, 3, *HW), dtype=torch.uint8, generator=g)


def test_eager_fp32_matches_plain_model_and_keeps_reference_untouched() -> None:
    model = tiny_model()
    img = _images(2)
    expected = model(img)
    rt = PerceptionRuntime(model, "eager_fp32", HW, cameras=2, batch=1)
    out = rt.run(img)
    torch.testing.assert_close(out["seg"], expected["seg"])
    torch.testing.assert_close(out["depth"], expected["depth"])
    for a, b in zip(out["det_cls"], expected["det_cls"], strict=True):
        torch.testing.assert_close(a, b)
    # the runtime works on its own copy: the reference model keeps fp32 contiguous weights
    assert rt.model is not model
    w = model.backbone.conv1.weight
    assert w.dtype == torch.float32 and w.is_contiguous()


def test_channels_last_and_bf16_variants_stay_close_to_fp32() -> None:
    model = tiny_model()
    img = _images(2)
    ref = PerceptionRuntime(model, "eager_fp32", HW, cameras=2).run(img)
    cl_rt = PerceptionRuntime(model, "eager_fp32_cl", HW, cameras=2)
    assert cl_rt.model.backbone.conv1.weight.is_contiguous(memory_format=torch.channels_last)
    rep = compare_outputs(ref, cl_rt.run(img), HW, class_offset=1)
    assert rep.seg_max_abs is not None and rep.seg_max_abs < 1e-4
    assert rep.depth_max_abs is not None and rep.depth_max_abs < 1e-4
    assert rep.det_agreement == 1.0 and rep.det_ref_count > 0
    bf = compare_outputs(ref, PerceptionRuntime(model, "eager_bf16_cl", HW, cameras=2).run(img),
                         HW, class_offset=1)
    assert 0 < bf.seg_max_abs < 0.2  # bf16 differs, but only a little
    assert bf.det_agreement is not None and bf.det_agreement > 0.8


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("variant", ["eager_fp16_cl", "whole_fp16w_freeze_graph"])
def test_fp16_variants_stay_close_to_fp32_on_gpu(variant: str) -> None:
    """fp16 (autocast, and weights cast + inductor freezing in one CUDA graph): the same
    accuracy check as bf16, against strict fp32 on the same GPU (TF32 off)."""
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    model = tiny_model()
    img = _images(2)
    ref = PerceptionRuntime(model, "eager_fp32", HW, cameras=2, device="cuda").run(img)
    ref = {k: [t.clone() for t in v] if isinstance(v, list) else v.clone() for k, v in
           ref.items()}
    rep = compare_outputs(ref, PerceptionRuntime(model, variant, HW, cameras=2,
                                                 device="cuda").run(img), HW, class_offset=1)
    assert rep.seg_max_abs is not None and 0 <= rep.seg_max_abs < 0.05
    assert rep.depth_max_abs is not None and rep.depth_max_abs < 0.05
    assert rep.det_agreement is not None and rep.det_agreement > 0.8


def test_bf16_weight_cast_keeps_fp32_normalisation() -> None:
    model = tiny_model()
    spec = VariantSpec("bf16", cast_weights=True, channels_last=True)
    rt = PerceptionRuntime(model, spec, HW)
    assert rt.model.backbone.conv1.weight.dtype == torch.bfloat16
    assert rt.model.in_scale.dtype == torch.float32
    out = rt.run(_images(1))
    with torch.no_grad():
        ref = model(_images(1))
    assert out["seg"].dtype == torch.bfloat16
    assert float((out["depth"].float() - ref["depth"]).abs().max()) < 0.2


def test_head_sets_are_prepared_and_switch_without_error() -> None:
    model = tiny_model()
    sets = [{"detection", "segmentation", "depth"}, {"depth"}]
    rt = PerceptionRuntime(model, "eager_fp32", HW, heads=sets)
    img = _images(1)
    assert set(rt.run(img, heads={"depth"})) == {"depth"}
    assert {"det_cls", "seg", "depth"} <= set(rt.run(img))
    with pytest.raises(RuntimeInputError, match="not prepared"):
        rt.run(img, heads={"segmentation"})


def test_lidar_projection_inside_the_forward() -> None:
    model = tiny_model()
    rt = PerceptionRuntime(model, "eager_fp32", HW, cameras=2, batch=2, lidar_points=4)
    K = torch.tensor([[50.0, 0, 48], [0, 50.0, 32], [0, 0, 1]]).repeat(2, 1, 1)
    T = torch.eye(4).repeat(2, 1, 1)
    T[1, 0, 3] = 1.0  # camera 1 sees the points shifted 1 m to the right
    rt.set_geometry(T, K)
    pts = torch.tensor([[0.0, 0.0, 2.0], [0.0, 0.0, -1.0], [float("nan")] * 3,
                        [0.2, 0.1, 5.0]]).repeat(2, 1, 1)
    out = rt.run(_images(4), pts)
    assert out["lidar_uv"].shape == (2, 2, 4, 2)
    torch.testing.assert_close(out["lidar_uv"][0, 0, 0], torch.tensor([48.0, 32.0]))
    torch.testing.assert_close(out["lidar_uv"][0, 1, 0], torch.tensor([73.0, 32.0]))
    assert out["lidar_valid"][1, 0].tolist() == [True, False, False, True]
    torch.testing.assert_close(out["lidar_depth"][0, 0, 3], torch.tensor(5.0))


def test_bad_inputs_and_config_raise_clear_errors() -> None:
    model = tiny_model()
    with pytest.raises(ValueError, match="parameter .variant. = .fastest."):
        PerceptionRuntime(model, "fastest", HW)
    with pytest.raises(ValueError, match="cameras"):
        PerceptionRuntime(model, "eager_fp32", HW, cameras=0)
    with pytest.raises(ValueError, match="heads"):
        PerceptionRuntime(tiny_model(heads=frozenset({"depth"})), "eager_fp32", HW,
                          heads={"segmentation"})
    with pytest.raises(ValueError, match="CUDA"):
        PerceptionRuntime(model, "compile_bf16_graph", HW, device="cpu")
    with pytest.raises(ValueError, match="precision"):
        VariantSpec("int8")
    rt = PerceptionRuntime(model, "eager_fp32", HW, cameras=2)
    with pytest.raises(RuntimeInputError, match="uint8"):
        rt.run(_images(2).float())
    with pytest.raises(RuntimeInputError, match="expected uint8"):
        rt.run(_images(3))
    with pytest.raises(RuntimeInputError, match="without LiDAR"):
        rt.run(_images(2), torch.zeros(1, 4, 3))


def test_detection_matching_counts_same_class_overlaps_only() -> None:
    boxes = torch.tensor([[0.0, 0, 10, 10], [20, 20, 30, 30]])
    ref = ImageDetections(boxes, torch.tensor([0.9, 0.8]), torch.tensor([1, 2]))
    same = ImageDetections(boxes + 0.5, torch.tensor([0.9, 0.8]), torch.tensor([1, 2]))
    other = ImageDetections(boxes, torch.tensor([0.9, 0.8]), torch.tensor([2, 1]))
    assert match_detections(ref, same) == 2
    assert match_detections(ref, other) == 0


@pytest.mark.slow
def test_compile_variant_matches_eager_on_cpu() -> None:
    """A small torch.compile check on CPU: only the heads compiled, tiny widths."""
    model = tiny_model(base_width=8, fpn_channels=16, heads=frozenset({"depth"}))
    img = _images(1)
    ref = model(img)
    rt = PerceptionRuntime(model, VariantSpec(heads_compile="default"), HW)
    out = rt.run(img)
    assert rt.compile_s > 0
    torch.testing.assert_close(out["depth"], ref["depth"], atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_switching_heads_never_compiles_in_the_hot_path() -> None:
    """One compiled region per head set, all compiled at configure: switching head sets
    between frames, back and forth, runs no Dynamo compilation (torch._dynamo's count of
    graphs does not move), and each set gives that set's outputs."""
    from torch._dynamo.utils import counters

    model = tiny_model()
    sets = [{"detection", "segmentation", "depth"}, {"depth"}, {"segmentation", "detection"}]
    torch._dynamo.reset()
    rt = PerceptionRuntime(model, VariantSpec(whole_compile="default", backend="eager"), HW,
                           heads=sets)
    compiled_at_configure = counters["stats"]["unique_graphs"]
    assert compiled_at_configure >= len(sets) and rt.compile_s > 0
    img = _images(1)
    for _ in range(3):
        for hs in (sets[1], sets[0], sets[2], sets[1]):
            out = rt.run(img, heads=hs)
            assert ("depth" in out) == ("depth" in hs) and ("seg" in out) == (
                "segmentation" in hs)
    assert counters["stats"]["unique_graphs"] == compiled_at_configure, dict(counters["stats"])


def test_variant_table_names() -> None:
    for name in ("eager_fp32", "eager_bf16_cl", "compile_bf16", "compile_bf16_graph"):
        assert name in VARIANTS
    assert VARIANTS["compile_bf16_graph"].cuda_graph
    assert VARIANTS["compile_bf16w_graph_at"].heads_compile == "max-autotune-no-cudagraphs"


def test_compile_mode_variants_differ_only_in_their_modes() -> None:
    """The compile-mode comparison: same transforms, one mode changed per group."""
    at = "max-autotune-no-cudagraphs"
    base = VARIANTS["compile_bf16w_fold_s2d_group_cudnn_graph"]
    assert base.optimize == VARIANTS["whole_bf16w_fold_s2d_group_cudnn_graph"].optimize
    modes = {n: (VARIANTS[n].trunk_compile, VARIANTS[n].heads_compile, VARIANTS[n].cuda_graph,
                 VARIANTS[n].optimize == base.optimize and VARIANTS[n].fold_bn)
             for n in ("compile_bf16w_fold_s2d_group_cudnn_graph",
                       "compile_bf16w_fold_s2d_group_cudnn_ro",
                       "compile_bf16w_fold_s2d_group_cudnn_graph_at",
                       "compile_bf16w_fold_s2d_group_cudnn_graph_tat")}
    assert list(modes.values()) == [("default", "default", True, True),
                                     ("reduce-overhead", "reduce-overhead", False, True),
                                     ("default", at, True, True), (at, "default", True, True)]
    whole_at = VARIANTS["whole_bf16w_fold_s2d_group_cudnn_at_graph"]
    assert whole_at.whole_compile == at and whole_at.optimize == base.optimize


@pytest.mark.gpu
@needs_gpu
def test_cuda_graph_variant_matches_eager_and_switches_heads() -> None:
    model = tiny_model(bev=True, bev_grid=16)
    sets = [{"detection", "segmentation", "depth"}, {"segmentation"}]
    img, pts = _images(2), torch.randn(1, 256, 3) * 5
    ref = PerceptionRuntime(model, "eager_fp32", HW, cameras=2, heads=sets, device="cuda",
                            lidar_points=256)
    ref_out = {k: v for k, v in ref.run(img, pts).items()}
    for variant in ("eager_bf16w_graph", "compile_bf16_graph"):
        rt = PerceptionRuntime(model, variant, HW, cameras=2, heads=sets, device="cuda",
                               lidar_points=256)
        out = rt.run(img, pts)
        rep = compare_outputs(ref_out, out, HW, class_offset=1)
        assert rep.seg_max_abs < 0.2 and rep.depth_max_abs < 0.2 and rep.bev_max_abs < 0.2
        torch.testing.assert_close(out["lidar_uv"], ref_out["lidar_uv"])
        seg_full = out["seg"].float().clone()  # graph outputs: valid until the next run
        seg_only = rt.run(img, pts, heads={"segmentation"})
        assert "det_cls" not in seg_only and "depth" not in seg_only
        torch.testing.assert_close(seg_only["seg"].float(), seg_full)


def test_batchnorm_folding_is_exact_in_fp32() -> None:
    from kestrel_models.perception.runtime import fold_batchnorm

    model = tiny_model(backbone_depth=50, base_width=8, fpn_channels=16)
    for m in model.modules():  # non-trivial BN statistics so the fold really changes weights
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
            m.weight.data.uniform_(0.5, 1.5)
    img = _images(1)
    ref = model(img)
    rt = PerceptionRuntime(model, "eager_fp32_fold", HW)
    n_bn = sum(isinstance(m, torch.nn.BatchNorm2d) for m in rt.model.modules())
    assert n_bn == 0
    assert fold_batchnorm(rt.model) == 0  # nothing left to fold
    out = rt.run(img)
    torch.testing.assert_close(out["seg"], ref["seg"], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out["depth"], ref["depth"], atol=1e-4, rtol=1e-4)


def test_lidar_projection_stays_fp32_under_autocast() -> None:
    model = tiny_model()
    pts = (torch.randn(1, 64, 3) * 5 + torch.tensor([0.0, 0.0, 6.0])).contiguous()
    runs = [PerceptionRuntime(model, v, HW, lidar_points=64) for v in
            ("eager_fp32", "eager_bf16_cl")]
    K = torch.tensor([[40.0, 0, 48], [0, 40.0, 32], [0, 0, 1]])[None]
    outs = []
    for rt in runs:
        rt.set_geometry(torch.eye(4)[None], K)
        outs.append(rt.run(_images(1), pts))
    assert outs[1]["lidar_uv"].dtype == torch.float32
    torch.testing.assert_close(outs[1]["lidar_uv"], outs[0]["lidar_uv"])


@pytest.mark.slow
def test_whole_forward_is_one_graph_and_keeps_geometry_an_input() -> None:
    """whole_* variants trace the forward (model + projection) as ONE graph per head set
    (fullgraph=True fails on any graph break); T/K stay inputs, so set_geometry still counts.
    The 'eager' backend checks the tracing without a slow inductor compile on CPU."""
    model = tiny_model(base_width=8, fpn_channels=16)
    img, pts = _images(2), torch.randn(1, 256, 3) * 5
    T = torch.eye(4).repeat(2, 1, 1)
    K = torch.tensor([[50.0, 0, 48], [0, 50, 32], [0, 0, 1]]).repeat(2, 1, 1)
    sets = [{"detection", "segmentation", "depth"}, {"depth"}]
    ref = PerceptionRuntime(model, "eager_fp32", HW, cameras=2, lidar_points=256, heads=sets)
    rt = PerceptionRuntime(model, VariantSpec(whole_compile="default", backend="eager"), HW,
                           cameras=2, lidar_points=256, heads=sets)
    assert set(rt._regions) == {frozenset(s) for s in sets}
    for geom in (T, T.clone().index_fill_(2, torch.tensor([3]), 1.0)):
        geom[:, 3, 3] = 1.0
        ref.set_geometry(geom, K)
        rt.set_geometry(geom, K)
        want, got = ref.run(img, pts), rt.run(img, pts)
        torch.testing.assert_close(got["depth"], want["depth"])
        torch.testing.assert_close(got["lidar_depth"], want["lidar_depth"], equal_nan=True)
        assert got["lidar_valid"].any()
    only = rt.run(img, pts, heads={"depth"})
    assert "seg" not in only and "det_cls" not in only
    torch.testing.assert_close(only["depth"], ref.run(img, pts)["depth"])


def test_whole_variant_table_and_spec_validation() -> None:
    for name in ("whole_bf16w_graph", "whole_bf16w_fold_graph", "whole_bf16w_freeze_graph",
                 "whole_fp16w_freeze_graph"):
        spec = VARIANTS[name]
        assert spec.whole_compile == "default" and spec.cuda_graph and spec.compiled
        assert spec.trunk_compile is None and spec.heads_compile is None
    assert VARIANTS["whole_fp16w_freeze_graph"].dtype == torch.float16
    assert not VARIANTS["eager_fp32"].compiled
    with pytest.raises(ValueError, match="'freeze' = True"):
        VariantSpec(freeze=True)
    with pytest.raises(ValueError, match="'whole_compile' = 'default'"):
        VariantSpec(trunk_compile="default", whole_compile="default")
    with pytest.raises(ValueError, match="'whole_compile' = 'fast'"):
        VariantSpec(whole_compile="fast")


@pytest.mark.gpu
@needs_gpu
def test_whole_freeze_variant_matches_eager_on_gpu() -> None:
    model = tiny_model(bev=True, bev_grid=16)
    img, pts = _images(2), torch.randn(1, 256, 3) * 5
    ref = PerceptionRuntime(model, "eager_fp32", HW, cameras=2, device="cuda", lidar_points=256)
    ref_out = {k: v.clone() for k, v in ref.run(img, pts).items() if torch.is_tensor(v)}
    rt = PerceptionRuntime(model, "whole_bf16w_freeze_graph", HW, cameras=2, device="cuda",
                           lidar_points=256)
    out = rt.run(img, pts)
    rep = compare_outputs(ref_out, out, HW, class_offset=1)
    assert rep.seg_max_abs < 0.2 and rep.depth_max_abs < 0.2 and rep.bev_max_abs < 0.2
    torch.testing.assert_close(out["lidar_uv"], ref_out["lidar_uv"], equal_nan=True)


@pytest.mark.gpu
@needs_gpu
def test_reduce_overhead_variant_runs_repeatedly_and_matches_eager_on_gpu() -> None:
    """compile modes "reduce-overhead" (inductor's CUDA-graph trees, per submodule group):
    without a step marked between inference forwards, the warm-up raises "accessing tensor
    output of CUDAGraphs that has been overwritten by a subsequent run". Each `run` is a
    step; its outputs hold until the next `run`."""
    model = tiny_model(backbone_depth=50)
    img = _images(2)
    ref = PerceptionRuntime(model, "eager_fp32", HW, cameras=2, device="cuda")
    ref_out = {k: v.clone() for k, v in ref.run(img).items() if torch.is_tensor(v)}
    rt = PerceptionRuntime(model, "compile_bf16w_fold_s2d_group_cudnn_ro", HW, cameras=2,
                           device="cuda", warmup=3)
    for _ in range(3):  # repeated runs, each reading the previous outputs first
        out = rt.run(img)
        rep = compare_outputs(ref_out, out, HW, class_offset=1)
        assert rep.seg_max_abs < 0.2 and rep.depth_max_abs < 0.2


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cudnn_fused_blocks_match_unfused_on_gpu(dtype: torch.dtype) -> None:
    """conv_act 'cudnn' on CUDA (torch.cudnn_convolution_relu / _add_relu) vs the same folded
    model unfused, ResNet-50 blocks, channels_last: equal up to rounding order."""
    import copy

    from kestrel_models.perception.optimize import OptimizeSpec, optimize_model
    from kestrel_models.perception.runtime import fold_batchnorm

    torch.backends.cudnn.allow_tf32 = False
    model = tiny_model(backbone_depth=50)
    fold_batchnorm(model)
    model = model.to("cuda", dtype).to(memory_format=torch.channels_last)
    model.in_scale, model.in_shift = model.in_scale.float(), model.in_shift.float()
    fused = copy.deepcopy(model)
    assert optimize_model(fused, OptimizeSpec(conv_act="cudnn"))["fused_blocks"] == 16
    x = torch.randn(2, 3, 64, 96, device="cuda", dtype=dtype).to(
        memory_format=torch.channels_last)
    with torch.no_grad():
        ref, out = model.backbone(x), fused.backbone(x)
    for a, b in zip(out, ref, strict=True):
        tol = 1e-4 if dtype == torch.float32 else 0.05 * float(b.abs().max())
        torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=tol)


@pytest.mark.slow
def test_cudnn_autotune_is_set_for_cuda_devices_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The runtime turns cuDNN's per-shape algorithm timing on for CUDA devices (static
    shapes: each conv is timed once, before any graph capture), never on the CPU."""
    from kestrel_models.perception.runtime import enable_cudnn_autotune

    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    assert not enable_cudnn_autotune(torch.device("cpu"))
    assert torch.backends.cudnn.benchmark is False
    rt = PerceptionRuntime(tiny_model(), "eager_fp32", HW, cameras=1)
    assert not rt.cudnn_autotune and torch.backends.cudnn.benchmark is False
    assert enable_cudnn_autotune(torch.device("cuda", 0))  # sets the flag, no GPU needed
    assert torch.backends.cudnn.benchmark is True
