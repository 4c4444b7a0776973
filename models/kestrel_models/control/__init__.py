"""Control models: the recurrent actor-critic policy run by the 1 kHz control node (no rclpy),
its inference backends (`runtimes`) and loaders for users' policy files (`external`)."""

from kestrel_models.control.external import ModelSpec, load_policy
from kestrel_models.control.policy import ActorCritic, PolicyConfig, build_policy
from kestrel_models.control.runtimes import (BACKENDS, BackendUnavailable, PolicyBackend,
                                             PostSpec, StepModule, StepPolicy, check_backend,
                                             create_backend, policy_from_actor_critic)

__all__ = [
    "BACKENDS", "ActorCritic", "BackendUnavailable", "ModelSpec", "PolicyBackend",
    "PolicyConfig", "PostSpec", "StepModule", "StepPolicy", "build_policy", "check_backend",
    "create_backend", "load_policy", "policy_from_actor_critic",
]
