"""Backend 'hf': a Hugging Face image-text-to-text model from a LOCAL directory (local_files_only:
nothing is downloaded). Where the architecture is one the decode engine runs (LLaVA-1.5 /
LLaVA-NeXT, Idefics3 / SmolVLM, Qwen2-VL / Qwen2.5-VL: kestrel_models.planner.hf_engine) the
checkpoint's decoder runs on the engine (static KV cache, CUDA graphs, continuous batching;
`engine_compile` compiles its step on CUDA); otherwise transformers runs it row by row
(kestrel_models.planner.hf: LLaVA-style checkpoints). `note` says which and why (the node logs
it at configure).

Tokenizer (hf_tokenizer): 'auto' = the directory's own (AutoTokenizer); its chat template, when
present, wraps the chat system prompt (prompting.py) and the request; without one the Kestrel
plain layout is used. 'byte' = Kestrel's byte tokenizer and plain layout (a Kestrel-trained
model exported to HF format, and the CPU tests).
Grammar (hf_grammar): true = decoding is constrained to the plan grammar, by the engine of
`grammar_engine`: 'llguidance' (default, constrained_llg.py) computes token masks for any fast
tokenizer, BPE included (multi-character tokens are fine; names the vocabulary cannot spell one
character per token are left out of the grammar so that the token budget stays exact);
'automaton' (constrained.py) needs every plan character as a single token (configure fails
naming 'hf.grammar' otherwise). false = free decoding, the text is
held to the schema by the prompt plus the parser and validator only.
Image place: on the engine the image goes where the model's chat template puts it (a user turn
whose content is [image, text]; where the template cannot render that, the model's image
tokens lead the user text); without a chat template, right after <bos>. On the transformers
path the image placeholder tokens go before the whole prompt. For large checkpoints served
with vLLM, backend 'remote' is the scalable path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from kestrel_models.planner import ByteTokenizer
from kestrel_models.planner.engine_request import pow2_ladder
from kestrel_models.planner.hf import parse_dtype
from kestrel_models.planner.hf_engine.runner import open_hf
from kestrel_models.planner.tokenizer import HFTokenizer
from kestrel_planner.core.backend import DecodeJob, DecodeOutput, PlannerInputError
from kestrel_planner.core.backend_local import WARM_PROMPT_TOKENS, plain_prompt
from kestrel_planner.core.constrained import PlanGrammar, PlanLogitsProcessor
from kestrel_planner.core.constrained_llg import LLGuidancePlanProcessor, lltokenizer
from kestrel_planner.core.plan import PlanParseError
from kestrel_planner.core.prompting import chat_system_prompt, reply_to_plan_text, user_prompt

if TYPE_CHECKING:
    from kestrel_planner.core.planner_core import PlannerConfig

__all__ = ["HFPlanBackend", "GRAMMAR_CHARS", "char_token_map"]

GRAMMAR_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789_ =-.\n"


def char_token_map(tokenizer: ByteTokenizer | HFTokenizer) -> dict[str, int]:
    """Each plan character -> its single-token id; ValueError naming 'hf.grammar' if one is
    missing. A candidate must decode to the character alone AND twice in a row (this excludes
    SentencePiece word-start pieces like '\u2581a', which decode to ' a' mid-text)."""
    out: dict[str, int] = {}
    for ch in GRAMMAR_CHARS:
        cands: list[int] = []
        try:
            cands.append(tokenizer.token_for_char(ch))
        except ValueError:
            pass
        if isinstance(tokenizer, HFTokenizer):
            for piece in (ch, f"<0x{ord(ch):02X}>"):
                tid = tokenizer.tok.convert_tokens_to_ids(piece)  # type: ignore[attr-defined]
                if isinstance(tid, int) and tid >= 0:
                    cands.append(tid)
        ok = [t for t in cands
              if tokenizer.decode([t]) == ch and tokenizer.decode([t, t]) == ch * 2]
        if not ok:
            raise ValueError(f"parameter 'hf.grammar' = True: the tokenizer has no single token "
                             f"for {ch!r}; set hf.grammar: false (prompt + parser + validator "
                             "only)")
        out[ch] = ok[0]
    return out


class HFPlanBackend:
    warmup = True

    def __init__(self, config: PlannerConfig) -> None:
        self.name = "hf"
        self.config = config
        dtype = parse_dtype(config.hf_dtype)
        if config.hf_tokenizer == "byte":
            self.tokenizer: ByteTokenizer | HFTokenizer = ByteTokenizer()
        else:
            self.tokenizer = HFTokenizer.from_pretrained(config.hf_model_path)
        hf_tok = self.tokenizer.tok if isinstance(self.tokenizer, HFTokenizer) else None
        self.vlm, self.note = open_hf(config.hf_model_path, config.device, dtype,
                                      eos_id=self.tokenizer.eos_id, max_batch=config.max_batch,
                                      compile_step=config.engine_compile, tokenizer=hf_tok)
        self.fallback = self.vlm.kind != "engine"  # transformers: `note` says why
        eng = getattr(self.vlm, "engine", None)
        if eng is not None and eng.cuda_graph and not any(config.hf_warmup_image_size):
            self.note += ("; hf.warmup_image_size is [0, 0]: the first goal of each frame "
                          "size captures its CUDA graphs")
        if self.vlm.vocab_size and self.tokenizer.vocab_size > self.vlm.vocab_size:
            raise ValueError(f"parameter 'hf.tokenizer' = {config.hf_tokenizer!r}: its "
                             f"{self.tokenizer.vocab_size} tokens exceed the model's vocabulary "
                             f"of {self.vlm.vocab_size}")
        llg = config.hf_grammar and config.grammar_engine == "llguidance"
        self._lltok = lltokenizer(self.tokenizer) if llg else None  # ~1 s for HF: once
        self._chars = (char_token_map(self.tokenizer)
                       if config.hf_grammar and not llg else None)
        self._chat = (isinstance(self.tokenizer, HFTokenizer)
                      and self.tokenizer.chat("s", "u") is not None)
        self._system = chat_system_prompt(config.limits, "text")

    def close(self) -> None:
        pass

    # ---- CUDA graphs -----------------------------------------------------------------------
    def warm_graphs(self) -> int:
        """Capture now (at configure) the graphs that goals on frames of hf_warmup_image_size
        replay, so that no such goal pays for a capture (or, with engine_compile, a compile):
        the prefill of 1..max_batch goals at each prompt bucket from the shortest plan prompt's
        (the system prompt and the chat template set it) up to the bucket after it, at least
        WARM_PROMPT_TOKENS, within the model's positions; then the decode step per batch and
        kv bucket up to what those prompts and the plan budget reach. Returns the graphs
        captured: 0 on transformers, without CUDA graphs (the CPU) or without a size."""
        eng = getattr(self.vlm, "engine", None)
        w, h = self.config.hf_warmup_image_size
        if eng is None or not eng.cuda_graph or w <= 0:
            return 0
        before = self.graph_count()
        cfg = self.config
        frame = np.zeros((h, w, 3), np.uint8)
        base = self.prompt_ids(DecodeJob("go", [], 1, frame))
        marker = self.vlm.image_marker
        n_text = len(base) - int(marker is not None and marker in base)
        n_img = self.vlm.image_tokens((3, h, w))
        room = self.vlm.max_positions - n_img - cfg.max_new_tokens
        length = 1 << max(4, (n_text - 1).bit_length())  # the engine's prompt bucket
        top = min(room, max(WARM_PROMPT_TOKENS, 2 * length))
        image = torch.zeros(3, h, w, dtype=torch.uint8)
        reached = n_img + n_text
        while length <= top:
            prompt = base + [base[-1]] * (length - n_text)  # filler: only the shape counts
            for n in range(1, cfg.max_batch + 1):  # one token: the prefill alone
                self.vlm.generate([prompt] * n, self.tokenizer.eos_id, 1, images=[image] * n)
            reached = n_img + length
            length *= 2
        longest = min(reached + cfg.max_new_tokens, self.vlm.max_positions)
        eng.warmup(range(1, cfg.max_batch + 1), pow2_ladder(128, longest),
                   cfg.temperature > 0)
        return self.graph_count() - before

    def graph_count(self) -> int:
        """CUDA graphs the engine captured so far (prefill and decode step; 0: transformers)."""
        eng = getattr(self.vlm, "engine", None)
        return 0 if eng is None else eng.graph_count()

    def _image_chat(self, user: str) -> list[int]:
        """The chat prompt with the image where the model's template puts it: a user turn of
        [image, text]; the model's image tokens before the user text where the template cannot
        render that (exactly one image marker either way)."""
        tok = self.tokenizer.tok  # type: ignore[union-attr]
        marker = self.vlm.image_marker
        msgs = [{"role": "system", "content": self._system},
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": user}]}]
        try:
            ids = self.tokenizer.encode(tok.apply_chat_template(msgs, tokenize=False,
                                                                add_generation_prompt=True))
        except Exception:  # noqa: BLE001 - a template for text content only
            ids = []
        if ids.count(marker) == 1:
            return ids
        lead = tok.decode(self.vlm.image_prompt_ids, skip_special_tokens=False)
        return self.tokenizer.encode(self.tokenizer.chat(  # type: ignore[union-attr]
            self._system, f"{lead}\n{user}"))

    def prompt_ids(self, job: DecodeJob) -> list[int]:
        marker = self.vlm.image_marker  # None: the image goes before the prompt
        user = user_prompt(job.instruction, job.names, job.cap)
        if self._chat and job.image is not None and marker is not None:
            ids = self._image_chat(user)
        elif self._chat:
            text = self.tokenizer.chat(self._system, user)  # type: ignore[union-attr]
            ids = self.tokenizer.encode(text)  # the template adds its own special tokens
        else:
            ids = self.tokenizer.encode(plain_prompt(job.instruction, job.names), add_bos=True)
            if job.image is not None and marker is not None:  # the image right after <bos>
                k = int(bool(ids) and ids[0] == self.tokenizer.bos_id)
                ids = ids[:k] + list(self.vlm.image_prompt_ids) + ids[k:]
        shape = None if job.image is None else (3, *job.image.shape[:2])
        n_img = self.vlm.image_tokens(shape) if shape is not None else 0
        limit = self.vlm.max_positions
        if limit and len(ids) + n_img + self.config.max_new_tokens > limit:
            raise PlannerInputError(f"prompt of {len(ids)} tokens + {n_img} image tokens + "
                                    f"max_new_tokens exceed the model's {limit} positions "
                                    "(too many scene objects)")
        return ids

    def processor(self, job: DecodeJob) -> LLGuidancePlanProcessor | PlanLogitsProcessor | None:
        """The plan-grammar logits processor of one job; None with hf_grammar false."""
        n = self.config.max_new_tokens
        if self._lltok is not None:
            return LLGuidancePlanProcessor(self._lltok, job.names, job.cap, n)
        if self._chars is not None:
            return PlanLogitsProcessor(PlanGrammar(job.names, job.cap), self._chars,
                                       self.tokenizer.eos_id, n)
        return None

    def decode(self, jobs: Sequence[DecodeJob]) -> list[DecodeOutput]:
        cfg = self.config
        prompts = []
        for k, j in enumerate(jobs):
            try:
                prompts.append(self.prompt_ids(j))
            except PlannerInputError as exc:
                raise PlannerInputError(f"request {k}: {exc}") from exc
        procs = [self.processor(j) for j in jobs]
        images = [None if j.image is None else
                  torch.from_numpy(j.image.copy()).permute(2, 0, 1).contiguous() for j in jobs]
        toks: list[list[int]] = [[] for _ in jobs]

        def on_token(row: int, tok: int) -> None:
            toks[row].append(tok)
            cb = jobs[row].on_token
            if cb is not None:
                cb(len(toks[row]), self.tokenizer.decode(toks[row]))

        res = self.vlm.generate(prompts, self.tokenizer.eos_id, cfg.max_new_tokens,
                                images=images, temperature=cfg.temperature,
                                generator=torch.Generator().manual_seed(cfg.seed),
                                logits_processor=procs, on_token=on_token,
                                should_stop=[j.should_cancel for j in jobs])
        out = []
        for k in range(len(jobs)):
            raw = self.tokenizer.decode(res.tokens[k])
            o = DecodeOutput(raw, res.stop_reasons[k], res.ttft_rows[k], len(res.tokens[k]))
            if procs[k] is None and o.stop_reason != "cancelled":
                try:
                    o.text = reply_to_plan_text(raw)
                except PlanParseError as exc:
                    o.reject = f"parse error: {exc}"
            out.append(o)
        return out

