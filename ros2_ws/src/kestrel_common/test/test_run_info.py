"""run_info.git_commit: a record's commit, "+dirty" when the code differs from it."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from kestrel_common.run_info import RESULTS_DIR, git_commit

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True,
                          text=True).stdout.strip()


def test_dirty_only_when_code_differs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A changed record under RESULTS_DIR (an earlier run's output) leaves the commit clean,
    from the top of the tree or below it; a changed source file makes it dirty."""
    monkeypatch.delenv("KESTREL_COMMIT", raising=False)
    (tmp_path / RESULTS_DIR).mkdir(parents=True)
    (tmp_path / "src").mkdir()
    record, code = tmp_path / RESULTS_DIR / "x_cpu.md", tmp_path / "src" / "a.py"
    record.write_text("old\n")
    code.write_text("x = 1\n")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "-c", "user.name=k", "-c", "user.email=k@k", "commit", "-q", "-m", "one")
    head = _git(tmp_path, "rev-parse", "--short", "HEAD")
    assert git_commit(tmp_path) == head
    record.write_text("new\n")
    (tmp_path / "notes.txt").write_text("untracked\n")
    assert git_commit(tmp_path) == head
    assert git_commit(tmp_path / "src") == head
    code.write_text("x = 2\n")
    assert git_commit(tmp_path) == head + "+dirty"
    assert git_commit(tmp_path / RESULTS_DIR) == head + "+dirty"  # from anywhere in the tree
