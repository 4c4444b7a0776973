"""Hugging Face checkpoints on the decode engine (hf_engine/): tiny random checkpoints of every
family built here with transformers (tests/tiny_hf_vlm.py, nothing downloaded). Greedy tokens
equal transformers' generate() for 64 tokens with an image (CPU, float32), under continuous
batching; the decoder's weights are held once; load failures name the parameter and cause."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed")

from kestrel_models.planner.engine import DecodeEngine  # noqa: E402
from kestrel_models.planner.hf import HFVisionLanguageModel  # noqa: E402
from kestrel_models.planner.hf_engine import (HFLoadError, Unsupported, load,  # noqa: E402
                                              supported_text)
from kestrel_models.planner.hf_engine.common import load_hf_model  # noqa: E402
from kestrel_models.planner.hf_engine.runner import EngineRunner, open_hf  # noqa: E402
from tiny_hf_vlm import EOS, FAMILIES, IMAGE_TOKEN, build, save_tiny  # noqa: E402

NEW = 64


def _image(seed: int, family: str) -> torch.Tensor:
    shape = (3, 56, 84) if family.startswith("qwen") else (3, 40, 48)  # Qwen: a 2 x 3 grid
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)


def reference(ref: torch.nn.Module, dec, prompt: list[int], image: torch.Tensor | None,
              n: int) -> list[int]:
    """transformers' greedy generate() of the same request (no <eos>: exactly n tokens)."""
    return reference_logits(ref, dec, prompt, image, n)[0]


def reference_logits(ref: torch.nn.Module, dec, prompt: list[int],
                     image: torch.Tensor | None, n: int) -> tuple[list[int], torch.Tensor]:
    """reference() and transformers' logits at each of the n picks ([n, vocab], float32)."""
    kw = dec.hf_inputs(prompt, image)
    ref.generation_config.eos_token_id = None
    out = ref.generate(**kw, max_new_tokens=n, do_sample=False, pad_token_id=0,
                       output_logits=True, return_dict_in_generate=True)
    logits = torch.cat([lg.float() for lg in out.logits])
    return out.sequences[0, kw["input_ids"].shape[1]:].tolist(), logits


def bf16_step(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bfloat16 values at |x| (8 significant bits)."""
    return torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(1e-30))) - 7)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {f: save_tiny(f, tmp_path_factory.mktemp(f)) for f in FAMILIES}


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_transformers_with_images(family: str, dirs: dict[str, Path]) -> None:
    """Two image requests (the image inside the prompt at different places) prefilled as one
    batch, a text request joining while they decode: every row's 64 greedy tokens equal
    transformers' generate() of that request alone."""
    torch.set_num_threads(1)
    dec, ref = load(dirs[family]), load_hf_model(dirs[family], None)
    m = IMAGE_TOKEN[family]
    reqs = [([1, 20, 21, m, 22, 23, 24], _image(0, family)),
            ([1, m, 25, 26, 27, 28, 29, 30, 31], _image(1, family)),
            ([1, 30, 31, 32], None)]
    eng = DecodeEngine(dec, 3, 256, eos_id=-1)
    live = [eng.submit(p, NEW, im) for p, im in reqs[:2]]
    for _ in range(5):
        eng.step()
    live.append(eng.submit(*reqs[2][:1], NEW))
    eng.run()
    assert dec.image_tokens(tuple(reqs[0][1].shape)) > 1
    for r, (p, im) in zip(live, reqs, strict=True):
        want = reference(ref, dec, p, im, NEW)
        assert r.tokens == want, (family, p[:3])
        assert len(set(want)) > 8  # the text varies: the comparison means something


def test_decoder_features_are_mapped(dirs: dict[str, Path]) -> None:
    """What each tiny checkpoint exercises is really in the packed decoder."""
    q = load(dirs["qwen2_vl"])
    assert q.layers[0]["bqkv"] is not None and q.mrope_section == (2, 3, 3)
    assert q.window == (0, 24) and q.image_positions((3, 56, 84)).max().item() == 2
    assert load(dirs["llava_next"]).window == (24, 24)
    s = load(dirs["smolvlm"])
    assert s.tied and s.lm_head is s.embed
    assert not load(dirs["llava"]).tied


def _storages(tensors) -> dict[int, int]:  # noqa: ANN001
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}


