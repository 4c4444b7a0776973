"""The planner node through ten lifecycle cycles (deactivate, cleanup, configure, activate)
over DDS, its multi-threaded executor spinning the whole time: no crash (entities are never
destroyed under the executor's wait set), and after every activation the node plans again,
sends control targets and publishes /diagnostics; while inactive it refuses goals."""

from __future__ import annotations

import pytest
from diagnostic_msgs.msg import DiagnosticArray
from kestrel_interfaces.action import PlanTask
from kestrel_interfaces.msg import ControlTarget
from lifecycle_msgs.msg import Transition
from lifecycle_msgs.srv import ChangeState
from test_planner_node_dds import PARAMS, Streamer, send, wait

from kestrel_common.base_node import COMMAND_QOS

pytestmark = pytest.mark.dds

R = PlanTask.Result
CYCLES = 10


def test_planner_lifecycle_cycles(launch_node, probe):
    node = launch_node("kestrel_planner.planner_node", "planner",
                       params=PARAMS | {"max_new_tokens": 160})
    client = probe.action_client(PlanTask, "/planner/plan_task")
    cli = probe.node.create_client(ChangeState, "/planner/change_state")
    run_cycles(node, probe, client, cli)


def run_cycles(node, probe, client, cli) -> None:
    targets = probe.subscribe(ControlTarget, "/planner/output/control_target", COMMAND_QOS)
    diag = probe.subscribe(DiagnosticArray, "/diagnostics")
    assert cli.wait_for_service(timeout_sec=30.0), node.output()
    assert client.wait_for_server(timeout_sec=30.0), node.output()

    def transition(tid: int) -> bool:
        fut = cli.call_async(ChangeState.Request(transition=Transition(id=tid)))
        assert wait(fut.done, 60.0), f"transition {tid} timed out\n{node.output()}"
        return fut.result().success

    def planner_diags() -> int:
        return sum(1 for a in diag.snapshot() for s in a.status if s.name == "planner")

    goal = PlanTask.Goal(instruction="put the red cube in the bin", max_steps=1)
    with Streamer(probe):
        for cycle in range(CYCLES + 1):
            if cycle:  # cycle 0: the autostarted node
                assert transition(Transition.TRANSITION_DEACTIVATE), node.output()
                fut = client.send_goal_async(goal)  # inactive: the goal is refused
                assert wait(fut.done, 15.0) and not fut.result().accepted
                assert transition(Transition.TRANSITION_CLEANUP), node.output()
                assert transition(Transition.TRANSITION_CONFIGURE), node.output()
                assert transition(Transition.TRANSITION_ACTIVATE), node.output()
            n_targets, n_diag = len(targets.snapshot()), planner_diags()
            # the scene arrives again after the cleanup (inputs are dropped with the model)
            ok = wait(lambda: send(client, goal)[1].result.validation_status
                      == R.VALIDATION_ACCEPTED, 30.0)
            assert ok, (cycle, node.output()[-3000:])
            assert targets.wait_for(lambda m, n=n_targets: len(m) > n + 2, timeout=15.0), cycle
            assert diag.wait_for(lambda m, n=n_diag: planner_diags() > n, timeout=15.0), cycle
            assert node.alive(), node.output()
    out = node.output()
    assert "InvalidHandle" not in out and "Traceback" not in out, out[-3000:]
    assert out.count("active: serving ~/plan_task") == CYCLES + 1
