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


def plot_moves(moved: dict[str, float], n: int):
    from course.kit.plotting import COLORS, figure

    fig, ax = figure(9, 2.8)
    names = list(moved)
    colors = [COLORS["bad"] if moved[k] > 0.5 else COLORS["ok"] for k in names]
    bars = ax.barh(names, [100 * moved[k] for k in names], color=colors)
    ax.bar_label(bars, fmt="%.1f%%", padding=3)
    ax.axvline(100 / (n + 1), color="grey", linestyle=":")
    ax.set_xlabel(f"keys moved when node {n + 1} joins {n} (%); dotted: the ideal 1/{n + 1}")
    ax.set_xlim(0, 110)
    ax.invert_yaxis()
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
