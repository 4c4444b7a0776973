"""ParamSpec validation: every bad value fails with a message naming parameter and value."""

import pytest

from kestrel_common.params import (ParamError, ParamSpec, check_known_names, check_unique_names,
                                   validate_params)


SPECS = [
    ParamSpec("rate_hz", 1000.0, "loop rate", min=10.0, max=2000.0),
    ParamSpec("num_cameras", 1, "cameras", min=1, max=8, read_only=True),
    ParamSpec("device", "cpu", "torch device", choices=("cpu", "cuda")),
    ParamSpec("enable", True, "flag"),
    ParamSpec("limits", [-1.0, 1.0], "joint limits", min=-10.0, max=10.0, length=2),
    ParamSpec("names", [], "joint names", element_type=str),
]


def test_defaults_are_valid():
    values = validate_params(SPECS, {})
    assert values["rate_hz"] == 1000.0 and values["names"] == []


def test_int_is_accepted_for_float_and_normalised():
    values = validate_params(SPECS, {"rate_hz": 500, "limits": [-2, 2]})
    assert isinstance(values["rate_hz"], float) and values["limits"] == [-2.0, 2.0]


@pytest.mark.parametrize("name,value,fragment", [
    ("rate_hz", 0.0, ">= 10.0"),
    ("rate_hz", 5000.0, "<= 2000.0"),
    ("rate_hz", float("nan"), "finite"),
    ("rate_hz", "fast", "number"),
    ("num_cameras", 2.5, "integer"),
    ("num_cameras", True, "integer"),
    ("device", "tpu", "one of"),
    ("enable", 1, "bool"),
    ("limits", [0.0], "exactly 2"),
    ("limits", [0.0, 100.0], "<= 10.0"),
    ("names", [1, 2], "strings"),
])
def test_bad_values_name_parameter_and_value(name, value, fragment):
    with pytest.raises(ParamError) as exc:
        validate_params(SPECS, {name: value})
    text = str(exc.value)
    assert f"parameter '{name}'" in text and fragment in text
    assert repr(value) in text or str(value) in text


def test_custom_check_and_duplicates():
    spec = ParamSpec("k", 1, "odd", check=lambda v: None if v % 2 else "must be odd")
    with pytest.raises(ParamError, match="must be odd"):
        validate_params([spec], {"k": 2})
    with pytest.raises(ValueError, match="declared twice"):
        check_unique_names([spec, spec])


def test_unknown_names_fail_with_a_suggestion_standard_ros_ones_pass():
    known = [s.name for s in SPECS]
    check_known_names(known, {"rate_hz": 500.0, "use_sim_time": True,
                              "start_type_description_service": False,
                              "qos_overrides./tf.publisher.depth": 10})
    with pytest.raises(ParamError, match=r"parameter 'rate_hx' = 1000: not a parameter of this "
                                         r"node; did you mean 'rate_hz'\?"):
        check_known_names(known, {"rate_hz": 500.0, "rate_hx": 1000})
    with pytest.raises(ParamError, match=r"'zzz' = 1: not a parameter of this node; its "
                                         r"parameters are device, enable, limits"):
        check_known_names(known, {"zzz": 1})


def test_a_node_spec_replaces_the_base_spec_of_its_name():
    from kestrel_common.params import with_base_specs

    base = [ParamSpec("autostart", True, "flag"), ParamSpec("diagnostics_period", 1.0, "s")]
    own = [ParamSpec("rate_hz", 1000.0, "Hz"), ParamSpec("diagnostics_period", 0.1, "s")]
    merged = with_base_specs(base, own)
    assert [(s.name, s.default) for s in merged] == [
        ("autostart", True), ("diagnostics_period", 0.1), ("rate_hz", 1000.0)]
    check_unique_names(merged)


def test_the_control_node_publishes_diagnostics_at_10_hz_by_default():
    """Loop statistics on /diagnostics at ~10 Hz, also without control.yaml."""
    import importlib.util

    if importlib.util.find_spec("kestrel_control") is None:
        pytest.skip("kestrel_control is not on the path")
    from kestrel_common.base_node import BASE_SPECS
    from kestrel_common.params import with_base_specs
    from kestrel_control.control_params import SPECS as CONTROL

    merged = {s.name: s for s in with_base_specs(BASE_SPECS, CONTROL)}
    assert merged["diagnostics_period"].default == 0.1
    assert merged["diagnostics_period"].read_only


GROUPED = [
    ParamSpec("num_cameras", 1, "cameras", min=1, max=8),
    ParamSpec("runtime.precision", "auto", "precision", choices=("auto", "fp32", "bf16")),
    ParamSpec("runtime.cuda_graph", "auto", "graph", choices=("auto", True, False)),
    ParamSpec("sync.slop", 0.02, "s", min=0.0, max=1.0),
]


def test_nested_params_file_values_are_dotted_names():
    from kestrel_common.params import flatten_params

    nested = {"num_cameras": 2, "runtime": {"precision": "bf16", "cuda_graph": True},
              "sync": {"slop": 0.05}}
    assert flatten_params(nested) == {"num_cameras": 2, "runtime.precision": "bf16",
                                      "runtime.cuda_graph": True, "sync.slop": 0.05}
    values = validate_params(GROUPED, nested)
    assert values["runtime.precision"] == "bf16" and values["sync.slop"] == 0.05
    assert validate_params(GROUPED, {"sync.slop": 0.05})["sync.slop"] == 0.05
    check_known_names([s.name for s in GROUPED], nested)


def test_dotted_names_are_named_in_full_in_errors():
    with pytest.raises(ParamError, match=r"parameter 'sync.slop' = 2.0: must be <= 1.0"):
        validate_params(GROUPED, {"sync": {"slop": 2.0}})
    known = [s.name for s in GROUPED]
    with pytest.raises(ParamError, match=r"'runtime.precison' = 'bf16': not a parameter of "
                                         r"this node; did you mean 'runtime.precision'\?"):
        check_known_names(known, {"runtime": {"precison": "bf16"}})
    with pytest.raises(ParamError, match=r"'sync.zzzzzzzzz' = 1: .*the group 'sync' holds "
                                         r"sync.slop"):
        check_known_names(known, {"sync": {"zzzzzzzzz": 1}})
    with pytest.raises(ParamError, match=r"'runtime' = 'bf16': a group of parameters, not "
                                         r"one: give runtime.cuda_graph, runtime.precision"):
        check_known_names(known, {"runtime": "bf16"})


def test_a_switch_with_auto_takes_its_choices_of_any_type():
    spec = GROUPED[2]
    for v in ("auto", True, False):
        out = validate_params([spec], {spec.name: v})[spec.name]
        assert out == v and type(out) is type(v)
    for bad in ("true", 1, 0, "on"):
        with pytest.raises(ParamError, match=r"parameter 'runtime.cuda_graph'"):
            validate_params([spec], {spec.name: bad})


def test_a_name_is_a_parameter_or_a_group_not_both():
    with pytest.raises(ValueError, match=r"'receive' is also the group of \['receive.cpus'\]"):
        check_unique_names([ParamSpec("receive", "auto", "mode"),
                            ParamSpec("receive.cpus", [0], "cpus")])
    with pytest.raises(ValueError, match="empty part"):
        check_unique_names([ParamSpec("runtime..precision", "auto", "x")])
    check_unique_names(GROUPED)
