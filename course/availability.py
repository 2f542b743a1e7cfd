"""Availability math (chapter 02): serial dependencies multiply, independent replicas add nines.

- :func:`serial`: every hard dependency on the request path must be up: multiply.
- :func:`parallel`: any one of several *independent* replicas will do: ``1 - prod(1 - a)``.
- :func:`with_shared`: replicas that share a fault domain (a zone, a database, a config
  rollout) are only as good as that shared part allows.
- :func:`downtime`: an availability as hours (or minutes) of downtime per month or year.
- :func:`describe`: one line for an availability: percent, nines, downtime.

A *soft* dependency (called with a timeout and a fallback) drops out of the product: its
failure degrades the answer, it does not fail the request.

Chapter 02 checks the formulas with a seeded Monte Carlo simulation, which shows that
correlated failures break the parallel formula (:func:`course.chapters.ch02.simulate_replicas`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

HOURS = {"month": 730.0, "year": 8766.0}  # average month: 365.25 * 24 / 12


def serial(*availabilities: float) -> float:
    """All of them on the path: the product."""
    return math.prod(availabilities)


def parallel(*availabilities: float) -> float:
    """Any one is enough and they fail independently: one minus the chance all are down."""
    return 1 - math.prod(1 - a for a in availabilities)


def with_shared(replica: float, n: int, shared: float) -> float:
    """``n`` independent replicas that all sit on one shared part of availability ``shared``."""
    return shared * parallel(*([replica] * n))


def downtime(a: float, per: str = "month") -> float:
    """Hours of downtime per month (or year) at availability ``a``."""
    return (1 - a) * HOURS[per]


def nines(a: float) -> float:
    """How many nines: 0.999 -> 3.0."""
    return math.inf if a >= 1 else -math.log10(1 - a)


def path(hard: Iterable[float], replicas: int = 1, replica: float = 1.0, shared: float = 1.0) -> float:
    """Availability of a request path: hard dependencies in series with a replicated tier."""
    tier = with_shared(replica, replicas, shared) if replicas > 0 else 1.0
    return serial(*hard) * tier


def describe(a: float) -> str:
    return (
        f"{a * 100:.4f}% ({nines(a):.2f} nines): {downtime(a) * 60:,.1f} min of downtime a month, "
        f"{downtime(a, 'year'):,.1f} h a year"
    )
