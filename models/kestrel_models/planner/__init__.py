"""Planner models: byte tokenizer, small vision-language model, cached generation, the decode
engine (static KV-cache slots, CUDA-graph decode, optional whole-step compile, local+global
or H2O attention policies), speculative decoding (no rclpy). Optional
backends, imported on use: hf.py (local HF models), remote.py (OpenAI-compatible HTTP)."""

from kestrel_models.planner.config import PRESETS, VLMConfig, get_config
from kestrel_models.planner.generate import GenerationResult, generate
from kestrel_models.planner.tokenizer import ByteTokenizer, StreamDecoder, Tokenizer
from kestrel_models.planner.vlm import KVCache, VisionLanguageModel
from kestrel_models.planner.attention_policy import AttentionPolicy
from kestrel_models.planner.engine import DecodeEngine, EngineRequest
from kestrel_models.planner.speculative import SpeculativeDecoder, SpecResult

__all__ = [
    "PRESETS", "VLMConfig", "get_config", "GenerationResult", "generate", "ByteTokenizer",
    "StreamDecoder", "Tokenizer", "KVCache", "VisionLanguageModel", "DecodeEngine",
    "EngineRequest", "SpeculativeDecoder", "SpecResult", "AttentionPolicy",
]
