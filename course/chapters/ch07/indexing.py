"""Chapter 07's search demos: dual-write drift against the outbox, and PostgreSQL full-text
search beside tantivy (an embedded engine) on one corpus, for relevance and speed."""

from __future__ import annotations

import asyncio
import importlib
import inspect
import random
import statistics
import time

from course import search

ARTICLES = """
CREATE TABLE IF NOT EXISTS ch07_articles (
    id      text    PRIMARY KEY,
    title   text    NOT NULL,
    body    text    NOT NULL,
    version integer NOT NULL
);
"""

# Last write wins: whatever reaches the index last is what the index shows.
UPSERT_LWW = f"""
INSERT INTO search_documents AS d (doc_id, version, title, body, deleted, tsv)
VALUES (%(doc_id)s, %(version)s, %(title)s, %(body)s, false, {search.TSV})
ON CONFLICT (doc_id) DO UPDATE SET version = EXCLUDED.version, title = EXCLUDED.title, body = EXCLUDED.body,
                                   deleted = false, tsv = EXCLUDED.tsv, indexed_at = now()
"""

WORDS = (
    "replica lag outbox ledger snapshot projection cursor shard quorum tombstone index vacuum checkpoint "
    "stream relay upcaster saga breaker bulkhead jitter backoff timeout cache bloom token bucket"
).split()


async def reset(pool) -> None:
    async with pool.connection() as conn:
        await conn.execute(ARTICLES)
        await conn.execute("TRUNCATE ch07_articles, search_documents, search_outbox")


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


async def _save_article(conn, article_id: str, title: str, body: str) -> int:
    cur = await conn.execute(
        "INSERT INTO ch07_articles (id, title, body, version) VALUES (%s, %s, %s, 1) "
        "ON CONFLICT (id) DO UPDATE SET title = EXCLUDED.title, body = EXCLUDED.body, "
        "version = ch07_articles.version + 1 RETURNING version",
        (article_id, title, body),
    )
    return (await cur.fetchone())[0]


async def drift(pool) -> dict:
    """Compare the index with the articles: documents missing, stale, or matching."""
    async with pool.connection() as conn:
        cur = await conn.execute(
            "SELECT count(*) FILTER (WHERE d.doc_id IS NULL), "
            "count(*) FILTER (WHERE d.doc_id IS NOT NULL AND (d.title <> a.title OR d.body <> a.body)), "
            "count(*) FILTER (WHERE d.title = a.title AND d.body = a.body), count(*) "
            "FROM ch07_articles a LEFT JOIN search_documents d ON d.doc_id = a.id"
        )
        missing, stale, same, total = await cur.fetchone()
    return {"missing": missing, "stale": stale, "in_sync": same, "articles": total}


async def dual_write_run(pool, *, docs: int, waves: int, crash_rate: float, run: int) -> dict:
    """Save articles in concurrent waves, each save writing the database, then the index.

    A save "crashes" between the two writes with probability ``crash_rate``; the index
    write of each save leaves after a random network delay (0-20 ms), so two saves of one
    article can reach the index in the other order. ``run`` numbers the random draws: the
    same run gives the same saves, delays and crashes.
    """
    await reset(pool)
    rng = random.Random(run)
    crashed = 0

    async def save(article_id: str, title: str, body: str, delay: float, crash: bool) -> None:
        nonlocal crashed
        async with pool.connection() as conn:
            version = await _save_article(conn, article_id, title, body)
        if crash:
            crashed += 1
            return  # the process died after the commit: the index never hears of it
        await asyncio.sleep(delay)
        async with pool.connection() as conn:
            await conn.execute(
                UPSERT_LWW, {"doc_id": article_id, "version": version, "title": title, "body": body}
            )

    for _ in range(waves):
        saves = []
        for _ in range(docs):
            article = f"art-{rng.randrange(docs):03d}"
            saves.append(
                save(article, _text(rng, 3), _text(rng, 12), rng.uniform(0, 0.02), rng.random() < crash_rate)
            )
        await asyncio.gather(*saves)
    return {**await drift(pool), "saves": docs * waves, "crashed": crashed}


async def outbox_run(pool, *, docs: int, waves: int, crash_rate: float, run: int, relays: int = 2) -> dict:
    """The same saves through the outbox: article and event in one transaction; ``relays``
    relays at once, each failing an indexing call with probability ``crash_rate`` (the batch
    stays unpublished and is delivered again)."""
    await reset(pool)
    rng = random.Random(run)
    failures = 0

    async def save(article_id: str, title: str, body: str) -> None:
        async with pool.connection() as conn, conn.transaction():
            version = await _save_article(conn, article_id, title, body)
            await search.enqueue(conn, article_id, version, "upsert", title, body)

    async def flaky_indexer(p, event: dict):
        nonlocal failures
        await asyncio.sleep(rng.uniform(0, 0.002))
        if rng.random() < crash_rate:
            failures += 1
            raise ConnectionError("the index did not answer")
        return await search.index_event(p, event)

    async def relay() -> None:
        while True:
            try:
                if not await search.relay_once(pool, flaky_indexer, batch=8):
                    return
            except ConnectionError:
                continue  # the batch stays unpublished: delivered again

    for _ in range(waves):
        await asyncio.gather(
            *(save(f"art-{rng.randrange(docs):03d}", _text(rng, 3), _text(rng, 12)) for _ in range(docs))
        )
        await asyncio.gather(*(relay() for _ in range(relays)))
    async with pool.connection() as conn:
        cur = await conn.execute("SELECT count(*) FROM search_outbox")
        (events,) = await cur.fetchone()
    return {**await drift(pool), "saves": docs * waves, "events": events, "failed_deliveries": failures}


