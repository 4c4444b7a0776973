"""freeze_heap: afterwards the collector no longer sees (walks) the objects that existed.
tune_malloc: a freed message buffer's pages are reused, not faulted in again."""

import gc

import pytest

from kestrel_common.heap import freeze_heap


@pytest.mark.slow
def test_freeze_heap_takes_existing_objects_out_of_collections():
    keep = [{"i": i, "l": [i]} for i in range(50_000)]  # a configure-sized heap
    assert id(keep[0]) in {id(o) for o in gc.get_objects()}
    try:
        frozen, ms = freeze_heap()
        assert frozen >= len(keep) and ms >= 0.0
        seen = {id(o) for o in gc.get_objects()}  # what a full collection walks now
        assert id(keep[0]) not in seen and id(keep[-1]["l"]) not in seen
        fresh = {"new": [1]}  # objects made after the freeze are collected as usual
        assert id(fresh) in {id(o) for o in gc.get_objects()}
    finally:
        gc.unfreeze()


# A received message's buffers, freed after the callback, then the next (larger) message's:
# minor page faults per allocation (a subprocess: mallopt is process-wide and one-way).
_FAULTS = """
import resource, sys
from kestrel_common.heap import tune_malloc
print(tune_malloc(), file=sys.stderr)
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
out = []
for n in (4 << 20, 6 << 20, 6 << 20, 5 << 20):
    f0 = faults(); buf = bytearray(n); del buf; out.append(faults() - f0)
print(out)
"""


def _faults_per_message(env_value: str | None) -> tuple[list[int], str]:
    import ast
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "KESTREL_MALLOC"}
    if env_value is not None:
        env["KESTREL_MALLOC"] = env_value
    r = subprocess.run([sys.executable, "-c", _FAULTS], env=env, capture_output=True,
                       text=True, timeout=60, check=True)
    return ast.literal_eval(r.stdout.strip()), r.stderr


def test_tune_malloc_keeps_freed_message_buffers_mapped():
    tuned, log = _faults_per_message(None)
    if "not tuned" in log:
        pytest.skip(f"no glibc here: {log.strip()}")
    assert "mmap_threshold 32 MiB" in log
    # after the heap grew to the largest message, the next ones fault (almost) no page in:
    # 6 MiB = 1536 pages of 4 KiB
    assert tuned[2] + tuned[3] < 100, tuned
    # glibc's defaults (what the test would see without tune_malloc): the 6 MiB buffer is
    # mmap()ed and munmap()ed, every page faulted in again
    default, log = _faults_per_message("default")
    assert "glibc defaults" in log
    assert default[1] > 1000, default
