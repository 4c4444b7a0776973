"""The static-shape Qwen2-VL / Qwen2.5-VL vision tower (hf_engine/qwen_vision.py): the same
features as transformers' own forward (tiny random checkpoints, CPU, float32) for equal and
unequal windows and several images at once; the decoder uses it (its prefill becomes
graphable) only when it matches, and falls back to transformers' tower otherwise."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed")

from kestrel_models.planner.hf_engine import from_model  # noqa: E402
from kestrel_models.planner.hf_engine import qwen_vision  # noqa: E402
from kestrel_models.planner.hf_engine.common import features_of  # noqa: E402
from kestrel_models.planner.hf_engine.qwen_vision import QwenVision, window_order  # noqa: E402
from tiny_hf_vlm import build  # noqa: E402

QWEN = ("qwen2_vl", "qwen2_5_vl")


def _reference(hf: torch.nn.Module, pv: torch.Tensor, n: int, gh: int, gw: int
               ) -> torch.Tensor:
    thw = torch.tensor([[1, gh, gw]] * n)
    with torch.inference_mode():
        return features_of(hf.model.get_image_features(pixel_values=pv, image_grid_thw=thw), n)


@pytest.mark.parametrize("family", QWEN)
@pytest.mark.parametrize("n,gh,gw", [(1, 4, 6), (1, 8, 8), (2, 4, 6), (3, 6, 10)])
def test_features_equal_transformers(family: str, n: int, gh: int, gw: int) -> None:
    """Grids in patches: 4x6 -> 2x3 merged units, windows of 2x2 units: unequal windows (the
    mask); 8x8: four equal windows (batched rows); 6x10: both directions padded."""
    hf = build(family)
    vis = QwenVision(hf.model.visual, hf.config.vision_config)
    g = torch.Generator().manual_seed(n * 100 + gh)
    pv = torch.randn(n * gh * gw, 3 * 2 * 14 * 14, generator=g)
    with torch.inference_mode():
        got = vis(pv, n, gh, gw)
    want = _reference(hf, pv, n, gh, gw)
    assert got.shape == want.shape == (n, gh * gw // 4, hf.config.text_config.hidden_size)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_window_order_covers_every_unit_once() -> None:
    order, sizes = window_order(3, 5, 2)  # windows of 2x2 units over a 3x5 merged grid
    assert sorted(order.tolist()) == list(range(15))
    assert sizes == [4, 4, 2, 2, 2, 1]
    assert order[:4].tolist() == [0, 1, 5, 6]  # the first window: rows 0-1, columns 0-1


@pytest.mark.parametrize("family", QWEN)
def test_decoder_uses_the_static_tower_and_its_prefill_is_graphable(family: str) -> None:
    hf = build(family)
    dec = from_model(hf, None, "cpu", None, consume=False)
    assert dec.graphable_prefill and "static shapes" in dec.describe()
    img = torch.randint(0, 256, (2, 3, 56, 84), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(3))
    dec.prepare_image(tuple(img.shape[1:]))
    pv, thw = dec.pixel_inputs(img)
    want = _reference(hf, pv, 2, int(thw[0, 1]), int(thw[0, 2]))
    torch.testing.assert_close(dec.embed_image(img), want, rtol=1e-4, atol=1e-4)


def test_a_tower_that_differs_falls_back_to_transformers(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """A transformers release whose tower computes something else: the load check sees it,
    the decoder runs transformers' eager tower (not graphable) and says why."""
    real = qwen_vision.QwenVision.__call__
    monkeypatch.setattr(qwen_vision.QwenVision, "__call__",
                        lambda self, *a: real(self, *a) * 1.01)
    hf = build("qwen2_5_vl")
    dec = from_model(hf, None, "cpu", None, consume=False)
    assert not dec.graphable_prefill
    assert "transformers' (eager" in dec.describe() and "relative error" in dec.describe()
    img = torch.randint(0, 256, (1, 3, 56, 84), dtype=torch.uint8)
    pv, thw = dec.pixel_inputs(img)
    want = _reference(hf, pv, 1, int(thw[0, 1]), int(thw[0, 2]))
    torch.testing.assert_close(dec.embed_image(img), want)


@pytest.mark.parametrize("family", ("idefics3", "smolvlm"))
def test_idefics3_static_tower_equals_transformers(family: str) -> None:
    """Idefics3 / SmolVLM: the static-shape tower (full image: positions 0..P-1, no mask)
    gives transformers' features; the decoder's prefill is graphable."""
    from tiny_hf_vlm import tokenizer
    hf = build(family)
    dec = from_model(hf, None, "cpu", tokenizer(family), consume=False)
    assert dec.graphable_prefill and "static shapes" in dec.describe()
    img = torch.randint(0, 256, (2, 3, 40, 48), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        torch.testing.assert_close(dec._features_static(img), dec._features_hf(img),
                                   rtol=1e-4, atol=1e-4)
