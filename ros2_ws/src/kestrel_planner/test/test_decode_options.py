"""The planner's decode options: speculative decoding (the plans stay the model's own, each
result carries its draft tokens and the accepted ones), the engine's prefix cache (the same
plans, the frame + object line reused), and their parameters' validation."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kestrel_common.params import ParamError, validate_params
from kestrel_models.planner import VisionLanguageModel, get_config
from kestrel_planner.core import PlanLimits, PlannerConfig, PlannerCore, PlanRequest, SceneObject
from kestrel_planner.core.backend_local import plain_prompt, scene_prompt
from kestrel_planner.params import SPECS, resolve_weights

torch.set_num_threads(1)
SCENE = [SceneObject("red_cube", "red_cube", (0.4, 0.0, 0.02)),
         SceneObject("bin", "bin", (0.3, 0.3, 0.0))]
LIMITS = PlanLimits(max_speed=0.5, min_height=0.0, max_height=0.3, max_steps=6)
IMAGE = np.random.default_rng(0).integers(0, 256, (48, 64, 3), dtype=np.uint8)
DEMO = "move_to bin speed=0.3\nend"  # the bigram demo model repeats the step up to max_steps
PLAN = "move_to bin speed=0.3\nmove_to bin speed=0.3\nend"
TASKS = ["put the red cube in the bin", "go home", "move to the bin"]


def _core(**kw: object) -> PlannerCore:
    return PlannerCore(PlannerConfig(**{"demo_plan": DEMO, "limits": LIMITS, "warmup": False,
                                        "max_new_tokens": 96, **kw}))


def _draft_file(tmp_path: Path, preset: str = "tiny", seed: int = 5) -> str:
    torch.manual_seed(seed)
    path = tmp_path / f"draft_{preset}_{seed}.pt"
    torch.save(VisionLanguageModel(get_config(preset)).state_dict(), path)
    return str(path)


def test_speculative_plans_are_the_models_own(tmp_path: Path) -> None:
    """A batch of goals, speculative (a layer-truncated draft, and a draft of its own) or not:
    the same plan texts and reports; every goal reports its drafted and accepted tokens."""
    reqs = [PlanRequest(t, IMAGE, SCENE, max_steps=2) for t in TASKS]
    plain = _core().plan_batch(reqs)
    assert all(r.report.accepted for r in plain) and plain[0].text == PLAN
    assert all(r.drafted == 0 and r.accepted == 0 for r in plain)
    # demo weights: every layer past the first is zero, so the first layer agrees with all
    same = _core(speculative_k=4, draft_layers=1).plan_batch(reqs)
    own = _core(speculative_k=3, draft_weights_path=_draft_file(tmp_path),
                draft_model="tiny").plan_batch(reqs)
    for res in (same, own):
        assert [r.text for r in res] == [r.text for r in plain]
        assert [r.report for r in res] == [r.report for r in plain]
        assert all(r.drafted > 0 and 0 <= r.accepted <= r.drafted for r in res)
    assert all(r.accepted == r.drafted for r in same)
    assert sum(r.accepted for r in own) < sum(r.drafted for r in own)


def test_speculative_stream_and_cancel() -> None:
    core = _core(speculative_k=3, draft_layers=1)
    streamed: list[tuple[int, str]] = []
    r = core.plan(TASKS[0], IMAGE, SCENE, max_steps=2,
                  on_token=lambda n, text: streamed.append((n, text)))
    assert [n for n, _ in streamed] == list(range(1, len(PLAN) + 1))
    assert streamed[-1][1] == r.text == PLAN
    streamed.clear()
    r = core.plan(TASKS[0], IMAGE, SCENE, on_token=lambda n, text: streamed.append((n, text)),
                  should_cancel=lambda: len(streamed) >= 3)
    assert r.cancelled and 3 <= r.tokens < len(PLAN)


def test_prefix_cache_reuses_frame_and_objects() -> None:
    """backend engine: the second goal on the same frame and objects reuses their KV; another
    frame or another object set does not; the plans equal the engine's without the cache."""
    plain = _core(backend="engine")
    kept = _core(backend="engine", prefix_cache_entries=4)
    other_image = IMAGE.copy()
    other_image[0, 0, 0] ^= 0xFF
    goals = [(TASKS[0], IMAGE, SCENE, False), (TASKS[1], IMAGE, SCENE, True),
             (TASKS[2], other_image, SCENE, False), (TASKS[1], IMAGE, SCENE[:1], False),
             (TASKS[2], IMAGE, SCENE, True)]
    for task, image, scene, hit in goals:
        a, b = plain.plan(task, image, scene, 2), kept.plan(task, image, scene, 2)
        assert (a.text, a.report) == (b.text, b.report)
        assert a.prefix_hit is None and b.prefix_hit is hit, task
    assert plain_prompt("go", ["a"]).startswith(scene_prompt(["a"]))


