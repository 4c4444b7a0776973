"""Record and replay rosbag2-compatible MCAP bags (rosbag2 itself is on no registry here).

    python -m kestrel_bringup.bag_node record -o runs/pick1 /camera/image_raw /lidar/points ...
    python -m kestrel_bringup.bag_node record -o runs/all --all --duration 30
    python -m kestrel_bringup.bag_node play runs/pick1 [--rate 0.5] [--loop] [--clock 100]
        [--topics /camera/image_raw ...] [--remap /camera/image_raw:=/cam0/image]
        [--wait-subscribers 5]
    python -m kestrel_bringup.bag_node info runs/pick1
    python -m kestrel_bringup.bag_node reindex runs/pick1   # a recording cut short

Record: subscribes raw (no deserialisation: the CDR bytes go straight to the file), with the QoS
the publishers offer (reliable only if every publisher is; transient local likewise, so latched
plans are recorded), one callback at a time on a single-threaded executor. Topics that appear
later are picked up by a rescan every 0.5 s. Ends on SIGINT/SIGTERM, --duration or
--max-messages; the file and metadata.yaml are always finalised.
Play: publishes the recorded bytes with the recorded timing (scaled by --rate) and the recorded
QoS. For a stack on `use_sim_time`: replay the bag's own /clock if it was recorded (a sim run),
or give `--clock HZ` to publish the bag's receive time as /clock (a wall-clock recording from a
real robot); a bag that has /clock replays it and ignores --clock (with a warning: two clocks
would jump time back and forth). Typical replay: `run_stack` without the sim node +
`play --clock 100`. `record --all` includes actions' feedback and status topics.
Format and core: kestrel_bringup.bag.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
import threading
import time
from typing import Any

import rclpy
from rclpy.duration import Duration
from rclpy.executors import ExternalShutdownException, SingleThreadedExecutor
from rclpy.node import Node
from rclpy.qos import DurabilityPolicy, HistoryPolicy, QoSProfile, ReliabilityPolicy
from rclpy.signals import SignalHandlerOptions
from rosgraph_msgs.msg import Clock

from kestrel_bringup import bag_qos
from kestrel_bringup.bag import BagError, BagReader, BagWriter, normalize_type, reindex
from kestrel_common.process_stop import SignalFlag, exit_process


# play, after SIGINT/SIGTERM: how long the readers may take in all to acknowledge the
# reliable topics' last messages, s
STOP_ACK_S = 0.5


def message_class(type_name: str) -> Any:
    """'sensor_msgs/msg/JointState' -> the generated class; 'pkg/action/X_FeedbackMessage' ->
    X.Impl.FeedbackMessage (BagError if it is not importable)."""
    pkg, sub, name = normalize_type(type_name).split("/")
    try:
        module = importlib.import_module(f"{pkg}.{sub}")
        if sub == "action":
            action, _, part = name.rpartition("_")
            return getattr(getattr(module, action).Impl, part)
        return getattr(module, name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise BagError(f"message type {type_name} is not available here: {exc}") from exc


def qos_to_profiles(profiles: list[QoSProfile]) -> list[dict]:
    """rclpy profiles -> rosbag2's version-9 dicts (bag_qos.profile)."""
    return [bag_qos.profile(
        int(p.history), int(p.depth), int(p.reliability), int(p.durability),
        p.deadline.nanoseconds, p.lifespan.nanoseconds, int(p.liveliness),
        p.liveliness_lease_duration.nanoseconds, bool(p.avoid_ros_namespace_conventions))
        for p in profiles]


def qos_from_yaml(text: str, depth: int = 10) -> QoSProfile:
    """The QoS for a recorded topic: reliable / transient local only if every recorded publisher
    offered it (as rosbag2 does: a reliable reader would not match a best-effort writer). A
    topic recorded without profiles (foreign bags may have none) is replayed reliable and
    volatile, rosbag2's default: a reliable writer matches readers of either reliability."""
    offered = bag_qos.parse_profiles(text)
    rel = (ReliabilityPolicy.RELIABLE
           if not offered or bag_qos.all_offer(offered, "reliability", "reliable")
           else ReliabilityPolicy.BEST_EFFORT)
    dur = (DurabilityPolicy.TRANSIENT_LOCAL
           if bag_qos.all_offer(offered, "durability", "transient_local")
           else DurabilityPolicy.VOLATILE)
    return QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=depth, reliability=rel,
                      durability=dur)


def clock_source(topics: set[str], clock_hz: float) -> tuple[bool, str]:
    """Whether play publishes its own /clock, and a warning when --clock is ignored because
    the bag replays a recorded /clock (two clocks would make time jump back and forth)."""
    if clock_hz <= 0:
        return False, ""
    if "/clock" in topics:
        return False, ("play: the bag has /clock: replaying the recorded clock; --clock "
                       f"{clock_hz:g} is ignored (no second clock is published)")
    return True, ""


