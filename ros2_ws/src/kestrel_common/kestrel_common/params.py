"""Parameter specifications: declared once (type, description, bounds), validated at configure.

No rclpy here: `base_node.KestrelLifecycleNode` turns each `ParamSpec` into a declared ROS
parameter with a `ParameterDescriptor` (description, range, read-only), and `validate_params`
checks the values a node got, raising `ParamError` whose message names the parameter and value.
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
    choices: allowed values (scalars) or allowed elements (lists).
    read_only: sizes that allocate memory are read-only (set at start-up only).
    check: extra validation, returns an error string or None.
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


def validate_value(spec: ParamSpec, value: Any) -> Any:
    """Return the validated (type-normalised) value or raise ParamError."""
    vtype = spec.value_type
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


def validate_params(specs: Sequence[ParamSpec], values: Mapping[str, Any]) -> dict[str, Any]:
    """Validate every spec's value (missing -> default). Raises the first ParamError."""
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
    seen: set[str] = set()
    for spec in specs:
        if spec.name in seen:
            raise ValueError(f"parameter '{spec.name}' is declared twice")
        seen.add(spec.name)


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
    for name, value in given.items():
        if name in names or name in ROS_PARAMETERS or name.startswith(ROS_PARAMETER_PREFIXES):
            continue
        close = difflib.get_close_matches(name, sorted(names), n=3)
        hint = f"did you mean {' or '.join(repr(c) for c in close)}?" if close else \
            f"its parameters are {', '.join(sorted(names))}"
        raise ParamError(name, value, f"not a parameter of this node; {hint}")
