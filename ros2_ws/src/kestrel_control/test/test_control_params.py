"""The control node's parameters: grouped names, renamed ones, errors under the node's names."""

from __future__ import annotations

from kestrel_common.params import check_unique_names
from kestrel_control.control_params import RENAMED, SPECS, qualify
from kestrel_models.control.registry import BACKENDS


def test_groups_and_names() -> None:
    names = [s.name for s in SPECS]
    check_unique_names(SPECS)
    groups = {n.split(".")[0] for n in names if "." in n}
    assert groups == {"loop", "safety", "policy", "cartesian", "gripper"}
    for name in ("loop.rate_hz", "loop.mode", "loop.rt_priority", "loop.cpu_affinity",
                 "safety.max_obs_age", "safety.joint_lower", "safety.obs_position_margin",
                 "policy.backend", "policy.model_path", "policy.obs_layout",
                 "policy.action_scales", "policy.weights_path"):
        assert name in names, name
    backend = next(s for s in SPECS if s.name == "policy.backend")
    assert tuple(backend.choices) == ("auto", *BACKENDS) and backend.default == "auto"
    assert all(b in backend.description for b in BACKENDS)  # when each one wins


def test_every_old_name_maps_to_a_declared_one() -> None:
    names = {s.name for s in SPECS}
    assert RENAMED["rate_hz"] == "loop.rate_hz" and RENAMED["loop_mode"] == "loop.mode"
    assert RENAMED["backend"] == "policy.backend" and RENAMED["max_obs_age"] == \
        "safety.max_obs_age"
    assert set(RENAMED.values()) <= names and not set(RENAMED) & names


def test_core_errors_are_reported_under_the_node_parameter_names() -> None:
    assert qualify("parameter 'model_path' = '/x.pt': the file is empty") == \
        "parameter 'policy.model_path' = '/x.pt': the file is empty"
    assert qualify("parameter 'obs_dim' = 20: the model '/x.pt' takes 18 values") == \
        "parameter 'policy.obs_dim' = 20: the model '/x.pt' takes 18 values"
    assert qualify("loop process failed to start: ValueError: parameter 'weights_path' = ''") \
        == "loop process failed to start: ValueError: parameter 'policy.weights_path' = ''"
    # names that are not grouped, and already qualified ones, stay as they are
    assert qualify("parameter 'robots' = 3") == "parameter 'robots' = 3"
    assert qualify("parameter 'loop.mode' = 'x'") == "parameter 'loop.mode' = 'x'"
