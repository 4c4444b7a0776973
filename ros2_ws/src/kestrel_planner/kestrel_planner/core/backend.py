"""Decoding backends of the planner: what PlannerCore hands them and what they give back.

  generate | engine  our VLM (backend_local.py): byte tokenizer, plan grammar, batched decode
  hf                 a Hugging Face VLM from a local directory (backend_hf.py)
  remote             an OpenAI-compatible server: vLLM, SGLang, TensorRT-LLM (backend_remote.py)
  plan_text          no model: the instruction is the plan text (backend_text.py)

A backend only turns DecodeJobs into text. PlannerCore does the rest for all of them alike:
request checks before, and after: the same plan parser and validator (skills enum, targets in
the current scene, numeric limits). No backend output reaches control without them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

__all__ = ["BACKENDS", "DecodeJob", "DecodeOutput", "PlanBackend", "OnToken", "StopFn",
           "PlannerInputError"]

BACKENDS = ("generate", "engine", "hf", "remote", "plan_text")
OnToken = Callable[[int, str], None]  # (tokens generated so far, partial plan text)
StopFn = Callable[[], bool]


class PlannerInputError(ValueError):
    """A request the planner cannot serve (bad image, bad instruction, prompt too long); the node
    reports it as VALIDATION_ERROR."""


@dataclass
class DecodeJob:
    """One request as a backend sees it. instruction: normalised and length-capped (data, never
    rules); names: the scene's valid object names, in order; cap: max plan steps (>= 1);
    image: uint8 [H, W, 3] RGB (checked) or None."""

    instruction: str
    names: list[str]
    cap: int
    image: np.ndarray | None
    on_token: OnToken | None = None
    should_cancel: StopFn | None = None


@dataclass
class DecodeOutput:
    """text: the plan text form to parse (or the raw reply when `reject` is set).
    stop_reason: 'eos' | 'max_new_tokens' | 'no_allowed_token' | 'cancelled' | 'stop' | 'error'.
    error: planning failed without a reply (server unreachable...): the node answers
    VALIDATION_ERROR. reject: a reply that is not a plan: the plan is REJECTED with it.
    ttft_s: s from the start of decode() to this row's first token (whole reply for remote).
    drafted / accepted: speculative decoding's draft tokens proposed for this row / accepted
    by the model (0 / 0 without it); prefix_hit: the prefix cache's KV was reused for this row
    (None: no prefix cache)."""

    text: str
    stop_reason: str
    ttft_s: float
    tokens: int
    error: str = ""
    reject: str = ""
    drafted: int = 0
    accepted: int = 0
    prefix_hit: bool | None = None


class PlanBackend(Protocol):
    name: str
    warmup: bool  # whether PlannerCore should run a warm-up plan at construction

    def decode(self, jobs: Sequence[DecodeJob]) -> list[DecodeOutput]:
        """Decode all jobs (len <= max_batch). Checks every job first and raises
        PlannerInputError (naming the job index) before decoding anything."""
        ...

    def close(self) -> None: ...
