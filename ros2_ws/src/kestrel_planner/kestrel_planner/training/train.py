"""Training and evaluation of the planner VLM on generated pairs (data.py).

Training: teacher forcing on the prompt layout of the local backends (backend_local.
plain_prompt, byte tokens, <bos> first), cross-entropy on the plan tokens and the final <eos>
only (only those positions go through the output head); samples are generated on the fly (no
data set on disk). Every row has an image, as every goal of the node does: the rendered scene
for half of them, noise or a flat colour for the rest, so the plan follows the text whatever
the camera shows. Evaluation images are rendered scenes or masked (no image).

Evaluation on the held-out split (held-out templates and polite frames, scenes from another
seed), greedy decoding with and without the plan grammar:
  grammatical   the text parses as a plan (plan.py), refusals included
  exact         the text equals the target plan
  refusals      of the requests that must be refused: refused with the right reason
  false_refusals of the requests that must not be refused: refused
  accepted      of the requests that must not be refused: the validator accepts the plan
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from kestrel_models.planner import ByteTokenizer, VisionLanguageModel, generate, get_config
from kestrel_planner.core.backend_local import plain_prompt
from kestrel_planner.core.constrained_llg import LLGuidancePlanProcessor, lltokenizer
from kestrel_planner.core.plan import REFUSE, PlanParseError, SceneObject, parse_plan
from kestrel_planner.core.validator import PlanLimits, PlanValidator
from kestrel_planner.training.data import Sample, SampleGenerator, render_scene

__all__ = ["TrainConfig", "train", "evaluate", "EVAL_SEED"]

EVAL_SEED = 1_000_003  # held-out scenes: a seed the training stream never uses
MAX_NEW_TOKENS = 64  # longest target plan: 'pick yellow_cylinder\nplace green_cylinder\nend'


@dataclass
class TrainConfig:
    preset: str = "small"
    steps: int = 1500
    batch: int = 32
    lr: float = 3e-3
    warmup: int = 50
    weight_decay: float = 0.01
    seed: int = 0
    image_p: float = 0.5  # share of rows with a rendered image
    eval_samples: int = 400
    threads: int = 1
    device: str = "cpu"  # torch device of the model ('cuda' on the GPU machine)
    workers: int = 0  # processes generating batches (0: in the training process)
    init: str = ""  # state dict of cfg.preset to start from (fine-tuning); "" = random init


@dataclass
class History:
    loss: list[float] = field(default_factory=list)
    seconds: float = 0.0


# Words and addresses a user adds without changing the request (training rows only): the
# planner learns that the action word and the object words decide the plan, not the rest.
_FILLERS = ("gently", "carefully", "slowly", "just", "quickly", "also", "softly", "again",
            "very carefully", "with care", "if possible", "at once", "when ready", "a little")
_ADDRESS = ("robot", "arm", "ok", "okay", "buddy", "kestrel", "hello", "hi", "alright", "so",
            "well", "listen")


def _augment(rng: random.Random, text: str) -> str:
    """Fillers, addresses, capitals and end punctuation as users type them (the plan does
    not change)."""
    words = text.split(" ")
    if rng.random() < 0.3 and len(words) > 1:  # a filler after the action word
        words.insert(rng.randint(1, len(words)), rng.choice(_FILLERS))
    if rng.random() < 0.15:  # an address before the request
        words.insert(0, rng.choice(_ADDRESS) + rng.choice((",", "", " robot,")))
    text = " ".join(words)
    if rng.random() < 0.3:
        text = text[0].upper() + text[1:]
    if rng.random() < 0.3:
        text += rng.choice((".", "!", "."))
    return text


def _rows(samples: list[Sample], tok: ByteTokenizer, rng: random.Random
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """-> tokens [B, T] (right-padded) and loss targets [B, T] (-100 outside the plan)."""
    seqs, starts = [], []
    for s in samples:
        prompt = tok.encode(plain_prompt(_augment(rng, s.instruction), s.objects), add_bos=True)
        seqs.append(prompt + tok.encode(s.plan) + [tok.eos_id])
        starts.append(len(prompt))
    t = max(len(x) for x in seqs)
    tokens = torch.full((len(seqs), t), tok.pad_id, dtype=torch.long)
    target = torch.full((len(seqs), t), -100, dtype=torch.long)
    for i, (x, k) in enumerate(zip(seqs, starts, strict=True)):
        tokens[i, : len(x)] = torch.tensor(x)
        # position j predicts token j + 1: targets are the plan tokens and <eos>
        target[i, k - 1: len(x) - 1] = torch.tensor(x[k:])
    return tokens, target


def _images(samples: list[Sample], p: float, size: int, rng: np.random.Generator
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 [B, 3, size, size] and the image mask [B] (False: no image for that row)."""
    imgs = np.zeros((len(samples), size, size, 3), np.uint8)
    mask = rng.random(len(samples)) < p
    for i, s in enumerate(samples):
        if mask[i]:
            imgs[i] = render_scene(s.objects, s.positions, rng, size)
    return torch.from_numpy(imgs).permute(0, 3, 1, 2).contiguous(), torch.from_numpy(mask)