@pytest.mark.parametrize("family", ["qwen2_vl", "smolvlm"])
def test_weights_held_once(family: str, dirs: dict[str, Path]) -> None:
    """After mapping, the checkpoint's decoder layers are gone: the bytes held (what remains of
    the transformers model + the packed decoder) equal the checkpoint's parameter bytes."""
    dec = load(dirs[family])
    fresh = load_hf_model(dirs[family], None)
    want = sum(_storages(fresh.parameters()).values())
    packed = [v for ly in dec.layers for v in ly.values() if v is not None]
    held = _storages([*dec.hf.parameters(), *packed, dec.embed, dec.norm, dec.lm_head])
    assert sum(held.values()) == want
    text = getattr(dec.hf.model, "language_model", None) or dec.hf.model.text_model
    assert len(text.layers) == 0


@pytest.mark.slow
def test_every_decode_path_gives_the_same_tokens(dirs: dict[str, Path]) -> None:
    """Qwen2-VL (qkv bias, a sliding-window layer, M-RoPE offsets) through each decode
    attention and MLP option, the compiled step and multi-step replays (CPU: the Triton ops'
    torch paths): the same greedy tokens."""
    torch.set_num_threads(1)
    dec = load(dirs["qwen2_vl"])
    m = IMAGE_TOKEN["qwen2_vl"]
    prompt, img = [1, 20, m, 21, 22], _image(3, "qwen2_vl")

    def run(**kw: object) -> list[int]:
        eng = DecodeEngine(dec, 2, 256, eos_id=-1, **kw)  # type: ignore[arg-type]
        return eng.generate([prompt], 40, images=[img]).tokens[0]

    base = run()
    for kw in (dict(decode_attention="sdpa"), dict(decode_attention="triton"),
               dict(decode_attention="triton_split"), dict(decode_attention="triton_fused"),
               dict(mlp="triton"), dict(steps_per_replay=4), dict(compile_step=True)):
        assert run(**kw) == base, kw


def test_unsupported_architecture_names_the_families(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "paligemma", "architectures": '
                                          '["PaliGemmaForConditionalGeneration"]}')
    with pytest.raises(Unsupported, match="PaliGemmaForConditionalGeneration .*supported "
                                          "families: LLaVA-1.5 \\(llava\\)"):
        load(tmp_path)
    assert "Qwen2.5-VL (qwen2_5_vl)" in supported_text() and "SmolVLM" in supported_text()


def test_corrupted_weights_name_parameter_and_cause(dirs: dict[str, Path],
                                                    tmp_path: Path) -> None:
    import shutil
    d = tmp_path / "corrupt"
    shutil.copytree(dirs["smolvlm"], d)
    (d / "model.safetensors").write_bytes(b"\x10" * 64)
    with pytest.raises(HFLoadError, match="parameter 'hf.model_path' = .*corrupt.*cannot load "
                                          "the checkpoint: SafetensorError"):
        load(d)
    with pytest.raises(ValueError, match="parameter 'hf.model_path' = .*cannot read "
                                         "config.json"):
        load(tmp_path / "missing")


def test_transformers_path_refuses_clearly(dirs: dict[str, Path], tmp_path: Path) -> None:
    """The transformers fallback: no AttributeError for Qwen2-VL (no image_size), no decode
    failure for SmolVLM: a ValueError naming the parameter at load."""
    for family in ("qwen2_vl", "smolvlm"):
        with pytest.raises(ValueError, match="parameter 'hf.model_path' = .*needs the decode "
                                             "engine"):
            HFVisionLanguageModel(dirs[family])


