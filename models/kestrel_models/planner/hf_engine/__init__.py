"""Hugging Face image-text-to-text checkpoints (a LOCAL directory, nothing downloaded) on the
decode engine: the checkpoint's vision tower and connector run as its own modules, once per
request in prefill; its text decoder is mapped into the engine's packed layout (decoder.py;
the original q/k/v and gate/up weights are released, no second copy) and decodes on the engine
(static KV cache, CUDA graphs, the compiled step, continuous batching).

Families (one module each):
    llava.py      LLaVA-1.5, LLaVA-NeXT          model_type llava, llava_next
    idefics3.py   Idefics3, SmolVLM               model_type idefics3, smolvlm
    qwen2_vl.py   Qwen2-VL, Qwen2.5-VL            model_type qwen2_vl, qwen2_5_vl
`load(path, device, dtype)` -> an HFDecoder (`from_model` for a model already in memory); it
raises `Unsupported` (a ValueError saying why:
another architecture, with the supported families listed, or a decoder feature the engine
lacks) and `HFLoadError` (a checkpoint that does not load: the parameter and the cause).
runner.py puts a decoder behind the generation interface of hf.py (`open_hf` picks the engine
or transformers).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kestrel_models.planner.hf_engine.common import (HFDecoder, HFLoadError, Unsupported,
                                                     load_hf_model, pack_text_model,
                                                     read_config, text_problem)

__all__ = ["FAMILIES", "HFDecoder", "HFLoadError", "Unsupported", "load", "from_model",
           "supported_text", "check_config"]

# model_type -> (family module, family name shown to users)
FAMILIES: dict[str, tuple[str, str]] = {
    "llava": ("llava", "LLaVA-1.5"),
    "llava_next": ("llava", "LLaVA-NeXT"),
    "idefics3": ("idefics3", "Idefics3"),
    "smolvlm": ("idefics3", "SmolVLM"),
    "qwen2_vl": ("qwen2_vl", "Qwen2-VL"),
    "qwen2_5_vl": ("qwen2_vl", "Qwen2.5-VL"),
}


def supported_text() -> str:
    return ", ".join(f"{name} ({mt})" for mt, (_, name) in FAMILIES.items())


def check_config(path: str | Path) -> dict:
    """config.json -> the config dict, or Unsupported naming the architecture and the
    supported families (HFLoadError when config.json cannot be read)."""
    cfg = read_config(path)
    mt = cfg.get("model_type")
    if mt not in FAMILIES:
        arch = ", ".join(cfg.get("architectures") or []) or "?"
        raise Unsupported(f"architecture {arch} (model_type {mt!r}) is not one the engine "
                          f"runs; supported families: {supported_text()}")
    tc = cfg.get("text_config")
    why = text_problem(tc) if isinstance(tc, dict) and "model_type" in tc else None
    if why:
        raise Unsupported(why)
    return cfg


def _text_parts(hf: Any) -> tuple[Any, Any]:
    inner = hf.model
    text = getattr(inner, "language_model", None) or getattr(inner, "text_model", None)
    if text is None or not hasattr(text, "layers"):
        raise Unsupported(f"{type(hf).__name__}: no text decoder with layers found")
    return text, hf.lm_head


def load(path: str | Path, device: str | torch.device = "cpu",
         dtype: torch.dtype | None = None, tokenizer: Any = None) -> HFDecoder:
    """The checkpoint at `path` on `device` as an engine decoder (module doc). tokenizer: the
    directory's tokenizer when the caller has it (Idefics3 / SmolVLM read their image tokens
    from it; loaded from the directory otherwise)."""
    check_config(path)
    return from_model(load_hf_model(path, dtype), path, device, tokenizer)


def from_model(hf: Any, path: str | Path | None = None, device: str | torch.device = "cpu",
               tokenizer: Any = None, consume: bool = True) -> HFDecoder:
    """A transformers model already in memory (e.g. random weights built for a benchmark) as
    an engine decoder; its decoder layers are consumed (consume=False: kept, a second copy,
    so that transformers can still run the model: benchmarks). path: its directory, if any
    (preprocessor_config.json, the tokenizer)."""
    mt = getattr(hf.config, "model_type", None)
    if mt not in FAMILIES:
        raise Unsupported(f"architecture {type(hf).__name__} (model_type {mt!r}) is not one "
                          f"the engine runs; supported families: {supported_text()}")
    module, _ = FAMILIES[mt]
    try:
        tcfg = hf.config.get_text_config()
        why = text_problem(tcfg)
        if why:
            raise Unsupported(why)
        hf = hf.to(device)
        text, lm_head = _text_parts(hf)
        packed = pack_text_model(text, lm_head, tcfg, consume)
        if module == "llava":
            from kestrel_models.planner.hf_engine.llava import LlavaDecoder
            return LlavaDecoder(hf, path, packed)
        if module == "idefics3":
            from kestrel_models.planner.hf_engine.idefics3 import Idefics3Decoder
            return Idefics3Decoder(hf, path, packed, tokenizer)
        from kestrel_models.planner.hf_engine.qwen2_vl import Qwen2VLDecoder
        return Qwen2VLDecoder(hf, path, packed)
    except (Unsupported, HFLoadError):
        raise
    except Exception as exc:  # noqa: BLE001 - a checkpoint variant the mapping does not know
        raise Unsupported(f"mapping {type(hf).__name__} into the engine failed: "
                          f"{type(exc).__name__}: {exc}") from exc
