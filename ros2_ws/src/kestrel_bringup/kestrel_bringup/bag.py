"""rosbag2-compatible MCAP bags without rosbag2 (not on any registry here): the pure-Python core.

A bag is a directory `<name>/` holding `<name>_0.mcap` and the `metadata.yaml` that `ros2 bag
play/info` expects beside it. The MCAP file follows rosbag2's mcap storage plugin:
  profile "ros2"; one schema per type, encoding "ros2msg", named "pkg/msg/Type", whose data is the
  full concatenated definition (the type's .msg text, then each nested type once after a line of
  80 '=' and "MSG: pkg/Type"); channels with message encoding "cdr" and metadata
  "offered_qos_profiles" (YAML list); message data = the CDR bytes rclpy serialises; log_time =
  receive time, publish_time = the header stamp where the message has one (else receive time), ns.
  metadata.yaml is rosbag2's version 9: offered QoS profiles with every key rosbag2 writes, policies
  as names (bag_qos.py). Action feedback topics (`pkg/action/X_FeedbackMessage`) are recorded too.
So Foxglove, `ros2 bag` (mcap plugin), `rosbags` and `mcap_ros2.decoder` read our bags, and we
read theirs (rosbag2's, rosbags').

A recording cut short (SIGKILL, full disk) has no MCAP summary and no metadata.yaml: `reindex`
scans the file's records, keeps every complete message, and writes a complete file and
metadata.yaml (as `ros2 bag reindex` does). Empty, truncated or foreign files raise BagError
with the reason, never another exception.

No rclpy here: the ROS side (subscribe raw, publish raw, /clock) is bag_node.py. The .msg files are
found through the ament index (share/<pkg>/msg/<Type>.msg on AMENT_PREFIX_PATH).
"""

from __future__ import annotations

import os
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from mcap.exceptions import McapError
from mcap.reader import make_reader
from mcap.records import Channel, Message, Schema
from mcap.stream_reader import StreamReader
from mcap.writer import CompressionType, Writer

from kestrel_bringup import bag_qos

__all__ = ["BagError", "BagMessage", "BagReader", "BagWriter", "message_definition",
           "normalize_type", "reindex"]

PRIMITIVES = {"bool", "byte", "char", "float32", "float64", "int8", "uint8", "int16", "uint16",
              "int32", "uint32", "int64", "uint64", "string", "wstring"}
_SEP = "=" * 80
_MAGIC = b"\x89MCAP0\r\n"
METADATA_VERSION = 9


class BagError(RuntimeError):
    """A bag that cannot be written or read (bad path, unknown type, corrupt file)."""


def normalize_type(type_name: str) -> str:
    """'sensor_msgs/JointState' or 'sensor_msgs/msg/JointState' -> 'sensor_msgs/msg/JointState';
    an action's topic types stay in their namespace ('pkg/action/X_FeedbackMessage')."""
    parts = type_name.strip().split("/")
    if len(parts) == 2:
        parts = [parts[0], "msg", parts[1]]
    if len(parts) != 3 or not all(parts) or parts[1] not in ("msg", "action"):
        raise BagError(f"message type {type_name!r}: expected 'pkg/msg/Type' or "
                       "'pkg/action/Type_FeedbackMessage'")
    return "/".join(parts)


def _find_share_file(pkg: str, sub: str, name: str) -> Path:
    for prefix in os.environ.get("AMENT_PREFIX_PATH", "").split(os.pathsep):
        if prefix:
            path = Path(prefix) / "share" / pkg / sub / name
            if path.is_file():
                return path
    raise BagError(f"no definition for {pkg}/{sub}/{Path(name).stem}: share/{pkg}/{sub}/{name} "
                   "is not on AMENT_PREFIX_PATH (source scripts/env.sh)")


def _find_msg_file(pkg: str, name: str) -> Path:
    return _find_share_file(pkg, "msg", f"{name}.msg")


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


def _action_feedback_root(pkg: str, name: str) -> tuple[str, list[str], list[str]]:
    """'X_FeedbackMessage' of pkg/action/X.action: its text, its nested parts, the types to add."""
    action, suffix = name.rsplit("_", 1) if "_" in name else (name, "")
    if suffix != "FeedbackMessage":
        raise BagError(f"action type {pkg}/action/{name}: only X_FeedbackMessage is a topic type")
    sections = _find_share_file(pkg, "action", f"{action}.action").read_text().split("\n---")
    if len(sections) != 3:
        raise BagError(f"{pkg}/action/{action}.action: expected goal --- result --- feedback")
    feedback = sections[2].lstrip("\n").rstrip("\n")
    root = f"unique_identifier_msgs/UUID goal_id\n{action}_Feedback feedback"
    nested = [f"{_SEP}\nMSG: {pkg}/{action}_Feedback\n{feedback}"]
    return root, nested, ["unique_identifier_msgs/UUID", *_field_types(feedback, pkg)]


