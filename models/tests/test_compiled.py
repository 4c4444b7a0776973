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


def test_memoised_and_equal_to_the_plain_function() -> None:
    f = comp.compiled(_affine)
    assert comp.compiled(_affine) is f  # one Dynamo cache per function
    x = torch.randn(64)
    torch.testing.assert_close(f(x, 2.0), _affine(x, 2.0))
    assert comp.enabled() and comp.errors == []


def test_a_failure_is_recorded_and_plain_torch_runs_from_then_on(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def broken_compile(fn):
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
