"""Parallel evaluation (evaluate --workers N) and the GPU variants' parameters, without ROS:
seed shares, each worker's command line, merging the workers' results into the one table a
single stack would give, the run record's GPU class."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict

import pytest

from kestrel_bringup import evaluate, evaluate_runs as ew
from kestrel_bringup.evaluation import EpisodeTrace, gpu_params, summarize


def _args(*argv: str):
    """The Namespace evaluate.main parses (parsed by its own parser, then stopped)."""
    seen = {}

    def fake_here(args, seeds):
        seen["args"], seen["seeds"] = args, seeds
        return [], None, 1

    real = ew.run_here
    ew.run_here = fake_here
    try:
        assert evaluate.main(list(argv)) == 1
    finally:
        ew.run_here = real
    return seen["args"], seen["seeds"]


def test_seeds_are_shared_round_robin_and_none_is_lost() -> None:
    seeds = list(range(1, 11))
    shares = ew.split_seeds(seeds, 4)
    assert shares[0][0] == 1  # the first episode (and its video) stays with worker 0
    assert sorted(s for share in shares for s in share) == seeds
    assert max(map(len, shares)) - min(map(len, shares)) <= 1
    assert ew.split_seeds([5, 6], 4) == [[5], [6]]  # no empty worker


def test_a_worker_gets_the_episode_options_and_its_own_seeds_out_and_video(tmp_path) -> None:
    args, _ = _args("--episodes", "3", "--timeout", "45", "--controller", "policy",
                    "--device", "cuda", "--oracle-plan", "--oracle-speed", "0.2")
    argv = ew.worker_argv(args, [7, 9], tmp_path / "w0", "", tmp_path / "logs")
    assert argv[:3] == [sys.executable, "-m", "kestrel_bringup.evaluate"]
    line = " ".join(argv)
    for part in ("--workers 1", "--seeds 7,9", f"--out {tmp_path / 'w0'}", "--video none",
                 "--timeout 45.0", "--controller policy", "--device cuda", "--oracle-plan",
                 "--oracle-speed 0.2", f"--log-dir {tmp_path / 'logs'}"):
        assert part in line, part
    plain, _ = _args("--episodes", "1")
    assert "--oracle-plan" not in ew.worker_argv(plain, [1], tmp_path / "w", "a.mp4", None)
    assert "a.mp4" in ew.worker_argv(plain, [1], tmp_path / "w", "a.mp4", None)


def test_merged_workers_give_the_single_stack_table() -> None:
    traces = [EpisodeTrace(seed=s, goal="red_cube", instruction="put the red cube in the bin",
                           plan_status="accepted", success_s=10.0 + s if s % 3 else None,
                           deadline_misses=s) for s in range(1, 8)]
    parts = [summarize(traces[i::2]) for i in range(2)]
    back = [t for p in (json.loads(json.dumps(p)) for p in parts) for t in ew.traces_from(p)]
    back.sort(key=lambda t: t.seed)
    assert [asdict(t) for t in back] == [asdict(t) for t in traces]
    whole, merged = summarize(traces), summarize(back)
    for key in ("successes", "success_ci95", "failures_by_stage", "time_to_success_s",
                "deadline_misses_per_episode"):
        assert merged[key] == whole[key], key


def test_sim_speed_over_workers_is_the_mean_stack_speed() -> None:
    speed = ew.merged_speed([{"sim_s": 100.0, "wall_s": 200.0, "real_time_factor": 0.5},
                             None, {"sim_s": 300.0, "wall_s": 200.0, "real_time_factor": 1.5}])
    assert speed == {"sim_s": 400.0, "wall_s": 400.0, "real_time_factor": 1.0, "stacks": 2}
    assert ew.merged_speed([None]) is None


def test_gpu_variants_put_the_models_on_the_gpu_and_keep_the_ik_controller() -> None:
    assert gpu_params("cpu", "ik") == {}
    p = gpu_params("cuda", "ik")
    assert p["perception"]["runtime.device"] == "cuda"
    assert p["planner"]["backend"] == "engine" and p["planner"]["device"] == "cuda"
    assert p["planner"]["speculative.k"] == "0"  # slower than the engine alone on the GPU
    assert "control" not in p  # IK has no model
    assert gpu_params("cuda", "policy")["control"]["policy.backend"] == "cuda_graph"


@pytest.mark.parametrize("bad", [("--workers", "0"), ("--workers", "2", "--no-stack"),
                                 ("--seeds", "1,x")])
def test_bad_options_fail_naming_the_option(bad, capsys) -> None:
    with pytest.raises(SystemExit):
        evaluate.main(list(bad))
    assert bad[0] in capsys.readouterr().err


def test_gpu_class_names_the_result_file() -> None:
    """The evaluation names a GPU as the benchmark records do (kestrel_common.run_info)."""
    from kestrel_common.run_info import gpu_class

    assert gpu_class("NVIDIA H200") == "h200"
    assert gpu_class("NVIDIA H100 80GB HBM3") == "h100"
    assert gpu_class("NVIDIA A100-SXM4-40GB") == "a100"
    assert gpu_class("NVIDIA GeForce RTX 4090") == "rtx4090"


FAKE_WORKER = '''
import json, signal, sys, time
from kestrel_bringup.evaluation import EpisodeTrace, summarize
out = sys.argv[sys.argv.index("--out") + 1]
seed = int(sys.argv[sys.argv.index("--seeds") + 1].split(",")[0])
def stop(*_):  # an evaluation interrupted after its first episode writes that one
    t = EpisodeTrace(seed=seed, goal="red_cube", instruction="put the red cube in the bin",
                     plan_status="accepted", success_s=9.0)
    with open(out + ".json", "w") as f:
        json.dump(summarize([t]), f)
    sys.exit(0)
signal.signal(signal.SIGINT, stop)
print("ready", flush=True)
time.sleep(60)
'''

DRIVER = '''
import sys
from kestrel_bringup import evaluate, evaluate_runs
real = evaluate_runs.worker_argv
evaluate_runs.worker_argv = lambda *a: [sys.executable, sys.argv[1], *real(*a)[3:]]
sys.exit(evaluate.main(["--episodes", "4", "--workers", "2", "--out", sys.argv[2]]))
'''


def test_a_terminated_parallel_run_keeps_the_episodes_that_ended(tmp_path) -> None:
    """SIGTERM (`timeout`) to an evaluation of N stacks: each worker is interrupted, writes the
    episodes that ended, and the merged table says how many of how many ran."""
    import os
    import signal
    import subprocess

    fake, driver = tmp_path / "fake_worker.py", tmp_path / "driver.py"
    fake.write_text(FAKE_WORKER)
    driver.write_text(DRIVER)
    proc = subprocess.Popen([sys.executable, str(driver), str(fake), str(tmp_path / "out")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ready = 0
    for line in proc.stdout:  # bounded: the fake workers exit on their own after 60 s
        ready += line.strip().endswith("ready")
        if ready == 2:
            break
    os.kill(proc.pid, signal.SIGTERM)
    output = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, output
    summary = json.loads((tmp_path / "out.json").read_text())
    assert (summary["episodes"], summary["episodes_planned"]) == (2, 4)
    assert sorted(e["seed"] for e in summary["per_episode"]) == [1, 2]
    assert "Interrupted: 2 of 4 episodes ran." in (tmp_path / "out.md").read_text()
