"""DecodeEngine prefix store (prefix_entries): a request whose image and leading prompt tokens
were seen before reuses their KV and decodes the same tokens as without the store."""

from __future__ import annotations

import pytest
import torch

from kestrel_models.planner import VisionLanguageModel, get_config
from kestrel_models.planner.engine import DecodeEngine
from kestrel_models.planner.prefix_store import PrefixStore

torch.set_num_threads(1)
EOS = 257
SCENE = list(b"\x01objects: red_cube bin blue_cylinder\n")  # the shared (scene) part
TASKS = [list(b"task: put the red cube in the bin\nplan:\n"),
         list(b"task: go home\nplan:\n"),
         list(b"task: push the blue can\nplan:\n")]


@pytest.fixture(scope="module")
def model() -> VisionLanguageModel:
    torch.manual_seed(0)
    m = VisionLanguageModel(get_config("tiny")).eval()
    with torch.no_grad():  # sharper random weights: varied greedy text (weak tests otherwise)
        for p in m.parameters():
            if p.ndim >= 2:
                p.mul_(30.0)
    return m


def _image(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (3, 32, 32), dtype=torch.uint8, generator=g)


def _run(eng: DecodeEngine, prompt: list[int], image: torch.Tensor | None, key: object,
         n: int = 24) -> tuple[list[int], bool]:
    r = eng.submit(prompt, n, image, image_key=key, prefix_tokens=len(SCENE))
    eng.run()
    return r.tokens, r.prefix_hit


@pytest.mark.parametrize("system", [(), tuple(b"You plan robot tasks.\n")])
def test_reused_prefix_gives_the_same_tokens(model: VisionLanguageModel,
                                             system: tuple[int, ...]) -> None:
    """Same scene (image + object line), three tasks, twice: with the store the later requests
    prefill only their task line and decode exactly the tokens of the engine without it."""
    img = _image(1)
    plain = DecodeEngine(model, 2, 256, EOS, system_prefix=system)
    kept = DecodeEngine(model, 2, 256, EOS, system_prefix=system, prefix_entries=4)
    for rnd in range(2):
        for i, task in enumerate(TASKS):
            ref, ref_hit = _run(plain, SCENE + task, img, "frame-1")
            got, hit = _run(kept, SCENE + task, img, "frame-1")
            assert got == ref
            assert not ref_hit and hit == (rnd > 0 or i > 0)
    assert len(set(ref)) > 5  # varied text: the equality means something
    assert (kept.store.hits, kept.store.misses) == (5, 1)
    assert plain.store.hits == plain.store.misses == 0


def test_other_image_or_scene_is_not_reused(model: VisionLanguageModel) -> None:
    eng = DecodeEngine(model, 2, 256, EOS, prefix_entries=4)
    _run(eng, SCENE + TASKS[0], _image(1), "a")
    _, hit = _run(eng, SCENE + TASKS[0], _image(2), "b")  # another frame
    assert not hit
    other = list(b"\x01objects: red_cube\n")
    r = eng.submit(other + TASKS[1], 8, _image(1), image_key="a", prefix_tokens=len(other))
    eng.run()
    assert not r.prefix_hit  # another object line
    _, hit = _run(eng, SCENE + TASKS[0], _image(1), None)  # no image key: never kept
    assert not hit
    _, hit = _run(eng, SCENE + TASKS[2], _image(1), "a")
    assert hit


def test_batched_admission_mixes_reused_and_new_prefixes(model: VisionLanguageModel) -> None:
    """Requests admitted together (one with a kept prefix, two without) decode as alone."""
    img = _image(3)
    kept = DecodeEngine(model, 4, 256, EOS, prefix_entries=2)
    _run(kept, SCENE + TASKS[0], img, "f")
    plain = DecodeEngine(model, 4, 256, EOS)
    reqs = []
    for eng in (plain, kept):
        reqs.append([eng.submit(SCENE + t, 16, img, image_key="f", prefix_tokens=len(SCENE))
                     for t in TASKS])
        eng.run()
    assert [r.tokens for r in reqs[0]] == [r.tokens for r in reqs[1]]
    assert [r.prefix_hit for r in reqs[1]] == [True, True, True]


def test_store_is_bounded_lru() -> None:
    s = PrefixStore(2)
    kv = [torch.zeros(2, 5, 4)]
    s.put("a", kv, kv)
    s.put("b", kv, kv)
    assert s.get("a") is not None  # a is now the most recent
    s.put("c", kv, kv)
    assert s.get("b") is None and s.get("a") is not None and s.get("c") is not None
    assert len(s) == 2 and s.get("c").length == 5
    PrefixStore(0).put("a", kv, kv)
    with pytest.raises(ValueError, match="'prefix_entries' = -1"):
        PrefixStore(-1)


def test_prefix_tokens_must_leave_a_prompt_token(model: VisionLanguageModel) -> None:
    eng = DecodeEngine(model, 1, 256, EOS, prefix_entries=1)
    with pytest.raises(ValueError, match="prefix_tokens = 3"):
        eng.submit([1, 2, 3], 4, None, prefix_tokens=3)


def test_reused_prefix_through_the_prefill_graph_path(model, cpu_graphs: None) -> None:  # noqa: ANN001
    """The graphed prefill path on the CPU (cpu_graphs: replays recompute): a hit's rest and
    a miss's batch read only inputs refreshed before each replay, so the tokens stay those
    of the engine without the store, and the hits replay graphs of their own."""

    img = _image(1)
    plain = DecodeEngine(model, 2, 256, EOS)
    kept = DecodeEngine(model, 2, 256, EOS, prefix_entries=2)
    kept.prefill_graph = True  # the CUDA code path, on cpu_graphs
    for task in TASKS * 2:
        ref, _ = _run(plain, SCENE + task, img, "frame-1")
        got, _ = _run(kept, SCENE + task, img, "frame-1")
        assert got == ref
    assert kept.store.hits == 5
    assert {k[0] for k in kept._pgraphs if isinstance(k[0], str)} == {"kept"}
    assert len(kept._pgraphs) > 2  # a miss's batch too, and hits of two buckets


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_reused_prefix_with_cuda_graphs() -> None:
    """On CUDA (graphed batched prefill and decode step) a reused prefix (the rest of the
    prompt prefilled by its own captured graph) decodes what the engine without the store
    decodes."""
    torch.manual_seed(0)
    m = VisionLanguageModel(get_config("tiny")).cuda().eval()
    with torch.no_grad():
        for p in m.parameters():
            if p.ndim >= 2:
                p.mul_(30.0)
    img = _image(1).cuda()
    plain = DecodeEngine(m, 2, 256, EOS)
    kept = DecodeEngine(m, 2, 256, EOS, prefix_entries=2)
    assert kept.cuda_graph and kept.prefill_graph
    for task in TASKS * 2:
        ref, _ = _run(plain, SCENE + task, img, "frame-1")
        got, _ = _run(kept, SCENE + task, img, "frame-1")
        assert got == ref
    assert kept.store.hits == 5
    assert any(k[0] == "kept" for k in kept._pgraphs)  # the hits replayed a graph
