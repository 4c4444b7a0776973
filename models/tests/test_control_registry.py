"""The backend registry: what it lists, that it imports nothing heavy, how it refuses names."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kestrel_models.control.registry import (AUTO, BACKENDS, CUDA_BACKENDS, POST_BACKENDS,
                                             REGISTRY, auto_candidates, backend_info,
                                             create_backend, cuda_available)


def test_registry_lists_the_backends_a_user_picks() -> None:
    assert BACKENDS == ("cpu_eager", "onnxruntime", "cuda_eager", "cuda_graph",
                        "cuda_graph_triton", "cuda_persistent", "tensorrt")
    assert set(CUDA_BACKENDS) == set(BACKENDS) - {"cpu_eager", "onnxruntime"}
    assert POST_BACKENDS == ("cuda_graph_triton", "cuda_persistent")
    for name, info in REGISTRY.items():
        assert info.name == name and info.when and "\n" not in info.when
        assert info.device in ("cpu", "cuda")
        assert ":" in info.factory and (not info.check or ":" in info.check)


def test_every_factory_and_check_resolves() -> None:
    import importlib

    for info in REGISTRY.values():
        for target in filter(None, (info.factory, info.check)):
            module, _, attr = target.partition(":")
            assert callable(getattr(importlib.import_module(module), attr)), target


def test_importing_the_registry_imports_no_backend_package() -> None:
    code = ("import sys; import kestrel_models.control.registry as r; "
            "heavy = [m for m in ('torch', 'triton', 'onnxruntime', 'tensorrt', "
            "'kestrel_models.control.runtimes', 'kestrel_models.control.triton_step', "
            "'kestrel_models.control.persistent_step', 'kestrel_models.control.trt_backend') "
            "if m in sys.modules]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout.strip()
    assert out == "[]", out


@pytest.mark.parametrize("name", ["cpu_int8", "cuda_graph_compiled", "gpu", ""])
def test_unknown_name_fails_naming_backend_and_the_choices(name: str) -> None:
    with pytest.raises(ValueError) as err:
        backend_info(name)
    text = str(err.value)
    assert text.startswith(f"parameter 'backend' = {name!r}: must be one of auto, ")
    assert all(b in text for b in BACKENDS)
    with pytest.raises(ValueError, match="parameter 'backend'"):
        create_backend(name, policy=None)


def _policy(kind: str):
    from kestrel_models.control.policy import PolicyConfig, build_policy
    from kestrel_models.control.runtimes import StepPolicy, policy_from_actor_critic

    if kind == "reference":
        model = build_policy(PolicyConfig.tiny(obs_dim=16, num_actions=4))
        policy = policy_from_actor_critic(model)
        policy.extra["model"] = model
        return policy
    if kind == "onnx_file":
        return StepPolicy(obs_dim=16, num_actions=4, onnx_path="/x/policy.onnx", source="ONNX")
    module = torch_linear()
    extra = {"reset": lambda: None, "max_batch": 1} if kind == "own_state" else {}
    return StepPolicy(obs_dim=16, num_actions=4, module=module, source="TorchScript",
                      extra=extra)


def torch_linear():
    import torch

    return torch.nn.Linear(16, 4)


@pytest.mark.parametrize(("kind", "cuda", "expected"), [
    ("reference", False, ("onnxruntime", "cpu_eager")),
    ("reference", True, ("cuda_graph_triton", "cuda_graph", "onnxruntime", "cpu_eager")),
    ("torchscript", True, ("cuda_graph", "onnxruntime", "cpu_eager")),
    ("own_state", False, ("cpu_eager",)),  # an ONNX export would freeze its state
    ("own_state", True, ("cuda_graph", "cpu_eager")),
    ("onnx_file", False, ("onnxruntime",)),
    ("onnx_file", True, ("tensorrt", "onnxruntime")),
])
def test_auto_tries_the_measured_best_that_fits_first(kind, cuda, expected) -> None:
    assert auto_candidates(_policy(kind), cuda=cuda) == expected


def test_auto_builds_the_first_that_runs(tmp_path) -> None:
    backend = create_backend(AUTO, _policy("reference"), 1, cache_dir=str(tmp_path))
    expected = "cuda_graph_triton" if cuda_available() else "onnxruntime"
    assert backend.name in (expected, "cuda_graph")
    backend.close()