# ----------------------------------------------------------------------------- PostgreSQL FTS beside tantivy

MODULES = """abc argparse array ast asyncio base64 bisect calendar cmath collections colorsys contextlib copy csv
dataclasses datetime decimal difflib enum filecmp fnmatch fractions functools getpass gettext glob gzip hashlib heapq
hmac html http.client http.server imaplib inspect io ipaddress itertools json keyword linecache locale logging lzma
mailbox math mimetypes numbers operator os os.path pathlib pickle platform plistlib pprint queue quopri random re
reprlib sched secrets select selectors shelve shlex shutil signal smtplib socket sqlite3 ssl stat statistics string
struct subprocess sys tarfile tempfile textwrap threading time timeit tokenize traceback types typing unicodedata
urllib.parse urllib.request uuid warnings weakref zipfile zlib""".split()


def stdlib_corpus() -> list[tuple[str, str, str]]:
    """``(doc_id, title, body)`` for the documented functions and classes of ~110 stdlib modules.

    Real English technical text that every Python has, so nothing is downloaded. The title
    is the name split into words (``os.path.getsize`` -> ``os path getsize``).
    """
    docs: dict[str, tuple[str, str, str]] = {}
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        for name, obj in sorted(vars(module).items()):
            if name.startswith("_"):
                continue
            if not (
                inspect.isfunction(obj)
                or inspect.isclass(obj)
                or inspect.isbuiltin(obj)
                or inspect.ismethod(obj)
            ):
                continue
            doc = inspect.getdoc(obj)
            if not doc or len(doc) < 20:
                continue
            doc_id = f"{module_name}.{name}"
            title = doc_id.replace(".", " ").replace("_", " ")
            docs.setdefault(doc_id, (doc_id, title, doc[:800]))
    return list(docs.values())


#: What a developer would type, and the documents that answer it.
QUERIES: list[tuple[str, set[str]]] = [
    ("parse json string", {"json.loads"}),
    ("pause for a number of seconds", {"time.sleep", "asyncio.sleep"}),
    ("copy file contents", {"shutil.copyfile", "shutil.copy", "shutil.copyfileobj", "shutil.copy2"}),
    ("random integer in a range", {"random.randint", "random.randrange"}),
    ("current working directory", {"os.getcwd", "os.getcwdb", "pathlib.Path.cwd", "os.chdir"}),
    ("delete a directory tree", {"shutil.rmtree", "os.removedirs"}),
    ("greatest common divisor", {"math.gcd"}),
    ("create a temporary directory", {"tempfile.mkdtemp", "tempfile.TemporaryDirectory"}),
    ("replace a pattern in a string", {"re.sub", "re.subn"}),
    ("read an environment variable", {"os.getenv", "os.getenvb", "os.putenv", "os.unsetenv"}),
    ("median of data", {"statistics.median", "statistics.median_low", "statistics.median_high"}),
    ("remove common leading whitespace", {"textwrap.dedent"}),
    ("parse a url query string", {"urllib.parse.parse_qs", "urllib.parse.parse_qsl"}),
    ("generate a random uuid", {"uuid.uuid4"}),
    ("push an item onto a heap", {"heapq.heappush", "heapq.heappushpop"}),
    ("tempory direcotry", {"tempfile.mkdtemp", "tempfile.TemporaryDirectory", "tempfile.gettempdir"}),
    ("enviroment variable", {"os.getenv", "os.getenvb", "os.putenv", "os.unsetenv"}),
]

PG_OR = """
SELECT doc_id FROM search_documents, (SELECT replace(plainto_tsquery('english', %s)::text, '&', '|')::tsquery AS q) s
WHERE tsv @@ s.q ORDER BY ts_rank(tsv, s.q) DESC, doc_id LIMIT %s
"""


async def pg_load(pool, corpus) -> float:
    """Index the corpus into ``search_documents``; seconds taken (tsvector + GIN)."""
    async with pool.connection() as conn:
        await conn.execute("TRUNCATE search_documents")
    t0 = time.perf_counter()
    async with pool.connection() as conn, conn.transaction(), conn.cursor() as cur:
        await cur.executemany(
            search.UPSERT,
            [{"doc_id": d, "version": 1, "title": t, "body": b, "deleted": False} for d, t, b in corpus],
        )
    return time.perf_counter() - t0


