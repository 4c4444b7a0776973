"""Repeated SIGINT/SIGTERM during shutdown (Ctrl-C reaches the whole process group and
`ros2 launch` forwards another SIGINT, then SIGTERM) must still give an orderly exit."""

from __future__ import annotations

import os
import signal
import time

import pytest
from std_msgs.msg import Float64

pytestmark = pytest.mark.dds


def test_repeated_signals_during_shutdown_exit_cleanly(launch_node, probe):
    node = launch_node("echo_node", "echo")
    out = probe.subscribe(Float64, "/echo/output/value")
    pub = probe.publisher(Float64, "/echo/input/value")
    assert probe.publish_until(pub, lambda: Float64(data=1.0), lambda: len(out.snapshot()) > 0)
    for sig in (signal.SIGINT, signal.SIGINT, signal.SIGTERM, signal.SIGINT):
        os.kill(node.proc.pid, sig)
        time.sleep(0.005)
    assert node.proc.wait(10) == 0, node.output()
    assert "Traceback" not in node.output()
    assert "terminate called" not in node.output()
