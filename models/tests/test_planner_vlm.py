"""Tests of the planner VLM: tokenizer, config validation, KV-cache correctness, generation."""

from __future__ import annotations

import pytest
import torch

from kestrel_models.planner import (
    ByteTokenizer, StreamDecoder, Tokenizer, VisionLanguageModel, VLMConfig, generate, get_config,
)

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model() -> VisionLanguageModel:
    torch.manual_seed(0)
    m = VisionLanguageModel(get_config("tiny")).eval()
    m.setup_cache(4, 256)
    return m


def _img(b: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (b, 3, 32, 32), dtype=torch.uint8, generator=g)


# ---- tokenizer ------------------------------------------------------------------------------
@pytest.mark.parametrize("text", ["", "pick red_cube speed=0.10\nend", "héllo wörld",
                                  "日本語 テキスト", "emoji 🤖🦅 mixed\tand\x00nul"])
def test_tokenizer_round_trip(text: str) -> None:
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text
    framed = tok.encode(text, add_bos=True, add_eos=True)
    assert framed[0] == tok.bos_id and framed[-1] == tok.eos_id
    assert tok.decode(framed) == text
    assert tok.decode(framed, keep_special=True) == f"<bos>{text}<eos>"


def test_tokenizer_specials_and_interface() -> None:
    tok = ByteTokenizer()
    assert isinstance(tok, Tokenizer)
    assert tok.vocab_size == 260 == get_config("tiny").vocab_size
    assert sorted(tok.special_ids.values()) == [256, 257, 258, 259]
    assert len({tok.bos_id, tok.eos_id, tok.pad_id, tok.image_id}) == 4
    with pytest.raises(ValueError, match="outside vocabulary"):
        tok.decode([300])
    with pytest.raises(TypeError):
        tok.encode(b"bytes")  # type: ignore[arg-type]


def test_tokenizer_utf8_safe_on_cut_sequences() -> None:
    tok = ByteTokenizer()
    ids = tok.encode("a🤖b")  # the robot is 4 bytes
    assert tok.decode(ids[:3]) == "a\ufffd"  # cut in the middle: replacement, no exception
    stream = StreamDecoder(tok)
    pieces = [stream.push(i) for i in ids + [tok.eos_id]]
    assert pieces == ["a", "", "", "", "🤖", "b", ""]
    assert stream.text == "a🤖b"


# ---- config -----------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, name", [
    ({"image_size": 30}, "image_size"), ({"n_kv_heads": 4, "n_heads": 6}, "n_heads"),
    ({"dim": 100}, "dim"), ({"n_layers": 0}, "n_layers"), ({"rope_theta": -1.0}, "rope_theta"),
    ({"max_seq_len": 16}, "max_seq_len"), ({"vision_dim": 66}, "vision_dim"),
])
def test_config_validation_names_parameter(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=f"parameter '{name}'"):
        VLMConfig(**kwargs)


@pytest.mark.slow
def test_presets_sizes() -> None:
    tiny = VisionLanguageModel(get_config("tiny"))
    assert 1_000_000 <= tiny.num_params() <= 5_000_000
    big = VisionLanguageModel.param_count_on_meta(get_config("0.5b"))
    assert 0.45e9 <= big <= 0.7e9
    with pytest.raises(ValueError, match="model_config"):
        get_config("huge")


# ---- model ------------------------------------------------------------------------------------
def test_gqa_shapes(model: VisionLanguageModel) -> None:
    cfg = model.cfg
    attn = model.layers[0].attn
    assert cfg.n_kv_heads < cfg.n_heads
    assert attn.wq.out_features == cfg.n_heads * cfg.head_dim
    assert attn.wk.out_features == attn.wv.out_features == cfg.n_kv_heads * cfg.head_dim
    assert attn.cache is not None
    assert tuple(attn.cache.k.shape) == (4, cfg.n_kv_heads, 256, cfg.head_dim)
    logits = model(_img(2), torch.randint(0, 256, (2, 7)))
    assert tuple(logits.shape) == (2, 7, cfg.vocab_size)


