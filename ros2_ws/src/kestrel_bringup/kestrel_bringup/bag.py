"""rosbag2-compatible MCAP bags without rosbag2 (not on any registry here): the pure-Python core.

A bag is a directory `<name>/` holding `<name>_0.mcap` and the `metadata.yaml` that `ros2 bag
play/info` expects beside it. The MCAP file follows rosbag2's mcap storage plugin:
  profile "ros2"; one schema per type, encoding "ros2msg", named "pkg/msg/Type", whose data is the
  full concatenated definition (the type's .msg text, then each nested type once after a line of
  80 '=' and "MSG: pkg/Type"); channels with message encoding "cdr" and metadata
  "offered_qos_profiles" (YAML list); message data = the CDR bytes rclpy serialises; log_time =
  receive time, publish_time = the header stamp where the message has one (else receive time), ns.
So Foxglove, `ros2 bag` (mcap plugin) and `mcap_ros2.decoder` read our bags, and we read theirs.

No rclpy here: the ROS side (subscribe raw, publish raw, /clock) is bag_node.py. The .msg files are
found through the ament index (share/<pkg>/msg/<Type>.msg on AMENT_PREFIX_PATH).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from mcap.reader import make_reader
from mcap.writer import CompressionType, Writer

__all__ = ["BagError", "BagMessage", "BagReader", "BagWriter", "message_definition",
           "normalize_type"]

PRIMITIVES = {"bool", "byte", "char", "float32", "float64", "int8", "uint8", "int16", "uint16",
              "int32", "uint32", "int64", "uint64", "string", "wstring"}
_SEP = "=" * 80


class BagError(RuntimeError):
    """A bag that cannot be written or read (bad path, unknown type, corrupt file)."""


def normalize_type(type_name: str) -> str:
    """'sensor_msgs/JointState' or 'sensor_msgs/msg/JointState' -> 'sensor_msgs/msg/JointState'."""
    parts = type_name.strip().split("/")
    if len(parts) == 2:
        parts = [parts[0], "msg", parts[1]]
    if len(parts) != 3 or not all(parts) or parts[1] != "msg":
        raise BagError(f"message type {type_name!r}: expected 'pkg/msg/Type'")
    return "/".join(parts)


def _find_msg_file(pkg: str, name: str) -> Path:
    for prefix in os.environ.get("AMENT_PREFIX_PATH", "").split(os.pathsep):
        if prefix:
            path = Path(prefix) / "share" / pkg / "msg" / f"{name}.msg"
            if path.is_file():
                return path
    raise BagError(f"no definition for {pkg}/msg/{name}: share/{pkg}/msg/{name}.msg is not on "
                   "AMENT_PREFIX_PATH (source scripts/env.sh)")


def _field_types(text: str, pkg: str) -> list[str]:
    """Nested (non-primitive) types a .msg text uses, as 'pkg/Type', in order of first use."""
    out: list[str] = []
    for line in text.splitlines():
        words = line.split("#", 1)[0].split()
        if len(words) < 2:
            continue  # blank or comment
        tok = words[0]  # constants ('uint8 MODE_JOINT=0') always have a primitive type
        base = re.sub(r"\[.*\]$", "", tok)          # drop array suffix: T[], T[3], T[<=3]
        base = re.sub(r"<=\d+$", "", base)           # drop string bound
        if base in PRIMITIVES:
            continue
        if "/" not in base:
            base = "std_msgs/Header" if base == "Header" else f"{pkg}/{base}"
        if base not in out:
            out.append(base)
    return out


def message_definition(type_name: str) -> str:
    """The ros2msg schema text of `type_name` (rosbag2 / mcap_ros2 format)."""
    pkg, _, name = normalize_type(type_name).split("/")
    root = _find_msg_file(pkg, name).read_text()
    parts = [root.rstrip("\n")]
    seen: set[str] = set()
    todo = _field_types(root, pkg)
    while todo:
        dep = todo.pop(0)
        if dep in seen:
            continue
        seen.add(dep)
        dpkg, dname = dep.split("/")
        text = _find_msg_file(dpkg, dname).read_text()
        parts.append(f"{_SEP}\nMSG: {dep}\n{text.rstrip(chr(10))}")
        todo.extend(t for t in _field_types(text, dpkg) if t not in seen)
    return "\n".join(parts) + "\n"


@dataclass
class BagMessage:
    topic: str
    type_name: str          # 'pkg/msg/Type'
    data: bytes             # CDR, as rclpy serialises it
    log_time_ns: int        # receive time
    publish_time_ns: int    # header stamp if any, else receive time
    qos_yaml: str = ""      # the channel's offered_qos_profiles


@dataclass
class _Topic:
    type_name: str
    channel_id: int
    qos_yaml: str
    count: int = 0


@dataclass
class BagWriter:
    """Writes `<directory>/<name>_0.mcap` + `metadata.yaml`. Use as a context manager."""

    directory: Path
    compression: str = "zstd"  # zstd | lz4 | none
    _topics: dict[str, _Topic] = field(default_factory=dict, init=False)
    _schemas: dict[str, int] = field(default_factory=dict, init=False)
    _first_ns: int = field(default=0, init=False)
    _last_ns: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.directory = Path(self.directory)
        if self.compression not in ("zstd", "lz4", "none"):
            raise BagError(f"parameter 'compression' = {self.compression!r}: must be zstd, "
                           "lz4 or none")
        if self.directory.exists() and any(self.directory.iterdir()):
            raise BagError(f"bag directory {self.directory} exists and is not empty")
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = self.directory / f"{self.directory.name}_0.mcap"
        self._file = open(self.path, "wb")  # noqa: SIM115 (closed in close())
        comp = {"zstd": CompressionType.ZSTD, "lz4": CompressionType.LZ4,
                "none": CompressionType.NONE}[self.compression]
        self._writer = Writer(self._file, compression=comp)
        self._writer.start(profile="ros2", library="kestrel_bringup.bag")
        self._closed = False

    def add_topic(self, topic: str, type_name: str, qos_yaml: str = "") -> None:
        """Declare a topic (idempotent for the same type; another type -> BagError)."""
        type_name = normalize_type(type_name)
        known = self._topics.get(topic)
        if known is not None:
            if known.type_name != type_name:
                raise BagError(f"topic {topic!r} is {known.type_name}, not {type_name}")
            return
        if type_name not in self._schemas:
            self._schemas[type_name] = self._writer.register_schema(
                name=type_name, encoding="ros2msg",
                data=message_definition(type_name).encode())
        cid = self._writer.register_channel(
            topic=topic, message_encoding="cdr", schema_id=self._schemas[type_name],
            metadata={"offered_qos_profiles": qos_yaml})
        self._topics[topic] = _Topic(type_name, cid, qos_yaml)

    def write(self, topic: str, data: bytes, log_time_ns: int,
              publish_time_ns: int | None = None) -> None:
        t = self._topics.get(topic)
        if t is None:
            raise BagError(f"topic {topic!r} was not declared with add_topic()")
        self._writer.add_message(channel_id=t.channel_id, log_time=int(log_time_ns),
                                 data=bytes(data), sequence=t.count,
                                 publish_time=int(publish_time_ns or log_time_ns))
        t.count += 1
        if not self._first_ns or log_time_ns < self._first_ns:
            self._first_ns = int(log_time_ns)
        self._last_ns = max(self._last_ns, int(log_time_ns))

    @property
    def topic_count(self) -> int:
        return len(self._topics)

    @property
    def message_count(self) -> int:
        return sum(t.count for t in self._topics.values())

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._writer.finish()
        self._file.close()
        meta = {"rosbag2_bagfile_information": {
            "version": 9, "storage_identifier": "mcap",
            "relative_file_paths": [self.path.name],
            "duration": {"nanoseconds": max(0, self._last_ns - self._first_ns)},
            "starting_time": {"nanoseconds_since_epoch": self._first_ns},
            "message_count": self.message_count,
            "topics_with_message_count": [
                {"topic_metadata": {"name": name, "type": t.type_name,
                                    "serialization_format": "cdr",
                                    "offered_qos_profiles": t.qos_yaml,
                                    "type_description_hash": ""},
                 "message_count": t.count} for name, t in self._topics.items()],
            "compression_format": "", "compression_mode": "",
            "files": [{"path": self.path.name,
                       "starting_time": {"nanoseconds_since_epoch": self._first_ns},
                       "duration": {"nanoseconds": max(0, self._last_ns - self._first_ns)},
                       "message_count": self.message_count}],
            "custom_data": {}, "ros_distro": "kilted"}}
        (self.directory / "metadata.yaml").write_text(yaml.safe_dump(meta, sort_keys=False))

    def __enter__(self) -> BagWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class BagReader:
    """Reads a bag directory (or one .mcap file) written by us or by rosbag2's mcap plugin."""

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        if path.is_dir():
            files = sorted(path.glob("*.mcap"))
            if not files:
                raise BagError(f"bag directory {path} holds no .mcap file")
        elif path.is_file():
            files = [path]
        else:
            raise BagError(f"bag {path} does not exist")
        self.files = files

    def topics(self) -> dict[str, str]:
        """topic -> 'pkg/msg/Type' (from the summary; no message is decoded)."""
        out: dict[str, str] = {}
        for f in self.files:
            with open(f, "rb") as fh:
                summary = make_reader(fh).get_summary()
                if summary is None:
                    raise BagError(f"{f}: no summary section (file not closed properly?)")
                for ch in summary.channels.values():
                    out[ch.topic] = summary.schemas[ch.schema_id].name
        return out

    def messages(self, topics: set[str] | None = None) -> Iterator[BagMessage]:
        """Messages in log-time order (per file; files in name order)."""
        for f in self.files:
            with open(f, "rb") as fh:
                reader = make_reader(fh)
                try:
                    for schema, channel, msg in reader.iter_messages(
                            topics=sorted(topics) if topics else None, log_time_order=True):
                        if channel.message_encoding != "cdr" or schema is None:
                            continue
                        yield BagMessage(channel.topic, normalize_type(schema.name), msg.data,
                                         msg.log_time, msg.publish_time,
                                         channel.metadata.get("offered_qos_profiles", ""))
                except Exception as exc:  # mcap raises several types for corrupt files
                    if isinstance(exc, BagError):
                        raise
                    raise BagError(f"{f}: {type(exc).__name__}: {exc}") from exc
