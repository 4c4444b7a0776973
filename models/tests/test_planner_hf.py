"""HF VLM loading from a local directory (tiny LLaVA config built here; nothing downloaded)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed")

from kestrel_models.planner.hf import HFVisionLanguageModel, parse_dtype  # noqa: E402
from tiny_llava import save_tiny_llava  # noqa: E402

torch.set_num_threads(1)
EOS = 257


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llava(tmp_path_factory.mktemp("llava_tiny"))


def _image(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (3, 48, 40), dtype=torch.uint8, generator=g)


@pytest.mark.slow
def test_loads_and_matches_hf_generate(model_dir: Path) -> None:
    vlm = HFVisionLanguageModel(model_dir)
    assert vlm.num_image_tokens == 16 and vlm.image_size == 32
    prompts = [[1, 2, 3, 4], [7, 8]]
    imgs = [_image(0), None]
    res = vlm.generate(prompts, EOS, 12, images=imgs)
    for i, (p, im) in enumerate(zip(prompts, imgs, strict=True)):
        kw = {} if im is None else {"pixel_values": vlm.pixel_values(im)}
        ids = vlm.input_ids(p, im is not None)
        ref = vlm.model.generate(input_ids=ids, max_new_tokens=12, do_sample=False,
                                 pad_token_id=0, eos_token_id=EOS, **kw)[0, ids.shape[1]:]
        ref = ref.tolist()
        if EOS in ref:
            ref = ref[:ref.index(EOS)]
        assert res.tokens[i] == ref
    assert len(set(res.tokens[0])) > 3


@pytest.mark.slow
def test_processor_stream_and_cancel(model_dir: Path) -> None:
    vlm = HFVisionLanguageModel(model_dir)
    allowed = [10, 11, 12]

    def only(prefix: list[int], logits: torch.Tensor) -> torch.Tensor:
        out = torch.full_like(logits, float("-inf"))
        out[allowed] = logits[allowed]
        return out

    seen: list[tuple[int, int]] = []
    res = vlm.generate([[1, 2, 3]], EOS, 6, images=[_image(1)], logits_processor=only,
                       on_token=lambda r, t: seen.append((r, t)))
    assert set(res.tokens[0]) <= set(allowed) and len(res.tokens[0]) == 6
    assert seen == [(0, t) for t in res.tokens[0]] and res.stop_reasons == ["max_new_tokens"]
    res = vlm.generate([[1, 2, 3]], EOS, 6, should_stop=lambda: len(seen) >= 8,
                       on_token=lambda r, t: seen.append((r, t)))
    assert res.stop_reasons == ["cancelled"] and len(res.tokens[0]) == 2


def test_bad_directory_and_image(tmp_path: Path, model_dir: Path) -> None:
    with pytest.raises(ValueError, match="parameter 'hf.model_path'"):
        HFVisionLanguageModel(tmp_path / "nothing_here")
    with pytest.raises(ValueError, match="image must be uint8"):
        HFVisionLanguageModel(model_dir).pixel_values(torch.zeros(3, 8, 8))


def test_dtype_and_sizes(model_dir: Path) -> None:
    assert parse_dtype("auto") is None and parse_dtype("bfloat16") is torch.bfloat16
    with pytest.raises(ValueError, match="parameter 'hf.dtype' = 'fp8'"):
        parse_dtype("fp8")
    vlm = HFVisionLanguageModel(model_dir, dtype=torch.bfloat16)
    assert next(vlm.model.parameters()).dtype is torch.bfloat16
    assert vlm.pixel_values(_image()).dtype is torch.bfloat16
    assert (vlm.vocab_size, vlm.max_positions) == (260, 256)
    res = vlm.generate([[1, 2, 3]], EOS, 4, images=[_image(2)])
    assert len(res.tokens[0]) == 4 or res.stop_reasons == ["eos"]