def _train_images(samples: list[Sample], p: float, size: int, rng: np.random.Generator
                  ) -> torch.Tensor:
    """uint8 [B, 3, size, size]: the rendered scene for a share p of the rows, else noise or
    one flat colour (the plan must follow the text, whatever the camera shows)."""
    imgs = np.empty((len(samples), size, size, 3), np.uint8)
    for i, s in enumerate(samples):
        u = rng.random()
        if u < p:
            imgs[i] = render_scene(s.objects, s.positions, rng, size)
        elif u < p + (1 - p) / 2:
            imgs[i] = rng.integers(0, 256, (size, size, 3))
        else:
            imgs[i] = rng.integers(0, 256, 3)
    return torch.from_numpy(imgs).permute(0, 3, 1, 2).contiguous()


class _Batches(torch.utils.data.IterableDataset):
    """Endless training batches (tokens, targets, images) from the generator; worker w of W
    draws from seed * 1000 + w, so a run is reproducible for a given number of workers."""

    def __init__(self, cfg: TrainConfig, size: int) -> None:
        self.cfg, self.size = cfg, size

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        seed = self.cfg.seed if info is None else self.cfg.seed * 1000 + info.id
        gen = SampleGenerator(seed, "train")
        rng, nrng = random.Random(seed + 1), np.random.default_rng(seed + 2)
        tok = ByteTokenizer()
        while True:
            samples = [gen.sample() for _ in range(self.cfg.batch)]
            tokens, target = _rows(samples, tok, rng)
            yield tokens, target, _train_images(samples, self.cfg.image_p, self.size, nrng)


def train(cfg: TrainConfig, on_step: Callable[[int, float], None] | None = None
          ) -> tuple[VisionLanguageModel, History]:
    """Train a model of cfg.preset (fresh, or from cfg.init); on_step(step, loss) after every
    step."""
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads)
    dev = torch.device(cfg.device)
    model = VisionLanguageModel(get_config(cfg.preset))
    if cfg.init:  # a missing or mismatched file fails here, naming it (load_state_dict: strict)
        model.load_state_dict(torch.load(cfg.init, map_location="cpu", weights_only=True))
    model = model.to(dev).train()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    other = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": other, "weight_decay": 0.0}], lr=cfg.lr,
                            betas=(0.9, 0.98))

    def lr_at(step: int) -> float:
        if step < cfg.warmup:
            return cfg.lr * (step + 1) / cfg.warmup
        frac = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
        return cfg.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * frac)))

    hist = History()
    t0 = time.monotonic()
    batches = iter(torch.utils.data.DataLoader(
        _Batches(cfg, model.cfg.image_size), batch_size=None, num_workers=cfg.workers,
        pin_memory=dev.type == "cuda", prefetch_factor=4 if cfg.workers else None))
    for step in range(cfg.steps):
        tokens, target, image = (x.to(dev, non_blocking=True) for x in next(batches))
        select = target >= 0
        loss = F.cross_entropy(model.train_logits(image, tokens, select), target[select])
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        value = loss.item()
        hist.loss.append(value)
        if on_step is not None:
            on_step(step, value)
    hist.seconds = time.monotonic() - t0
    return model.cpu().eval(), hist


