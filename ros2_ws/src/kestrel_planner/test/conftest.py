"""Shared by kestrel_planner's tests: `cpu_graphs` (tests/cpu_graphs.py), the engine's
CUDA-graph code paths on the CPU."""

from cpu_graphs import cpu_graphs  # noqa: F401 - the fixture, for the tests here
