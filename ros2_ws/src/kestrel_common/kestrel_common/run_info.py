"""What a result file says about where it was measured (no rclpy, stdlib only): the commit of
the code, the machine's CPU model and the GPU's class. Shared by the benchmark records
(kestrel_bench.record) and the closed-loop evaluation (kestrel_bringup.evaluation), so both name
the same machine and commit the same way."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path


RESULTS_DIR = "docs/benchmarks"  # the repository's result records (git_commit)


def git_commit(repo: str | Path, explicit: str = "") -> str:
    """An explicit value, else $KESTREL_COMMIT (a copy of the tree whose git metadata may not
    be its own: a remote machine), else `git rev-parse --short HEAD` in `repo` with "+dirty"
    when tracked files differ, those under RESULTS_DIR aside (the records earlier runs wrote:
    they do not change what is measured); "unknown" without git."""
    if explicit:
        return explicit
    env = os.environ.get("KESTREL_COMMIT", "")
    if env:
        return env
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo,
                              capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--",
                                ":/", f":(top,exclude){RESULTS_DIR}"],
                               cwd=repo, capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty.strip() else "") if head else "unknown"


def gpu_class(name: str) -> str:
    """'NVIDIA H200' -> 'h200', 'NVIDIA H100 80GB HBM3' -> 'h100', 'NVIDIA A100-SXM4-40GB' ->
    'a100', 'NVIDIA GeForce RTX 4090' -> 'rtx4090', 'NVIDIA L4' -> 'l4'; else a slug."""
    n = name.upper().replace("NVIDIA", "").replace("GEFORCE", "")
    m = re.search(r"\bRTX\s*(A?\d{3,4})", n)
    if m:
        return "rtx" + m.group(1).lower()
    m = re.search(r"\b([A-Z]{1,2}\d{1,4})\b", n.replace("-", " "))
    if m:
        return m.group(1).lower()
    return re.sub(r"[^a-z0-9]+", "", name.lower())[:16] or "gpu"


def cpu_model() -> str | None:
    """The CPU's model name from /proc/cpuinfo (None where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None
