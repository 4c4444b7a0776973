"""doctor --live reads the parameters of a running node through its parameter services."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

NODE = """
import rclpy
from rclpy.parameter import Parameter
rclpy.init()
node = rclpy.create_node("control", automatically_declare_parameters_from_overrides=True,
                         parameter_overrides=[Parameter("loop.rt_priority", value=80),
                                              Parameter("loop.cpu_affinity", value=[0]),
                                              Parameter("policy.backend", value="cuda_graph")])
rclpy.spin(node)
"""


@pytest.mark.dds
def test_live_parameters_of_a_running_node(tmp_path, monkeypatch, capsys) -> None:
    if "AMENT_PREFIX_PATH" not in os.environ:
        pytest.skip("ROS environment not sourced (run through scripts/run.sh)")
    pytest.importorskip("rclpy")
    from ros_harness import DomainLease, ros_env

    from kestrel_bench import doctor
    from kestrel_bench.__main__ import main
    from kestrel_bench.doctor_node import read_live_params

    lease = DomainLease()
    env = ros_env(lease.domain_id, tmp_path)
    for key in ("ROS_DOMAIN_ID", "ROS_AUTOMATIC_DISCOVERY_RANGE"):
        monkeypatch.setenv(key, env[key])
    proc = subprocess.Popen([sys.executable, "-c", NODE], env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        nodes = read_live_params(("control",), discovery_s=30.0, timeout_s=10.0)
        assert nodes["control"]["loop.rt_priority"] == 80
        assert list(nodes["control"]["loop.cpu_affinity"]) == [0]
        checks = doctor.run_checks(nodes, cuda=False, host=False)
        assert next(c for c in checks if c.name == "control.backend").status == "FAIL"
        assert main(["doctor", "--live", "--no-host", "--cuda", "no"]) == 1
        assert "running nodes control" in capsys.readouterr().out
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
        lease.release()
