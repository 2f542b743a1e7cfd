"""Chapter 06's figures. Legends sit outside the data (:func:`course.kit.plotting.legend_outside`)."""

from __future__ import annotations

from course.kit.plotting import COLORS, figure, legend_outside

OUTCOME_COLORS = {
    "completed": COLORS["ok"],
    "compensated": COLORS["fix"],
    "untouched": "#bdc3c7",
    "half-done": COLORS["bad"],
    "broken": "#6e2c00",
}


def lock_hold(blocked_s: float, saga_ms: list[float], operator_after: float):
    """How long the stock row stays locked: 2PC with its coordinator down vs one saga step."""
    import statistics

    fig, ax = figure(8, 2.4)
    labels = ["2PC, coordinator died\nafter PREPARE", "saga step\n(reserve_stock)"]
    values = [blocked_s * 1000, statistics.median(saga_ms)]
    bars = ax.barh(labels, values, color=[COLORS["bad"], COLORS["ok"]])
    ax.set_xscale("log")
    ax.set_xlabel("ms the next buyer of the same book waited (log scale)")
    for bar, v in zip(bars, values, strict=True):
        ax.text(v * 1.1, bar.get_y() + bar.get_height() / 2, f"{v:,.1f} ms", va="center", fontsize=9)
    ax.set_title(
        f"one row, locked until an operator acted ({operator_after:g} s here; hours in real outages)"
    )
    ax.set_xlim(right=max(values) * 8)
    return fig


def crash_matrix(results: dict[str, list[dict]]):
    """One panel per design: every crash point of every kind of order, coloured by how it ended."""
    from matplotlib.patches import Patch, Rectangle

    designs = list(results)
    kinds = list(dict.fromkeys(row["kind"] for rows in results.values() for row in rows))
    width = max(row["k"] for rows in results.values() for row in rows)
    fig, axes = figure(10, 1.0 + 1.1 * len(designs) * len(kinds) / 3, nrows=len(designs), sharex=True)
    axes = axes if len(designs) > 1 else [axes]
    for ax, design in zip(axes, designs, strict=True):
        for y, kind in enumerate(kinds):
            for row in results[design]:
                if row["kind"] == kind:
                    color = OUTCOME_COLORS[row["recovered"]]
                    ax.add_patch(Rectangle((row["k"] - 0.45, y - 0.4), 0.9, 0.8, color=color))
        ax.set_yticks(range(len(kinds)), [f"{k} order" for k in kinds])
        ax.set_ylim(-0.6, len(kinds) - 0.4)
        ax.set_xlim(0.4, width + 0.6)
        ax.set_title(f"{design}: state after a crash before write k, then recovery", fontsize=10, loc="left")
        ax.invert_yaxis()
    axes[-1].set_xlabel("the process died just before its k-th write")
    axes[-1].set_xticks(range(1, width + 1))
    handles = [Patch(color=c, label=name) for name, c in OUTCOME_COLORS.items()]
    legend_outside(axes[0], handles=handles)
    return fig


