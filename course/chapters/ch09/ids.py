"""Chapter 09's id demo: one table per kind of primary key, filled with the same rows, measured.

Index size comes from ``pg_relation_size`` of the primary key's index. The embedded
server has no ``pgstattuple`` (no contrib extensions), so leaf density is estimated from
page counts: the bytes the index entries need (an 8-byte index tuple header plus the
key, plus a 4-byte line pointer) divided by the bytes of the index's pages (8,152 usable
bytes each, after the page header and the B-tree's special space). A handful of inner
pages and the metapage are counted as leaves, so the estimate is a little low.
"""

from __future__ import annotations

import time

KINDS = {
    "bigint identity": ("bigint GENERATED ALWAYS AS IDENTITY", None, 8),
    "UUIDv4": ("uuid DEFAULT gen_random_uuid()", None, 16),
    "UUIDv7": ("uuid DEFAULT uuidv7()", None, 16),
    "Snowflake": (
        "bigint",
        # 41 bits of ms since 2024-01-01, worker 1, then a 12-bit sequence (g mod 4096, as one worker would)
        "(((extract(epoch FROM clock_timestamp()) * 1000)::bigint - 1704067200000) << 22) | (1 << 12) | (g %% 4096)",
        8,
    ),
}

#: The figures to expect for 2 million rows on PostgreSQL 18 (MiB), and the leaf fill they follow from:
#: appends split the rightmost page at the B-tree fillfactor (90 %, PostgreSQL's CREATE INDEX docs);
#: random inserts leave leaves about ln 2 = 69 % full on average (A. C. Yao, "On random 2-3 trees", 1978).
CLAIM_MIB = {"bigint identity": 43, "UUIDv4": 76, "UUIDv7": 60}
CLAIM_FILL = {"bigint identity": 0.90, "UUIDv4": 0.71, "UUIDv7": 0.90}
CLAIM_ROWS = 2_000_000
PAGE_USABLE = 8192 - 24 - 16
MIB = 2**20  # PostgreSQL's pg_size_pretty counts in units of 1024: its "MB" is a MiB


def table_name(kind: str) -> str:
    return "ch09_ids_" + kind.split()[0].lower()


async def fill(pool, kind: str, n: int) -> dict:
    """Create ``ch09_ids_<kind>`` anew, insert ``n`` rows, and measure what it cost."""
    column, expr, key_bytes = KINDS[kind]
    table = table_name(kind)
    async with pool.connection() as conn:
        await conn.execute(f"DROP TABLE IF EXISTS {table}")
        await conn.execute(f"CREATE TABLE {table} (id {column} PRIMARY KEY, payload int NOT NULL)")
        start_lsn = (await (await conn.execute("SELECT pg_current_wal_lsn()")).fetchone())[0]
        t0 = time.perf_counter()
        if expr is None:
            await conn.execute(f"INSERT INTO {table} (payload) SELECT g FROM generate_series(1, %s) g", (n,))
        else:
            await conn.execute(
                f"INSERT INTO {table} (id, payload) SELECT {expr}, g FROM generate_series(1, %s) g "
                "ON CONFLICT (id) DO NOTHING",
                (n,),
            )
        seconds = time.perf_counter() - t0
        cur = await conn.execute(
            "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s), pg_relation_size(%s), (SELECT count(*) FROM "
            + table
            + ")",
            (start_lsn, f"{table}_pkey"),
        )
        wal, index_bytes, rows = await cur.fetchone()
        later = await _after_checkpoint(conn, table, expr, max(n // 10, 1))
    pages = index_bytes // 8192
    fill_ratio = rows * (8 + key_bytes + 4) / max(1, (pages - 1) * PAGE_USABLE)
    return {
        "kind": kind,
        "rows": rows,
        "seconds": seconds,
        "rows_per_s": rows / seconds,
        "wal_mib": float(wal) / MIB,
        "index_mib": index_bytes / MIB,
        "pages": pages,
        "fill": fill_ratio,
        **later,
    }


async def _after_checkpoint(conn, table: str, expr: str | None, n: int) -> dict:
    """WAL and full-page images of ``n`` more rows inserted right after a checkpoint.

    After a checkpoint, the first change to each page writes the whole 8 kB page into the WAL
    (a full-page image, ``full_page_writes``), so a crash cannot leave a torn page. Keys that land
    on random pages touch many pages once each; keys that append touch the last few. Counted for
    this session alone (PostgreSQL 18's ``pg_stat_get_backend_wal``), so other sessions' writes do
    not add to it. Empty when this role may not run ``CHECKPOINT`` or the server is older.
    """
    try:
        await conn.execute("CHECKPOINT")
        before = await _session_wal(conn)
    except Exception:  # noqa: BLE001 - no privilege, or no per-session WAL counters: the figure is left out
        return {}
    if expr is None:
        await conn.execute(f"INSERT INTO {table} (payload) SELECT g FROM generate_series(1, %s) g", (n,))
    else:  # a Snowflake: later milliseconds than the first rows, so no conflict
        await conn.execute(
            f"INSERT INTO {table} (id, payload) SELECT {expr}, g FROM generate_series(1, %s) g "
            "ON CONFLICT (id) DO NOTHING",
            (n,),
        )
    after = await _session_wal(conn)
    return {"later_rows": n, "later_wal_mib": (after[0] - before[0]) / MIB, "later_fpi": after[1] - before[1]}


async def _session_wal(conn) -> tuple[float, int]:
    """(WAL bytes, full-page images) this session has written, flushed to the statistics first."""
    await conn.execute("SELECT pg_stat_force_next_flush()")
    await conn.execute("SELECT 1")  # the flush happens as a transaction ends
    cur = await conn.execute("SELECT wal_bytes, wal_fpi FROM pg_stat_get_backend_wal(pg_backend_pid())")
    wal, fpi = await cur.fetchone()
    return float(wal), int(fpi)


async def drop_all(pool) -> None:
    async with pool.connection() as conn:
        for kind in KINDS:
            await conn.execute(f"DROP TABLE IF EXISTS {table_name(kind)}")


def plot_ids(results: list[dict]):
    from course.kit.plotting import COLORS, figure

    later = all("later_wal_mib" in r for r in results)
    fig, axes = figure(16 if later else 12, 3.2, ncols=4 if later else 3)
    names = [r["kind"] for r in results]
    colors = [COLORS["ok"], COLORS["bad"], COLORS["fix"], COLORS["neutral"]][: len(results)]
    panels = [
        (axes[0], "index_mib", "primary key index (MiB)"),
        (axes[1], "fill", "leaf fill (estimated)"),
        (axes[2], "wal_mib", "WAL written by the insert (MiB)"),
    ]
    if later:
        panels.append(
            (axes[3], "later_wal_mib", f"WAL of {results[0]['later_rows']:,} rows after a checkpoint (MiB)")
        )
    for ax, key, label in panels:
        bars = ax.barh(names, [r[key] for r in results], color=colors)
        ax.bar_label(bars, fmt="%.2f" if key == "fill" else "%.1f", padding=3)
        ax.set_xlabel(label)
        ax.invert_yaxis()
        ax.margins(x=0.25)
    for ax in axes[1:]:
        ax.set_yticks([])
    return fig
