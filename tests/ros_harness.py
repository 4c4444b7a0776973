"""Multi-process ROS 2 test harness: node processes + an in-test probe node, isolated per test.

Isolation: every test gets its own ROS_DOMAIN_ID (an flock-held id in 1..100, so concurrent
runs on one machine never share a domain), localhost-only discovery, and its own ROS_HOME /
ROS_LOG_DIR. Every wait is bounded. Node processes are started in their own process group and
stopped with SIGINT -> SIGTERM -> SIGKILL; the harness checks nothing of the group survives.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml
from kestrel_common.domain_lease import DomainLease  # noqa: F401 (re-exported)

REPO = Path(__file__).resolve().parents[1]


def ros_env(domain_id: int, run_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "ROS_DOMAIN_ID": str(domain_id),
        "ROS_AUTOMATIC_DISCOVERY_RANGE": "LOCALHOST",
        "ROS_HOME": str(run_dir / "ros_home"),
        "ROS_LOG_DIR": str(run_dir / "ros_log"),
        "PYTHONUNBUFFERED": "1",
        "RCUTILS_COLORIZED_OUTPUT": "0",
        "OMP_NUM_THREADS": "1",
        # tests/ holds small test-only nodes (echo_node.py)
        "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]),
    })
    return env


@dataclass
class NodeProcess:
    """A node running as its own process. Output goes to `log_path` (stdout+stderr)."""

    name: str
    proc: subprocess.Popen
    log_path: Path
    _log_file: Any = None

    def output(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def wait_for_output(self, text: str, timeout: float = 20.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in self.output():
                return True
            if self.proc.poll() is not None:
                return text in self.output()
            time.sleep(0.05)
        return False

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 10.0) -> int:
        """SIGINT, then SIGTERM, then SIGKILL (each bounded). Returns the exit code."""
        for sig, wait in ((signal.SIGINT, timeout), (signal.SIGTERM, 3.0), (signal.SIGKILL, 3.0)):
            if self.proc.poll() is not None:
                break
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(wait)
            except subprocess.TimeoutExpired:
                continue
        code = self.proc.wait(5.0)
        if self._log_file is not None:
            self._log_file.close()
        return code

    def group_gone(self) -> bool:
        try:
            os.killpg(self.proc.pid, 0)
        except ProcessLookupError:
            return True
        return False


def write_params(path: Path, node_name: str, params: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump({node_name: {"ros__parameters": params}}))
    return path


def spawn_node(module: str, node_name: str, env: dict[str, str], run_dir: Path,
               params: dict[str, Any] | None = None, remaps: dict[str, str] | None = None,
               params_files: list[Path] | None = None) -> NodeProcess:
    """Start `python -m module --ros-args -r __node:=node_name ...` in its own process group."""
    cmd = [sys.executable, "-m", module, "--ros-args", "-r", f"__node:={node_name}"]
    for pf in params_files or []:
        cmd += ["--params-file", str(pf)]
    if params:
        pf = write_params(run_dir / f"{node_name}_params.yaml", node_name, params)
        cmd += ["--params-file", str(pf)]
    for src, dst in (remaps or {}).items():
        cmd += ["-r", f"{src}:={dst}"]
    log_path = run_dir / f"{node_name}.log"
    log_file = open(log_path, "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log_file, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True, cwd=str(run_dir))
    return NodeProcess(node_name, proc, log_path, log_file)


class WaitResult(list):
    """The messages collected so far; truthy only if the awaited condition held.

    So `assert col.wait_for(pred)` asserts the condition (not merely that messages exist), and
    the messages stay available for content checks and failure messages."""

    def __init__(self, messages: list, satisfied: bool) -> None:
        super().__init__(messages)
        self.satisfied = satisfied

    def __bool__(self) -> bool:
        return self.satisfied


@dataclass
class Collector:
    """Messages received on one topic (thread-safe append from the probe's executor)."""

    topic: str
    messages: list = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, msg: Any) -> None:
        with self.lock:
            self.messages.append(msg)

    def snapshot(self) -> list:
        with self.lock:
            return list(self.messages)

    def wait_for(self, predicate: Callable[[list], bool] = lambda m: len(m) > 0,
                 timeout: float = 20.0) -> WaitResult:
        """Wait (bounded) until predicate(messages) holds. Returns the messages either way, as
        a WaitResult that is truthy only if the predicate held."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            msgs = self.snapshot()
            if predicate(msgs):
                return WaitResult(msgs, True)
            time.sleep(0.02)
        msgs = self.snapshot()
        return WaitResult(msgs, bool(predicate(msgs)))


MAX_SPIN_ERRORS = 10  # a probe whose spin keeps raising stops (each one printed)


class Probe:
    """An rclpy node inside the test process, spun on a background thread, in its own context
    (kestrel_common.spin_thread: stopped before anything is destroyed)."""

    def __init__(self, domain_id: int, name: str = "kestrel_test_probe") -> None:
        import rclpy
        from rclpy.executors import SingleThreadedExecutor

        from kestrel_common.spin_thread import SpinThread

        self._rclpy = rclpy
        self.context = rclpy.Context()
        rclpy.init(context=self.context, domain_id=domain_id)
        self.node = rclpy.create_node(name, context=self.context)
        self.executor = SingleThreadedExecutor(context=self.context)
        self.executor.add_node(self.node)
        self._action_clients: list[Any] = []
        self._closing = False
        self.spin_errors = 0  # exceptions the spin raised and survived (see _spin_error)
        self._spin = SpinThread(self.executor, name="probe_spin", on_error=self._spin_error)

    def _spin_error(self, exc: Exception) -> bool:
        """An exception of the spin while the context is valid is printed with its traceback
        (pytest shows it with the failing test) and the spin goes on (True): a probe that
        stopped spinning silently would receive nothing more while its graph queries
        (wait_for_subscribers) still answer. After MAX_SPIN_ERRORS, or while closing, it
        stops."""
        if self._closing:
            return False
        self.spin_errors += 1
        again = self.spin_errors < MAX_SPIN_ERRORS
        print(f"probe: the executor raised while spinning "
              f"({'spinning again' if again else 'giving up'}):\n"
              + "".join(traceback.format_exception(exc)), file=sys.stderr, flush=True)
        return again

    def action_client(self, action_type: Any, name: str) -> Any:
        """An ActionClient on the probe's node, destroyed by close() once the spin has stopped
        (destroyed while the executor spins, it leaves an unretrieved "cannot use Destroyable"
        exception in an executor task; left to the garbage collector, the participant's files
        stay in /dev/shm)."""
        from rclpy.action import ActionClient

        client = ActionClient(self.node, action_type, name)
        self._action_clients.append(client)
        return client

    def subscribe(self, msg_type: Any, topic: str, qos: Any = 10) -> Collector:
        col = Collector(topic)
        self.node.create_subscription(msg_type, topic, col, qos)
        return col

    def publisher(self, msg_type: Any, topic: str, qos: Any = 10) -> Any:
        return self.node.create_publisher(msg_type, topic, qos)

    def wait_for_subscribers(self, pub: Any, count: int = 1, timeout: float = 20.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if pub.get_subscription_count() >= count:
                return True
            time.sleep(0.02)
        return False

    def publish_until(self, pub: Any, make_msg: Callable[[], Any], done: Callable[[], bool],
                      period: float = 0.05, timeout: float = 20.0) -> bool:
        """Publish make_msg() every `period` until done() (bounded)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pub.publish(make_msg())
            if done():
                return True
            time.sleep(period)
        return done()

    def now_ns(self) -> int:
        return self.node.get_clock().now().nanoseconds

    def close(self) -> None:
        # Stop spinning before destroying anything: a take on an entity being destroyed leaves
        # an unretrieved "cannot use Destroyable" exception in an executor task.
        self._closing = True
        if not self._spin.stop(timeout_s=5.0):
            print("probe: a callback did not return within 5 s; closing under it",
                  file=sys.stderr, flush=True)
        for client in self._action_clients:  # before the node: each holds its handle
            client.destroy()
        self.node.destroy_node()
        self._rclpy.try_shutdown(context=self.context)


