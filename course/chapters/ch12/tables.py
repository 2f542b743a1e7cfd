"""Chapter 12's printed tables: the walk-through's estimate and the load test's two paths."""

from __future__ import annotations


def si(x: float, unit: str = "") -> str:
    """``3.52e12`` as ``3.52 T`` (k, M, G, T), with a unit."""
    for bound, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= bound:
            return f"{x / bound:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}".rstrip()


def estimate_lines(e: dict) -> list[str]:
    """The walk-through's numbers as printable lines."""
    return [
        f"writes:   {e['writes_per_s']:8.1f} links/s on average, {e['writes_peak']:8.0f}/s at a 10x peak",
        f"reads:    {e['reads_per_s']:8.0f} redirects/s on average at 10:1, {e['reads_peak']:8.0f}/s at a 10x peak",
        f"claimed peak of 1,000,000 redirects/s = {e['peak_over_average']:,.0f} x the average read rate,",
        f"          or {e['reads_per_write_at_peak']:,.0f} reads per write at peak: the two figures do not fit together",
        f"storage:  {si(e['links_per_year'])} links/year x 500 B = {si(e['storage_per_year'], 'B')} per year",
        f"cache:    the month's hottest 20% = {si(e['hot_links'])} links x 250 B = {si(e['cache_bytes'], 'B')} of Redis",
        f"codes:    62^7 = {e['codes']:,} = {e['years_of_codes']:,.0f} years of links "
        f"(62^6 would last {e['years_of_6_chars']:.0f} years)",
    ]


def path_lines(runs: dict) -> list[str]:
    """One line per run and path (``{connections: LoadRun}``), and the ratios of the two paths within
    each run."""
    lines = [
        f"{'connections':>11} {'path':9} {'redirects/s':>12} {'p50 ms':>8} {'p99 ms':>8} {'errors':>6}  served"
    ]
    for n, run in sorted(runs.items()):
        stats = run.by_label()
        for label, s in stats.items():
            served = ", ".join(f"{k} {v}" for k, v in s["x_cache"].most_common())
            lines.append(
                f"{n:>11} {label:9} {s['per_s']:12,.0f} {s['p50']:8.2f} {s['p99']:8.2f} {s['errors']:>6}  {served}"
            )
        c, d = stats["cache"], stats["database"]
        lines.append(
            f"{'':>11} ratio     cache/database: {c['per_s'] / d['per_s']:.2f}x redirects/s, "
            f"database/cache: {d['p50'] / c['p50']:.2f}x p50, {d['p99'] / c['p99']:.2f}x p99"
        )
    return lines
