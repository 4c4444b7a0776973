"""Percentiles of a sample array, the one summary every kestrel_bench result uses.

`summary(samples, scale)` -> {"n", "mean", "p50", "p90", "p99", "p999", "max"}: linear-
interpolated percentiles (numpy's default) of `samples * scale`; {"n": 0} for no samples.
Units are the caller's: the schema's `latency_ms` takes milliseconds, so pass seconds with
scale=1e3 or microseconds with scale=1e-3.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

KEYS = ("n", "mean", "p50", "p90", "p99", "p999", "max")
QUANTILES = {"p50": 50.0, "p90": 90.0, "p99": 99.0, "p999": 99.9}


def summary(samples: Iterable[float] | np.ndarray, scale: float = 1.0) -> dict:
    """n, mean, p50, p90, p99, p99.9 and max of `samples` times `scale` (NaNs dropped)."""
    a = np.asarray(list(samples) if not isinstance(samples, np.ndarray) else samples,
                   dtype=np.float64).ravel()
    a = a[~np.isnan(a)] * scale
    if a.size == 0:
        return {"n": 0}
    q = np.percentile(a, list(QUANTILES.values()))
    out = {"n": int(a.size), "mean": float(a.mean())}
    out.update({k: float(v) for k, v in zip(QUANTILES, q, strict=True)})
    out["max"] = float(a.max())
    return out


def ratio(baseline: float | None, value: float | None) -> float | None:
    """baseline / value (how many times faster `value` is), None where either is missing or
    not positive."""
    if not baseline or not value or baseline <= 0 or value <= 0:
        return None
    return float(baseline) / float(value)