@pytest.mark.parametrize("with_image", [True, False])
def test_cached_decode_matches_full_forward(model: VisionLanguageModel, with_image: bool) -> None:
    img = _img(2) if with_image else None
    toks = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))
    full = model(img, toks)  # [2, 24, V]
    pre = model.prefill(img, toks[:, :10])
    torch.testing.assert_close(pre, full[:, :10], atol=1e-4, rtol=0)
    for i in range(10, 24):
        step = model.decode_step(toks[:, i:i + 1])
        assert step.shape == (2, 1, model.cfg.vocab_size)
        torch.testing.assert_close(step[:, 0], full[:, i], atol=1e-4, rtol=0)


def test_padded_batch_with_mixed_images_matches_single_rows(model: VisionLanguageModel) -> None:
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, 256, (n,), generator=g) for n in (5, 12, 8)]
    imgs = _img(3, seed=9)
    has_img = torch.tensor([True, False, True])
    # Reference: each row alone, fed all of its tokens through forward().
    refs = [model(imgs[i:i + 1] if has_img[i] else None, s[None])[0] for i, s in enumerate(seqs)]
    # Batched: prefill on the first 4 tokens of each (right-padded), then per-row decode.
    first = 4
    toks = torch.zeros(3, first, dtype=torch.long)
    for i, s in enumerate(seqs):
        toks[i] = s[:first]
    pre = model.prefill(imgs, toks, torch.full((3,), first), has_img)
    for i in range(3):
        torch.testing.assert_close(pre[i], refs[i][:first], atol=1e-4, rtol=0)
    for t in range(first, 12):
        feed = torch.tensor([[int(s[t]) if t < len(s) else 0] for s in seqs])
        out = model.decode_step(feed)
        for i, s in enumerate(seqs):
            if t < len(s):
                torch.testing.assert_close(out[i, 0], refs[i][t], atol=1e-4, rtol=0)


def test_padded_prefill_lengths(model: VisionLanguageModel) -> None:
    toks = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(2))
    imgs = _img(2)
    ref = model(imgs[1:], toks[1:, :6])[0]
    padded = toks.clone()
    padded[1, 6:] = 258
    pre = model.prefill(imgs, padded, torch.tensor([9, 6]))
    torch.testing.assert_close(pre[1, :6], ref, atol=1e-4, rtol=0)
    nxt = model.decode_step(torch.tensor([[1], [int(toks[1, 6])]]))
    ref7 = model(imgs[1:], toks[1:, :7])[0, 6]
    torch.testing.assert_close(nxt[1, 0], ref7, atol=1e-4, rtol=0)


def test_image_changes_output(model: VisionLanguageModel) -> None:
    toks = torch.randint(0, 256, (1, 6))
    a = model(_img(1, seed=1), toks)
    b = model(_img(1, seed=2), toks)
    c = model(None, toks)
    assert (a - b).abs().max() > 1e-4
    assert (a - c).abs().max() > 1e-4
    # A different-size image is resized to image_size, not rejected.
    big = torch.randint(0, 256, (1, 3, 48, 64), dtype=torch.uint8)
    assert model(big, toks).shape == a.shape


