"""Pure-Python planner core (no rclpy): skills, plan schema, constrained decoding, validation,
execution, the decoding backends (our VLM, a local HF VLM, an OpenAI-compatible server) and the
PlannerCore that puts every backend's output through the same parser and validator."""

from kestrel_planner.core.backend import BACKENDS, DecodeJob, DecodeOutput, PlanBackend
from kestrel_planner.core.constrained import PlanGrammar, PlanLogitsProcessor
from kestrel_planner.core.constrained_llg import (GRAMMAR_ENGINES, LLGuidancePlanProcessor,
                                                  plan_lark)
from kestrel_planner.core.executor import (
    ControlTargetSpec, ExecutorConfig, ExecutorOutput, PlanExecutor, StepEvent, StepState,
    TargetMode,
)
from kestrel_planner.core.plan import (
    Plan, PlanParseError, PlanStep, SceneObject, format_plan, parse_plan,
)
from kestrel_planner.core.planner_core import (
    PlannerConfig, PlannerCore, PlannerInputError, PlanRequest, PlanResult, make_backend,
)
from kestrel_planner.core.skills import SKILLS, Skill, skill_by_name
from kestrel_planner.core.validator import PlanLimits, PlanValidator, ValidationReport

__all__ = [
    "PlanGrammar", "PlanLogitsProcessor", "GRAMMAR_ENGINES", "LLGuidancePlanProcessor",
    "plan_lark", "ControlTargetSpec", "ExecutorConfig",
    "ExecutorOutput", "PlanExecutor", "StepEvent", "StepState", "TargetMode", "Plan",
    "PlanParseError", "PlanStep", "SceneObject", "format_plan", "parse_plan", "PlannerConfig",
    "PlannerCore", "PlannerInputError", "PlanRequest", "PlanResult", "SKILLS", "Skill",
    "skill_by_name", "PlanLimits", "PlanValidator", "ValidationReport", "BACKENDS", "DecodeJob",
    "DecodeOutput", "PlanBackend", "make_backend",
]