def test_parameter_values_are_validated() -> None:
    base = validate_params(SPECS, {s.name: s.default for s in SPECS})
    assert (base["speculative.k"], base["speculative.draft_model_config"],
            base["prefix_cache_entries"]) == (0, "draft", 8)
    for bad, msg in [({"speculative.k": -1}, "parameter 'speculative.k' = -1"),
                     ({"speculative.k": 17}, "parameter 'speculative.k' = 17"),
                     ({"speculative.draft_layers": 0}, "parameter 'speculative.draft_layers' = 0"),
                     ({"speculative.draft_model_config": "huge"},
                      "parameter 'speculative.draft_model_config' = 'huge'"),
                     ({"prefix_cache_entries": -1}, "parameter 'prefix_cache_entries' = -1")]:
        with pytest.raises(ParamError, match=msg):
            validate_params(SPECS, base | bad)


def test_configure_checks_name_the_parameter(tmp_path: Path) -> None:
    cases = [
        (dict(backend="plan_text", speculative_k=2), "parameter 'speculative.k' = 2"),
        (dict(speculative_k=2, draft_layers=4), "parameter 'speculative.draft_layers' = 4"),
        (dict(speculative_k=2, draft_model="tiny", draft_weights_path=str(tmp_path / "none.pt")),
         "parameter 'speculative.draft_weights_path' = .*none.pt.*cannot load"),
        (dict(speculative_k=2, draft_model="small", draft_weights_path=_draft_file(tmp_path)),
         "parameter 'speculative.draft_model_config' = 'small'.*max_seq_len"),
        (dict(speculative_k=2, draft_model="tiny",
              draft_weights_path=_draft_file(tmp_path, "draft")),
         "parameter 'speculative.draft_weights_path' = .*does not fit "
         "speculative.draft_model_config"),
        (dict(prefix_cache_entries=-2), "parameter 'prefix_cache_entries' = -2"),
    ]
    for kw, msg in cases:
        with pytest.raises(ValueError, match=msg):
            _core(**kw)
    with pytest.raises(ValueError, match="parameter 'speculative.draft_weights_path' = "
                                         "'package://no_such_package/d.pt'"):
        resolve_weights("package://no_such_package/d.pt", "speculative.draft_weights_path")


def test_trainer_trains_the_draft_of_the_small_model(tmp_path: Path) -> None:
    """The 'draft' preset fits 'small' (same vocabulary, image size and reach, a smaller
    decoder); the trainer trains it as any preset (scripts/train_planner.py --preset draft) and
    the file serves as speculative.draft_weights_path of a 'small' model."""
    from kestrel_planner.training.train import TrainConfig, train

    s, d = get_config("small"), get_config("draft")
    assert (d.vocab_size, d.image_size) == (s.vocab_size, s.image_size)
    assert d.max_seq_len >= s.max_seq_len and d.n_layers < s.n_layers and d.dim < s.dim
    draft, hist = train(TrainConfig(preset="draft", steps=2, batch=4, warmup=1))
    assert draft.cfg == d and len(hist.loss) == 2
    path = tmp_path / "planner_draft.pt"
    torch.save(draft.state_dict(), path)
    reqs = [PlanRequest(t, IMAGE, SCENE, max_steps=2) for t in TASKS[:2]]
    plain = _core(model="small").plan_batch(reqs)
    spec = _core(model="small", speculative_k=3, draft_weights_path=str(path),
                 draft_model="draft").plan_batch(reqs)
    assert [r.text for r in spec] == [r.text for r in plain]
    assert all(r.drafted > 0 for r in spec)