def _scene(s: Sample) -> list[SceneObject]:
    return [SceneObject(n, n, s.positions[n]) for n in s.objects]


def evaluate(model: VisionLanguageModel, n: int, grammar: bool, seed: int = EVAL_SEED,
             batch: int = 32, image_p: float = 0.5,
             on_batch: Callable[[int], None] | None = None) -> dict:
    """Greedy decoding of n held-out samples, with (grammar=True) or without the plan grammar;
    the metrics of the module doc, plus per-kind exact rates and a few failures."""
    tok = ByteTokenizer()
    lltok = lltokenizer(tok) if grammar else None
    gen = SampleGenerator(seed, "heldout")
    nrng = np.random.default_rng(seed)
    validator = PlanValidator(PlanLimits(max_speed=0.5, max_height=0.4, max_steps=8))
    model.eval()
    model.setup_cache(batch, model.cfg.max_seq_len)
    counts = {"n": 0, "grammatical": 0, "exact": 0, "refusal_n": 0, "refusals": 0,
              "positive_n": 0, "false_refusals": 0, "accepted": 0}
    per_kind: dict[str, list[int]] = {}
    failures: list[dict] = []
    try:
        done = 0
        while done < n:
            samples = [gen.sample() for _ in range(min(batch, n - done))]
            prompts = [tok.encode(plain_prompt(s.instruction, s.objects), add_bos=True)
                       for s in samples]
            image, mask = _images(samples, image_p, model.cfg.image_size, nrng)
            procs = None
            if lltok is not None:
                procs = [LLGuidancePlanProcessor(lltok, s.objects, 8, MAX_NEW_TOKENS)
                         for s in samples]
            res = generate(model, prompts, tok.eos_id, tok.pad_id, MAX_NEW_TOKENS, image=image,
                           image_mask=mask, logits_processor=procs)
            for s, ids in zip(samples, res.tokens, strict=True):
                _score(tok.decode(ids).strip(), s, validator, counts, per_kind, failures)
            done += len(samples)
            if on_batch is not None:
                on_batch(done)
    finally:
        for layer in model.layers:
            layer.attn.cache = None
    return _metrics(counts, per_kind, failures)


def _score(text: str, s: Sample, validator: PlanValidator, counts: dict,
           per_kind: dict[str, list[int]], failures: list[dict]) -> None:
    counts["n"] += 1
    exact = text == s.plan
    counts["exact"] += exact
    k = per_kind.setdefault(s.kind, [0, 0])
    k[0] += exact
    k[1] += 1
    try:
        plan = parse_plan(text)
        counts["grammatical"] += 1
    except PlanParseError:
        plan = None
    must_refuse = s.plan.startswith(REFUSE)
    if must_refuse:
        counts["refusal_n"] += 1
        counts["refusals"] += exact
    else:
        counts["positive_n"] += 1
        if plan is not None and plan.refusal:
            counts["false_refusals"] += 1
        elif plan is not None and validator.validate(plan, _scene(s)).accepted:
            counts["accepted"] += 1
    if not exact and len(failures) < 12:
        failures.append({"instruction": s.instruction, "objects": s.objects,
                         "expected": s.plan, "got": text})


def _metrics(c: dict, per_kind: dict[str, list[int]], failures: list[dict]) -> dict:
    def rate(a: int, b: int) -> float:
        return round(a / b, 4) if b else float("nan")

    return {"samples": c["n"], "grammatical": rate(c["grammatical"], c["n"]),
            "exact": rate(c["exact"], c["n"]),
            "refusals": rate(c["refusals"], c["refusal_n"]),
            "false_refusals": rate(c["false_refusals"], c["positive_n"]),
            "accepted": rate(c["accepted"], c["positive_n"]),
            "exact_by_kind": {k: rate(a, b) for k, (a, b) in sorted(per_kind.items())},
            "failures": failures}


def config_dict(cfg: TrainConfig) -> dict:
    return asdict(cfg)
