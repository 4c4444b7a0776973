"""Branched forward (branches.py) and the fused stem (conv_act.fuse_stem): same outputs as the
one-region forward (CPU: exact in fp32, the code path CI runs; GPU: streams in a CUDA graph)."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_perception import tiny_model

from kestrel_models.perception.accuracy import compare_outputs
from kestrel_models.perception.branches import BranchPlan, merge_outputs
from kestrel_models.perception.optimize import OptimizeSpec, optimize_model
from kestrel_models.perception.runtime import VARIANTS, PerceptionRuntime, VariantSpec, \
    fold_batchnorm

HW = (64, 96)
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
PLANS = [BranchPlan(), BranchPlan((("det0",), ("det1",), ("det2",), ("dense",))),
         BranchPlan((("dense", "det2"), ("det1", "det0")), priority=True)]
SETS = [{"detection", "segmentation", "depth"}, {"segmentation"}, {"detection"}]


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    img = torch.randint(0, 256, (2, 3, *HW), dtype=torch.uint8, generator=g)
    pts = torch.randn(1, 256, 3, generator=g) * 5 + torch.tensor([0.0, 0.0, 6.0])
    T = torch.eye(4).repeat(2, 1, 1)
    K = torch.tensor([[50.0, 0, 48], [0, 50, 32], [0, 0, 1]]).repeat(2, 1, 1)
    return img, pts, T, K


def _assert_runs_alike(rt: PerceptionRuntime, ref: PerceptionRuntime, sets: list[set[str]],
                       **tol: float) -> None:
    """Both runtimes on the same inputs and geometry give the same outputs for each head set."""
    img, pts, T, K = _inputs()
    for r in (ref, rt):
        r.set_geometry(T, K)
    for hs in sets:
        _assert_same(rt.run(img, pts, heads=hs), ref.run(img, pts, heads=hs), **tol)


def _assert_same(got: dict, want: dict, **tol: float) -> None:
    assert list(got) == list(want)
    for key, w in want.items():
        g = got[key]
        if isinstance(w, list):
            assert len(g) == len(w), key
            for a, b in zip(g, w, strict=True):
                torch.testing.assert_close(a.float(), b.float(), **tol)
        else:
            torch.testing.assert_close(g.float(), w.float(), equal_nan=True, **tol)


@pytest.mark.slow
@pytest.mark.parametrize("plan", PLANS, ids=["default", "four", "reordered"])
def test_branched_forward_equals_the_model_forward(plan: BranchPlan) -> None:
    """Every plan, every head set, with LiDAR and BEV: the same dict, same order, same values
    as the one-region forward (fp32, eager parts: the CPU run of the branched code path)."""
    model = tiny_model(bev=True, bev_grid=16)
    ref = PerceptionRuntime(model, "eager_fp32", HW, cameras=2, lidar_points=256, heads=SETS)
    rt = PerceptionRuntime(model, VariantSpec(branches=plan), HW, cameras=2, lidar_points=256,
                           heads=SETS)
    _assert_runs_alike(rt, ref, SETS, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("stem", ["s2d", "s2d4"])
def test_branched_parts_trace_as_whole_graphs_with_the_best_transforms(stem: str) -> None:
    """Each part is one torch.compile region (fullgraph: a graph break fails); the 'eager'
    backend checks the tracing without an inductor compile. ResNet-50 blocks, s2d / s2d4
    stem, grouped FCOS, fused trunk epilogues and stem (their CPU form)."""
    model = tiny_model(backbone_depth=50)
    opt = OptimizeSpec(stem, 8, "grouped", conv_act="cudnn", fuse_stem=True)
    ref = PerceptionRuntime(model, VariantSpec(fold_bn=True), HW, cameras=2, lidar_points=256)
    rt = PerceptionRuntime(model, VariantSpec(fold_bn=True, whole_compile="default",
                                              backend="eager", optimize=opt,
                                              branches=BranchPlan()),
                           HW, cameras=2, lidar_points=256)
    assert rt.optimized["fused_stem"] == 1
    _assert_runs_alike(rt, ref, [set(model.enabled_heads)], atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_every_head_set_compiles_within_dynamo_s_recompile_limit() -> None:
    """The node prepares all 7 head sets. The parts are shared, one code object per kind, so
    the trunk compiles once, detection once per level and the dense part once per seg/depth
    subset; one generic wrapper per part and head set made ~35 entries on one code object
    and hit Dynamo's recompile limit (8) at configure."""
    from itertools import combinations

    import torch._dynamo

    torch._dynamo.reset()
    model = tiny_model(bev=True, bev_grid=16)
    names = ("detection", "segmentation", "depth")
    sets = [set(c) for n in (1, 2, 3) for c in combinations(names, n)]
    ref = PerceptionRuntime(model, "eager_fp32", HW, cameras=2, lidar_points=256, heads=sets)
    with torch._dynamo.config.patch(recompile_limit=3, fail_on_recompile_limit_hit=True):
        rt = PerceptionRuntime(model, VariantSpec(whole_compile="default", backend="eager",
                                                  branches=BranchPlan()),
                               HW, cameras=2, lidar_points=256, heads=sets)
        _assert_runs_alike(rt, ref, sets, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["branch", "whole"])
