"""optimize.py: output-preserving configure-time transforms (fp32 on the tiny config, CPU)."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_perception import tiny_model

from kestrel_models.perception.conv_act import (
    FusedBasicBlock,
    FusedBottleneck,
    fuse_residual_blocks,
)
from kestrel_models.perception.optimize import (
    ChannelPadConv2d,
    MergedFCOSHead,
    OptimizeSpec,
    SlicedConv2d,
    SpaceToDepth4Conv2d,
    SpaceToDepthConv2d,
    optimize_model,
    pad_conv_outputs,
)
from kestrel_models.perception.runtime import (
    VARIANTS,
    PerceptionRuntime,
    VariantSpec,
    fold_batchnorm,
)

HW = (64, 96)


def _model(**kw: object) -> torch.nn.Module:
    """Tiny model with non-trivial GroupNorm affine parameters (a merge that mixed up the
    halves' parameters would show)."""
    m = tiny_model(**kw)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for mod in m.modules():
            if isinstance(mod, torch.nn.GroupNorm):
                mod.weight.uniform_(0.5, 1.5, generator=g)
                mod.bias.normal_(0.0, 0.1, generator=g)
    return m


def _images(n: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 256, (n, 3, *HW), dtype=torch.uint8, generator=g)


def _assert_same(out: dict, ref: dict) -> None:
    assert out.keys() == ref.keys()
    for k, r in ref.items():
        pairs = zip(out[k], r, strict=True) if isinstance(r, list) else [(out[k], r)]
        for a, b in pairs:
            assert a.shape == b.shape, k
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=k)


SPECS = [OptimizeSpec("pad4"), OptimizeSpec("pad8"), OptimizeSpec("s2d"),
         OptimizeSpec(pad_outputs=8), OptimizeSpec(fcos="merged"), OptimizeSpec(fcos="grouped"),
         OptimizeSpec("s2d", 8, "grouped"), OptimizeSpec("s2d4"),
         OptimizeSpec("s2d4", 8, "grouped")]


@pytest.mark.parametrize("spec", SPECS,
                         ids=lambda s: f"{s.stem}-{s.pad_outputs}-{s.fcos}")
