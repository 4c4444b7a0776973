"""Control models: the recurrent actor-critic policy run by the 1 kHz control node (no rclpy),
its inference backends (`registry`: name -> factory; `runtimes`) and loaders for users' policy
files (`external`). Names are imported on first use, so `registry` stays free of torch."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ModelSpec": "external", "load_policy": "external",
    "ActorCritic": "policy", "PolicyConfig": "policy", "build_policy": "policy",
    "BACKENDS": "registry", "BackendUnavailable": "registry", "check_backend": "registry",
    "create_backend": "registry",
    "PolicyBackend": "runtimes", "PostSpec": "runtimes", "StepModule": "runtimes",
    "StepPolicy": "runtimes", "policy_from_actor_critic": "runtimes",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