class Recorder(Node):
    def __init__(self, writer: BagWriter, topics: list[str], record_all: bool,
                 max_messages: int = 0, queue_depth: int = 1000) -> None:
        super().__init__("kestrel_bag_recorder")
        self.writer = writer
        self.wanted = set(topics)
        self.record_all = record_all
        self.max_messages = max_messages
        self.queue_depth = queue_depth
        self.done = threading.Event()
        self._subs: dict[str, Any] = {}
        self._scan()
        self.create_timer(0.5, self._scan)

    def _scan(self) -> None:
        for topic, types in self.get_topic_names_and_types():
            if topic in self._subs or not (self.record_all or topic in self.wanted):
                continue
            if self.record_all and topic in ("/rosout", "/parameter_events"):
                continue
            infos = self.get_publishers_info_by_topic(topic)
            if not infos:
                continue
            try:
                cls = message_class(types[0])
            except BagError as exc:
                self.get_logger().warning(f"not recording {topic}: {exc}")
                self._subs[topic] = None
                continue
            offered = qos_to_profiles([i.qos_profile for i in infos])
            # a deep reader queue: a burst waits for the (single) writer thread, not dropped
            qos = qos_from_yaml(bag_qos.to_yaml(offered), self.queue_depth)
            self.writer.add_topic(topic, types[0], offered)
            self._subs[topic] = self.create_subscription(
                cls, topic, lambda data, t=topic: self._on_message(t, data), qos, raw=True)
            self.get_logger().info(f"recording {topic} [{types[0]}]")

    def _on_message(self, topic: str, data: bytes) -> None:
        if self.done.is_set():
            return
        self.writer.write(topic, data, time.time_ns())
        if self.max_messages and self.writer.message_count >= self.max_messages:
            self.done.set()


def _record(args: argparse.Namespace, stop: SignalFlag) -> int:
    if not args.topics and not args.all:
        print("record: name topics or pass --all", file=sys.stderr)
        return 2
    writer = BagWriter(args.output, compression=args.compression)
    node = Recorder(writer, args.topics, args.all, args.max_messages, args.queue_depth)
    executor = SingleThreadedExecutor()
    executor.add_node(node)
    end = time.monotonic() + args.duration if args.duration > 0 else float("inf")
    try:
        while not stop.is_set() and not node.done.is_set() and time.monotonic() < end:
            executor.spin_once(timeout_sec=0.1)
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    finally:
        node.done.set()
        writer.close()
        print(f"recorded {writer.message_count} messages on {writer.topic_count} topics "
              f"to {writer.path}", flush=True)
        executor.shutdown()
        node.destroy_node()
    return 0


def _play(args: argparse.Namespace, stop: SignalFlag) -> int:
    reader = BagReader(args.bag)
    remap = dict(r.split(":=", 1) for r in args.remap)
    wanted = set(args.topics) if args.topics else None
    node = Node("kestrel_bag_player")
    pubs: dict[str, Any] = {}
    first = next(reader.messages(wanted), None)
    if first is None:
        print(f"play: no messages in {args.bag}", file=sys.stderr)
        node.destroy_node()
        return 1
    for m in reader.messages(wanted):  # one pass to create every publisher before the clock runs
        if m.topic not in pubs:
            pubs[m.topic] = node.create_publisher(message_class(m.type_name),
                                                  remap.get(m.topic, m.topic),
                                                  qos_from_yaml(m.qos_yaml, 100))
    own_clock, warning = clock_source(set(pubs), args.clock)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    clock_pub = node.create_publisher(Clock, "/clock", 10) if own_clock else None
    if args.wait_subscribers > 0:
        deadline = time.monotonic() + args.wait_subscribers
        while time.monotonic() < deadline and not stop.is_set() and any(
                p.get_subscription_count() == 0 for p in pubs.values()):
            time.sleep(0.02)
    clock_msg = Clock()
    count = 0
    try:
        while not stop.is_set():
            t_bag0, t_wall0 = first.log_time_ns, time.monotonic_ns()
            next_clock = t_wall0
            for m in reader.messages(wanted):
                due = t_wall0 + int((m.log_time_ns - t_bag0) / args.rate)
                while not stop.is_set():
                    now = time.monotonic_ns()
                    if clock_pub is not None and now >= next_clock:
                        bag_now = t_bag0 + int((now - t_wall0) * args.rate)
                        clock_msg.clock.sec, clock_msg.clock.nanosec = divmod(bag_now, 10**9)
                        clock_pub.publish(clock_msg)
                        next_clock += int(1e9 / args.clock)
                    if now >= due:
                        break
                    wake = min(due, next_clock) if clock_pub is not None else due
                    time.sleep(max(0.0, min(0.05, (wake - now) / 1e9)))
                if stop.is_set():
                    break
                pubs[m.topic].publish(m.data)
                count += 1
            if not args.loop:
                break
    finally:
        # reliable topics: let the readers acknowledge the tail before the writers go
        # (bounded: each topic at the bag's end; all of them together after a stop signal,
        # whose process must be gone within STOP_ACK_S plus the exit)
        end = time.monotonic() + STOP_ACK_S
        for p in pubs.values():
            left = 2.0 if not stop.is_set() else max(0.0, end - time.monotonic())
            p.wait_for_all_acked(Duration(seconds=left))
        print(f"played {count} messages from {args.bag}", flush=True)
        node.destroy_node()
    return 0


