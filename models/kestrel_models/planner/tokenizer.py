"""Byte-level tokenizer: 256 byte tokens + 4 special tokens, no downloaded files.

Ids 0..255 are the UTF-8 bytes of the text (id == byte value); ids 256.. are the special tokens
<bos>, <eos>, <pad>, <image>. Every string round-trips exactly (encode -> decode), including
any Unicode, because the text is encoded as UTF-8 bytes. `decode` of an arbitrary id sequence
never raises: special ids are dropped and invalid UTF-8 (e.g. a sequence cut in the middle of
a multi-byte character) is replaced with U+FFFD; `StreamDecoder` decodes token by token for
streaming and holds back an incomplete multi-byte character until it is complete.

The `Tokenizer` protocol is the interface the planner uses. `HFTokenizer` adapts a Hugging Face
tokenizer saved in a local model directory (AutoTokenizer, local_files_only: nothing is
downloaded) to it, plus the model's chat template when it has one (the tokenizer's own, else
the directory's chat_template.jinja or chat_template.json, where processors keep it).
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol, runtime_checkable

__all__ = ["Tokenizer", "ByteTokenizer", "StreamDecoder", "HFTokenizer"]


@runtime_checkable
class Tokenizer(Protocol):
    """What the planner needs from a tokenizer."""

    bos_id: int
    eos_id: int
    pad_id: int
    image_id: int

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 byte tokenizer. `vocab_size` = 260: bytes 0..255, then <bos> <eos> <pad> <image>.

    <image> is reserved for prompt formats that mark the image position inline; the Kestrel VLM
    places the image embeddings before the text tokens, so its prompts do not contain it.
    """

    NUM_BYTES = 256
    SPECIAL_TOKENS = ("<bos>", "<eos>", "<pad>", "<image>")

    def __init__(self) -> None:
        self.bos_id = self.NUM_BYTES + 0
        self.eos_id = self.NUM_BYTES + 1
        self.pad_id = self.NUM_BYTES + 2
        self.image_id = self.NUM_BYTES + 3
        self._special_by_id = {self.NUM_BYTES + i: s for i, s in enumerate(self.SPECIAL_TOKENS)}

    @property
    def vocab_size(self) -> int:
        return self.NUM_BYTES + len(self.SPECIAL_TOKENS)

    @property
    def special_ids(self) -> dict[str, int]:
        return {s: i for i, s in self._special_by_id.items()}

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_by_id

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """text -> ids (one per UTF-8 byte), optionally framed by <bos>/<eos>."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects str, got {type(text).__name__}")
        ids = list(text.encode("utf-8"))
        if add_bos:
            ids.insert(0, self.bos_id)
        if add_eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Iterable[int], keep_special: bool = False) -> str:
        """ids -> text. Special ids are dropped (or rendered as '<eos>' etc. with keep_special);
        invalid UTF-8 becomes U+FFFD; ids outside the vocabulary raise ValueError."""
        out: list[str] = []
        buf = bytearray()
        for i in ids:
            i = int(i)
            if 0 <= i < self.NUM_BYTES:
                buf.append(i)
                continue
            if i not in self._special_by_id:
                raise ValueError(f"token id {i} outside vocabulary [0, {self.vocab_size})")
            if keep_special:
                out.append(buf.decode("utf-8", errors="replace"))
                buf.clear()
                out.append(self._special_by_id[i])
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    def token_for_char(self, ch: str) -> int:
        """The single id of an ASCII character (used by the plan grammar)."""
        ids = self.encode(ch)
        if len(ids) != 1:
            raise ValueError(f"character {ch!r} is not a single token")
        return ids[0]


class StreamDecoder:
    """Incremental decoding for streaming: push(id) -> newly completed text ('' while a
    multi-byte character is incomplete). Special ids produce no text."""

    def __init__(self, tokenizer: ByteTokenizer) -> None:
        self._tok = tokenizer
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""

    def push(self, token_id: int) -> str:
        if 0 <= token_id < ByteTokenizer.NUM_BYTES:
            piece = self._dec.decode(bytes([token_id]))
        elif self._tok.is_special(token_id):
            piece = ""
        else:
            raise ValueError(f"token id {token_id} outside vocabulary")
        self.text += piece
        return piece

    def flush(self) -> str:
        piece = self._dec.decode(b"", final=True)
        self.text += piece
        return piece


def processor_template(path: Path) -> str | None:
    """The chat template a processor saved beside the tokenizer (chat_template.jinja, or
    chat_template.json's "chat_template"), or None."""
    try:
        if (path / "chat_template.jinja").is_file():
            return (path / "chat_template.jinja").read_text()
        if (path / "chat_template.json").is_file():
            t = json.loads((path / "chat_template.json").read_text()).get("chat_template")
            return t if isinstance(t, str) else None
    except (OSError, ValueError, AttributeError):
        return None
    return None


class HFTokenizer:
    """A transformers tokenizer behind the `Tokenizer` protocol (+ `token_for_char`, `chat`).

    encode() never adds special tokens unless asked (add_bos); decode() drops them. The EOS is
    the tokenizer's eos_token (for chat models usually the end-of-turn token); pad falls back
    to EOS. image_id is the id of `image_token` (e.g. '<image>') or -1 when absent.
    """

    def __init__(self, tokenizer: object, image_token: str = "<image>") -> None:
        self.tok = tokenizer
        eos = getattr(tokenizer, "eos_token_id", None)
        if eos is None:
            raise ValueError("parameter 'hf.tokenizer' = 'auto': the tokenizer has no "
                             "eos_token; the planner needs one to end a plan")
        self.eos_id = int(eos)
        bos = getattr(tokenizer, "bos_token_id", None)
        self.bos_id = -1 if bos is None else int(bos)
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_id = self.eos_id if pad is None else int(pad)
        img = tokenizer.convert_tokens_to_ids(image_token)  # type: ignore[attr-defined]
        unk = getattr(tokenizer, "unk_token_id", None)
        self.image_id = -1 if img is None or img == unk else int(img)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> HFTokenizer:
        """AutoTokenizer from a local directory; ValueError naming 'hf.model_path' if none."""
        try:
            from transformers import AutoTokenizer
        except ImportError as exc:
            raise ValueError("parameter 'hf.tokenizer' = 'auto' needs transformers, which is "
                             "not installed") from exc
        try:
            tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except Exception as exc:  # noqa: BLE001 - missing or corrupt files: name the parameter
            raise ValueError(f"parameter 'hf.model_path' = {str(path)!r}: no loadable tokenizer "
                             f"there ({exc}); save it with the model or set hf.tokenizer: byte"
                             ) from exc
        if not getattr(tok, "chat_template", None):
            tok.chat_template = processor_template(Path(path))
        return cls(tok)

    @property
    def vocab_size(self) -> int:
        return len(self.tok)  # type: ignore[arg-type]

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = list(self.tok.encode(text, add_special_tokens=False))  # type: ignore[attr-defined]
        return ([self.bos_id] if add_bos and self.bos_id >= 0 else []) + ids

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)  # type: ignore[attr-defined]

    def token_for_char(self, ch: str) -> int:
        """The one id whose text is exactly `ch` (used by the plan grammar); ValueError when
        the character is not a single token of this vocabulary."""
        ids = self.encode(ch)
        if len(ids) == 1 and self.decode(ids) == ch:
            return ids[0]
        raise ValueError(f"character {ch!r} is not a single token of this tokenizer "
                         f"(encodes to {ids})")

    def chat(self, system: str, user: str) -> str | None:
        """The prompt text through the model's chat template (generation prompt added), or None
        when the tokenizer has no chat template."""
        if not getattr(self.tok, "chat_template", None):
            return None
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        return self.tok.apply_chat_template(  # type: ignore[attr-defined]
            messages, tokenize=False, add_generation_prompt=True)
