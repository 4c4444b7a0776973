"""The product speaks of itself only: no words about how it was developed in tracked files.

Every text file `git ls-files` lists (code, tests, docs, YAML, result files) is searched for
the patterns below: work-round numbers and run tags, issue numbers, review notes, the names of
development tools, superseded result files. Binary files (a NUL byte in the first 8 KiB, or
not UTF-8) are skipped. The patterns are case-insensitive and were tuned against the tree so
that product words (`store_prev`, `InferenceSession`, "host->device copy", "fp16", "int8")
do not match.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# name -> pattern; each names one way of talking about the development instead of the product
PATTERNS: dict[str, str] = {
    "work-round number": r"\bsessions? ?\d+",
    "work round": r"\b(this|last|next|earlier|previous|that|same) session\b|\bwork rounds?\b",
    "run tag": r"(?<![A-Za-z0-9])s1\d[a-e]?(?![A-Za-z0-9])",
    "issue number": r"\bissues? ?#?\d+",
    "review note": r"\breview fix(es)?\b|\breviewers?\b|\breview (of|found)\b",
    "development tool": r"\bdevice tool\b|the `run` tool|\bdevice calls?\b|\bthe device copy\b",
    "call tag": r"\[call \d+\]|\bcall \d+\)",
    "superseded result": r"_(prev|before)\.(json|md|npz|txt)\b",
    "dated todo": r"TODO\(session",
}
_COMPILED = {name: re.compile(p, re.IGNORECASE) for name, p in PATTERNS.items()}
_SELF = Path(__file__).resolve()


def _tracked_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    return [ROOT / p for p in out.stdout.decode().split("\0") if p]


def _text(path: Path) -> str | None:
    """The file's text, or None for a binary, unreadable or absent file."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def find_hits(path: Path, text: str) -> list[str]:
    """'path:line: [pattern name] line' for every line matching a pattern."""
    hits = []
    for number, line in enumerate(text.splitlines(), 1):
        for name, pattern in _COMPILED.items():
            if pattern.search(line):
                rel = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
                hits.append(f"{rel}:{number}: [{name}] {line.strip()[:120]}")
    return hits


@pytest.mark.parametrize("line, name", [
    ("measured in session 12 on the H200", "work-round number"),
    ("docs/benchmarks/perception_node_h200_s18_s2d4.md", "run tag"),
    ("the s10c runs", "run tag"),
    ("Issue 3: loop statistics", "issue number"),
    ("see issue #4", "issue number"),
    ("review fixes: the engine key", "review note"),
    ("a reviewer's findings", "review note"),
    ("pass carry to the device call", "development tool"),
    ("rows tagged [call 4]", "call tag"),
    ("perception_h200_prev.json", "superseded result"),
    ("control_tick_parts_cpu_before.json", "superseded result"),
    ("# TODO(session 9): remove", "dated todo"),
])
def test_each_pattern_catches_what_it_names(line: str, name: str) -> None:
    assert _COMPILED[name].search(line), (name, line)


@pytest.mark.parametrize("line", [
    "self.session = ort.InferenceSession(path, opts)",
    "row.store_prev()  # the last_action term",
    "one non_blocking host->device copy per input",
    "precision: fp16 | bf16 | int8; s2d4 stem; 16 bit; s3 bucket",
    "start_new_session=True",
    "the time the target was issued",
    "CUDA events around each call (device time)",
])
def test_product_words_do_not_match(line: str) -> None:
    assert not [n for n, p in _COMPILED.items() if p.search(line)], line


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(),
                    reason="needs a git checkout (git ls-files)")
def test_tracked_files_speak_of_the_product_only() -> None:
    hits: list[str] = []
    for path in _tracked_files():
        if path.resolve() == _SELF:
            continue
        text = _text(path)
        if text is not None:
            hits.extend(find_hits(path, text))
    assert not hits, ("words about how the project was developed (say what the product does "
                      "instead):\n" + "\n".join(hits[:80]) +
                      (f"\n... and {len(hits) - 80} more" if len(hits) > 80 else ""))
