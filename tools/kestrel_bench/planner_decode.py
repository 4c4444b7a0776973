"""The planner decode options of `kestrel_bench planner`, each against the same engine without
it: prefix reuse (TTFT) and speculative decoding with trained weights (plan latency, accepted
draft tokens, agreement).

prefix_cache (random weights of --config, runs with --quick on the CPU), TTFT of one request
(submit -> first token on the host), the engine's defaults (on CUDA: graphed batched prefill;
a reused prefix's rest padded to a bucket, a graph per (slot, bucket, kv bucket)), the
requests one after another:
  prefix_system_off / _on   a 48-token system prefix before the image (chat layouts):
                            DecodeEngine(system_prefix, prefix_cache=False / True)
  prefix_scene_off / _on    the node's layout [image][scene tokens][task tokens]: the same
                            frame and scene line (40 tokens), a new task line (24 tokens) per
                            request; prefix_entries 0 / 8 (the store is filled by a warm-up)
spec_trained (needs --target-weights and --draft-weights: a target and a draft trained on the
planner task, scripts/train_planner.py --preset <target> / --preset draft), --goals held-out
goals of the training generator (rendered scene, object line, instruction), one at a time,
greedy under the plan grammar (llguidance), the node's prompt and budget (64 new tokens):
  spec_engine               DecodeEngine (the node's backend engine), the reference
  spec_generate             the generate backend's decode loop (kestrel_models.planner.generate)
  spec_draft_k<k>           SpeculativeDecoder, the trained draft, k = --k
  spec_layers<n>_k<k>       SpeculativeDecoder, the target's first --draft-layers layers
Rows: latency = plan decode time per goal (ms); throughput = generated tokens / decode time;
metrics: acceptance_rate (accepted / proposed draft tokens), tokens_per_round, agree_engine
(share of goals whose plan text equals the engine's: greedy decoding makes them equal up to
float rounding), exact (share of goals whose plan equals the generator's target plan).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from kestrel_bench import stats

SCENE_TOKENS, TASK_TOKENS, SYSTEM_TOKENS = 40, 24, 48


def _ttfts(eng: Any, requests: list[tuple[list[int], torch.Tensor, dict]], new_tokens: int
           ) -> tuple[list[float], list[list[int]]]:
    ttft, toks = [], []
    for prompt, image, kw in requests:
        r = eng.submit(prompt, new_tokens, image, **kw)
        eng.run()
        ttft.append(r.ttft_s)
        toks.append(r.tokens)
    return ttft, toks


def bench_prefix(model: Any, prompt: list[int], image: torch.Tensor, reps: int,
                 max_len: int, new_tokens: int = 4) -> dict[str, dict]:
    """The four prefix rows of the module doc -> name: {ttft_ms summary, same_tokens}."""
    from kestrel_models.planner.engine import DecodeEngine

    g = torch.Generator().manual_seed(7)
    n = max(reps, 8)
    tasks = [torch.randint(0, 256, (TASK_TOKENS,), generator=g).tolist() for _ in range(n)]
    scene = prompt[:SCENE_TOKENS]
    system, rest = prompt[:SYSTEM_TOKENS], prompt[SYSTEM_TOKENS:]
    layouts = {
        "system": ([(rest, image, {})] * n,
                   lambda on: DecodeEngine(model, 1, max_len, -1, system_prefix=system,
                                           prefix_cache=on)),
        "scene": ([(scene + t, image, {"image_key": "frame", "prefix_tokens": len(scene)})
                   for t in tasks],
                  lambda on: DecodeEngine(model, 1, max_len, -1, prefix_entries=8 if on else 0)),
    }
    out: dict[str, dict] = {}
    for name, (reqs, make) in layouts.items():
        tokens = {}
        for on in (False, True):
            eng = make(on)
            _ttfts(eng, reqs[:2], new_tokens)  # warm-up (and, for the scene, the kept prefix)
            ttft, tokens[on] = _ttfts(eng, reqs, new_tokens)
            out[f"prefix_{name}_{'on' if on else 'off'}"] = dict(
                ttft_ms=stats.summary(ttft, 1e3), prefix_tokens=(
                    SYSTEM_TOKENS if name == "system" else SCENE_TOKENS),
                image_tokens=model.cfg.num_image_tokens,
                reused=eng.store.hits if name == "scene" else (n if on else 0))
        out[f"prefix_{name}_on"]["same_tokens"] = tokens[True] == tokens[False]
    return out


def _load(path: str, preset: str, dev: torch.device, dtype: torch.dtype) -> Any:
    from kestrel_models.planner import VisionLanguageModel, get_config

    model = VisionLanguageModel(get_config(preset))
    model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    return model.to(dev, dtype).eval()


def _goals(n: int, size: int) -> list[tuple[Any, torch.Tensor]]:
    """n held-out samples of the training generator with their rendered scenes [3, S, S]."""
    from kestrel_planner.training.data import SampleGenerator, render_scene
    from kestrel_planner.training.train import EVAL_SEED

    gen, rng = SampleGenerator(EVAL_SEED, "heldout"), np.random.default_rng(EVAL_SEED)
    out = []
    for _ in range(n):
        s = gen.sample()
        img = render_scene(s.objects, s.positions, rng, size)
        out.append((s, torch.from_numpy(img).permute(2, 0, 1).contiguous()))
    return out


def bench_spec_trained(target_path: str, target_preset: str, draft_path: str,
                       draft_preset: str, k: int, draft_layers: int, goals: int,
                       dev: torch.device, dtype: torch.dtype, new_tokens: int = 64
                       ) -> dict[str, dict]:
    """The spec rows of the module doc -> name: row dict."""
    from kestrel_models.planner import ByteTokenizer
    from kestrel_models.planner.engine import DecodeEngine
    from kestrel_models.planner.speculative import SpeculativeDecoder, truncated_draft
    from kestrel_planner.core.backend_local import plain_prompt
    from kestrel_planner.core.constrained_llg import LLGuidancePlanProcessor, lltokenizer

    tok = ByteTokenizer()
    lltok = lltokenizer(tok)
    target = _load(target_path, target_preset, dev, dtype)
    draft = _load(draft_path, draft_preset, dev, dtype)
    max_len = target.cfg.max_seq_len
    samples = _goals(goals + 2, target.cfg.image_size)  # the first 2: warm-up
    prompts = [tok.encode(plain_prompt(s.instruction, s.objects), add_bos=True)
               for s, _ in samples]
    decoders: dict[str, Any] = {
        "spec_engine": DecodeEngine(target, 1, max_len, tok.eos_id),
        "spec_generate": _GenerateLoop(target, tok.eos_id, tok.pad_id, max_len)}
    decoders[f"spec_draft_k{k}"] = SpeculativeDecoder(target, draft, k, 1, max_len, tok.eos_id)
    if 1 <= draft_layers < target.cfg.n_layers:
        decoders[f"spec_layers{draft_layers}_k{k}"] = SpeculativeDecoder(
            target, truncated_draft(target, draft_layers), k, 1, max_len, tok.eos_id)
    rows: dict[str, dict] = {}
    ref: list[str] = []
    for name, dec in decoders.items():
        times, texts, ntok, drafted, accepted, rounds = [], [], 0, 0, 0, 0
        for i, ((s, img), prompt) in enumerate(zip(samples, prompts, strict=True)):
            proc = LLGuidancePlanProcessor(lltok, s.objects, 8, new_tokens)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            res = dec.generate([prompt], new_tokens, images=[img.to(dev)],
                               logits_processor=[proc])
            dt = time.perf_counter() - t0
            if i < 2:
                continue
            times.append(dt)
            texts.append(tok.decode(res.tokens[0]).strip())
            ntok += len(res.tokens[0])
            if hasattr(res, "drafted"):
                drafted, accepted, rounds = (drafted + res.drafted, accepted + res.accepted,
                                             rounds + res.rounds)
        if not ref:
            ref = texts
        row = dict(plan_ms=stats.summary(times, 1e3), tok_s=ntok / sum(times),
                   tokens_per_goal=ntok / len(times),
                   agree_engine=sum(a == b for a, b in zip(texts, ref, strict=True)) / len(ref),
                   exact=sum(t == s.plan for t, (s, _) in zip(texts, samples[2:], strict=True))
                   / len(texts), goals=len(times))
        if drafted:
            row.update(acceptance_rate=accepted / drafted,
                       tokens_per_round=(ntok / rounds) if rounds else None, k=k)
        rows[name] = row
    return rows


class _GenerateLoop:
    """The planner's `generate` backend decode loop (kestrel_models.planner.generate) behind
    the engine's generate() call shape: the baseline of a node on that backend."""

    def __init__(self, model: Any, eos_id: int, pad_id: int, max_len: int) -> None:
        self.model, self.eos_id, self.pad_id = model, eos_id, pad_id
        model.setup_cache(1, max_len)  # as the backend does at configure (one goal at a time)

    def generate(self, prompts: list[list[int]], max_new: int, images: list[torch.Tensor],
                 logits_processor: list[Any]) -> Any:
        from kestrel_models.planner import generate as generate_tokens

        image = torch.stack(images)
        mask = torch.ones(len(images), dtype=torch.bool)
        return generate_tokens(self.model, prompts, self.eos_id, self.pad_id, max_new,
                               image=image, image_mask=mask, logits_processor=logits_processor)


