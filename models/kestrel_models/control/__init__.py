"""Control models: the recurrent actor-critic policy run by the 1 kHz control node (no rclpy)."""

from kestrel_models.control.policy import ActorCritic, PolicyConfig, build_policy

__all__ = ["ActorCritic", "PolicyConfig", "build_policy"]
