import threading

import numpy as np

from kestrel_common.counters import Counters, LatencyWindow, StageTimer


def test_counters_thread_safe():
    c = Counters(["a"])
    threads = [threading.Thread(target=lambda: [c.inc("a") for _ in range(10000)])
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert c.get("a") == 40000 and c.snapshot() == {"a": 40000}


def test_latency_window_ring_and_percentiles():
    w = LatencyWindow(100)
    assert np.isnan(w.percentiles()["p50"])
    for i in range(250):
        w.add(float(i))
    assert len(w) == 100
    p = w.percentiles((50, 99, 99.9))
    assert p["max"] == 249.0 and 195 <= p["p50"] <= 205 and "p999" in p


def test_stage_timer():
    t = StageTimer(["model"])
    t.add("model", 0.01)
    t.add("post", 0.002)
    s = t.summary()
    assert s["model"]["p50"] == 0.01 and s["post"]["max"] == 0.002
