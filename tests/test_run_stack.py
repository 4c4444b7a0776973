"""The launch-free runner's respawn policy (launch's respawn / respawn_delay, mirrored)."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from kestrel_bringup.run_stack import StackRunner, main
from kestrel_bringup.stack import STACK, entry

BRINGUP = Path(__file__).resolve().parents[1] / "ros2_ws" / "src" / "kestrel_bringup"


def _crashing(name: str, respawn: bool):
    # `python -m json.tool --ros-args ...` exits at once with code 2 (a node that dies)
    return replace(entry("perception"), name=name, module="json.tool", respawn=respawn,
                   respawn_delay=0.2)


def test_a_respawning_node_is_restarted_and_others_stop_the_stack(tmp_path: Path) -> None:
    runner = StackRunner(["perception"], env={"PATH": "/usr/bin"}, log_dir=tmp_path,
                         echo=False)
    runner.entries = [_crashing("perception", True), _crashing("planner", False)]
    runner.start()
    try:
        final: list = []
        deadline = time.monotonic() + 30.0
        while time.monotonic() < deadline and (runner.procs[0].restarts < 2 or not final):
            final = runner.supervise() or final
            time.sleep(0.05)
        assert runner.procs[0].restarts >= 2
        assert final == [("planner", 2)]
    finally:
        runner.stop(timeout=2.0)
    # the log is appended across restarts: one usage message per run
    assert (tmp_path / "perception.log").read_text().count("usage: python -m json.tool") >= 2


def test_respawn_policy_from_the_table_and_the_command_line() -> None:
    assert {e.name for e in STACK if e.respawn} == {"perception", "planner"}
    runner = StackRunner(env={"PATH": "/usr/bin"}, respawn={"control": True,
                                                            "perception": False})
    policy = {e.name: e.respawn for e in runner.entries}
    assert policy == {"sim": False, "perception": False, "planner": True, "control": True}
    # the launch files build their Node actions with the same fields
    src = (BRINGUP / "kestrel_bringup" / "launch_nodes.py").read_text()
    assert "respawn=e.respawn" in src and "respawn_delay=e.respawn_delay" in src


def test_unknown_nodes_are_refused(capsys) -> None:
    try:
        main(["--respawn", "camera"])
    except SystemExit as exc:
        assert exc.code == 2
    assert "unknown node(s) ['camera']" in capsys.readouterr().err
