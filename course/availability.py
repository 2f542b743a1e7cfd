"""Availability math (chapter 02): serial dependencies multiply, independent replicas add nines.

- :func:`serial`: every hard dependency on the request path must be up: multiply.
- :func:`parallel`: any one of several *independent* replicas will do: ``1 - prod(1 - a)``.
- :func:`with_shared`: replicas that share a fault domain (a zone, a database, a config
  rollout) are only as good as that shared part allows.
- :func:`simulate`: a seeded Monte Carlo check of the formulas, minute by minute, to show
  that correlated failures break the parallel formula.
- :func:`downtime`: an availability as hours (or minutes) of downtime per month or year.
- :func:`describe` / :func:`plot`: the chapter's calculator widget.

A *soft* dependency (called with a timeout and a fallback) drops out of the product: its
failure degrades the answer, it does not fail the request.
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


def simulate(
    replica: float = 0.99, n: int = 2, *, shared: float = 1.0, minutes: int = 5_000_000, seed: int = 7
) -> float:
    """Fraction of minutes in which at least one replica is up (and the shared part is up).

    Replica outages are drawn independently; the shared part's outages take all replicas
    down at once, which is what a common zone or a common bad config rollout does.
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    replica_up = rng.random((n, minutes)) < replica
    shared_up = rng.random(minutes) < shared
    return float((replica_up.any(axis=0) & shared_up).mean())


def simulate_serial(*availabilities: float, minutes: int = 2_000_000, seed: int = 7) -> float:
    """Fraction of minutes in which every one of the (independent) parts is up."""
    import numpy as np

    rng = np.random.default_rng(seed)
    up = np.ones(minutes, dtype=bool)
    for a in availabilities:
        up &= rng.random(minutes) < a
    return float(up.mean())


def path(hard: Iterable[float], replicas: int = 1, replica: float = 1.0, shared: float = 1.0) -> float:
    """Availability of a request path: hard dependencies in series with a replicated tier."""
    tier = with_shared(replica, replicas, shared) if replicas > 0 else 1.0
    return serial(*hard) * tier


def describe(a: float) -> str:
    return (
        f"{a * 100:.4f}% ({nines(a):.2f} nines): {downtime(a) * 60:,.1f} min of downtime a month, "
        f"{downtime(a, 'year'):,.1f} h a year"
    )


def plot(ax, parts: dict[str, float], total: float) -> None:
    """Minutes of downtime a month for each part and for the whole path (log scale)."""
    names = [*parts, "whole path"]
    minutes = [downtime(v) * 60 for v in parts.values()] + [downtime(total) * 60]
    colors = ["#7f8c8d"] * len(parts) + ["#c0392b"]
    ax.barh(names, [max(m, 0.01) for m in minutes], color=colors)
    ax.set_xscale("log")
    ax.set_xlim(0.01, 50_000)
    ax.invert_yaxis()
    ax.set_xlabel("minutes of downtime a month (log scale)")
    for i, (m, name) in enumerate(zip(minutes, names, strict=True)):
        a = total if name == "whole path" else parts[name]
        ax.text(max(m, 0.01), i, f"  {100 * a:.3f}%", va="center", fontsize=8)
