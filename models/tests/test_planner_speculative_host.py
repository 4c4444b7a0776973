"""Speculative decoding with host decisions (logits processors, streaming, cancel): the text is
the target's own under the same processor; the acceptance rule keeps the masked distribution."""

from __future__ import annotations

import itertools

import pytest
import torch

from kestrel_models.planner import VisionLanguageModel, VLMConfig, get_config
from kestrel_models.planner.engine import DecodeEngine
from kestrel_models.planner.speculative import SpeculativeDecoder, truncated_draft

torch.set_num_threads(1)
EOS = 257


def sharpen(m: VisionLanguageModel, scale: float = 30.0) -> VisionLanguageModel:
    with torch.no_grad():
        for p in m.parameters():
            if p.ndim >= 2:
                p.mul_(scale)
    return m


@pytest.fixture(scope="module")
def models() -> tuple[VisionLanguageModel, VisionLanguageModel]:
    torch.manual_seed(0)
    target = sharpen(VisionLanguageModel(get_config("tiny")).eval())
    dcfg = get_config("tiny").with_overrides(dim=64, n_layers=1, n_heads=2, n_kv_heads=1,
                                             ffn_hidden=128)
    return target, sharpen(VisionLanguageModel(dcfg).eval())


class Letters:
    """Mask-only processor: lower-case letters for 12 tokens, then only <eos>; token 'z' is
    never allowed, and nothing at all at position `dead` (when set)."""

    def __init__(self, dead: int = -1) -> None:
        self.dead = dead

    def __call__(self, prefix: list[int], logits: torch.Tensor) -> torch.Tensor:
        keep = torch.zeros(logits.shape[-1], dtype=torch.bool)
        if len(prefix) == self.dead:
            pass
        elif len(prefix) >= 12:
            keep[EOS] = True
        else:
            keep[ord("a"):ord("z")] = True
        return logits.masked_fill(~keep, float("-inf"))


def _inputs(b: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 9, 2)][:b]
    imgs = list(torch.randint(0, 256, (b, 3, 32, 32), dtype=torch.uint8, generator=g))
    return prompts, imgs


def _engine(target: VisionLanguageModel, prompts, imgs, procs, n: int = 20):  # noqa: ANN001, ANN202
    eng = DecodeEngine(target, 3, 256, EOS)
    return eng.generate(prompts, n, images=imgs, logits_processor=procs)


def test_greedy_under_a_processor_is_the_targets_text(models) -> None:  # noqa: ANN001
    target, draft = models
    prompts, imgs = _inputs(3)
    procs = [Letters(), Letters(dead=7), None]
    ref = _engine(target, prompts, imgs, procs)
    assert ref.stop_reasons == ["eos", "no_allowed_token", "max_new_tokens"]
    for d, k in ((draft, 1), (draft, 4), (truncated_draft(target, 2), 3)):
        spec = SpeculativeDecoder(target, d, k=k, max_batch=3, max_len=256, eos_id=EOS)
        res = spec.generate(prompts, 20, images=imgs, logits_processor=procs)
        assert res.tokens == ref.tokens, k
        assert res.stop_reasons == ref.stop_reasons
        assert all(ord("a") <= t < ord("z") for t in res.tokens[0])
        assert 0.0 <= res.acceptance_rate < 1.0
        assert sum(res.drafted_rows) == res.drafted and sum(res.accepted_rows) == res.accepted
        assert len(res.ttft_rows) == 3 and min(res.ttft_rows) == res.ttft_s
    # the target as its own draft: every draft token is accepted
    same = SpeculativeDecoder(target, target, k=4, max_batch=3, max_len=256, eos_id=EOS)
    res = same.generate(prompts, 20, images=imgs, logits_processor=procs)
    assert res.tokens == ref.tokens and res.acceptance_rate == 1.0
    assert res.rounds < sum(len(t) for t in res.tokens) / 3  # several tokens per round


def test_rows_with_and_without_an_image_in_one_batch(models, cpu_graphs: None) -> None:  # noqa: ANN001
    """Prefill groups contiguous rows by image shape; a batch mixing rows with and without an
    image decodes each row as the engine does, eagerly and on the graph path (cpu_graphs),
    where a second call replays the prefill graphs."""

    target, draft = models
    prompts, imgs = _inputs(3)
    imgs[1] = None
    procs = [Letters(), Letters(), None]
    ref = _engine(target, prompts, imgs, procs)
    for graphed in (False, True):
        spec = SpeculativeDecoder(target, draft, k=3, max_batch=3, max_len=256, eos_id=EOS)
        spec.cuda_graph = graphed
        for _ in range(2):
            res = spec.generate(prompts, 20, images=imgs, logits_processor=procs)
            assert res.tokens == ref.tokens and res.stop_reasons == ref.stop_reasons
        assert bool(spec._pin) == graphed  # eager: no inputs kept per prompt length
    # three runs (image, none, image) per model, each one padded batch, graphed once
    assert sorted((k[1], k[2], k[3]) for k in spec._graphs if k[0] == "prefill") == [
        ("d", 0, 1), ("d", 1, 1), ("d", 2, 1), ("t", 0, 1), ("t", 1, 1), ("t", 2, 1)]


