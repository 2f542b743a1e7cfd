"""Chapter 09's sharding demos: keys moved when a node joins, balance against the vnode count."""

from __future__ import annotations

from collections.abc import Callable

from course.sharding import (
    HashRing,
    jump_hash,
    loads,
    modulo_node,
    moved_fraction,
    rendezvous_node,
    stable_hash,
)


def node_names(n: int) -> list[str]:
    return [f"node-{i}" for i in range(n)]


def placements(nodes: list[str], vnodes: int = 160) -> dict[str, Callable[[str], str]]:
    """One placement function per scheme, over ``nodes``."""
    ring = HashRing(nodes, vnodes=vnodes)
    one_point = HashRing(nodes, vnodes=1)
    return {
        "modulo": lambda k: modulo_node(k, nodes),
        "ring, 1 point per node": one_point.node_for,
        f"ring, {vnodes} vnodes": ring.node_for,
        "rendezvous": lambda k: rendezvous_node(k, nodes),
        "jump hash": lambda k: nodes[jump_hash(stable_hash(k), len(nodes))],
    }


def moved_when_adding(keys: list[str], n: int = 10, vnodes: int = 160) -> dict[str, float]:
    """The share of ``keys`` each scheme moves when node ``n + 1`` joins ``n`` nodes."""
    before, after = placements(node_names(n), vnodes), placements(node_names(n + 1), vnodes)
    return {name: moved_fraction(before[name], after[name], keys) for name in before}


def spread(place: Callable[[str], str], keys: list[str], nodes: list[str]) -> float:
    """The largest distance of any node's load from the mean, as a share of the mean."""
    counts = loads(place, keys)
    mean = len(keys) / len(nodes)
    return max(abs(counts.get(node, 0) - mean) / mean for node in nodes)


def spread_by_vnodes(keys: list[str], counts: list[int], n: int = 10) -> list[float]:
    nodes = node_names(n)
    return [spread(HashRing(nodes, vnodes=v).node_for, keys, nodes) for v in counts]


def spreads_of_schemes(keys: list[str], n: int = 10, vnodes: int = 160) -> dict[str, float]:
    """Each scheme's worst node, as its distance from the mean load (:func:`spread`), on ``n`` nodes."""
    nodes = node_names(n)
    return {name: spread(place, keys, nodes) for name, place in placements(nodes, vnodes).items()}


#: Worse than this, a scheme's balance is drawn as a failure: one node then carries 1.5x the mean or more.
BALANCE_LIMIT = 0.5


def plot_moves(moved: dict[str, float], n: int, spreads: dict[str, float] | None = None):
    """Keys moved when node ``n + 1`` joins; with ``spreads``, each scheme's balance beside it.

    A scheme is drawn as a failure when it moves more than half the keys, or when its worst node
    is :data:`BALANCE_LIMIT` or more from the mean: one point per node moves few keys only because
    the new node's single arc is small, and the same small-or-huge arcs unbalance every node.
    """
    from course.kit.plotting import COLORS, figure

    names = list(moved)
    bad = [moved[k] > 0.5 or (spreads is not None and spreads[k] >= BALANCE_LIMIT) for k in names]
    colors = [COLORS["bad"] if b else COLORS["ok"] for b in bad]
    fig, axes = figure(13 if spreads else 9, 2.8, ncols=2 if spreads else 1)
    ax = axes[0] if spreads else axes
    bars = ax.barh(names, [100 * moved[k] for k in names], color=colors)
    ax.bar_label(bars, fmt="%.1f%%", padding=3)
    ax.axvline(100 / (n + 1), color="grey", linestyle=":")
    ax.set_xlabel(f"keys moved when node {n + 1} joins {n} (%); dotted: the ideal 1/{n + 1}")
    ax.set_xlim(0, 110)
    ax.invert_yaxis()
    if spreads:
        right = axes[1]
        bars = right.barh(names, [100 * spreads[k] for k in names], color=colors)
        right.bar_label(bars, fmt="%.0f%%", padding=3)
        right.axvline(100 * BALANCE_LIMIT, color="grey", linestyle=":")
        right.set_xlabel(
            f"worst of {n} nodes: distance from the mean load (%); dotted: {100 * BALANCE_LIMIT:.0f} %"
        )
        right.set_xlim(0, max(100 * max(spreads.values()) * 1.25, 60))
        right.invert_yaxis()
        right.set_yticks([])
    return fig


def plot_spread(counts: list[int], spreads: list[float]):
    from course.kit.plotting import COLORS, figure, legend_outside

    fig, ax = figure(9, 3)
    ax.plot(
        counts, [100 * s for s in spreads], "o-", color=COLORS["fix"], label="measured: worst node vs mean"
    )
    ax.axhspan(10, 20, color=COLORS["ok"], alpha=0.15, label="claim at 100-200 vnodes: 10-20 %")
    ax.set_xscale("log")
    ax.set_xlabel("virtual nodes per node (10 nodes)")
    ax.set_ylabel("worst node's distance from mean (%)")
    legend_outside(ax)
    return fig
