"""scripts/bench_control.py's default loops: issue 3's benchmark runs the graph path for
100,000 cycles with eager GPU and CPU in the same run on a GPU machine, without flags."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from bench_control import default_loops  # noqa: E402


def _entries(loops: str) -> list[tuple[str, int, int, str]]:
    out = []
    for spec in loops.split(","):
        backend, rest = spec.split("@")
        rate, cycles, *mode = rest.split(":")
        out.append((backend, int(rate), int(cycles), mode[0] if mode else ""))
    return out


def test_gpu_default_is_100k_graph_cycles_then_eager_gpu_and_cpu() -> None:
    for triton, graph in ((True, "cuda_graph_triton"), (False, "cuda_graph")):
        entries = _entries(default_loops(cuda=True, triton=triton))
        assert entries[0] == (graph, 1000, 100_000, "process")
        assert [e[0] for e in entries[1:]] == ["cuda_eager", "cpu_eager"]
        assert all(rate == 1000 for _, rate, _, _ in entries)


def test_cpu_default_is_the_cpu_policy() -> None:
    assert _entries(default_loops(cuda=False, triton=True)) == [("cpu_eager", 1000, 10_000, "")]
