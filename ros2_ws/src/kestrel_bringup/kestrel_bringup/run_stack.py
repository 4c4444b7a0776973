"""Launch-free runner: start the stack's nodes as processes from the same table and YAML files
as the launch files, for machines without ROS 2 launch (e.g. ROS from PyPI wheels).

    ros2 run kestrel_bringup run_stack [--nodes sim,control] [--duration 30]
    python -m kestrel_bringup.run_stack ...

Deliberately small: no substitutions, events or conditions. It starts each node with
`python -m <module> --ros-args ...` (see stack.ros_args) and prefixes its output with the node
name. A node that exits by itself is restarted after its respawn_delay when its table entry
says respawn (as launch's `respawn` does; `--respawn` / `--no-respawn` override the table);
any other exit stops everything (SIGINT, then SIGTERM, then SIGKILL, each bounded), as do
Ctrl-C, SIGTERM and the end of --duration. Exit status: 0 when every node ran until it was
asked to stop (restarts included), else 1.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import IO

from kestrel_bringup.stack import NODE_NAMES, STACK, NodeEntry, dds_environment, entry, ros_args
from kestrel_common.process_stop import SignalFlag


class StackProcess:
    def __init__(self, e: NodeEntry, proc: subprocess.Popen, pump: threading.Thread) -> None:
        self.entry = e
        self.proc = proc
        self.pump = pump
        self.restarts = 0
        self.restart_at: float | None = None   # monotonic s: when a respawn is due


class StackRunner:
    """Start and stop the stack's node processes."""

    def __init__(self, nodes: list[str] | None = None, env: dict[str, str] | None = None,
                 extra_params: dict[str, dict[str, str]] | None = None,
                 log_dir: Path | None = None, echo: bool = True,
                 respawn: dict[str, bool] | None = None) -> None:
        self.entries = [entry(n) for n in nodes] if nodes else list(STACK)
        # per-node override of the table's respawn policy
        self.entries = [replace(e, respawn=(respawn or {}).get(e.name, e.respawn))
                        for e in self.entries]
        self.env = dict(env if env is not None else os.environ)
        self.env.update(dds_environment(self.env))
        self.env.setdefault("PYTHONUNBUFFERED", "1")
        self.env.setdefault("RCUTILS_COLORIZED_OUTPUT", "0")
        self.extra_params = extra_params or {}
        self.log_dir = log_dir
        self.echo = echo
        self.procs: list[StackProcess] = []
        self._stopping = False

    def start(self) -> None:
        for e in self.entries:
            self.procs.append(StackProcess(e, *self._spawn(e, "w")))

    def _spawn(self, e: NodeEntry, log_mode: str) -> tuple[subprocess.Popen, threading.Thread]:
        cmd = [sys.executable, "-m", e.module,
               *ros_args(e, extra_params=self.extra_params.get(e.name))]
        proc = subprocess.Popen(cmd, env=self.env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, text=True, bufsize=1)
        log = open(self.log_dir / f"{e.name}.log", log_mode) if self.log_dir else None
        pump = threading.Thread(target=self._pump, args=(e.name, proc.stdout, log),
                                daemon=True)
        pump.start()
        return proc, pump

    def supervise(self) -> list[tuple[str, int]]:
        """Restart exited nodes whose policy is respawn (after their delay); returns the nodes
        that exited and are not restarted: (name, return code). Call periodically."""
        final = []
        now = time.monotonic()
        for p in self.procs:
            code = p.proc.poll()
            if code is None or self._stopping:
                continue
            if not p.entry.respawn:
                final.append((p.entry.name, code))
            elif p.restart_at is None:
                p.restart_at = now + p.entry.respawn_delay
                self._say(f"node '{p.entry.name}' exited with code {code}; restarting in "
                          f"{p.entry.respawn_delay:g} s")
            elif now >= p.restart_at:
                p.pump.join(timeout=2.0)
                p.proc, p.pump = self._spawn(p.entry, "a")
                p.restarts += 1
                p.restart_at = None
                self._say(f"node '{p.entry.name}' restarted ({p.restarts})")
        return final

    def _say(self, text: str) -> None:
        print(f"[run_stack] {text}", file=sys.stderr, flush=True)

    def _pump(self, name: str, stream: IO[str], log: IO[str] | None) -> None:
        width = max(len(n) for n in NODE_NAMES)
        for line in stream:
            if self.echo:
                sys.stdout.write(f"[{name:<{width}}] {line}")
            if log is not None:
                log.write(line)
                log.flush()
        if log is not None:
            log.close()

    def exited(self) -> list[tuple[str, int]]:
        """Nodes that have exited: (name, return code)."""
        return [(p.entry.name, p.proc.returncode) for p in self.procs
                if p.proc.poll() is not None]

    def stop(self, timeout: float = 10.0) -> dict[str, int]:
        """Stop every node (SIGINT -> SIGTERM -> SIGKILL, bounded). Returns exit codes."""
        self._stopping = True
        for sig, wait in ((signal.SIGINT, timeout), (signal.SIGTERM, 3.0),
                          (signal.SIGKILL, 3.0)):
            alive = [p for p in self.procs if p.proc.poll() is None]
            if not alive:
                break
            for p in alive:
                try:
                    os.killpg(p.proc.pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + wait
            for p in alive:
                try:
                    p.proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        for p in self.procs:
            p.pump.join(timeout=2.0)
        return {p.entry.name: p.proc.wait(5.0) for p in self.procs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", default=",".join(NODE_NAMES),
                        help=f"comma-separated subset of {','.join(NODE_NAMES)}")
    parser.add_argument("--duration", type=float, default=0.0,
                        help="stop after this many seconds (0 = until Ctrl-C)")
    parser.add_argument("--log-dir", type=Path, default=None,
                        help="also write each node's output to <dir>/<node>.log")
    parser.add_argument("--respawn", default="", help="comma-separated nodes restarted when "
                        "they exit (adds to the table's: "
                        f"{','.join(e.name for e in STACK if e.respawn)})")
    parser.add_argument("--no-respawn", default="", help="comma-separated nodes never "
                        "restarted ('all' for every node)")
    args = parser.parse_args(argv)
    names = [n for n in args.nodes.split(",") if n]
    policy = {n: True for n in args.respawn.split(",") if n}
    off = NODE_NAMES if args.no_respawn == "all" else args.no_respawn.split(",")
    policy.update({n: False for n in off if n})
    unknown = sorted(set(names) - set(NODE_NAMES)) + sorted(set(policy) - set(NODE_NAMES))
    if unknown:
        parser.error(f"unknown node(s) {unknown}: nodes are {','.join(NODE_NAMES)}")
    if args.log_dir:
        args.log_dir.mkdir(parents=True, exist_ok=True)
    runner = StackRunner(names, log_dir=args.log_dir, respawn=policy)
    stop = SignalFlag()  # set by signal handlers: no lock (process_stop.SignalFlag)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    runner.start()
    deadline = time.monotonic() + args.duration if args.duration > 0 else float("inf")
    early: list[tuple[str, int]] = []
    while not stop.is_set() and time.monotonic() < deadline:
        early = runner.supervise()
        if early:
            break
        stop.wait(0.2)
    codes = runner.stop()
    for name, code in early:
        print(f"[run_stack] node '{name}' exited early with code {code}", file=sys.stderr)
    failed = {n: c for n, c in codes.items() if c not in (0, -signal.SIGINT)}
    if failed:
        print(f"[run_stack] exit codes: {failed}", file=sys.stderr)
    return 1 if early or failed else 0


if __name__ == "__main__":
    sys.exit(main())
