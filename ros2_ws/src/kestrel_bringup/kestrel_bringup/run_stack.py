"""Launch-free runner: start the stack's nodes as processes from the same table and YAML files
as the launch files, for machines without ROS 2 launch (e.g. ROS from PyPI wheels).

    ros2 run kestrel_bringup run_stack [--nodes sim,control] [--duration 30]
    python -m kestrel_bringup.run_stack ...

Deliberately small: no substitutions, events or conditions. It starts each node with
`python -m <module> --ros-args ...` (see stack.ros_args), prefixes its output with the node
name, and stops everything (SIGINT, then SIGTERM, then SIGKILL, each bounded) on Ctrl-C,
SIGTERM, the end of --duration, or when any node exits. Exit status: 0 when every node ran
until it was asked to stop, else 1.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

from kestrel_bringup.stack import NODE_NAMES, STACK, NodeEntry, dds_environment, entry, ros_args


class StackProcess:
    def __init__(self, e: NodeEntry, proc: subprocess.Popen, pump: threading.Thread) -> None:
        self.entry = e
        self.proc = proc
        self.pump = pump


class StackRunner:
    """Start and stop the stack's node processes."""

    def __init__(self, nodes: list[str] | None = None, env: dict[str, str] | None = None,
                 extra_params: dict[str, dict[str, str]] | None = None,
                 log_dir: Path | None = None, echo: bool = True) -> None:
        self.entries = [entry(n) for n in nodes] if nodes else list(STACK)
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
            cmd = [sys.executable, "-m", e.module,
                   *ros_args(e, extra_params=self.extra_params.get(e.name))]
            proc = subprocess.Popen(cmd, env=self.env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, text=True, bufsize=1)
            log = open(self.log_dir / f"{e.name}.log", "w") if self.log_dir else None
            pump = threading.Thread(target=self._pump, args=(e.name, proc.stdout, log),
                                    daemon=True)
            pump.start()
            self.procs.append(StackProcess(e, proc, pump))

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
    args = parser.parse_args(argv)
    names = [n for n in args.nodes.split(",") if n]
    if args.log_dir:
        args.log_dir.mkdir(parents=True, exist_ok=True)
    runner = StackRunner(names, log_dir=args.log_dir)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    runner.start()
    deadline = time.monotonic() + args.duration if args.duration > 0 else float("inf")
    early: list[tuple[str, int]] = []
    while not stop.is_set() and time.monotonic() < deadline:
        early = runner.exited()
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
