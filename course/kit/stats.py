"""Small statistics shared by the chapters' measurements (percentiles, summaries)."""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(samples: Sequence[float], p: float) -> float:
    """The p-th percentile (0-100) by linear interpolation; NaN for no samples."""
    if not samples:
        return math.nan
    xs = sorted(samples)
    k = (len(xs) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summary(samples: Sequence[float], unit: str = "ms") -> str:
    """``median 1.2 ms, p95 3.4 ms, p99 5.6 ms, max 7.8 ms (n=100)``."""
    if not samples:
        return "no samples"
    return (
        f"median {percentile(samples, 50):.3g} {unit}, p95 {percentile(samples, 95):.3g} {unit}, "
        f"p99 {percentile(samples, 99):.3g} {unit}, max {max(samples):.3g} {unit} (n={len(samples)})"
    )