def test_each_transform_keeps_fp32_outputs_and_the_users_state_dict(spec: OptimizeSpec) -> None:
    model = _model(head_convs=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    img = _images()
    with torch.no_grad():
        ref = model(img)
        work = copy.deepcopy(model)
        done = optimize_model(work, spec)
        out = work(img)
    _assert_same(out, ref)
    assert done["stem"] == (spec.stem != "plain")
    assert done["fcos_merged"] == (spec.fcos != "plain")
    after = model.state_dict()  # the user's model: same keys, shapes and values
    assert after.keys() == before.keys()
    for k, v in before.items():
        assert torch.equal(after[k], v), k
    # and its state dict still loads into a fresh reference model
    _model(head_convs=2).load_state_dict(after)


def test_modules_are_replaced_as_described() -> None:
    model = _model(head_convs=3)
    optimize_model(model, OptimizeSpec("pad8", 8, "grouped"))
    stem = model.backbone.conv1
    assert isinstance(stem, ChannelPadConv2d) and stem.weight.shape[1] == 8
    assert torch.count_nonzero(stem.weight[:, 3:]) == 0  # zero weights on the pad channels
    head = model.det_head
    assert isinstance(head, MergedFCOSHead) and head.grouped
    c = head.channels
    assert head.first[0].out_channels == 2 * c and head.first[1].num_groups == 64
    assert all(layer[0].groups == 2 for layer in head.tower) and len(head.tower) == 2
    # class + box + ctr = 6 + 5 = 11 filters, padded to 16
    assert isinstance(head.pred, SlicedConv2d) and head.pred.out_channels == 16
    assert head.pred.real_out == 11
    # the seg (7) and depth (1) predictions were padded to 8
    assert model.seg_head.pred.out_channels == 8 and model.depth_head.pred.out_channels == 8
    s2d = _model()
    optimize_model(s2d, OptimizeSpec("s2d"))
    conv = s2d.backbone.conv1
    assert isinstance(conv, SpaceToDepthConv2d) and conv.kernel_size == (4, 4)
    assert conv.stride == (1, 1) and conv.in_channels == 16


def test_merged_head_without_towers_and_odd_input_sizes() -> None:
    """head_convs=0 (one merged prediction conv); an odd image size through the s2d stem."""
    model = _model(head_convs=0)
    img = torch.randint(0, 256, (1, 3, 45, 77), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = model(img)
        optimize_model(model, OptimizeSpec("s2d", 8, "grouped"))
        _assert_same(model(img), ref)
    conv = torch.nn.Conv2d(5, 9, 7, stride=2, padding=3)
    stem = SpaceToDepthConv2d.from_conv(conv)
    x = torch.randn(2, 5, 33, 18)
    with torch.no_grad():
        torch.testing.assert_close(stem(x), conv(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("cin", "cout", "k", "pad", "hw"), [
    (3, 64, 7, 3, (64, 96)), (5, 9, 7, 3, (33, 18)), (3, 8, 3, 1, (45, 77)),
    (2, 4, 5, 2, (20, 21))])
def test_space_to_depth4_stem_is_exact(cin: int, cout: int, k: int, pad: int,
                                       hw: tuple[int, int]) -> None:
    """The s2d(4) stem equals the stride-2 conv in fp64 for stem-like and odd shapes (odd
    output sizes: the extra sub-pixels are cut off); the ResNet stem becomes a 3x3 conv with
    4x the filters over 48 channels."""
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(cin, cout, k, stride=2, padding=pad).double()
    stem = SpaceToDepth4Conv2d.from_conv(conv)
    x = torch.randn(2, cin, *hw, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(stem(x), conv(x), rtol=1e-12, atol=1e-12)
    if k == 7:
        assert stem.kernel_size == (3, 3) and stem.out_channels == 4 * cout
        assert stem.in_channels == -(-16 * cin // 8) * 8


@pytest.mark.slow
def test_space_to_depth4_stem_fused_keeps_the_backbone_outputs() -> None:
    """s2d4 + fuse_stem (unfused ops on the CPU: the same arithmetic as the GPU's fused
    call) keeps the backbone's outputs."""
    from kestrel_models.perception.conv_act import FusedStem

    model = _model(backbone_depth=50)
    fold_batchnorm(model)
    x = torch.randn(2, 3, *HW)
    with torch.no_grad():
        ref = model.backbone(x)
        done = optimize_model(model, OptimizeSpec("s2d4", 8, fuse_stem=True))
        out = model.backbone(x)
    for a, b in zip(out, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert isinstance(model.backbone.conv1, FusedStem)
    assert isinstance(model.backbone.conv1.conv, SpaceToDepth4Conv2d)
    assert done["stem"] == 1 and done["fused_stem"] == 1
    with pytest.raises(ValueError, match="'stem' = 's2d8'"):
        OptimizeSpec("s2d8")


def test_pad_conv_outputs_counts_and_slices() -> None:
    seq = torch.nn.Sequential(torch.nn.Conv2d(4, 6, 3, padding=1), torch.nn.ReLU(),
                              torch.nn.Conv2d(6, 16, 1), torch.nn.Conv2d(16, 3, 1))
    x = torch.randn(1, 4, 8, 8)
    with torch.no_grad():
        ref = seq(x)
        assert pad_conv_outputs(seq, 8) == 2  # the 6- and 3-filter convs, not the 16
        torch.testing.assert_close(seq(x), ref, rtol=1e-5, atol=1e-5)
    assert seq[0].out_channels == 8 and seq[3].out_channels == 8


def test_runtime_variants_apply_the_transforms_on_their_copy() -> None:
    model = _model()
    img = _images()
    ref = PerceptionRuntime(model, "eager_fp32", HW, cameras=2).run(img)
    spec = VariantSpec(fold_bn=True, channels_last=True,
                       optimize=OptimizeSpec("s2d", 8, "grouped"))
    rt = PerceptionRuntime(model, spec, HW, cameras=2)
    assert rt.optimized == {"stem": 1, "fcos_merged": 1, "padded_convs": 3, "fused_blocks": 0,
                            "fused_stem": 0}
    _assert_same(rt.run(img), ref)
    assert type(model.backbone.conv1) is torch.nn.Conv2d  # the user's model is untouched
    for name in ("whole_bf16w_fold_pad_group_graph", "whole_bf16w_fold_s2d_group_graph",
                 "compile_bf16w_fold_pad_merge_graph"):
        assert VARIANTS[name].optimize.active and VARIANTS[name].fold_bn


@pytest.mark.slow
def test_whole_region_traces_in_one_graph() -> None:
    """fullgraph=True (no graph break) through the transformed modules ('eager' backend)."""
    model = _model()
    img = _images()
    ref = PerceptionRuntime(model, "eager_fp32", HW, cameras=2).run(img)
    spec = VariantSpec(fold_bn=True, channels_last=True, whole_compile="default",
                       backend="eager", optimize=OptimizeSpec("s2d", 8, "grouped"))
    _assert_same(PerceptionRuntime(model, spec, HW, cameras=2).run(img), ref)


def test_bad_spec_values_are_named() -> None:
    with pytest.raises(ValueError, match="parameter 'stem' = 'pad3'"):
        OptimizeSpec("pad3")
    with pytest.raises(ValueError, match="parameter 'pad_outputs' = -1"):
        OptimizeSpec(pad_outputs=-1)
    with pytest.raises(ValueError, match="parameter 'fcos' = 'fused'"):
        OptimizeSpec(fcos="fused")
    with pytest.raises(ValueError, match="parameter 'conv_act' = 'tensorrt'"):
        OptimizeSpec(conv_act="tensorrt")
    with pytest.raises(ValueError, match="stride-2"):
        SpaceToDepthConv2d.from_conv(torch.nn.Conv2d(3, 8, 3, padding=1))


@pytest.mark.parametrize("depth", [18, 50])
def test_conv_act_cudnn_blocks_are_exact_off_cuda(depth: int) -> None:
    """The fused blocks (conv_act 'cudnn') run the unfused ops off CUDA: same fp32 outputs as
    the folded model; every residual block replaced, none left with a BatchNorm."""
    model = _model(backbone_depth=depth)
    fold_batchnorm(model)
    # non-trivial folded biases (a fused block that dropped a bias would show)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for mod in model.backbone.modules():
            if isinstance(mod, torch.nn.Conv2d) and mod.bias is not None:
                mod.bias.normal_(0.0, 0.2, generator=g)
    img = _images()
    with torch.no_grad():
        ref = model(img)
        done = optimize_model(model, OptimizeSpec("s2d", 8, "grouped", conv_act="cudnn"))
        out = model(img)
    _assert_same(out, ref)
    blocks = [m for m in model.backbone.modules()
              if isinstance(m, (FusedBottleneck, FusedBasicBlock))]
    assert done["fused_blocks"] == len(blocks) == (8 if depth == 18 else 16)
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in model.backbone.modules())


def test_conv_act_cudnn_needs_folded_batchnorm() -> None:
    with pytest.raises(ValueError, match=r"block layer1\.0 has an unfolded bn1"):
        fuse_residual_blocks(_model().backbone)
    rt_spec = VariantSpec(optimize=OptimizeSpec(conv_act="cudnn"))  # fold_bn off
    with pytest.raises(ValueError, match="fold the BatchNorms first"):
        PerceptionRuntime(_model(), rt_spec, HW, cameras=2)


@pytest.mark.slow
def test_conv_act_variant_traces_in_one_graph() -> None:
    """The whole region, conv_act 'cudnn' included, under fullgraph=True ('eager' backend)."""
    model = _model()
    img = _images()
    ref = PerceptionRuntime(model, "eager_fp32", HW, cameras=2).run(img)
    spec = VariantSpec(fold_bn=True, channels_last=True, whole_compile="default",
                       backend="eager", optimize=VARIANTS[
                           "whole_bf16w_fold_s2d_group_cudnn_graph"].optimize)
    rt = PerceptionRuntime(model, spec, HW, cameras=2)
    assert rt.optimized["fused_blocks"] == 8
    _assert_same(rt.run(img), ref)