def test_runtimes_of_several_shapes_in_one_process_stay_within_the_recompile_limit(
        variant: str) -> None:
    """Four runtimes (camera counts 1-4) of one variant in one process: each compiles its
    own parts. With one code object per part shared across runtimes, the fourth runtime
    would fail on Dynamo's recompile limit."""
    import torch._dynamo

    torch._dynamo.reset()
    model = tiny_model()
    spec = VariantSpec(whole_compile="default", backend="eager",
                       branches=BranchPlan() if variant == "branch" else None)
    with torch._dynamo.config.patch(recompile_limit=3, fail_on_recompile_limit_hit=True):
        for cams in (1, 2, 3, 4):
            rt = PerceptionRuntime(model, spec, HW, cameras=cams, lidar_points=256)
            ref = PerceptionRuntime(model, "eager_fp32", HW, cameras=cams, lidar_points=256)
            img = torch.randint(0, 256, (cams, 3, *HW), dtype=torch.uint8)
            pts = torch.randn(1, 256, 3)
            _assert_same(rt.run(img, pts), ref.run(img, pts), atol=1e-5, rtol=1e-5)


def test_branch_plan_validation_and_head_sets() -> None:
    plan = BranchPlan()
    assert plan.for_heads(frozenset({"segmentation"}), bev=False) == (("dense",),)
    assert plan.for_heads(frozenset({"detection"}), bev=True) == (("det0", "bev"),
                                                                  ("det1", "det2"))
    for bad in ((), (("det0",), ()), (("det0", "det0"),), (("seg",),)):
        with pytest.raises(ValueError, match="parameter 'branches'"):
            BranchPlan(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="parameter 'branches'"):
        VariantSpec(trunk_compile="default", branches=plan)
    for name in ("branch_bf16w_fold_s2d_group_cudnn_graph",
                 "branch4_bf16w_fold_s2d_group_cudnn_stem_graph"):
        spec = VARIANTS[name]
        assert spec.branches is not None and spec.cuda_graph and spec.compiled


def test_merge_outputs_orders_levels_whatever_order_the_parts_ran() -> None:
    def det(size: int) -> dict:
        t = torch.zeros(1, 2, size, size)
        return {"det_cls": [t], "det_ltrb": [t], "det_ctr": [t]}

    out = merge_outputs({"det2": det(2), "dense": {"seg": torch.ones(1)}, "det0": det(8),
                         "det1": det(4)}, {"lidar_uv": torch.zeros(1)})
    assert [t.shape[-1] for t in out["det_cls"]] == [8, 4, 2]
    assert list(out) == ["det_cls", "det_ltrb", "det_ctr", "seg", "lidar_uv"]


@pytest.mark.parametrize("stem", ["s2d", "s2d4", "pad8", "plain"])
def test_fused_stem_is_exact_on_cpu_and_needs_a_folded_stem(stem: str) -> None:
    model = tiny_model(backbone_depth=50)
    for m in model.modules():  # non-trivial BN statistics: the folded stem has a real bias
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.bias.data.uniform_(-0.5, 0.5)
    with pytest.raises(ValueError, match="fuse_stem: the stem has an unfolded bn1"):
        optimize_model(copy.deepcopy(model), OptimizeSpec(fuse_stem=True))
    fold_batchnorm(model)
    fused = copy.deepcopy(model)
    assert optimize_model(fused, OptimizeSpec(stem, fuse_stem=True))["fused_stem"] == 1
    assert fused.backbone.conv1.weight is fused.backbone.conv1.conv.weight
    img = _inputs()[0]
    with torch.no_grad():
        _assert_same(fused(img), model(img), atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@needs_gpu
def test_branched_graph_variant_matches_the_whole_region_on_gpu() -> None:
    """The branched forward's streams inside one CUDA graph: the same outputs as the one-region
    variant (bf16 on both sides, so only rounding order differs), stable over replays and head
    switches; with LiDAR (its own stream, forked before the trunk)."""
    model = tiny_model(backbone_depth=50)
    img, pts, T, K = _inputs()
    kw = dict(image_hw=HW, cameras=2, device="cuda", lidar_points=256, heads=SETS)
    ref = PerceptionRuntime(model, "eager_fp32", **kw)
    whole = PerceptionRuntime(model, "whole_bf16w_fold_s2d_group_cudnn_graph", **kw)
    for r in (ref, whole):
        r.set_geometry(T, K)
    want = {hs: {k: [t.clone() for t in v] if isinstance(v, list) else v.clone()
                 for k, v in whole.run(img, pts, heads=hs).items()} for hs in map(frozenset, SETS)}
    ref_out = ref.run(img, pts)
    for name in ("branch_bf16w_fold_s2d_group_cudnn_stem_graph",
                 "branchp_bf16w_fold_s2d_group_cudnn_graph",
                 "branch_bf16w_fold_s2d4_group_cudnn_stem_graph"):
        rt = PerceptionRuntime(model, name, **kw)
        rt.set_geometry(T, K)
        for _ in range(2):
            for hs in map(frozenset, SETS):
                _assert_same(rt.run(img, pts, heads=hs), want[hs], atol=0.05, rtol=0.05)
        rep = compare_outputs(ref_out, rt.run(img, pts), HW, class_offset=1)
        assert rep.seg_max_abs < 0.2 and rep.depth_max_abs < 0.2


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("stem", ["s2d", "s2d4"])
def test_fused_stem_matches_unfused_on_gpu(stem: str) -> None:
    """torch.cudnn_convolution_relu for the s2d / s2d4 stem vs the same folded stem unfused."""
    torch.backends.cudnn.allow_tf32 = False
    model = tiny_model(backbone_depth=50)
    fold_batchnorm(model)
    optimize_model(model, OptimizeSpec(stem, 8))
    model = model.to("cuda").to(memory_format=torch.channels_last)
    fused = copy.deepcopy(model)
    optimize_model(fused, OptimizeSpec(fuse_stem=True))
    x = torch.randn(2, 3, 64, 96, device="cuda").to(memory_format=torch.channels_last)
    with torch.no_grad():
        for a, b in zip(fused.backbone(x), model.backbone(x), strict=True):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