@pytest.mark.slow
@pytest.mark.parametrize(("speculative", "temperature", "kept"),
                         [(False, 0.0, 0), (False, 0.7, 0), (True, 0.0, 0), (False, 0.0, 4)])
def test_configure_captures_the_graphs_goals_replay(cpu_graphs: None, speculative: bool,
                                                    temperature: float, kept: int) -> None:
    """warm_graphs (PlannerCore's warm-up on CUDA) captures the prefill per batch size and
    prompt bucket, the decode step (or the speculative passes) per batch and kv bucket and,
    with a prefix store, the prefill after a kept scene per slot and bucket: goals of several
    scene sizes, alone and in batches, prefix hits among them, then replay graphs only. The
    CUDA code paths run on the CPU with tests/cpu_graphs.py's stand-in."""

    kw = {"speculative_k": 3, "draft_layers": 1} if speculative else {}
    core = _core(backend="engine", max_batch=3, temperature=temperature,
                 prefix_cache_entries=kept, **kw)
    plain = _core(backend="engine", max_batch=3)
    backend = core.backend
    assert backend.warm_graphs() == 0  # no CUDA graphs (the CPU): nothing to capture
    dec = backend.spec if speculative else backend.engine
    dec.cuda_graph = True
    if not speculative:
        dec.prefill_graph = True
    captured = backend.warm_graphs()
    assert captured > 0 and captured == backend.graph_count()
    many = SCENE + [SceneObject(f"block_{i}", "red_cube", (0.4, 0.1 * i, 0.02))
                    for i in range(9)]
    hits = 0
    for n in (1, 3, 2):
        for scene in (SCENE, many):
            reqs = [PlanRequest(t, IMAGE, scene, max_steps=2) for t in TASKS[:n]]
            res = core.plan_batch(reqs)
            assert len(res) == n
            hits += sum(bool(r.prefix_hit) for r in res)
            if not temperature:  # the plans of the eager engine without a prefix store
                assert [r.text for r in res] == [r.text for r in plain.plan_batch(reqs)]
    assert hits >= 6 if kept else hits == 0
    assert backend.graph_count() == captured  # every goal replayed a graph captured before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kw", [{}, {"temperature": 0.7}, {"speculative_k": 3, "draft_layers": 1},
                                {"prefix_cache_entries": 4}])
def test_configure_capture_on_cuda(kw: dict) -> None:
    """CUDA: the graphs captured at configure (real CUDA graphs) give the CPU's plans; every
    goal, prefix hits included, replays a graph captured then."""
    cpu = _core(backend="engine", max_batch=3, **kw)
    gpu = _core(backend="engine", max_batch=3, device="cuda", **{**kw, "warmup": True})
    backend = gpu.backend
    assert gpu.graphs_at_configure > 0
    captured = backend.graph_count()
    many = SCENE + [SceneObject(f"block_{i}", "red_cube", (0.4, 0.1 * i, 0.02))
                    for i in range(9)]
    for n in (1, 3, 2, 3):
        for scene in (SCENE, many):
            reqs = [PlanRequest(t, IMAGE, scene, max_steps=2) for t in TASKS[:n]]
            got, want = gpu.plan_batch(reqs), cpu.plan_batch(reqs)
            if not kw.get("temperature"):  # sampling draws from other generators
                assert [r.text for r in got] == [r.text for r in want]
            assert all(r.report.accepted for r in got)
    assert backend.graph_count() == captured
