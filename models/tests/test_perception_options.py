"""Runtime options -> VariantSpec: every combination resolves or fails naming one option."""

from __future__ import annotations

import itertools

import pytest
import torch
from tiny_perception import tiny_model

from kestrel_models.perception.options import (COMPILES, ENGINES, OPTIMIZE, PRECISIONS, SWITCH,
                                               OptionError, resolve_options)
from kestrel_models.perception.runtime import VARIANTS, PerceptionRuntime, VariantSpec

DEVICES = ("cpu", "cuda")
USER_FORMATS = (None, "torchscript", "exported_program", "onnx")
OPTION_NAMES = ("engine", "precision", "compile", "cuda_graph", "optimize")


def _combinations():
    return itertools.product(DEVICES, USER_FORMATS, ENGINES, PRECISIONS, COMPILES, SWITCH,
                             SWITCH)


def test_every_combination_resolves_to_a_consistent_spec_or_names_an_explicit_option() -> None:
    resolved = failed = 0
    for device, user, engine, precision, comp, graph, opt in _combinations():
        given = dict(engine=engine, precision=precision, compile=comp, cuda_graph=graph,
                     optimize=opt)
        try:
            r = resolve_options(device, **given, user_format=user, prefix="runtime.")
        except OptionError as exc:
            failed += 1
            name = exc.name.removeprefix("runtime.")
            # only a value the user gave can be wrong: every 'auto' resolves to what fits
            assert exc.name.startswith("runtime.") and name in OPTION_NAMES, exc
            assert given[name] != "auto" and exc.value == given[name], exc
            assert f"parameter '{exc.name}' = {given[name]!r}: " in str(exc)
            continue
        resolved += 1
        got = dict(engine=r.engine, precision=r.precision, compile=r.compile,
                   cuda_graph=r.cuda_graph, optimize=r.optimize)
        for k, v in given.items():  # explicit values are kept, 'auto' is resolved
            assert got[k] != "auto" and (v == "auto" or got[k] == v), (given, got)
        cuda = device == "cuda"
        assert cuda or not r.cuda_graph
        spec = r.spec
        if user is not None or (r.engine == "torch" and r.precision == "fp32" and
                                r.compile == "off" and not r.cuda_graph and not r.optimize):
            assert spec is None, (given, user, r)  # the plain model runs the forward
            continue
        assert isinstance(spec, VariantSpec)
        if r.engine == "tensorrt":
            assert spec == VARIANTS[f"tensorrt_{r.precision}"] and cuda
        elif r.engine == "onnxruntime":
            assert spec == VARIANTS["onnxruntime"] and r.precision == "fp32"
        else:
            assert spec.precision == r.precision and spec.cuda_graph == r.cuda_graph
            assert spec.fold_bn == r.optimize and spec.optimize.active == r.optimize
            assert (spec.whole_compile is not None) == (r.compile != "off")
            assert (spec.branches is not None) == (r.compile == "branched")
            assert spec.channels_last and spec.cast_weights == (cuda and r.precision != "fp32")
    assert resolved > 100 and failed > 100  # both kinds are exercised


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("user", USER_FORMATS)
def test_auto_always_resolves(device: str, user: str | None) -> None:
    r = resolve_options(device, user_format=user)
    assert r.engine == ("onnxruntime" if user == "onnx" else "torch")


def test_auto_picks_the_measured_best_per_device() -> None:
    gpu = resolve_options("cuda")
    assert gpu.spec == VARIANTS["branch_bf16w_fold_s2d4_group_cudnn_stem_graph"]
    assert gpu.describe() == "torch bf16, compile branched, cuda_graph on, optimize on"
    assert resolve_options("cuda:1").spec == gpu.spec
    cpu = resolve_options("cpu")  # the plain fp32 channels_last model: no runtime
    assert (cpu.precision, cpu.compile, cpu.cuda_graph, cpu.optimize, cpu.spec) == \
        ("fp32", "off", False, False, None)
    assert resolve_options("cuda", engine="tensorrt").spec == VARIANTS["tensorrt_fp16"]
    assert resolve_options("cpu", engine="onnxruntime").spec == VARIANTS["onnxruntime"]


def test_single_options_map_to_the_benchmarked_specs() -> None:
    assert resolve_options("cpu", precision="bf16").spec == VARIANTS["eager_bf16_cl"]
    assert resolve_options("cuda", compile="whole", optimize=False).spec == \
        VARIANTS["whole_bf16w_graph"]
    assert resolve_options("cuda", compile="off", optimize=False).spec == \
        VARIANTS["eager_bf16w_graph"]
    assert resolve_options("cuda", precision="fp32", compile="off", cuda_graph=False,
                           optimize=False).spec is None
    opt = resolve_options("cpu", optimize=True).spec
    assert opt is not None and opt.fold_bn and opt.optimize == OPTIMIZE


@pytest.mark.parametrize("kwargs,name,fragment", [
    (dict(device="cpu", cuda_graph=True), "runtime.cuda_graph", "need device 'cuda'"),
    (dict(device="cpu", engine="tensorrt"), "runtime.engine", "needs device 'cuda'"),
    (dict(device="cuda", engine="tensorrt", compile="whole"), "runtime.compile", "use 'off'"),
    (dict(device="cuda", engine="tensorrt", cuda_graph=True), "runtime.cuda_graph",
     "use false"),
    (dict(device="cuda", engine="onnxruntime", precision="bf16"), "runtime.precision",
     "fp32"),
    (dict(device="cuda", precision="int8"), "runtime.precision", "tensorrt engine only"),
    (dict(device="cpu", precision="fp16"), "runtime.precision", "use bf16 on the CPU"),
    (dict(device="cuda", user_format="onnx", engine="torch"), "runtime.engine",
     "runs in onnxruntime"),
    (dict(device="cuda", user_format="torchscript", optimize=True), "runtime.optimize",
     "runs as exported"),
    (dict(device="cuda", precision="bf32"), "runtime.precision", "must be one of"),
    (dict(device="cuda", cuda_graph="true"), "runtime.cuda_graph", "must be one of"),
    (dict(device="tpu"), "runtime.device", "'cpu' or 'cuda'"),
])
def test_incompatible_options_fail_naming_the_option(kwargs, name, fragment) -> None:
    with pytest.raises(OptionError, match=fragment) as exc:
        resolve_options(**kwargs, prefix="runtime.")
    assert exc.value.name == name and f"parameter '{name}'" in str(exc.value)


@pytest.mark.slow
def test_onnxruntime_engine_runs_the_exported_reference_forward() -> None:
    """engine onnxruntime: the fp32 forward exported at configure, same outputs as torch."""
    pytest.importorskip("onnxruntime")
    model = tiny_model()
    hw = (64, 96)
    img = torch.randint(0, 256, (2, 3, *hw), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = model(img)
    rt = PerceptionRuntime(model, resolve_options("cpu", engine="onnxruntime").spec, hw,
                           cameras=2, heads=[{"detection", "segmentation", "depth"}, {"depth"}])
    out = rt.run(img)
    torch.testing.assert_close(out["seg"], ref["seg"], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out["depth"], ref["depth"], atol=1e-4, rtol=1e-4)
    for a, b in zip(out["det_cls"], ref["det_cls"], strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert set(rt.run(img, heads={"depth"})) == {"depth"}