def test_open_hf_falls_back_with_the_reason(tmp_path: Path) -> None:
    """A LLaVA whose decoder is not one the engine runs (GELU MLP) goes to transformers, and
    the note says why; a supported one goes to the engine."""
    from transformers import AutoModelForImageTextToText
    from tiny_hf_vlm import config
    cfg = config("llava")
    cfg.text_config.hidden_act = "gelu"
    AutoModelForImageTextToText.from_config(cfg).save_pretrained(str(tmp_path / "gelu"))
    runner, note = open_hf(tmp_path / "gelu", eos_id=EOS)
    assert isinstance(runner, HFVisionLanguageModel)
    assert note.startswith("transformers") and "activation 'gelu'" in note
    save_tiny("llava", tmp_path / "ok", with_tokenizer=False)
    runner, note = open_hf(tmp_path / "ok", eos_id=EOS, max_batch=2)
    assert isinstance(runner, EngineRunner) and note.startswith("engine: llava")
    res = runner.generate([[1, 20, IMAGE_TOKEN["llava"], 21]], EOS, 8,
                          images=[_image(0, "llava")])
    assert res.stop_reasons[0] in ("eos", "max_new_tokens") and res.ttft_rows[0] > 0


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_agreement_on_gpu(family: str, tmp_path: Path) -> None:
    """CUDA, bf16: the engine (CUDA graphs, compiled step) along transformers' greedy path
    (teacher-forced through a logits processor) picks the same token at >= 98% of 128
    positions, a rounding tie counting as the same pick: a token whose logit in transformers'
    own bf16 step is within one bf16 step of its pick's. (These tiny random models have
    near-flat logits: transformers' bf16 path itself picks another token than its float32
    path at a few percent of positions, where two logits differ by about one bf16 step.)
    Without the ties, at least 95%."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    save_tiny(family, tmp_path, sharpen=4.0)
    dec = load(tmp_path, "cuda", torch.bfloat16)
    ref = build(family, sharpen=4.0).to("cuda", torch.bfloat16)
    prompt = [1, 20, 21, IMAGE_TOKEN[family], 22, 23]
    img = _image(0, family)
    want, ref_logits = reference_logits(ref, dec, prompt, img.cuda(), 128)
    picks: list[int] = []

    def follow(prefix: list[int], logits: torch.Tensor) -> torch.Tensor:
        picks.append(int(logits.argmax()))
        out = torch.full_like(logits, float("-inf"))
        out[want[len(prefix)]] = 0.0
        return out

    eng = DecodeEngine(dec, 2, 512, eos_id=-1, compile_step=True)
    res = eng.generate([prompt], 128, images=[img.cuda()], logits_processor=[follow])
    assert res.tokens[0] == want
    got, ref_pick = (torch.tensor(t, device=ref_logits.device) for t in (picks, want))
    rows = torch.arange(len(want), device=ref_logits.device)
    same, top = got == ref_pick, ref_logits[rows, ref_pick]
    tie = ref_logits[rows, got] >= top - bf16_step(top)
    assert same.float().mean() >= 0.95, (family, same.float().mean().item())
    assert (same | tie).float().mean() >= 0.98, (family, (same | tie).float().mean().item())


def test_engine_or_tokenizer_failures_name_the_parameter(dirs: dict[str, Path], tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine that cannot be built (here: its constructor raises) and a corrupt
    tokenizer.json are ValueErrors naming hf.model_path and the cause."""
    import shutil

    from kestrel_models.planner.hf_engine import runner
    from kestrel_models.planner.tokenizer import HFTokenizer

    def no_memory(*a: object, **k: object) -> None:
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(runner, "DecodeEngine", no_memory)
    with pytest.raises(HFLoadError, match="parameter 'hf.model_path' = .*could not be built .*"
                                          "RuntimeError: CUDA out of memory"):
        open_hf(dirs["llava"], eos_id=EOS)
    d = tmp_path / "badtok"
    shutil.copytree(dirs["llava"], d)
    (d / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="parameter 'hf.model_path' = .*no loadable tokenizer"):
        HFTokenizer.from_pretrained(d)


