"""The deployment checklist on params files with known problems (CPU, no ROS graph)."""

from __future__ import annotations

import resource
import textwrap
from pathlib import Path

import pytest
import torch
from kestrel_bench import doctor, doctor_host, doctor_params
from kestrel_bench.__main__ import main
from kestrel_bench.doctor_host import FAIL, PASS, SKIP, WARN


def params_file(tmp_path: Path, text: str, name: str = "params.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def by_name(checks: list, name: str):
    found = [c for c in checks if c.name == name]
    assert found, f"no check {name}: {[c.name for c in checks]}"
    return found[0]


GOOD = """
control:
  ros__parameters:
    policy:
      backend: cpu_eager
    loop:
      rate_hz: 500.0
perception:
  ros__parameters:
    runtime:
      device: cpu
"""


def test_good_file_passes_offline(tmp_path) -> None:
    nodes = doctor_params.load_params_files([params_file(tmp_path, GOOD)])
    assert nodes["control"] == {"policy.backend": "cpu_eager", "loop.rate_hz": 500.0}
    checks = doctor.run_checks(nodes, cuda=False, host=False)
    assert all(c.status in (PASS, SKIP) for c in checks), doctor.format_checks(checks)
    assert by_name(checks, "params.control").status == PASS


def test_other_yaml_in_the_folder_is_skipped(tmp_path) -> None:
    other = params_file(tmp_path, "schema: bridge/1\nnodes: [a, b]\n", "bridge.yaml")
    listed = params_file(tmp_path, "- 1\n- 2\n", "list.yaml")
    good = params_file(tmp_path, GOOD, "good.yaml")
    nodes = doctor_params.load_params_files([other, listed, good])
    assert sorted(nodes) == ["control", "perception"]


def test_unknown_name_and_bad_value_fail_naming_them(tmp_path) -> None:
    nodes = doctor_params.load_params_files([params_file(tmp_path, """
        control:
          ros__parameters:
            loop:
              rate_hx: 1000.0
        planner:
          ros__parameters:
            backend: nope
        """)])
    checks = doctor_params.check_specs(nodes)
    control, planner = by_name(checks, "params.control"), by_name(checks, "params.planner")
    assert control.status == FAIL and "loop.rate_hx" in control.detail
    assert "loop.rate_hz" in control.detail  # did you mean
    assert planner.status == FAIL and "'backend'" in planner.detail


def test_gpu_settings_against_the_device(tmp_path) -> None:
    nodes = doctor_params.load_params_files([params_file(tmp_path, """
        perception:
          ros__parameters:
            runtime: {device: cuda, precision: fp32, cuda_graph: false, compile: "off"}
        control:
          ros__parameters:
            policy: {backend: cuda_graph}
        planner:
          ros__parameters:
            device: cuda
            backend: generate
        """)])
    without = doctor_params.check_runtime_settings(nodes, cuda=False)
    assert by_name(without, "perception.device").status == FAIL
    assert by_name(without, "control.backend").status == FAIL
    assert by_name(without, "planner.device").status == FAIL
    with_gpu = doctor_params.check_runtime_settings(nodes, cuda=True)
    for name, fix in (("perception.precision", "runtime.precision: bf16"),
                      ("perception.cuda_graph", "runtime.cuda_graph: true"),
                      ("perception.compile", "runtime.compile: branched"),
                      ("planner.backend", "backend: engine")):
        c = by_name(with_gpu, name)
        assert c.status == WARN and fix in c.fix, c
    assert by_name(with_gpu, "control.backend").status == PASS
    if not torch.cuda.is_available():  # this machine: the registry's own check runs
        missing = doctor_params.check_runtime_settings(
            {"control": {"policy.backend": "onnxruntime"}}, cuda=False)
        assert by_name(missing, "control.backend").status == PASS
    auto = {"control": {"policy.backend": "auto"}}
    assert by_name(doctor_params.check_runtime_settings(auto, cuda=True),
                   "control.backend").status == PASS
    cpu_backend = {"control": {"policy.backend": "cpu_eager"}}
    assert by_name(doctor_params.check_runtime_settings(cpu_backend, cuda=True),
                   "control.backend").status == WARN


def test_control_backend_that_cannot_run_here_fails(monkeypatch) -> None:
    if torch.cuda.is_available():
        pytest.skip("checks this machine's CPU backends")
    from kestrel_models.control import runtimes
    from kestrel_models.control.registry import BackendUnavailable

    def missing() -> None:
        raise BackendUnavailable("parameter 'backend' = 'onnxruntime': the onnxruntime "
                                 "package is not installed")

    monkeypatch.setattr(runtimes, "check_onnxruntime", missing)
    c = by_name(doctor_params.check_runtime_settings(
        {"control": {"policy.backend": "onnxruntime"}}, cuda=False), "control.backend")
    assert c.status == FAIL and "not installed" in c.detail


def test_runtime_options_that_cannot_run_together_fail() -> None:
    graph_on_cpu = {"perception": {"runtime.device": "cpu", "runtime.cuda_graph": True}}
    c = by_name(doctor_params.check_runtime_settings(graph_on_cpu, cuda=False),
                "perception.runtime")
    assert c.status == FAIL and "runtime.cuda_graph" in c.detail
    auto_gpu = {"perception": {"runtime.device": "cuda"}}
    checks = doctor_params.check_runtime_settings(auto_gpu, cuda=True)
    c = by_name(checks, "perception.runtime")
    assert c.status == PASS and "bf16" in c.detail
    assert all(x.status == PASS for x in checks), doctor.format_checks(checks)


def test_missing_weights_and_engine_without_tensorrt(tmp_path) -> None:
    nodes = {"perception": {"model.weights_path": str(tmp_path / "absent.pt"),
                            "runtime.engine": "tensorrt"},
             "control": {"policy.weights_path": "package://kestrel_perception/weights/"
                                                "tiny_sim.pt"}}
    files = doctor_params.check_files(nodes)
    assert by_name(files, "perception.weights").status == FAIL
    assert by_name(files, "control.weights").status == PASS  # package:// resolved
    try:
        import tensorrt  # noqa: F401
        pytest.skip("TensorRT installed here")
    except ImportError:
        pass
    trt = by_name(doctor_params.check_trt_engine(nodes, cuda=True), "perception.trt_engine")
    assert trt.status == FAIL and "TensorRT is not installed" in trt.detail


def test_time_source_mixed_fails() -> None:
    mixed = {"perception": {"use_sim_time": True}, "control": {"use_sim_time": False},
             "sim": {"use_sim_time": False}}
    c = by_name(doctor_params.check_time_source(mixed), "time.use_sim_time")
    assert c.status == FAIL and "control=False" in c.detail
    same = {"perception": {}, "control": {}, "sim": {}}  # the launch's values
    assert by_name(doctor_params.check_time_source(same), "time.use_sim_time").status == PASS


def test_realtime_refused_fails_and_mlock_limit(monkeypatch) -> None:
    refused = doctor_host.check_realtime({"rt_priority": 80},
                                         probe=lambda p: (False, "Operation not permitted"))
    fifo = by_name(refused, "rt.sched_fifo")
    assert fifo.status == FAIL and "CAP_SYS_NICE" in fifo.fix
    granted = doctor_host.check_realtime({"rt_priority": 80}, probe=lambda p: (True, "ok"))
    assert by_name(granted, "rt.sched_fifo").status == PASS
    assert by_name(granted, "rt.mlock").status == WARN  # real-time loop without mlock
    real = resource.getrlimit
    monkeypatch.setattr(resource, "getrlimit", lambda which: (64 * 2**10, 64 * 2**10)
                        if which == resource.RLIMIT_MEMLOCK else real(which))
    locked = doctor_host.check_realtime({"rt_priority": 80, "lock_memory": True},
                                        probe=lambda p: (True, "ok"))
    mlock = by_name(locked, "rt.mlock")
    assert mlock.status == FAIL and "memlock" in mlock.fix
    assert by_name(locked, "rt.cpu_affinity").status == WARN
    bad_cpu = doctor_host.check_realtime({"cpu_affinity": [4095]}, probe=lambda p: (True, ""))
    assert by_name(bad_cpu, "rt.cpu_affinity").status == FAIL


def test_dds_profile() -> None:
    assert by_name(doctor_host.check_dds({"RMW_IMPLEMENTATION": "rmw_fastrtps_cpp"}),
                   "dds.profile").status == WARN
    missing = doctor_host.check_dds({"RMW_IMPLEMENTATION": "rmw_fastrtps_cpp",
                                     "FASTDDS_DEFAULT_PROFILES_FILE": "/nonexistent.xml"})
    assert by_name(missing, "dds.profile").status == FAIL
    assert by_name(doctor_host.check_dds({}), "dds.rmw").status == WARN


def test_model_eval_grad_and_file(tmp_path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.1))
    checks = doctor.check_model(model, "m")
    assert by_name(checks, "model.m.eval").status == FAIL
    assert by_name(checks, "model.m.grad").status == WARN
    model.eval().requires_grad_(False)
    checks = doctor.check_model(model, "m", cuda=True)
    assert by_name(checks, "model.m.eval").status == PASS
    assert by_name(checks, "model.m.grad").status == PASS
    assert by_name(checks, "model.m.dtype").status == WARN  # fp32 on a GPU
    path = tmp_path / "policy.pt"
    torch.jit.script(torch.nn.Sequential(torch.nn.Linear(4, 4)).train()).save(str(path))
    assert by_name(doctor.check_model_file(path, False), "model.policy.pt.eval").status == FAIL


def test_cli_exit_code(tmp_path, capsys) -> None:
    good = params_file(tmp_path, GOOD, "good.yaml")
    assert main(["doctor", "--params", str(good), "--no-host", "--cuda", "no"]) == 0
    bad = params_file(tmp_path, GOOD.replace("cpu_eager", "cuda_graph"), "bad.yaml")
    assert main(["doctor", "--params", str(bad), "--no-host", "--cuda", "no"]) == 1
    out = capsys.readouterr().out
    assert "FAIL  control.backend" in out and "fix: policy.backend: onnxruntime" in out


def test_bringup_entry_point(tmp_path) -> None:
    from kestrel_bringup.doctor import main as bringup_main

    good = params_file(tmp_path, GOOD, "good.yaml")
    assert bringup_main(["--params", str(good), "--no-host", "--cuda", "no"]) == 0


def test_knobs_are_parameters_of_their_nodes() -> None:
    import importlib

    for node, knobs in doctor_params.KNOBS.items():
        names = {s.name for s in importlib.import_module(doctor_params.SPEC_MODULES[node]).SPECS}
        missing = sorted(set(knobs.values()) - names)
        assert not missing, f"{node}: {missing} are not parameters (renamed?)"
