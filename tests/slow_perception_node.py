"""The perception node with a deliberately slow model, for overload tests (not a test module).

Every frame sleeps FRAME_S (environment KESTREL_TEST_FRAME_S, s; default 0.1) before the core
runs, so the node processes at most 1 / FRAME_S sets per second whatever the machine: a
sensor publishing faster overloads it, and its depth-1 subscriptions overwrite what it has
no time to take.
"""

from __future__ import annotations

import os
import time
from typing import Any

from kestrel_common.base_node import run_node
from kestrel_perception.perception_node import PerceptionNode
from rclpy.lifecycle import LifecycleState, TransitionCallbackReturn

FRAME_S = float(os.environ.get("KESTREL_TEST_FRAME_S", "0.1"))


class SlowPerceptionNode(PerceptionNode):
    def on_configure(self, state: LifecycleState) -> TransitionCallbackReturn:
        result = super().on_configure(state)
        core = self.core
        if core is not None:
            process = core.process

            def slow_process(*args: Any, **kwargs: Any) -> Any:
                time.sleep(FRAME_S)  # the slow model (the sleep releases the GIL)
                return process(*args, **kwargs)

            core.process = slow_process
        return result


def main(args: list[str] | None = None) -> int:
    return run_node(SlowPerceptionNode, args)


if __name__ == "__main__":
    raise SystemExit(main())
