"""Planner models: byte tokenizer, small vision-language model, cached generation (no rclpy)."""

from kestrel_models.planner.config import PRESETS, VLMConfig, get_config
from kestrel_models.planner.generate import GenerationResult, generate
from kestrel_models.planner.tokenizer import ByteTokenizer, StreamDecoder, Tokenizer
from kestrel_models.planner.vlm import KVCache, VisionLanguageModel

__all__ = [
    "PRESETS", "VLMConfig", "get_config", "GenerationResult", "generate", "ByteTokenizer",
    "StreamDecoder", "Tokenizer", "KVCache", "VisionLanguageModel",
]