def test_processor_chat_template_is_used(dirs: dict[str, Path], tmp_path: Path) -> None:
    """A tokenizer without a chat template gets the one its processor saved beside it."""
    import json
    import shutil

    from kestrel_models.planner.tokenizer import HFTokenizer
    from tiny_hf_vlm import tokenizer

    d = tmp_path / "proc"
    shutil.copytree(dirs["llava"], d)
    tok = tokenizer("llava")
    tok.chat_template = None
    tok.save_pretrained(str(d))
    for f in ("chat_template.jinja", "chat_template.json"):
        (d / f).unlink(missing_ok=True)
    assert HFTokenizer.from_pretrained(d).chat("s", "u") is None
    (d / "chat_template.json").write_text(json.dumps({"chat_template": "[{{ messages[1]"
                                                      "['content'] }}]"}))
    assert HFTokenizer.from_pretrained(d).chat("s", "u") == "[u]"


@pytest.mark.parametrize("family", ["llava", "qwen2_vl"])
def test_kept_prefix_with_the_image_inside(family: str, dirs: dict[str, Path]) -> None:
    """prefix_entries: a prefix holding the image marker (the image block and the prompt up to
    prefix_tokens) is kept and reused (M-RoPE: the rope offset after the image comes back
    with it); the tokens equal a run without the store. An image after the prefix: nothing
    kept."""
    torch.set_num_threads(1)
    dec = load(dirs[family])
    m, img = IMAGE_TOKEN[family], _image(5, family)
    first, second = [1, 20, m, 21, 22, 23], [1, 20, m, 21, 22, 40, 41]
    plain = DecodeEngine(dec, 1, 256, eos_id=-1)
    want = [plain.generate([p], 24, images=[img]).tokens[0] for p in (first, second)]
    eng = DecodeEngine(dec, 1, 256, eos_id=-1, prefix_entries=2)
    got = []
    for p in (first, second):
        r = eng.submit(p, 24, img, image_key="frame", prefix_tokens=5)
        eng.run()
        got.append((r.tokens, r.prefix_hit))
        eng.generate([[1, 30, 31]], 2)  # a text request in the slot between (offset 0)
    assert got == [(want[0], False), (want[1], True)]
    r = eng.submit([1, 20, 21, m, 22], 4, img, image_key="frame", prefix_tokens=2)
    eng.run()
    assert not r.prefix_hit and len(eng.store) == 1


@pytest.mark.parametrize("family", ["qwen2_vl", "smolvlm"])
def test_graph_paths_equal_eager(family: str, dirs: dict[str, Path], cpu_graphs: None) -> None:
    """The CUDA-graph code paths on the CPU (cpu_graphs: replays recompute): static vision
    tower, M-RoPE positions and offsets, a kept prefix's rest and the decode step read only
    static inputs refreshed before each replay, so the tokens are the eager engine's."""

    torch.set_num_threads(1)
    dec = load(dirs[family])
    assert dec.graphable_prefill, dec.describe()
    m = IMAGE_TOKEN[family]
    frame = {5: _image(5, family), 6: _image(6, family)}  # image key -> image
    # (prompt, image key, prefix tokens kept): the third reuses the first's kept prefix, the
    # last the one before it, a prefix one token longer: the same kept-rest graph, replayed
    # from another position
    reqs = [([1, 20, m, 21, 22, 23], 5, 5), ([1, 30, 31], None, 0),
            ([1, 20, m, 21, 22, 40, 41], 5, 5), ([1, 20, m, 24], 6, 0),
            ([1, 20, m, 25, 26, 27, 28], 6, 6), ([1, 20, m, 25, 26, 27, 50, 51], 6, 6)]

    def run(eng: DecodeEngine) -> list[list[int]]:
        out = []
        for p, key, keep in reqs:  # one at a time
            img = None if key is None else frame[key]
            r = eng.submit(p, 16, img, image_key=key, prefix_tokens=keep)
            eng.run()
            out.append(r.tokens)
        both = eng.generate([reqs[0][0], reqs[3][0]], 12, images=[frame[5], frame[6]])
        return out + both.tokens

    want = run(DecodeEngine(dec, 2, 256, eos_id=-1, prefix_entries=2))
    eng = DecodeEngine(dec, 2, 256, eos_id=-1, prefix_entries=2)
    eng.cuda_graph = eng.prefill_graph = True  # the CUDA code paths, on cpu_graphs
    assert run(eng) == want
    assert eng.store.hits >= 2 and any(k[0] == "kept" for k in eng._pgraphs)
