"""Offered QoS profiles as rosbag2 writes them (metadata version 9): no rclpy here.

rosbag2 stores, per topic, the QoS profiles its publishers offered, in two places: the MCAP
channel's metadata `offered_qos_profiles` (a YAML string) and metadata.yaml's
`topic_metadata.offered_qos_profiles` (a YAML list). Under version 9 each profile is a mapping
with every key below, policies as lower-case names and durations as {sec, nsec}; readers that
follow rosbag2 (rosbag2 itself, `rosbags`) read every key unconditionally. Older bags (version
<= 8) wrote the policies as integers: `parse_profiles` takes both.
"""

from __future__ import annotations

from typing import Any

import yaml

# Policy value -> name, as rmw numbers them (rclpy's HistoryPolicy etc. have the same values).
POLICY_NAMES: dict[str, dict[int, str]] = {
    "history": {0: "system_default", 1: "keep_last", 2: "keep_all", 3: "unknown"},
    "reliability": {0: "system_default", 1: "reliable", 2: "best_effort", 3: "unknown",
                    4: "best_available"},
    "durability": {0: "system_default", 1: "transient_local", 2: "volatile", 3: "unknown",
                   4: "best_available"},
    "liveliness": {0: "system_default", 1: "automatic", 3: "manual_by_topic", 4: "unknown",
                   5: "best_available"},
}
DURATION_KEYS = ("deadline", "lifespan", "liveliness_lease_duration")
# rmw's "infinite" duration (RMW_DURATION_INFINITE, INT64_MAX ns) as rosbag2 writes it.
INFINITE_NS = 2**63 - 1


def _duration(ns: int) -> dict[str, int]:
    sec, nsec = divmod(int(ns), 10**9)
    return {"sec": sec, "nsec": nsec}


def profile(history: int = 1, depth: int = 10, reliability: int = 1, durability: int = 2,
            deadline_ns: int = 0, lifespan_ns: int = 0, liveliness: int = 1,
            liveliness_lease_ns: int = 0, avoid_ros_namespace_conventions: bool = False
            ) -> dict[str, Any]:
    """One profile in rosbag2's version-9 form from rmw's numbers (durations in ns; 0 = the
    rmw default, written as the infinite duration as rmw reports it for publishers)."""
    def name(policy: str, value: int) -> str:
        return POLICY_NAMES[policy].get(int(value), "unknown")

    return {"history": name("history", history), "depth": int(depth),
            "reliability": name("reliability", reliability),
            "durability": name("durability", durability),
            "deadline": _duration(deadline_ns or INFINITE_NS),
            "lifespan": _duration(lifespan_ns or INFINITE_NS),
            "liveliness": name("liveliness", liveliness),
            "liveliness_lease_duration": _duration(liveliness_lease_ns or INFINITE_NS),
            "avoid_ros_namespace_conventions": bool(avoid_ros_namespace_conventions)}


def _policy_name(policy: str, value: Any) -> str:
    if isinstance(value, bool):
        return "unknown"
    if isinstance(value, int):
        return POLICY_NAMES[policy].get(value, "unknown")
    text = str(value).strip().lower()
    return text if text in POLICY_NAMES[policy].values() else "unknown"


def _parse_duration(value: Any) -> dict[str, int]:
    if isinstance(value, dict):
        try:
            return {"sec": int(value.get("sec", 0)), "nsec": int(value.get("nsec", 0))}
        except (TypeError, ValueError):
            pass
    return _duration(INFINITE_NS)


def parse_profiles(value: str | list | None) -> list[dict[str, Any]]:
    """Profiles from a YAML string or list, version 9 (names) or older (integers); keys that
    are missing or malformed get rmw's defaults, so a foreign bag never fails here."""
    if isinstance(value, str):
        try:
            value = yaml.safe_load(value) if value.strip() else []
        except yaml.YAMLError:
            value = []
    out = []
    for item in value if isinstance(value, list) else []:
        if not isinstance(item, dict):
            continue
        depth = item.get("depth", 0)
        out.append({
            "history": _policy_name("history", item.get("history", 1)),
            "depth": int(depth) if isinstance(depth, int) and depth >= 0 else 0,
            "reliability": _policy_name("reliability", item.get("reliability", 0)),
            "durability": _policy_name("durability", item.get("durability", 0)),
            **{k: _parse_duration(item.get(k)) for k in ("deadline", "lifespan")},
            "liveliness": _policy_name("liveliness", item.get("liveliness", 1)),
            "liveliness_lease_duration": _parse_duration(item.get("liveliness_lease_duration")),
            "avoid_ros_namespace_conventions": bool(
                item.get("avoid_ros_namespace_conventions", False)),
        })
    return out


def to_yaml(profiles: list[dict[str, Any]]) -> str:
    """The channel-metadata string ('' for no profile, as rosbag2 writes it)."""
    return yaml.safe_dump(profiles, sort_keys=False).strip() if profiles else ""


def all_offer(profiles: list[dict[str, Any]], policy: str, name: str) -> bool:
    """True when there is a profile and every one offers `policy` = `name` (rosbag2 subscribes
    reliable / transient local only then: such a reader would not match the other writers)."""
    return bool(profiles) and all(p[policy] == name for p in profiles)
