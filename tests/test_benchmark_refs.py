"""Every result file that a tracked file names (`docs/benchmarks/<name>.md|json|png`) exists.

docs/benchmarks/ keeps one current result per benchmark and machine; a re-run overwrites it and
git keeps the history. A comment or doc that points at a removed file sends the reader nowhere.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REF = re.compile(r"docs/benchmarks/([A-Za-z0-9_.-]+\.(?:md|json|png))")
# files whose text names result files as examples, not as references
EXAMPLES = {"tests/test_product_words.py", "tests/test_benchmark_refs.py"}


def dangling_refs(paths: list[str]) -> list[str]:
    """'path:line: docs/benchmarks/<name>' for each named result file that does not exist."""
    out = []
    for rel in paths:
        if rel in EXAMPLES:
            continue
        try:
            text = (ROOT / rel).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        for number, line in enumerate(text.splitlines(), 1):
            for name in REF.findall(line):
                if not (ROOT / "docs" / "benchmarks" / name).exists():
                    out.append(f"{rel}:{number}: docs/benchmarks/{name}")
    return out


def test_the_pattern_finds_result_file_names() -> None:
    assert REF.findall("see docs/benchmarks/control_h200.md and docs/benchmarks/x_cpu.json.") \
        == ["control_h200.md", "x_cpu.json"]


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(),
                    reason="needs a git checkout (git ls-files)")
def test_named_result_files_exist() -> None:
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                           check=True).stdout.decode().split("\0")
    missing = dangling_refs([f for f in files if f])
    assert not missing, ("result files named but not in docs/benchmarks/ (point at the current "
                         "file of that benchmark):\n" + "\n".join(missing))
