"""Tiny random checkpoints of the Hugging Face VLM families that the planner's decode engine
runs, saved with save_pretrained to a directory together with a character-level tokenizer and
a chat template (built locally with transformers, nothing downloaded). Shared by
models/tests/test_planner_hf_engine.py, kestrel_planner's tests and the benchmark's tests.

Every family gets a 2-layer decoder (dim 64, 4 query / 2 kv heads, vocabulary 320) and a
1-layer vision tower; weight matrices are scaled (`sharpen`) so greedy text varies token to
token. Decoder features exercised: qkv bias + M-RoPE + a sliding-window layer (Qwen2-VL,
Qwen2.5-VL), a Mistral decoder with a sliding window (LLaVA-NeXT), tied embeddings (SmolVLM).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

FAMILIES = ("llava", "llava_next", "idefics3", "smolvlm", "qwen2_vl", "qwen2_5_vl")
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>", "<image>", "<fake_token_around_image>",
            "<global-img>", "<|vision_start|>", "<|image_pad|>", "<|vision_end|>",
            "<|video_pad|>", "<|im_start|>", "<|im_end|>"]
CHARS = ("abcdefghijklmnopqrstuvwxyz0123456789_ =-.\n:,;()'\"!?ABCDEFGHIJKLMNOPQRSTUVWXYZ<>/"
         "[]{}+*#|")
VOCAB = 320
IDS = {t: i for i, t in enumerate(SPECIALS)}
EOS = IDS["</s>"]
# a chat template that places images where the processor's templates do (list content)
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
            "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
            "{% for c in m['content'] %}{% if c['type'] == 'image' %}{{ image_text }}"
            "{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
IMAGE_TEXT = {"llava": "<image>", "llava_next": "<image>", "idefics3": "<image>",
              "smolvlm": "<image>", "qwen2_vl": "<|vision_start|><|image_pad|><|vision_end|>",
              "qwen2_5_vl": "<|vision_start|><|image_pad|><|vision_end|>"}
IMAGE_TOKEN = {f: IDS["<|image_pad|>" if f.startswith("qwen") else "<image>"] for f in FAMILIES}


def tokenizer(family: str = "llava") -> Any:
    """A character-level fast tokenizer: the SPECIALS first (ids 0..12), then CHARS."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast
    vocab = {t: i for i, t in enumerate(SPECIALS + list(CHARS))}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>",
                                  pad_token="<pad>", unk_token="<unk>",
                                  additional_special_tokens=SPECIALS[4:])
    tok.chat_template = TEMPLATE.replace("{{ image_text }}", IMAGE_TEXT[family])
    return tok


def _text(**kw: Any) -> dict:
    return dict(dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                     max_position_embeddings=1024, rms_norm_eps=1e-6, bos_token_id=1,
                     eos_token_id=EOS, pad_token_id=3), **kw)


def config(family: str, image_size: int = 32, **text: Any) -> Any:
    """The transformers config of a tiny checkpoint of `family` (FAMILIES)."""
    import transformers as tf
    vis = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
               num_attention_heads=2, image_size=image_size, patch_size=8)
    if family in ("llava", "llava_next"):
        kw: dict = {}
        tc = _text(**text)
        if family == "llava_next":  # a Mistral decoder with a sliding window
            tc = dict(_text(sliding_window=24, **text), model_type="mistral")
            kw = dict(image_grid_pinpoints=[[image_size, 2 * image_size],
                                            [2 * image_size, image_size],
                                            [2 * image_size, 2 * image_size]])
        else:
            tc = dict(tc, model_type="llama")
        cls = tf.LlavaNextConfig if family == "llava_next" else tf.LlavaConfig
        return cls(vision_config=dict(vis, model_type="clip_vision_model", projection_dim=32),
                   text_config=tc, image_token_id=IMAGE_TOKEN[family],
                   vision_feature_layer=-1, vision_feature_select_strategy="default", **kw)
    if family in ("idefics3", "smolvlm"):
        cls = tf.SmolVLMConfig if family == "smolvlm" else tf.Idefics3Config
        tied = family == "smolvlm"
        return cls(vision_config=vis, text_config=dict(_text(tie_word_embeddings=tied, **text),
                                                       model_type="llama"),
                   scale_factor=2, image_token_id=IMAGE_TOKEN[family], tie_word_embeddings=tied)
    if family in ("qwen2_vl", "qwen2_5_vl"):
        rope = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}
        tc = _text(rope_parameters=rope, use_sliding_window=True, sliding_window=24,
                   max_window_layers=1, **text)
        if family == "qwen2_vl":
            vc = dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2,
                      patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
            cls = tf.Qwen2VLConfig
        else:
            vc = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                      out_hidden_size=64, patch_size=14, spatial_merge_size=2,
                      temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1])
            cls = tf.Qwen2_5_VLConfig
        return cls(text_config=tc, vision_config=vc, image_token_id=IMAGE_TOKEN[family],
                   video_token_id=IDS["<|video_pad|>"],
                   vision_start_token_id=IDS["<|vision_start|>"],
                   vision_end_token_id=IDS["<|vision_end|>"])
    raise ValueError(f"family {family!r}: one of {FAMILIES}")


def build(family: str, sharpen: float = 20.0, seed: int = 0, **text: Any) -> Any:
    """The random model (eval mode, float32)."""
    from transformers import AutoModelForImageTextToText
    torch.manual_seed(seed)
    m = AutoModelForImageTextToText.from_config(config(family, **text)).eval()
    with torch.no_grad():  # sharper random weights: greedy text varies token to token
        for name, p in m.named_parameters():
            if p.ndim >= 2:
                p.mul_(sharpen)
            elif name.endswith("bias") and not p.any():  # transformers starts biases at 0
                p.normal_(0.0, 0.5)
    return m


def save_tiny(family: str, directory: Path, with_tokenizer: bool = True, **kw: Any) -> Path:
    """build(family, **kw).save_pretrained(directory) (+ the tokenizer and its template)."""
    build(family, **kw).save_pretrained(str(directory))
    if with_tokenizer:
        tokenizer(family).save_pretrained(str(directory))
    return directory