async def pg_search(pool, query: str, mode: str, k: int = 5) -> list[str]:
    if mode == "and":
        return await search.search(pool, query, k)
    async with pool.connection() as conn:
        cur = await conn.execute(PG_OR, (query, k))
        return [row[0] for row in await cur.fetchall()]


class Tantivy:
    """An in-memory tantivy index of the corpus: English stemming, BM25, title boosted."""

    def __init__(self, corpus) -> None:
        import tantivy

        self.tantivy = tantivy
        builder = tantivy.SchemaBuilder()
        builder.add_text_field("doc_id", stored=True, tokenizer_name="raw")
        builder.add_text_field("title", stored=False, tokenizer_name="en_stem")
        builder.add_text_field("body", stored=False, tokenizer_name="en_stem")
        self.index = tantivy.Index(builder.build())
        t0 = time.perf_counter()
        writer = self.index.writer(heap_size=15_000_000, num_threads=1)
        for doc_id, title, body in corpus:
            writer.add_document(tantivy.Document(doc_id=doc_id, title=title, body=body))
        writer.commit()
        writer.wait_merging_threads()
        self.index.reload()
        self.searcher = self.index.searcher()
        self.build_seconds = time.perf_counter() - t0

    def search(self, query: str, k: int = 5, *, fuzzy: bool = False) -> list[str]:
        fuzzy_fields = {"title": (True, 1, True), "body": (True, 1, True)} if fuzzy else None
        parsed = self.index.parse_query(
            query, ["title", "body"], field_boosts={"title": 2.0}, fuzzy_fields=fuzzy_fields
        )
        return [
            self.searcher.doc(address)["doc_id"][0] for _, address in self.searcher.search(parsed, k).hits
        ]


def _rank(found: list[str], relevant: set[str]) -> int | None:
    return next((i for i, doc in enumerate(found, 1) if doc in relevant), None)


async def compare(pool, corpus, *, repeats: int = 5) -> dict:
    """Relevance (hit in the top 5, reciprocal rank) and speed of four searchers on ``QUERIES``."""
    pg_seconds = await pg_load(pool, corpus)
    engine = Tantivy(corpus)
    searchers = {
        "PostgreSQL, all words (websearch_to_tsquery)": lambda q: pg_search(pool, q, "and"),
        "PostgreSQL, any word, ts_rank": lambda q: pg_search(pool, q, "or"),
        "tantivy BM25": lambda q: _sync(engine.search, q),
        "tantivy BM25 + fuzzy (1 typo)": lambda q: _sync(engine.search, q, fuzzy=True),
    }
    table: dict[str, dict] = {}
    for name, run in searchers.items():
        ranks, times = [], []
        for query, relevant in QUERIES:
            found = await run(query)
            ranks.append(_rank(found, relevant))
            for _ in range(repeats):
                t0 = time.perf_counter()
                await run(query)
                times.append((time.perf_counter() - t0) * 1000)
        table[name] = {
            "ranks": ranks,
            "hits": sum(r is not None for r in ranks),
            "mrr": sum(1 / r for r in ranks if r) / len(ranks),
            "median_ms": statistics.median(times),
        }
    return {
        "docs": len(corpus),
        "pg_index_s": pg_seconds,
        "tantivy_index_s": engine.build_seconds,
        "table": table,
    }


async def _sync(fn, *args, **kwargs):
    return fn(*args, **kwargs)


def print_compare(result: dict) -> None:
    names = list(result["table"])
    print(
        f"{len(QUERIES)} queries on {result['docs']} documents; rank of the first right answer in the top 5 (- = none)"
    )
    print(f"{'query':34}" + "".join(f"{i + 1:>5}" for i in range(len(names))))
    for qi, (query, _) in enumerate(QUERIES):
        cells = "".join(f"{(result['table'][n]['ranks'][qi] or '-'):>5}" for n in names)
        print(f"{query[:33]:34}{cells}")
    print()
    for i, name in enumerate(names, 1):
        row = result["table"][name]
        print(
            f"{i}. {name:46} found {row['hits']:>2}/{len(QUERIES)}  MRR {row['mrr']:.2f}  "
            f"median query {row['median_ms']:.2f} ms"
        )
    print(
        f"\nindexing {result['docs']} documents: PostgreSQL {result['pg_index_s'] * 1000:.0f} ms "
        f"(tsvector + GIN, one transaction), tantivy {result['tantivy_index_s'] * 1000:.0f} ms (in memory)"
    )


def payload(doc_id: str, version: int, op: str, title: str = "", body: str = "") -> dict:
    """An outbox event as the indexer receives it (what :func:`course.search.outbox_event` builds)."""
    return {"outbox_id": 0, "doc_id": doc_id, "version": version, "op": op, "title": title, "body": body}
