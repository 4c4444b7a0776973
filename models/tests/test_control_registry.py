"""The backend registry: what it lists, that it imports nothing heavy, how it refuses names."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kestrel_models.control.registry import (BACKENDS, CUDA_BACKENDS, POST_BACKENDS, REGISTRY,
                                             backend_info, create_backend)


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
    assert text.startswith(f"parameter 'backend' = {name!r}: must be one of ")
    assert all(b in text for b in BACKENDS)
    with pytest.raises(ValueError, match="parameter 'backend'"):
        create_backend(name, policy=None)