def test_streaming_and_cancel(models) -> None:  # noqa: ANN001
    target, draft = models
    prompts, imgs = _inputs(2)
    seen: list[tuple[int, int]] = []
    polls = [0]

    def stop_second() -> bool:
        polls[0] += 1
        return polls[0] > 2  # cancelled after its first round

    spec = SpeculativeDecoder(target, draft, k=3, max_batch=2, max_len=256, eos_id=EOS)
    res = spec.generate(prompts, 20, images=imgs, logits_processor=[Letters(), Letters()],
                        on_token=lambda row, tok: seen.append((row, tok)),
                        should_stop=[None, stop_second])
    assert res.stop_reasons == ["eos", "cancelled"]
    for row in (0, 1):
        assert [t for r, t in seen if r == row] == res.tokens[row]
    assert 1 <= len(res.tokens[1]) < 12


@pytest.mark.slow
def test_sampling_under_a_mask_keeps_the_masked_target_distribution() -> None:
    """Toy vocabulary of 5, token 0 = <eos> never allowed, token 1 never after a 2: the joint
    distribution of 3 sampled tokens (4000 sequences, k = 2) matches the masked target's."""
    cfg = VLMConfig(image_size=8, patch_size=8, vision_dim=16, vision_depth=1, vision_heads=2,
                    projector_hidden=16, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                    ffn_hidden=64, vocab_size=5, max_seq_len=64)
    torch.manual_seed(1)
    target = VisionLanguageModel(cfg).eval()
    torch.manual_seed(2)
    draft = VisionLanguageModel(cfg).eval()
    with torch.no_grad():
        target.tok_emb.weight.mul_(3.0)

    def mask(prefix: list[int], logits: torch.Tensor) -> torch.Tensor:
        out = logits.clone()
        out[0] = float("-inf")
        if prefix and prefix[-1] == 2:
            out[1] = float("-inf")
        return out

    prompt = [1, 3, 2]
    exact = torch.zeros(5, 5, 5)
    for a, b in itertools.product(range(5), range(5)):
        def dist(seq: list[int], made: list[int]) -> torch.Tensor:
            lg = target(None, torch.tensor([seq]))[0, -1]
            return torch.softmax(mask(made, lg), -1)
        exact[a, b] = (dist(prompt, [])[a] * dist(prompt + [a], [a])[b]
                       * dist(prompt + [a, b], [a, b]))
    n = 4000
    spec = SpeculativeDecoder(target, draft, k=2, max_batch=n, max_len=16, eos_id=-1)
    res = spec.generate([prompt] * n, 3, temperature=1.0, logits_processor=[mask] * n,
                        generator=torch.Generator().manual_seed(0))
    assert all(len(t) == 3 and 0 not in t for t in res.tokens)
    idx = torch.tensor([a * 25 + b * 5 + c for a, b, c in res.tokens])
    emp = torch.bincount(idx, minlength=125).float() / n
    tv = 0.5 * float((emp - exact.flatten()).abs().sum())
    assert tv < 0.08, tv  # sampling noise for 4000 draws over <= 64 cells is ~0.05
    assert 0.1 < res.acceptance_rate < 0.95


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_greedy_under_a_processor_on_cuda(models) -> None:  # noqa: ANN001
    target, draft = (m.cuda() for m in models)
    try:
        prompts, imgs = _inputs(3)
        imgs = [im.cuda() for im in imgs]
        procs = [Letters(), Letters(dead=7), None]
        ref = _engine(target, prompts, imgs, procs)
        spec = SpeculativeDecoder(target, draft, k=3, max_batch=3, max_len=256, eos_id=EOS)
        for _ in range(2):  # captured on the first call, replayed on the second
            res = spec.generate(prompts, 20, images=imgs, logits_processor=procs)
            assert res.tokens == ref.tokens and res.stop_reasons == ref.stop_reasons
        # every pass of a round with host decisions ran as a CUDA graph
        assert {key[0] for key in spec._graphs} == {"prefill", "draft", "verify"}
    finally:
        for m in models:
            m.cpu()



def test_graphed_passes_read_only_their_static_inputs(models, cpu_graphs: None) -> None:  # noqa: ANN001
    """The graph path on the CPU, with replays that recompute into the first output: every
    input a pass reads must be refreshed in its static buffer before the replay. A stale one
    changes the tokens (the target's side) or what a draft equal to the target gets accepted
    (the draft's side: verification keeps the tokens right), with and without host
    decisions."""

    target, draft = models
    prompts, imgs = _inputs(3)
    procs = [Letters(), Letters(dead=7), None]
    ref = _engine(target, prompts, imgs, procs)
    free = _engine(target, prompts, imgs, None)
    spec = SpeculativeDecoder(target, draft, k=3, max_batch=3, max_len=256, eos_id=EOS)
    same = SpeculativeDecoder(target, target, k=3, max_batch=3, max_len=256, eos_id=EOS)
    spec.cuda_graph = same.cuda_graph = True  # the CUDA code path, on cpu_graphs
    for _ in range(2):  # captured on the first call, replayed on both
        res = spec.generate(prompts, 20, images=imgs, logits_processor=procs)
        assert res.tokens == ref.tokens and res.stop_reasons == ref.stop_reasons
        assert spec.generate(prompts, 20, images=imgs).tokens == free.tokens  # no host rounds
        # the target as its own draft accepts every token only if the draft's passes saw
        # the right tokens at the right positions
        for kw in ({"logits_processor": procs}, {}):
            assert same.generate(prompts, 20, images=imgs, **kw).acceptance_rate == 1.0, kw
    kinds = {key[0] for key in spec._graphs}
    assert kinds == {"prefill", "draft", "verify", "round"}, kinds
    # prompts padded to their bucket where graphed (5, 9 and 2 tokens -> 16)
    assert {key[5] for key in spec._graphs if key[0] == "prefill"} == {16}
