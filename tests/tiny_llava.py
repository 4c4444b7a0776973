"""A tiny random LLaVA checkpoint saved to a directory (tests of the Hugging Face backend; built
locally, nothing downloaded). Shared by models/tests/test_planner_hf.py and
kestrel_planner's test_backend_hf.py."""

from __future__ import annotations

from pathlib import Path

import torch

IMAGE_ID = 259  # image token id in the 260-token vocabulary


def save_tiny_llava(directory: Path, max_positions: int = 256) -> Path:
    """CLIP vision tower (32x32 images, 8 px patches) + a 2-layer Llama (vocab 260), seeded, with
    weight matrices scaled x20 so greedy text varies token to token; save_pretrained there."""
    from transformers import (CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration)
    vc = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=2, image_size=32, patch_size=8, projection_dim=32)
    tc = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, vocab_size=260,
                     max_position_embeddings=max_positions)
    cfg = LlavaConfig(vision_config=vc, text_config=tc, image_token_id=IMAGE_ID,
                      vision_feature_layer=-1, vision_feature_select_strategy="default")
    torch.manual_seed(0)
    m = LlavaForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # sharper random weights: greedy text varies token to token
        for p in m.parameters():
            if p.ndim >= 2:
                p.mul_(20.0)
    m.save_pretrained(str(directory))
    return directory
