"""LatestValueBuffer: newest value, stamps, no torn reads under a concurrent writer."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from kestrel_control.core.double_buffer import LatestValueBuffer


def test_empty_buffer_reads_zeros_version_zero() -> None:
    buf = LatestValueBuffer((2, 3))
    out = np.full((2, 3), 7.0)
    assert buf.read_into(out) == (0, 0)
    assert np.all(out == 0.0)


def test_write_then_read_newest_with_stamp() -> None:
    buf = LatestValueBuffer(4, np.float32)
    out = np.empty(4, np.float32)
    for k in range(1, 6):
        assert buf.write(np.arange(4) + k, stamp_ns=1000 * k) == k
    assert buf.read_into(out) == (5, 5000)
    np.testing.assert_array_equal(out, np.arange(4) + 5)
    assert buf.version == 5 and buf.dtype == np.float32 and buf.shape == (4,)


def test_write_with_fills_in_place_and_failed_fill_publishes_nothing() -> None:
    buf = LatestValueBuffer(3)
    buf.write([1.0, 2.0, 3.0], 10)

    def bad_fill(slot: np.ndarray) -> None:
        slot[0] = 99.0
        raise KeyError("unknown joint")

    with pytest.raises(KeyError):
        buf.write_with(bad_fill, 20)
    out = np.empty(3)
    assert buf.read_into(out) == (1, 10)
    np.testing.assert_array_equal(out, [1.0, 2.0, 3.0])
    buf.write_with(lambda slot: slot.__setitem__(slice(None), 5.0), 30)
    assert buf.read_into(out) == (2, 30) and np.all(out == 5.0)


def test_reader_during_a_write_gets_previous_complete_value() -> None:
    buf = LatestValueBuffer(3)
    buf.write([1.0, 1.0, 1.0], 1)
    seen = []

    def fill(slot: np.ndarray) -> None:
        slot[:2] = 2.0  # half-written; a read now must not see it
        out = np.empty(3)
        seen.append((buf.read_into(out), out.copy()))
        slot[2] = 2.0

    buf.write_with(fill, 2)
    (version_stamp, value), = seen
    assert version_stamp == (1, 1)
    np.testing.assert_array_equal(value, [1.0, 1.0, 1.0])


def test_reader_returns_its_previous_value_when_the_writer_never_settles() -> None:
    """The real-time reader never waits on the writer: with every try torn it gets its own
    previous complete value with that value's (older) version and stamp, counted."""
    buf = LatestValueBuffer(2, max_retries=3)
    buf.write([4.0, 4.0], 4)
    out = np.empty(2)
    assert buf.read_into(out) == (1, 4)  # a good read: remembered
    buf.write([5.0, 5.0], 5)
    buf._seq[buf._published] += 1  # simulate a writer stuck on the published slot (odd seq)
    with buf._write_lock:  # ... holding its lock: a reader that waited would hang here
        assert buf.read_into(out) == (1, 4)  # bounded, no wait, the previous value
    np.testing.assert_array_equal(out, [4.0, 4.0])
    assert buf.read_retries == 3 and buf.locked_reads == 1


def test_read_into_does_not_allocate() -> None:
    import tracemalloc

    buf = LatestValueBuffer(512)
    buf.write(np.ones(512), 1)
    out = np.empty(512)
    for _ in range(100):
        buf.read_into(out)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(2000):
            buf.read_into(out)
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert after - before < 1024


@pytest.mark.slow
def test_stress_no_torn_read_with_concurrent_writer() -> None:
    """Writer publishes arrays whose elements all equal a counter (= version = stamp); the
    reader must never see a mixed array. 2048 float64 elements: numpy releases the GIL for such
    copies, so reader and writer truly overlap (a plain copy of the published slot does tear)."""
    n, reads = 2048, 200_000
    buf = LatestValueBuffer(n)
    stop = threading.Event()
    writes = [0]

    def writer() -> None:
        value = np.empty(n)
        k = 0
        while not stop.is_set():
            k += 1
            value.fill(k)
            buf.write(value, stamp_ns=k)
        writes[0] = k

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    out = np.empty(n)
    torn = mismatched = regressions = done = 0
    last_version = 0
    deadline = time.monotonic() + 15.0  # bounded even on a loaded machine
    try:
        while done < reads and time.monotonic() < deadline:
            version, stamp = buf.read_into(out)
            first = out[0]
            if out.min() != out.max():
                torn += 1
            if version and (first != version or stamp != version):
                mismatched += 1
            if version < last_version:
                regressions += 1
            last_version = version
            done += 1
    finally:
        stop.set()
        thread.join(5.0)
    assert not thread.is_alive()
    assert done >= 20_000, f"only {done} reads in the time bound"
    assert writes[0] > 100, "the writer did not run concurrently"
    assert (torn, mismatched, regressions) == (0, 0, 0)