def to_record(record: Any, rows: dict[str, dict]) -> None:
    """Prefix and trained-speculative rows (own metrics) into the record, with their ratios."""
    for name, r in rows.items():
        if "skipped" in r or "error" in r:
            record.add(name, "variant", **{k: r[k] for k in ("skipped", "error") if k in r})
        elif name.startswith("prefix_"):
            record.add(name, "variant", latency_ms=r["ttft_ms"], metrics={
                k: r[k] for k in ("prefix_tokens", "image_tokens", "reused", "same_tokens")
                if k in r}, config={"measure": "TTFT of one request (submit -> first token)"})
        else:
            record.add(name, "variant", latency_ms=r["plan_ms"], throughput=r["tok_s"],
                       unit="tok/s", metrics={k: r[k] for k in (
                           "acceptance_rate", "tokens_per_round", "k", "agree_engine", "exact",
                           "tokens_per_goal", "goals") if r.get(k) is not None},
                       config={"measure": "plan decode time per goal, greedy, plan grammar"})
    for name in ("system", "scene"):
        off, on = rows.get(f"prefix_{name}_off", {}), rows.get(f"prefix_{name}_on", {})
        if "ttft_ms" in off and "ttft_ms" in on:
            record.ratio(f"prefix_{name}_ttft_off_vs_on",
                         stats.ratio(off["ttft_ms"]["p50"], on["ttft_ms"]["p50"]))
    for ref in ("engine", "generate"):  # the two backends' decode loops without a draft
        base = rows.get(f"spec_{ref}", {}).get("plan_ms", {}).get("p50")
        for name, r in rows.items():
            if name.startswith("spec_") and name not in ("spec_engine", "spec_generate") \
                    and "plan_ms" in r and base:
                record.ratio(f"{name}_vs_{ref}_plan_time",
                             stats.ratio(base, r["plan_ms"]["p50"]))