def message_definition(type_name: str) -> str:
    """The ros2msg schema text of `type_name` (rosbag2 / mcap_ros2 format)."""
    pkg, sub, name = normalize_type(type_name).split("/")
    if sub == "action":
        root, parts, todo = _action_feedback_root(pkg, name)
        parts = [root, *parts]
    else:
        root = _find_msg_file(pkg, name).read_text()
        parts = [root.rstrip("\n")]
        todo = _field_types(root, pkg)
    seen: set[str] = set()
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
    qos: list            # offered profiles, rosbag2's version-9 form (bag_qos.profile)
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

    def add_topic(self, topic: str, type_name: str, qos: str | list = "") -> None:
        """Declare a topic (idempotent for the same type; another type -> BagError). `qos`: the
        offered profiles, a list of bag_qos.profile() dicts or their YAML (older integer form
        too); written in rosbag2's version-9 form."""
        type_name = normalize_type(type_name)
        known = self._topics.get(topic)
        if known is not None:
            if known.type_name != type_name:
                raise BagError(f"topic {topic!r} is {known.type_name}, not {type_name}")
            return
        profiles = bag_qos.parse_profiles(qos)
        if type_name not in self._schemas:
            self._schemas[type_name] = self._writer.register_schema(
                name=type_name, encoding="ros2msg",
                data=message_definition(type_name).encode())
        cid = self._writer.register_channel(
            topic=topic, message_encoding="cdr", schema_id=self._schemas[type_name],
            metadata={"offered_qos_profiles": bag_qos.to_yaml(profiles)})
        self._topics[topic] = _Topic(type_name, cid, profiles)

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
            "version": METADATA_VERSION, "storage_identifier": "mcap",
            "relative_file_paths": [self.path.name],
            "duration": {"nanoseconds": max(0, self._last_ns - self._first_ns)},
            "starting_time": {"nanoseconds_since_epoch": self._first_ns},
            "message_count": self.message_count,
            "topics_with_message_count": [
                {"topic_metadata": {"name": name, "type": t.type_name,
                                    "serialization_format": "cdr",
                                    "offered_qos_profiles": t.qos,
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


def _check_start(path: Path) -> None:
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            head = fh.read(len(_MAGIC))
    except OSError as exc:
        raise BagError(f"{path}: cannot be read: {exc}") from exc
    if size == 0:
        raise BagError(f"{path}: empty file (0 bytes): nothing was recorded")
    if head != _MAGIC[:len(head)] or size < len(_MAGIC):
        raise BagError(f"{path}: not an MCAP file (no MCAP magic at its start)")


def scan(path: Path) -> tuple[list[tuple[Schema | None, Channel, Message]], bool]:
    """Every complete message of an MCAP file in file order, and whether the file ended before
    its footer (cut short). Reads records one by one, so a damaged tail loses only itself."""
    _check_start(path)
    schemas: dict[int, Schema] = {}
    channels: dict[int, Channel] = {}
    out: list[tuple[Schema | None, Channel, Message]] = []
    complete = False
    with open(path, "rb") as fh:
        try:
            for record in StreamReader(fh, validate_crcs=True).records:
                if isinstance(record, Schema):
                    schemas[record.id] = record
                elif isinstance(record, Channel):
                    channels[record.id] = record
                elif isinstance(record, Message) and record.channel_id in channels:
                    ch = channels[record.channel_id]
                    out.append((schemas.get(ch.schema_id), ch, record))
            complete = True
        except (McapError, EOFError, ValueError, struct.error, OSError, MemoryError) as exc:
            if not out and not channels:
                raise BagError(f"{path}: no complete record after the MCAP magic "
                               f"({type(exc).__name__}): nothing to recover") from exc
        except Exception as exc:  # zstd/lz4 errors from a damaged chunk: keep what came before
            if not out and not channels:
                raise BagError(f"{path}: unreadable ({type(exc).__name__}: {exc})") from exc
    return out, not complete


def reindex(directory: str | Path) -> int:
    """Recover a bag cut short: keep every complete message of its .mcap files and write a
    complete file plus metadata.yaml in place (the damaged files are replaced). Returns the
    number of messages kept; BagError when there is nothing to recover."""
    directory = Path(directory)
    files = sorted(directory.glob("*.mcap")) if directory.is_dir() else []
    if not files:
        raise BagError(f"bag directory {directory} holds no .mcap file")
    recovered = [m for f in files for m in scan(f)[0]]
    tmp = directory.parent / f".{directory.name}.reindex"
    if tmp.exists():
        for f in tmp.iterdir():
            f.unlink()
        tmp.rmdir()
    with BagWriter(tmp) as w:
        for schema, ch, msg in recovered:
            if schema is None or ch.message_encoding != "cdr":
                continue
            w.add_topic(ch.topic, schema.name, ch.metadata.get("offered_qos_profiles", ""))
            w.write(ch.topic, msg.data, msg.log_time, msg.publish_time)
    for f in [*files, directory / "metadata.yaml"]:
        f.unlink(missing_ok=True)
    name = directory.name
    (tmp / f"{tmp.name}_0.mcap").rename(directory / f"{name}_0.mcap")
    meta = (tmp / "metadata.yaml").read_text().replace(f"{tmp.name}_0.mcap", f"{name}_0.mcap")
    (directory / "metadata.yaml").write_text(meta)
    (tmp / "metadata.yaml").unlink()
    tmp.rmdir()
    return w.message_count


def read_metadata(directory: Path) -> dict:
    """metadata.yaml of a bag directory, checked: rosbag2's layout, MCAP storage, every file
    it names present. BagError naming what is wrong (and `reindex` where that repairs it)."""
    path = directory / "metadata.yaml"
    fix = f"recover it with `python -m kestrel_bringup.bag_node reindex {directory}`"
    if not path.is_file():
        raise BagError(f"bag directory {directory} has no metadata.yaml (recording cut short?): "
                       + fix)
    try:
        meta = yaml.safe_load(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise BagError(f"{path}: not valid YAML ({exc}): {fix}") from exc
    info = meta.get("rosbag2_bagfile_information") if isinstance(meta, dict) else None
    if not isinstance(info, dict):
        raise BagError(f"{path}: no rosbag2_bagfile_information mapping: {fix}")
    version = info.get("version")
    if not isinstance(version, int) or not 1 <= version <= METADATA_VERSION:
        raise BagError(f"{path}: version {version!r}: this reader knows 1..{METADATA_VERSION}")
    storage = info.get("storage_identifier")
    if storage != "mcap":
        raise BagError(f"{path}: storage_identifier {storage!r}: only 'mcap' bags are read "
                       "(convert with `ros2 bag convert`)")
    names = info.get("relative_file_paths")
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise BagError(f"{path}: relative_file_paths must list the bag's files: {fix}")
    missing = [n for n in names if not (directory / n).is_file()]
    if missing:
        raise BagError(f"{path}: names files that are missing: {missing}")
    if info.get("compression_mode"):
        raise BagError(f"{path}: compression_mode {info['compression_mode']!r}: whole-file "
                       "compressed bags are not read (MCAP chunk compression is)")
    return info


class BagReader:
    """Reads a bag directory (or one .mcap file) written by us or by rosbag2's mcap plugin."""

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        if path.is_dir():
            if not any(path.glob("*.mcap")):
                raise BagError(f"bag directory {path} holds no .mcap file")
            info = read_metadata(path)
            files = [path / n for n in info["relative_file_paths"]]
        elif path.is_file():
            files = [path]
        else:
            raise BagError(f"bag {path} does not exist")
        for f in files:
            _check_start(f)
        self.files = files

    def _summary(self, f: Path, fh):  # noqa: ANN001, ANN202 (mcap's types)
        try:
            summary = make_reader(fh).get_summary()
        except Exception as exc:  # mcap raises several types for damaged files
            summary, cause = None, f" ({type(exc).__name__}: {exc})"
        else:
            cause = ""
        if summary is None:
            raise BagError(f"{f}: no summary section{cause}: the recording was cut short; "
                           f"recover it with `python -m kestrel_bringup.bag_node reindex "
                           f"{f.parent}`")
        return summary

    def topics(self) -> dict[str, str]:
        """topic -> 'pkg/msg/Type' (from the summary; no message is decoded)."""
        out: dict[str, str] = {}
        for f in self.files:
            with open(f, "rb") as fh:
                summary = self._summary(f, fh)
                for ch in summary.channels.values():
                    out[ch.topic] = summary.schemas[ch.schema_id].name
        return out

    def messages(self, topics: set[str] | None = None) -> Iterator[BagMessage]:
        """Messages in log-time order (per file; files in name order)."""
        for f in self.files:
            with open(f, "rb") as fh:
                self._summary(f, fh)
                fh.seek(0)
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