def test_errors_are_specific(model: VisionLanguageModel) -> None:
    with pytest.raises(ValueError, match="exceeds the cache batch"):
        model.prefill(None, torch.zeros(5, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\[B, 3, H, W\]"):
        model(torch.zeros(1, 1, 32, 32, dtype=torch.uint8), torch.zeros(1, 3, dtype=torch.long))
    fresh = VisionLanguageModel(get_config("tiny"))
    with pytest.raises(RuntimeError, match="setup_cache"):
        fresh.prefill(None, torch.zeros(1, 3, dtype=torch.long))


# ---- generation -------------------------------------------------------------------------------
def test_greedy_generate_matches_full_forward_argmax(model: VisionLanguageModel) -> None:
    tok = ByteTokenizer()
    prompt = tok.encode("plan:", add_bos=True)
    res = generate(model, [prompt], tok.eos_id, tok.pad_id, max_new_tokens=8, image=_img(1))
    seq = list(prompt)
    for _ in range(8):  # reference greedy loop without the cache
        nxt = int(model(_img(1), torch.tensor([seq]))[0, -1].argmax())
        if nxt == tok.eos_id:
            break
        seq.append(nxt)
    assert res.tokens[0] == seq[len(prompt):]
    assert res.ttft_s > 0 and res.total_s >= res.ttft_s


def test_generate_processor_stop_and_callbacks(model: VisionLanguageModel) -> None:
    tok = ByteTokenizer()
    script = tok.encode("ok") + [tok.eos_id]
    seen_prefixes: list[list[int]] = []

    def force(prefix: list[int], logits: torch.Tensor) -> torch.Tensor:
        seen_prefixes.append(list(prefix))
        out = torch.full_like(logits, float("-inf"))
        out[script[len(prefix)]] = 0.0
        return out

    streamed: list[tuple[int, int]] = []
    res = generate(model, [tok.encode("a"), tok.encode("bcd")], tok.eos_id, tok.pad_id, 10,
                   logits_processor=[force, None], on_token=lambda r, t: streamed.append((r, t)))
    assert res.tokens[0] == tok.encode("ok") and res.stop_reasons[0] == "eos"
    assert seen_prefixes[:3] == [[], tok.encode("o"), tok.encode("ok")]
    assert len(res.tokens[1]) <= 10
    assert [t for r, t in streamed if r == 0] == tok.encode("ok")
    # max_new_tokens and should_stop
    res2 = generate(model, [tok.encode("x")], tok.eos_id, tok.pad_id, 3,
                    logits_processor=lambda p, lg: _ban(lg, tok.eos_id))
    assert len(res2.tokens[0]) == 3 and res2.stop_reasons == ["max_new_tokens"]
    calls = {"n": 0}

    def stop() -> bool:
        calls["n"] += 1
        return calls["n"] > 2

    res3 = generate(model, [tok.encode("x")], tok.eos_id, tok.pad_id, 50, should_stop=stop,
                    logits_processor=lambda p, lg: _ban(lg, tok.eos_id))
    assert res3.stop_reasons == ["cancelled"] and len(res3.tokens[0]) == 2


def _ban(logits: torch.Tensor, token: int) -> torch.Tensor:
    logits = logits.clone()
    logits[token] = float("-inf")
    return logits


def test_sampling_is_seeded(model: VisionLanguageModel) -> None:
    tok = ByteTokenizer()

    def run(seed: int) -> list[int]:
        g = torch.Generator().manual_seed(seed)
        return generate(model, [tok.encode("hi")], tok.eos_id, tok.pad_id, 12,
                        temperature=1.0, generator=g,
                        logits_processor=lambda p, lg: _ban(lg, tok.eos_id)).tokens[0]

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_bigram_state_dict_drives_greedy_decoding() -> None:
    from kestrel_models.planner.vlm import bigram_state_dict

    tok = ByteTokenizer()
    cfg = get_config("tiny")
    text = tok.encode("\nhome\n") + [tok.eos_id]
    m = VisionLanguageModel(cfg).eval()
    m.load_state_dict(bigram_state_dict(cfg, text, tok.eos_id, tok.encode("abc")))
    m.setup_cache(1, 128)
    res = generate(m, [tok.encode("task: go\n", add_bos=True)], tok.eos_id, tok.pad_id, 20,
                   image=_img(1))
    # '\n' -> 'h' (first successor), ..., 'e' -> '\n', '\n' -> 'h' again until the budget.
    assert tok.decode(res.tokens[0]).startswith("home\nhome\n")
    with pytest.raises(ValueError, match="do not fit"):
        bigram_state_dict(cfg, list(range(256)), tok.eos_id, [])


def test_train_logits_match_the_inference_forward() -> None:
    """train_logits (autograd, output head on the selected positions only) gives the logits
    of forward() at those positions, and gradients reach every trained parameter."""
    torch.manual_seed(0)
    m = VisionLanguageModel(get_config("small"))
    tokens = torch.randint(0, 256, (2, 12))
    select = torch.zeros(2, 12, dtype=torch.bool)
    select[0, 3:7] = True
    select[1, 5:] = True
    img = _img(2)
    ref = m.forward(img, tokens)[select]
    got = m.train_logits(img, tokens, select)
    assert got.shape == ref.shape and torch.allclose(got, ref, atol=1e-5)
    got.logsumexp(-1).sum().backward()
    assert m.tok_emb.weight.grad is not None and m.vision.patchify.weight.grad is not None
    m.setup_cache(1, 32)
    with pytest.raises(RuntimeError, match="without a KV cache"):
        m.train_logits(img, tokens, select)