def timeline(run: dict):
    """Each order's steps (solid) and compensations (hatched), and what its page said meanwhile."""
    spans, pages = run["spans"], run["pages"]
    orders = list(pages)
    step_colors = {"reserve_stock": "#8e44ad", "charge_payment": "#2980b9", "schedule_shipment": "#16a085"}
    page_colors = {
        "pending": COLORS["warn"],
        "cancelling": "#e67e22",
        "confirmed": COLORS["ok"],
        "cancelled": COLORS["neutral"],
    }
    fig, ax = figure(10, 0.9 + 0.85 * len(orders))
    for y, oid in enumerate(orders):
        for order_id, step, phase, t0, t1 in spans:
            if order_id == oid:
                ax.barh(
                    y - 0.12,
                    t1 - t0,
                    left=t0,
                    height=0.42,
                    color=step_colors[step],
                    alpha=0.9 if phase == "do" else 0.45,
                    hatch="//" if phase == "undo" else None,
                    edgecolor="white",
                )
        samples = pages[oid]
        for (t, status), (t_next, _) in zip(
            samples, samples[1:] + [(samples[-1][0] + 0.02, None)], strict=True
        ):
            ax.barh(y + 0.28, t_next - t, left=t, height=0.16, color=page_colors.get(status, "#ccc"))
    ax.set_yticks(range(len(orders)), [f"{o}\n({run['results'][o]})" for o in orders], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds (each remote call slowed to show the window)")
    ax.set_title(
        "a saga in flight: the thin bar is what the customer's order page says", fontsize=10, loc="left"
    )
    from matplotlib.patches import Patch

    handles = [Patch(color=c, label=s.replace("_", " ")) for s, c in step_colors.items()]
    handles.append(Patch(facecolor="#999", hatch="//", alpha=0.5, label="compensation"))
    handles += [Patch(color=c, label=f"page: {s}") for s, c in page_colors.items()]
    legend_outside(ax, handles=handles)
    return fig


def stream_order(races: dict[str, list[tuple[str, int]]]):
    """Per relay design: where each order's events landed in the stream (``[(aggregate, event_id)]``
    in stream order). Red: an order whose events arrived out of order."""
    from matplotlib.lines import Line2D

    fig, axes = figure(10, 2.6, ncols=len(races), sharey=True)
    axes = list(axes) if len(races) > 1 else [axes]
    for ax, (title, entries) in zip(axes, races.items(), strict=True):
        lanes: dict[str, list[tuple[int, int]]] = {}
        for pos, (agg, eid) in enumerate(entries, 1):
            lanes.setdefault(agg, []).append((pos, eid))
        names = sorted(lanes)
        for y, agg in enumerate(names):
            points = lanes[agg]
            ids = [e for _, e in points]
            bad = any(b < a for i, a in enumerate(ids) for b in ids[i + 1 :])
            ax.plot([p for p, _ in points], [y] * len(points), color="#ccc", zorder=1)
            for x, eid in points:
                ax.scatter([x], [y], s=170, color=COLORS["bad"] if bad else COLORS["ok"], zorder=2)
                ax.text(
                    x,
                    y,
                    str(sorted(set(ids)).index(eid) + 1),
                    ha="center",
                    va="center",
                    fontsize=8,
                    color="white",
                )
        ax.set_yticks(range(len(names)), names, fontsize=8)
        ax.set_xlabel("position in the stream")
        ax.set_title(title, fontsize=10, loc="left")
    axes[0].invert_yaxis()
    fig.suptitle("each order's events (rows) by their position in the stream", fontsize=10)
    handles = [
        Line2D([], [], marker="o", ls="", color=COLORS["ok"], label="events in order"),
        Line2D([], [], marker="o", ls="", color=COLORS["bad"], label="out of order"),
    ]
    legend_outside(axes[-1], handles=handles, title="n: the order's n-th event")
    return fig


def latency(runs: dict[str, tuple[float, list[float]]]):
    """Commit-to-stream latency per relay (``{label: (polling interval s, latencies s)}``), each
    with its polling interval marked."""
    import statistics

    fig, ax = figure(8, 2.8)
    labels = list(runs)
    data = [[v * 1000 for v in runs[label][1]] for label in labels]
    ax.boxplot(data, positions=range(len(labels)), widths=0.5, showfliers=True)
    for x, label in enumerate(labels):
        interval = runs[label][0]
        ax.hlines(
            interval * 1000,
            x - 0.35,
            x + 0.35,
            color=COLORS["bad"],
            ls="--",
            label="the polling interval" if x == 0 else None,
        )
        median = statistics.median(data[x])
        ax.text(x + 0.3, median, f"median {median:.0f} ms", fontsize=8, va="bottom")
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylabel("commit to stream (ms)")
    legend_outside(ax)
    return fig


def wal(points: list[tuple[int, int, int]]):
    """WAL held back by an idle slot vs one that is read, as the server writes."""
    fig, ax = figure(8, 2.8)
    mb = 1 / (1024 * 1024)
    written = [p[0] * mb for p in points]
    ax.plot(written, [p[1] * mb for p in points], "o-", color=COLORS["bad"], label="slot nobody reads")
    ax.plot(
        written, [p[2] * mb for p in points], "s-", color=COLORS["ok"], label="slot read after each round"
    )
    ax.set_xlabel("WAL written since the slots were created (MB)")
    ax.set_ylabel("WAL the slot holds back (MB)")
    legend_outside(ax)
    return fig
