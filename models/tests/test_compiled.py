"""compiled.py: memoised torch.compile with a permanent, recorded fallback to plain torch."""

from __future__ import annotations

import pytest
import torch
from kestrel_models.perception import compiled as comp


@pytest.fixture(autouse=True)
def _fresh_state(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(comp, "_CACHE", {})
    monkeypatch.setattr(comp, "errors", [])


def _affine(x: torch.Tensor, a: float) -> torch.Tensor:
    return torch.sigmoid(x) * a + 1.0


@pytest.mark.slow
def test_memoised_and_equal_to_the_plain_function() -> None:
    f = comp.compiled(_affine)
    assert comp.compiled(_affine) is f  # one Dynamo cache per function
    assert comp.compiled(_affine, on=False) is _affine  # switched off: the plain function
    x = torch.randn(64)
    torch.testing.assert_close(f(x, 2.0), _affine(x, 2.0))
    assert comp.enabled() and comp.errors == []


def test_a_failure_is_recorded_and_plain_torch_runs_from_then_on(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def broken_compile(fn, **kw):
        def run(*a, **k):
            calls.append(1)
            raise RuntimeError("inductor exploded")
        return run

    monkeypatch.setattr(torch, "compile", broken_compile)
    f = comp.compiled(_affine)
    x = torch.randn(8)
    torch.testing.assert_close(f(x, 3.0), _affine(x, 3.0))  # the frame is not lost
    assert not comp.enabled() and "inductor exploded" in comp.errors[0]
    assert "_affine" in comp.errors[0]
    torch.testing.assert_close(f(x, 3.0), _affine(x, 3.0))
    assert len(calls) == 1  # the compiled path is not retried
    assert comp.compiled(_affine) is _affine  # new lookups get the plain function


def test_a_failure_to_create_the_compiled_function_falls_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def unsupported(fn, **kw):  # torch.compile itself raises (e.g. Dynamo unsupported)
        raise RuntimeError("Dynamo is not supported on this Python")

    monkeypatch.setattr(torch, "compile", unsupported)
    f = comp.compiled(_affine)  # creating the wrapper never raises
    x = torch.randn(8)
    torch.testing.assert_close(f(x, 2.0), _affine(x, 2.0))
    assert "not supported" in comp.errors[0]


@pytest.mark.slow
def test_an_error_of_the_plain_function_too_propagates_and_compile_stays_on() -> None:
    """Bad input (here a shape mismatch) is not a compile problem: it raises as the plain
    function would, nothing is recorded, the next good call runs compiled."""
    f = comp.compiled(_add)
    with pytest.raises(RuntimeError):
        f(torch.randn(3), torch.randn(4))
    assert comp.enabled() and comp.errors == []
    torch.testing.assert_close(f(torch.ones(3), torch.ones(3)), torch.full((3,), 2.0))
    assert comp.enabled()


def _add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a + b
