"""llguidance tokenizers (llguidance.LLTokenizer) for the planner's tokenizers: kestrel's
ByteTokenizer (ids 0..255 = bytes, then special tokens), a Hugging Face fast tokenizer (BPE,
SentencePiece: llguidance.hf.from_tokenizer), or a `tokenizers.Tokenizer`. Building one for a
large HF vocabulary takes ~1 s: build it once per backend, at configure time."""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["lltokenizer", "require_llguidance"]


def require_llguidance() -> Any:
    """The llguidance module; ValueError naming 'grammar_engine' when it is not installed."""
    try:
        import llguidance
    except ImportError as exc:
        raise ValueError("parameter 'grammar_engine' = 'llguidance': the llguidance package is "
                         "not installed (pip install llguidance==1.9.1, requirements/base.txt); "
                         "or set grammar_engine: automaton") from exc
    return llguidance


class _ByteTokens:
    """kestrel's ByteTokenizer in the shape llguidance.TokenizerWrapper reads: ids 0..255 =
    bytes, then the special tokens (never allowed by the grammar; <eos> ends the plan)."""

    def __init__(self, tok: Any) -> None:
        self.eos_token_id = tok.eos_id
        self.bos_token_id = tok.bos_id
        specials = sorted(tok.special_ids.items(), key=lambda kv: kv[1])
        self.tokens = [bytes([i]) for i in range(tok.NUM_BYTES)] + [s.encode() for s, _ in specials]
        self.special_token_ids = [i for _, i in specials]

    def __call__(self, text: str | bytes) -> list[int]:
        return list(text.encode("utf-8") if isinstance(text, str) else text)


class _DecodedTokens:
    """A fast HF tokenizer whose decoder llguidance does not know (e.g. Fuse): each token's
    bytes = its decoded text, kept only where that is context-free (decode([t, t]) is the text
    twice); other tokens are passed as special ones, which the grammar never allows."""

    def __init__(self, hf: Any, eos_id: int) -> None:
        self.eos_token_id = eos_id
        self.bos_token_id = getattr(hf, "bos_token_id", None)
        n = len(hf)
        special = set(getattr(hf, "all_special_ids", []))
        self.tokens, self.special_token_ids = [], []
        for i in range(n):
            text = hf.decode([i])
            if i in special or not text or hf.decode([i, i]) != text * 2:
                self.tokens.append(f"<special_{i}>".encode())
                self.special_token_ids.append(i)
            else:
                self.tokens.append(text.encode("utf-8"))
        self._hf = hf

    def __call__(self, text: str | bytes) -> list[int]:
        s = text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text
        return list(self._hf.encode(s, add_special_tokens=False))


@functools.lru_cache(maxsize=1)
def _byte_lltokenizer() -> Any:
    from kestrel_models.planner import ByteTokenizer
    llg = require_llguidance()
    return llg.LLTokenizer(llg.TokenizerWrapper(_ByteTokens(ByteTokenizer())))


def lltokenizer(tokenizer: Any, eos_id: int | None = None) -> Any:
    """An llguidance.LLTokenizer for: kestrel's ByteTokenizer (cached), kestrel's HFTokenizer or
    a transformers fast tokenizer (llguidance.hf.from_tokenizer, ~1 s: build once per backend;
    decoders it does not know: token bytes from decode(), see _DecodedTokens),
    or a `tokenizers.Tokenizer` (eos_id needed). ValueError naming 'grammar_engine' otherwise."""
    llg = require_llguidance()
    from kestrel_models.planner import ByteTokenizer
    if isinstance(tokenizer, ByteTokenizer):
        return _byte_lltokenizer()
    inner = getattr(tokenizer, "tok", tokenizer)  # kestrel HFTokenizer -> the transformers one
    if eos_id is None:
        eos_id = getattr(tokenizer, "eos_id", None)
    if hasattr(inner, "backend_tokenizer"):
        from llguidance.hf import from_tokenizer
        try:
            return from_tokenizer(inner, eos_token=eos_id)
        except ValueError as exc:  # e.g. "can't determine decoder type"
            if eos_id is None or "decoder" not in str(exc):
                raise ValueError(f"parameter 'grammar_engine' = 'llguidance': {exc}") from exc
            return llg.LLTokenizer(llg.TokenizerWrapper(_DecodedTokens(inner, int(eos_id))))
    if hasattr(inner, "to_str") and eos_id is not None:  # tokenizers.Tokenizer
        return llg.LLTokenizer(inner.to_str(), eos_token=int(eos_id))
    raise ValueError(f"parameter 'grammar_engine' = 'llguidance': cannot use a "
                     f"{type(inner).__name__} (a fast Hugging Face tokenizer is needed); set "
                     "grammar_engine: automaton or hf.grammar: false")
