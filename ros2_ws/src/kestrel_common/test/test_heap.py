"""freeze_heap: afterwards the collector no longer sees (walks) the objects that existed."""

import gc

from kestrel_common.heap import freeze_heap


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
