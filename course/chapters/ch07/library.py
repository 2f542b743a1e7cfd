"""The ``eventsourcing`` package (John Bywater) on chapter 07's PostgreSQL: the same account,
the same conflict, snapshots, and the tables it makes (``ch07bank_events``, ``ch07bank_snapshots``)."""

from __future__ import annotations

import functools
import time
from urllib.parse import parse_qs, unquote, urlsplit


def env_for(database_url: str) -> dict[str, str]:
    """The package's settings (it reads them as environment variables) for ``database_url``."""
    parts = urlsplit(database_url)
    query = parse_qs(parts.query)
    return {
        "PERSISTENCE_MODULE": "eventsourcing.postgres",
        "POSTGRES_DBNAME": parts.path.lstrip("/"),
        "POSTGRES_HOST": query.get("host", [parts.hostname or "localhost"])[0],
        "POSTGRES_PORT": str(parts.port or query.get("port", ["5432"])[0]),
        "POSTGRES_USER": unquote(parts.username or "postgres"),
        "POSTGRES_PASSWORD": unquote(parts.password or ""),
        "POSTGRES_POOL_SIZE": "2",
        "POSTGRES_MAX_OVERFLOW": "0",
        "CREATE_TABLE": "y",
    }


@functools.cache  # the package registers each class under its topic once per process
def _classes():
    from eventsourcing.application import Application
    from eventsourcing.domain import Aggregate, event

    class Account(Aggregate):
        @event("Opened")
        def __init__(self, owner: str) -> None:
            self.owner = owner
            self.balance_cents = 0

        @event("Deposited")
        def deposit(self, amount_cents: int) -> None:
            self.balance_cents += amount_cents

        def withdraw(self, amount_cents: int) -> None:
            if amount_cents > self.balance_cents:  # the rule is checked before the event exists
                raise ValueError(f"insufficient funds: {self.balance_cents} < {amount_cents}")
            self._withdrawn(amount_cents)

        @event("Withdrawn")
        def _withdrawn(self, amount_cents: int) -> None:
            self.balance_cents -= amount_cents

    class Ch07Bank(Application):
        snapshotting_intervals = {Account: 100}  # a snapshot every 100 events of an account

    return Account, Ch07Bank


def demo(database_url: str, *, deposits: int = 250) -> dict:
    """Open an account, race two withdrawals, deposit ``deposits`` times; what happened."""
    from eventsourcing.persistence import RecordConflictError

    Account, Bank = _classes()
    app = Bank(env=env_for(database_url))
    try:
        account = Account("ada")
        account.deposit(10_000)
        app.save(account)

        first, second = app.repository.get(account.id), app.repository.get(account.id)
        first.withdraw(10_000)
        second.withdraw(10_000)  # both saw 100.00 and both decided to take it
        app.save(first)
        try:
            app.save(second)
            conflict = "saved: the account is overdrawn"
        except (
            RecordConflictError
        ) as err:  # on PostgreSQL it arrives as the package's IntegrityError subclass
            conflict = f"{type(err).__name__} (a RecordConflictError): {str(err).splitlines()[0]}"

        loaded = app.repository.get(account.id)
        for _ in range(deposits):
            loaded.deposit(100)
        app.save(loaded)

        t0 = time.perf_counter()
        current = app.repository.get(account.id)
        load_ms = (time.perf_counter() - t0) * 1000
        snapshots = list(app.snapshots.get(account.id)) if app.snapshots is not None else []
        rows = app.recorder.select_events(account.id)
        return {
            "conflict": conflict,
            "version": current.version,
            "balance_cents": current.balance_cents,
            "events_stored": len(rows),
            "snapshot_versions": [s.originator_version for s in snapshots],
            "load_ms": load_ms,
            "tables": _tables(database_url),
        }
    finally:
        app.close()


def _tables(database_url: str) -> list[str]:
    import psycopg

    with psycopg.connect(database_url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_name LIKE 'ch07bank%%' ORDER BY 1"
        ).fetchall()
    return [row[0] for row in rows]
