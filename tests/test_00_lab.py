"""course.kit.lab: every run gets its own database and Redis logical database, and gives them back."""

import json

import psycopg
import redis as redis_sync

from course.kit import lab


def _databases(admin_url: str) -> set[str]:
    with psycopg.connect(admin_url, autocommit=True) as conn:
        return {row[0] for row in conn.execute("SELECT datname FROM pg_database")}


def test_two_namespaces_do_not_see_each_others_data():
    with lab.scratch_sync("a") as a, lab.scratch_sync("b") as b:
        assert a.name != b.name and a.redis_db != b.redis_db
        a.redis_sync().set("shared-name", "a")
        assert b.redis_sync().get("shared-name") is None
        with a.connect() as conn:
            conn.execute("CREATE TABLE only_in_a (id int)")
        with b.connect() as conn:
            found = conn.execute("SELECT to_regclass('only_in_a')").fetchone()[0]
        assert found is None


def test_a_scratch_namespace_is_dropped_afterwards():
    with lab.scratch_sync("gone") as ns:
        ns.redis_sync().set("k", "v")
        name, db, admin = ns.name, ns.redis_db, ns.servers.database_url
        assert name in _databases(admin)
    assert name not in _databases(admin)
    base = redis_sync.Redis.from_url(lab._redis_url_with_db(ns.servers.redis_url, db))
    assert base.dbsize() == 0
    claims = redis_sync.Redis.from_url(lab._redis_url_with_db(ns.servers.redis_url, 0))
    assert claims.get(f"{lab.CLAIM_PREFIX}{db}") is None


def test_current_is_one_namespace_per_process():
    assert lab.current() is lab.current()


def test_a_dead_owners_database_is_reaped():
    ns = lab.create("orphan")
    admin = ns.servers.database_url
    with psycopg.connect(admin, autocommit=True) as conn:
        dead = json.dumps({"host": lab._HOST, "pid": 2**22 + 12345, "created": 0})
        conn.execute(f"COMMENT ON DATABASE {ns.name} IS '{dead}'")
    assert ns.name in lab.reap_databases(admin)
    assert ns.name not in _databases(admin)
    lab._forget(ns)


async def test_async_helpers_reach_the_namespace(ans):
    ns = ans
    pool = await ns.pool()
    async with pool.connection() as conn:
        assert (await (await conn.execute("SELECT current_database()")).fetchone())[0] == ns.name
    r = ns.redis()
    await r.set("k", "v")
    assert await r.get("k") == "v"


def test_a_process_that_cannot_see_the_hosts_processes_records_its_given_owner_and_reaps_nothing(monkeypatch):
    """Inside a grading sandbox pids are the sandbox's own: a namespace made there belongs to
    the grader outside, and no claim is judged dead by a pid the sandbox cannot see."""
    import json

    from course.kit import procs

    outside = {"host": lab._HOST, **procs.identity()}
    monkeypatch.setenv(lab.OWNER_ENV, json.dumps(outside))
    assert lab._owner()["pid"] == outside["pid"] and lab._owner()["started"] == outside["started"]
    gone = {"host": lab._HOST, "pid": 999_999_999, "started": 1.0, "created": 0.0 + lab.time.time()}
    assert not lab._owner_dead(gone)
    monkeypatch.delenv(lab.OWNER_ENV)
    assert lab._owner_dead(gone)


async def test_spares_hand_out_namespaces_made_between_checks_and_drop_each_one(monkeypatch):
    """A grading run's scratch namespaces (lab.Spares): the one a check gets was made before it asked, the
    next one is made once the check's own is dropped (never while a check's code runs), none is made past
    the last check, and close() leaves nothing."""
    spares = lab.Spares("spare")
    monkeypatch.setattr(lab, "spares", spares)
    shown: list[str] = []
    monkeypatch.setattr(lab, "created_hooks", [lambda ns: shown.append(ns.name)])
    spares.begin()
    first = spares._next.result()  # made before anybody asked for it
    assert shown == []  # and shown to no hook (a run's grant to its learner's role) until it is taken
    async with lab.scratch("any label") as ns:
        assert ns is first and spares._next is None  # nothing is made while the check runs
        assert shown == [first.name]
        ns.redis_sync().set("k", "v")
        with ns.connect() as conn:
            conn.execute("CREATE TABLE t (id int)")
    admin, redis_url = first.servers.database_url, first.servers.redis_url
    assert first.name not in _databases(admin)  # dropped when the check's block ended
    ahead = spares._next  # the next check's, being made meanwhile
    assert ahead is not None
    spares.ahead = False  # the last check
    async with lab.scratch() as last:
        assert last is ahead.result() and last.name != first.name
    assert spares._next is None
    spares.close()
    assert not {first.name, last.name} & _databases(admin)
    claims = redis_sync.Redis.from_url(lab._redis_url_with_db(redis_url, 0))
    assert claims.get(f"{lab.CLAIM_PREFIX}{first.redis_db}") is None
    assert claims.get(f"{lab.CLAIM_PREFIX}{last.redis_db}") is None

    unused = lab.Spares("spare")
    unused.begin()
    never_taken = unused._next.result()
    unused.close()
    assert never_taken.name not in _databases(admin) and never_taken not in lab._open


def test_a_drop_ends_the_databases_sessions_first():
    ns = lab.create("busy")
    held = psycopg.connect(ns.database_url, autocommit=True)
    lab._forget(ns)
    assert ns.name not in _databases(ns.servers.database_url)
    assert held.closed or held.broken or _raises_on_use(held)


def _raises_on_use(conn) -> bool:
    try:
        conn.execute("SELECT 1")
    except psycopg.OperationalError:
        return True
    return False