SHM_DIR = Path("/dev/shm")
SHM_PREFIXES = ("fastrtps_", "fastdds_")


def dds_shm_files(ports: bool = False) -> set[str]:
    """Fast DDS shared-memory segments in /dev/shm (`ports`: port files too): each
    participant's own segment (the memory its samples live in), which a process that ends
    without destroying its participant leaves behind. Not the named semaphores
    `sem.fastdds_port<N>_mutex`: Fast DDS keeps one per port on purpose and reuses it. Not the
    `*_el` files: empty lock files, which Fast DDS reclaims when the next participant starts,
    and which a participant of the pytest process can leave behind until that process exits
    (~1 in 10 stack tests; reproduced every time by a node created and destroyed in the
    probe's context). Not the port files `fastdds_port<N>` (one per locator port, a few kB)
    unless asked: a sender that opens a port creates it when it is missing
    (SharedMemGlobal::open_port), so a peer still sending while the port's owner exits can
    recreate the file its owner just removed (1 in ~16 whole-stack signal stops, every process
    exiting 0 with its segment removed); the next participant on that port number opens that
    file (or replaces it when its health check fails), so they never accumulate past the
    ports in use."""
    try:
        return {p.name for p in SHM_DIR.iterdir()
                if p.name.startswith(SHM_PREFIXES) and not p.name.endswith("_el")
                and (ports or "_port" not in p.name)}
    except OSError:
        return set()


def shm_owners(names: set[str]) -> dict[str, str]:
    """name -> the live processes that have it mapped or open ("pid: command line", joined by
    '; '); names no process uses are absent."""
    owners: dict[str, list[str]] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            maps = (proc / "maps").read_text()
        except OSError:
            continue
        used = {name for name in names if name in maps}
        try:
            for fd in (proc / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("/dev/shm/") and target[len("/dev/shm/"):] in names:
                    used.add(target[len("/dev/shm/"):])
        except OSError:
            pass
        if not used:
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:160].strip()
        except OSError:
            cmd = "?"
        for name in used:
            owners.setdefault(name, []).append(f"{proc.name}: {cmd}")
    return {name: "; ".join(who) for name, who in owners.items()}


def orphaned_shm_files(candidates: set[str]) -> set[str]:
    """The candidates that no live process has mapped or open (left by a dead process)."""
    if not candidates:
        return set()
    in_use = shm_owners(candidates)
    return {name for name in candidates if name not in in_use and (SHM_DIR / name).exists()}


def diagnostics_values(msgs: list, node_name: str) -> dict[str, str]:
    """Latest key/values of `node_name`'s status from collected DiagnosticArray messages."""
    for arr in reversed(msgs):
        for status in arr.status:
            if status.name == node_name:
                return {kv.key: kv.value for kv in status.values}
    return {}
