"""Backend 'plan_text': the goal's instruction IS the plan, in the plan text form (plan.py), with
';' between lines (as the demo_plan parameter): "pick red_cube speed=0.3; place bin; end".

No model runs: the robot side of the loop (perception's scene, the validator, the executor,
control, the robot) is driven with a known plan, e.g. by the closed-loop evaluation's
`--oracle-plan` (which then measures everything but the planner's model) or by tests. The text
goes through the same parser and validator as every backend's output: targets must be in the
current perception scene with a 3D position, numbers within the limits.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from kestrel_planner.core.backend import DecodeJob, DecodeOutput

__all__ = ["PlanTextBackend", "plan_text_of"]


def plan_text_of(instruction: str) -> str:
    """'pick a; place bin; end' -> 'pick a\\nplace bin\\nend' (each line stripped)."""
    return "\n".join(line.strip() for line in instruction.split(";"))


class PlanTextBackend:
    warmup = False  # nothing to warm up

    def __init__(self) -> None:
        self.name = "plan_text"

    def close(self) -> None:
        pass

    def decode(self, jobs: Sequence[DecodeJob]) -> list[DecodeOutput]:
        out = []
        for job in jobs:
            t0 = time.monotonic()
            if job.should_cancel is not None and job.should_cancel():
                out.append(DecodeOutput("", "cancelled", 0.0, 0))
                continue
            text = plan_text_of(job.instruction)
            if job.on_token is not None:
                job.on_token(1, text)
            out.append(DecodeOutput(text, "stop", time.monotonic() - t0, 1))
        return out