def _info(args: argparse.Namespace) -> int:
    reader = BagReader(args.bag)
    counts: dict[str, int] = {}
    t0 = t1 = None
    for m in reader.messages():
        counts[m.topic] = counts.get(m.topic, 0) + 1
        t0 = m.log_time_ns if t0 is None else min(t0, m.log_time_ns)
        t1 = m.log_time_ns if t1 is None else max(t1, m.log_time_ns)
    types = reader.topics()
    dur = (t1 - t0) / 1e9 if t0 is not None else 0.0
    print(f"bag {args.bag}: {sum(counts.values())} messages, {dur:.3f} s")
    for topic, n in sorted(counts.items()):
        print(f"  {topic} [{types.get(topic, '?')}]: {n}")
    return 0


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="kestrel_bringup.bag_node", description=__doc__.split(
        "\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    rec = sub.add_parser("record", help="record topics into a new bag directory")
    rec.add_argument("topics", nargs="*")
    rec.add_argument("-o", "--output", required=True, help="bag directory (must not exist)")
    rec.add_argument("--all", action="store_true", help="every topic (except rosout/params)")
    rec.add_argument("--duration", type=float, default=0.0, help="s; 0 = until SIGINT")
    rec.add_argument("--max-messages", type=int, default=0)
    rec.add_argument("--queue-depth", type=int, default=1000,
                     help="reader history per topic (a burst beyond it is dropped)")
    rec.add_argument("--compression", default="zstd", choices=["zstd", "lz4", "none"])
    play = sub.add_parser("play", help="replay a bag with its timing")
    play.add_argument("bag")
    play.add_argument("--rate", type=float, default=1.0)
    play.add_argument("--loop", action="store_true")
    play.add_argument("--clock", type=float, default=0.0, help="publish /clock at this rate, Hz")
    play.add_argument("--topics", nargs="*", default=[])
    play.add_argument("--remap", nargs="*", default=[], help="from:=to")
    play.add_argument("--wait-subscribers", type=float, default=0.0,
                      help="wait (bounded, s) until every topic has a subscriber")
    info = sub.add_parser("info", help="topics, types, counts")
    info.add_argument("bag")
    fix = sub.add_parser("reindex", help="recover a recording cut short (keeps every complete "
                         "message, rewrites the file and metadata.yaml)")
    fix.add_argument("bag")
    args = ap.parse_args(argv)
    if args.cmd == "play":
        if not 0.01 <= args.rate <= 100:
            ap.error(f"--rate {args.rate}: must be in [0.01, 100]")
        if args.clock < 0 or args.clock > 10000:
            ap.error(f"--clock {args.clock}: must be in [0, 10000] Hz")
        if any(":=" not in r for r in args.remap):
            ap.error(f"--remap {args.remap}: each must be from:=to")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv if argv is None else argv)
    ours = argv[1:argv.index("--ros-args")] if "--ros-args" in argv else argv[1:]
    args = parse_args(ours)
    if args.cmd in ("info", "reindex"):
        try:
            if args.cmd == "info":
                return _info(args)
            print(f"reindexed {args.bag}: kept {reindex(args.bag)} messages", flush=True)
            return 0
        except BagError as exc:
            print(f"{args.cmd}: {exc}", file=sys.stderr)
            return 1
    # SIGINT/SIGTERM end record and play through `stop` (their loops check it at least every
    # 0.1 s); rclpy's handlers would shut the context down under the recorder's callbacks and
    # before the bag is finalised. Only the --ros-args part goes to rcl (it would read our
    # `from:=to` remaps as its own).
    stop = SignalFlag()  # set by signal handlers: no lock (process_stop.SignalFlag)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    ros_argv = argv[:1] + (argv[argv.index("--ros-args"):] if "--ros-args" in argv else [])
    rclpy.init(args=ros_argv, signal_handler_options=SignalHandlerOptions.NO)
    try:
        code = _record(args, stop) if args.cmd == "record" else _play(args, stop)
    except BagError as exc:
        print(f"{args.cmd}: {exc}", file=sys.stderr)
        code = 1
    finally:
        if rclpy.ok():  # (uninstall_handlers=False: kestrel_common.process_stop, step 2)
            rclpy.try_shutdown(uninstall_handlers=False)
    # the bag is finalised, the node and the context are gone: what is left is the
    # interpreter's finalisation, which nothing here needs (process_stop)
    exit_process(code, f"bag {args.cmd}")


if __name__ == "__main__":
    sys.exit(main())
