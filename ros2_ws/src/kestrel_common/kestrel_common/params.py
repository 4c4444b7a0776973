"""Parameter specifications: declared once (type, description, bounds), validated at configure.

No rclpy here: `base_node.KestrelLifecycleNode` turns each `ParamSpec` into a declared ROS
parameter with a `ParameterDescriptor` (description, range, read-only), and `validate_params`
checks the values a node got, raising `ParamError` whose message names the parameter and value.

Dotted names group parameters (`runtime.precision`, `sync.slop`): ROS 2 declares them as they
are, and a params file nests them (`runtime: {precision: bf16}` is `runtime.precision`);
`flatten_params` turns such a nested mapping into dotted names, which `validate_params` and
`check_known_names` accept either way. A name is a parameter or a group, never both.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

ParamValue = bool | int | float | str | list


class ParamError(ValueError):
    """A parameter value is invalid. The message names the parameter and the value."""

    def __init__(self, name: str, value: Any, reason: str) -> None:
        super().__init__(f"parameter '{name}' = {value!r}: {reason}")
        self.name = name
        self.value = value
        self.reason = reason


@dataclass(frozen=True)
class ParamSpec:
    """One node parameter.

    default: its type fixes the parameter type (bool, int, float, str, or a list of one of
        them; an empty list needs `element_type`).
    min/max: inclusive bounds for numbers (and for every element of a numeric list).
    choices: allowed values (scalars) or allowed elements (lists). A choice of another type
        than the default is allowed as it is: default "auto" with choices ("auto", True, False)
        makes a switch whose `auto` the node resolves (a bool is then accepted, a string
        "true" is not).
    read_only: sizes that allocate memory are read-only (set at start-up only).
    check: extra validation, returns an error string or None.
    redact: an invalid value is never shown in the error (a parameter that names a secret,
        e.g. an environment variable holding a key, may be given the secret by mistake).
    """

    name: str
    default: ParamValue
    description: str
    min: float | None = None
    max: float | None = None
    choices: tuple | None = None
    read_only: bool = False
    element_type: type | None = None
    length: int | None = None
    check: Callable[[Any], str | None] | None = None
    redact: bool = False

    @property
    def value_type(self) -> type:
        if isinstance(self.default, list):
            return list
        return type(self.default)

    @property
    def list_element_type(self) -> type | None:
        if not isinstance(self.default, list):
            return None
        if self.element_type is not None:
            return self.element_type
        if not self.default:
            raise ValueError(f"ParamSpec '{self.name}': empty list default needs element_type")
        return type(self.default[0])

    def range_text(self) -> str:
        parts = []
        if self.min is not None or self.max is not None:
            parts.append(f"range [{self.min}, {self.max}]")
        if self.choices is not None:
            parts.append(f"one of {list(self.choices)}")
        return "; ".join(parts)


def _check_number(spec: ParamSpec, value: Any, shown: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ParamError(spec.name, shown, f"must be a number, got {type(value).__name__}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ParamError(spec.name, shown, "must be finite")
    if spec.min is not None and value < spec.min:
        raise ParamError(spec.name, shown, f"must be >= {spec.min}")
    if spec.max is not None and value > spec.max:
        raise ParamError(spec.name, shown, f"must be <= {spec.max}")


def _is_choice(spec: ParamSpec, value: Any) -> bool:
    """`value` is one of the scalar choices, of the same type (True is not 1)."""
    return spec.choices is not None and any(
        type(value) is type(c) and value == c for c in spec.choices)


def validate_value(spec: ParamSpec, value: Any) -> Any:
    """Return the validated (type-normalised) value or raise ParamError (whose message shows
    the value unless spec.redact)."""
    if not spec.redact:
        return _validate_value(spec, value)
    try:
        return _validate_value(spec, value)
    except ParamError as exc:
        raise ParamError(spec.name, "<not shown>", exc.reason) from None


def _validate_value(spec: ParamSpec, value: Any) -> Any:
    vtype = spec.value_type
    if vtype is not list and _is_choice(spec, value):  # a choice of any type, as it is
        err = spec.check(value) if spec.check is not None else None
        if err:
            raise ParamError(spec.name, value, err)
        return value
    if vtype is list:
        if not isinstance(value, (list, tuple)):
            try:
                value = list(value)  # numpy arrays from rclpy
            except TypeError:
                raise ParamError(spec.name, value, "must be a list") from None
        value = list(value)
        if spec.length is not None and len(value) != spec.length:
            raise ParamError(spec.name, value, f"must have exactly {spec.length} elements")
        etype = spec.list_element_type
        out = []
        for item in value:
            if etype is float:
                if isinstance(item, int) and not isinstance(item, bool):
                    item = float(item)
                _check_number(spec, item, value)
                item = float(item)
            elif etype is int:
                if isinstance(item, bool) or not isinstance(item, int):
                    raise ParamError(spec.name, value, "elements must be integers")
                _check_number(spec, item, value)
            elif etype is str:
                if not isinstance(item, str):
                    raise ParamError(spec.name, value, "elements must be strings")
            if spec.choices is not None and item not in spec.choices:
                raise ParamError(spec.name, value, f"element {item!r} not in {list(spec.choices)}")
            out.append(item)
        value = out
    elif vtype is bool:
        if not isinstance(value, bool):
            raise ParamError(spec.name, value, "must be a bool")
    elif vtype is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ParamError(spec.name, value, "must be an integer")
        _check_number(spec, value, value)
    elif vtype is float:
        if isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        _check_number(spec, value, value)
        value = float(value)
    elif vtype is str:
        if not isinstance(value, str):
            raise ParamError(spec.name, value, "must be a string")
    if vtype is not list and spec.choices is not None and value not in spec.choices:
        raise ParamError(spec.name, value, f"must be one of {list(spec.choices)}")
    if spec.check is not None:
        err = spec.check(value)
        if err:
            raise ParamError(spec.name, value, err)
    return value


def flatten_params(values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A params file's nested mapping -> dotted names: {"sync": {"slop": 0.02}} ->
    {"sync.slop": 0.02} (what ROS 2 declares). Flat dotted keys pass as they are."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten_params(value, f"{name}."))
        else:
            out[name] = value
    return out


def validate_params(specs: Sequence[ParamSpec], values: Mapping[str, Any]) -> dict[str, Any]:
    """Validate every spec's value (missing -> default); `values` flat (dotted names) or
    nested. Raises the first ParamError."""
    values = flatten_params(values)
    out: dict[str, Any] = {}
    for spec in specs:
        out[spec.name] = validate_value(spec, values.get(spec.name, spec.default))
    return out


def with_base_specs(base: Sequence[ParamSpec], specs: Sequence[ParamSpec]) -> list[ParamSpec]:
    """The base specs every node declares, then the node's own: a node spec with a base
    spec's name replaces it (the control node's diagnostics_period defaults to 10 Hz, the
    others' to 1 Hz), in the base spec's place."""
    own = {s.name: s for s in specs}
    return [own.pop(b.name, b) for b in base] + [s for s in specs if s.name in own]


def check_unique_names(specs: Sequence[ParamSpec]) -> None:
    """Each name once, with non-empty dotted parts, and none both a parameter and a group
    (`receive` and `receive.cpus`: a params file could not nest them)."""
    seen: set[str] = set()
    for spec in specs:
        if spec.name in seen:
            raise ValueError(f"parameter '{spec.name}' is declared twice")
        if not all(spec.name.split(".")):
            raise ValueError(f"parameter '{spec.name}': empty part in a dotted name")
        seen.add(spec.name)
    groups = {".".join(n.split(".")[:i]) for n in seen for i in range(1, n.count(".") + 1)}
    for name in sorted(seen & groups):
        raise ValueError(f"parameter '{name}' is also the group of "
                         f"{sorted(n for n in seen if n.startswith(name + '.'))}")


# Parameters every rclpy node may be given besides its own: the clock source, rclpy's type
# description service, and QoS overrides (`qos_overrides./topic.publisher.depth`, ...).
ROS_PARAMETERS = frozenset({"use_sim_time", "start_type_description_service"})
ROS_PARAMETER_PREFIXES = ("qos_overrides.",)


def check_known_names(known: Sequence[str], given: Mapping[str, Any]) -> None:
    """Every name in `given` (a params file's / command line's values for this node) must be
    one of `known` or a standard ROS parameter; raises ParamError for the first that is not.

    Why: ROS silently ignores a value given for a parameter the node never declares, so a typo
    (`rate_hx: 1000`) would run the node with the default instead of failing at configure.
    """
    names = set(known)
    for name, value in flatten_params(given).items():
        if name in names or name in ROS_PARAMETERS or name.startswith(ROS_PARAMETER_PREFIXES):
            continue
        members = sorted(n for n in names if n.startswith(name + "."))
        if members:  # a value for a whole group (`runtime: bf16`)
            raise ParamError(name, value, f"a group of parameters, not one: give "
                                          f"{', '.join(members)}")
        group = name.rpartition(".")[0]
        close = difflib.get_close_matches(name, sorted(names), n=3)
        siblings = sorted(n for n in names if group and n.startswith(group + "."))
        hint = f"did you mean {' or '.join(repr(c) for c in close)}?" if close else \
            f"the group '{group}' holds {', '.join(siblings)}" if siblings else \
            f"its parameters are {', '.join(sorted(names))}"
        raise ParamError(name, value, f"not a parameter of this node; {hint}")
