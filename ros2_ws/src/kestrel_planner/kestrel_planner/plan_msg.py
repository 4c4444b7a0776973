"""A planner result as a TaskPlan message (the node's result and latched plan topic)."""

from __future__ import annotations

from kestrel_interfaces.msg import StepArgument, TaskPlan, TaskStep

from kestrel_common.conversions import make_header
from kestrel_planner.core import SKILLS, PlanResult, Skill

__all__ = ["plan_to_msg"]


def plan_to_msg(result: PlanResult, stamp_ns: int, frame_id: str) -> TaskPlan:
    """Steps with the effective value of every argument (given or default), SI units."""
    msg = TaskPlan(header=make_header(stamp_ns, frame_id))
    if result.plan is None:
        return msg
    msg.instruction = result.plan.instruction
    for s in result.plan.steps:
        spec = SKILLS[Skill(int(s.skill))]
        msg.steps.append(TaskStep(
            skill=int(s.skill), skill_name=spec.name, target_object=s.target_object,
            arguments=[StepArgument(name=a.name, value=s.value(a.name), unit=a.unit)
                       for a in spec.args]))
    return msg
