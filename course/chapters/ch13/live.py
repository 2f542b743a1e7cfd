"""Chapter 13's live page: the board's top 10 pushed to browsers over Server-Sent Events.

    app = make_app(ns, top_and_rank=lb.top_and_rank, record_score=lb.record)
    svc = Service(app, name="leaderboard").start()      # open svc.url in a browser

Routes:

- ``GET /``            the page (plain HTML and a dozen lines of JavaScript: ``EventSource``);
- ``GET /events``      the stream, written by hand on Starlette's ``StreamingResponse``;
- ``GET /events-lib``  the same stream through ``sse-starlette``'s ``EventSourceResponse``;
- ``GET /board``       the current snapshot as JSON;
- ``POST /scores``     one score event, applied with ``record_score``;
- ``POST /play``       a new game: the board cleared, then a burst of score events for a few seconds,
  played by the server itself (the page's "new game" button, which says so), so the board can move
  long after the notebook's cells ran.

One poller per app (:class:`BoardFeed`) reads the top N a few times a second and wakes the
streams when it changed, so a thousand open pages cost the same Redis reads as one. A
slow page is never sent a backlog: it gets the newest snapshot (conflation).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import threading
import time
from collections.abc import Awaitable, Callable, Iterator

from course import leaderboard as lb
from course.kit.notebook import not_done
from course.kit.serve import Service

#: Seconds since this moment are the ``at`` of the events the page's ``POST /scores`` makes up.
SEASON_START = 1_735_689_600  # 2025-01-01T00:00:00Z


def season_clock() -> int:
    """Seconds since the season began (``at`` of a live event)."""
    return int(time.time()) - SEASON_START


def game_events(per_tick: int = 6, players: int = 40) -> Iterator[list[dict]]:
    """Ticks of a small game, forever: ``per_tick`` score events each, for ``players`` players
    and ``you`` (the player the page follows), with event ids unique to this generator."""
    rng = random.Random()
    stamp = time.monotonic_ns()
    i = 0
    while True:
        tick = []
        for _ in range(per_tick):
            i += 1
            player = "you" if rng.random() < 0.03 else f"player{rng.randrange(players):02d}"
            tick.append({"event_id": f"live-{stamp}-{i}", "player": player, "points": rng.choice([5, 10, 25, 50]),
                         "at": season_clock()})  # fmt: skip
        yield tick


class BoardFeed:
    """Reads ``read()`` every ``interval`` seconds; streams wait for the next version.

    A waiter holds the :class:`asyncio.Event` of the version it saw; a change sets that event
    and puts a fresh one in its place. No lock: a stream whose wait times out (every quarter
    second while the board is quiet) has nothing to give back. (An ``asyncio.Condition``
    waited on under ``wait_for`` broke here on Python 3.11: "cannot wait on un-acquired lock"
    in the notebook's stderr, from a stream timing out as the board changed.)
    """

    def __init__(self, read: Callable[[], Awaitable[dict]], interval: float = 0.2) -> None:
        self.read = read
        self.interval = interval
        self.version = 0
        self.snapshot: dict | None = None
        self.problem: str | None = None
        self.reads = 0
        self._changed = asyncio.Event()

    async def run(self) -> None:
        while True:
            try:
                snapshot, problem = await self.read(), None
            except Exception as err:  # noqa: BLE001 - a page shows the problem instead of freezing
                where = not_done(err)
                snapshot = self.snapshot
                problem = (
                    f"not done yet: {where or 'top_and_rank'}"
                    if where is not None
                    else f"{type(err).__name__}"
                )
            self.reads += 1
            if snapshot != self.snapshot or problem != self.problem:
                self.snapshot, self.problem = snapshot, problem
                self.version += 1
                changed, self._changed = self._changed, asyncio.Event()
                changed.set()
            await asyncio.sleep(self.interval)

    async def after(self, version: int, timeout: float) -> int:
        """Wait until the feed is past ``version`` (or ``timeout`` passes); the version now."""
        if self.version <= version:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout)
        return self.version


def _snapshot(top: list[tuple[str, int]], follow: str, rank: int | None) -> dict:
    return {
        "top": [{"rank": i + 1, "player": p, "points": pts} for i, (p, pts) in enumerate(top)],
        "follow": {"player": follow, "rank": rank},
    }


def sse(data: dict, *, event: str = "board", id: int | None = None) -> str:
    """One Server-Sent Event on the wire: ``event:``, ``id:`` (when given), ``data:`` lines and a blank line.

    The page's stream sends no ``id:``: every frame is the whole snapshot, so a page that
    reconnects needs nothing replayed, and a browser's ``Last-Event-ID`` would only be worth
    reading if ids meant the same to every server process and across restarts.
    """
    lines = [f"event: {event}"]
    if id is not None:
        lines.append(f"id: {id}")
    lines += [f"data: {line}" for line in json.dumps(data).splitlines()]
    return "\n".join(lines) + "\n\n"


def make_app(
    ns,
    *,
    top_and_rank: Callable[..., Awaitable[tuple[list[tuple[str, int]], int | None]]],
    record_score: Callable[..., Awaitable[bool]] | None = None,
    n: int = 10,
    follow: str = "you",
    interval: float = 0.2,
    keepalive: float = 15.0,
    board_key: str = lb.BOARD,
):
    """The live-board app on namespace ``ns``; its pool and Redis client live on the server's own loop.

    ``board_key`` is the board ``top_and_rank`` reads: ``POST /play`` starts it afresh
    (``UNLINK``) before its burst, because cells that ran since may have emptied PostgreSQL
    under it, and ``ZADD GT`` would then refuse the smaller new totals.
    """
    from starlette.requests import Request
    from starlette.responses import HTMLResponse, JSONResponse, StreamingResponse
    from starlette.routing import Route

    from course.kit import serve

    @contextlib.asynccontextmanager
    async def lifespan(app):
        pool = await ns.pool(max_size=4, fresh=True)
        r = ns.redis(fresh=True)
        await lb.setup_schema(pool)

        async def read() -> dict:
            top, rank = await top_and_rank(r, n, follow)
            return _snapshot(top, follow, rank)

        app.state.pool, app.state.r, app.state.read = pool, r, read
        app.state.feed = feed = BoardFeed(read, interval)
        app.state.burst = None
        poller = asyncio.create_task(feed.run())
        try:
            yield
        finally:
            poller.cancel()
            bursts = [app.state.burst] if app.state.burst is not None else []
            for task in bursts:
                task.cancel()
            await asyncio.gather(poller, *bursts, return_exceptions=True)
            await r.aclose()
            await pool.close()
            # sse-starlette learns of a shutdown through uvicorn's signal handlers, which a server
            # in a thread does not install: its watcher task would outlive this loop. End it here.
            for other in asyncio.all_tasks():
                if getattr(other.get_coro(), "__qualname__", "") == "_shutdown_watcher":
                    other.cancel()

    async def page(request: Request):
        return HTMLResponse(PAGE.replace("{{N}}", str(n)).replace("{{FOLLOW}}", follow))

    async def board(request: Request):
        return JSONResponse(await request.app.state.read())  # a stub answers 501 "not done yet"

    async def frames(request: Request):
        """Full snapshots (ten rows are tiny), so a page that reconnects needs no replay.

        Yields ``(kind, data, version)``, or None after ``keepalive`` quiet seconds; ends when
        the service stops (an open stream would otherwise hold the server's shutdown).
        """
        feed: BoardFeed = request.app.state.feed
        closing: threading.Event = request.app.state.closing
        seen, quiet_since = -1, time.monotonic()
        while not closing.is_set():
            version = await feed.after(seen, 0.25)
            if version == seen:
                if time.monotonic() - quiet_since >= keepalive:
                    quiet_since = time.monotonic()
                    yield None
                continue
            seen, quiet_since = version, time.monotonic()
            if feed.problem:
                yield ("problem", {"problem": feed.problem}, version)
            elif feed.snapshot is not None:
                yield ("board", feed.snapshot, version)

    async def events(request: Request):
        await request.app.state.read()  # fail fast (501) before the stream starts

        async def body():
            yield "retry: 1000\n\n"  # how long a browser waits before it reconnects
            async for frame in frames(request):
                if frame is None:
                    yield ": keep-alive\n\n"  # a comment line: proxies see traffic, browsers ignore it
                else:
                    kind, data, _version = frame
                    yield sse(data, event=kind)  # no id: a full snapshot needs no resume

        headers = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}  # no caching, no proxy buffering
        return StreamingResponse(body(), media_type="text/event-stream", headers=headers)

    async def events_lib(request: Request):
        from sse_starlette import EventSourceResponse, ServerSentEvent

        await request.app.state.read()

        async def body():
            async for frame in frames(request):
                if frame is not None:
                    kind, data, _version = frame
                    yield ServerSentEvent(data=json.dumps(data), event=kind, retry=1000)

        return EventSourceResponse(body(), ping=keepalive, send_timeout=10)

    async def scores(request: Request):
        if record_score is None:
            return JSONResponse({"error": "this page does not take scores"}, status_code=405)
        try:
            body = await request.json()
            event = {
                "event_id": str(body["event_id"]),
                "player": str(body["player"])[:64],
                "points": int(body["points"]),
                "at": int(body.get("at", season_clock())),
            }
            if event["points"] <= 0 or not 0 <= event["at"] < lb.TIE_SPAN:
                raise ValueError
        except (KeyError, TypeError, ValueError):
            return JSONResponse(
                {"error": "expected {event_id, player, points > 0, at (optional)}"}, status_code=400
            )
        applied = await record_score(request.app.state.pool, request.app.state.r, event)
        return JSONResponse({"applied": bool(applied)})

    async def replay(request: Request):
        """A burst of score events, played by the server through ``record_score``."""
        state = request.app.state
        if record_score is None:
            return JSONResponse({"error": "this page does not take scores"}, status_code=405)
        if state.burst is not None and not state.burst.done():
            return JSONResponse({"playing": True, "started": False})
        try:
            seconds = min(max(float((await request.json()).get("seconds", 5)), 0.5), 30.0)
        except (AttributeError, TypeError, ValueError):
            seconds = 5.0

        async def burst() -> None:
            await state.r.unlink(board_key)
            ticks = game_events()
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                for event in next(ticks):
                    await record_score(state.pool, state.r, event)
                await asyncio.sleep(0.1)

        state.burst = asyncio.create_task(burst())
        return JSONResponse({"playing": True, "started": True, "seconds": seconds, "cleared": True})

    routes = [
        Route("/", page),
        Route("/board", board),
        Route("/events", events),
        Route("/events-lib", events_lib),
        Route("/scores", scores, methods=["POST"]),
        Route("/play", replay, methods=["POST"]),
    ]
    application = serve.app(routes, lifespan=lifespan)
    application.state.closing = threading.Event()
    return application


class LiveService(Service):
    """A :class:`~course.kit.serve.Service` that ends its open streams first when it stops."""

    def __init__(self, app, *, name: str = "leaderboard", **config) -> None:
        config.setdefault("timeout_graceful_shutdown", 2)  # a last resort: streams end by themselves
        super().__init__(app, name=name, **config)

    def start(self, timeout: float = 10.0) -> LiveService:
        self.app.state.closing.clear()
        super().start(timeout)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.app.state.closing.set()
        super().stop(timeout)


PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>Live leaderboard</title>
<style>
  body { font: 15px/1.4 system-ui, sans-serif; margin: 16px 20px; color: #222; max-width: 560px; }
  header { display: flex; align-items: baseline; gap: 12px; }
  h1 { font-size: 20px; margin: 0 0 8px; }
  #status { font-size: 12px; padding: 2px 8px; border-radius: 10px; background: #eee; }
  #status.live { background: #d5f5e3; color: #1e8449; }
  #status.down { background: #fadbd8; color: #922b21; }
  #play { margin-left: auto; font: inherit; font-size: 13px; padding: 2px 10px; cursor: pointer; }
  table { border-collapse: collapse; width: 100%; }
  th, td { text-align: left; padding: 4px 8px; border-bottom: 1px solid #eee; }
  td.points, th.points { text-align: right; font-variant-numeric: tabular-nums; }
  tr.up { animation: flash 1.2s ease-out; }
  tr.new { animation: flash 1.2s ease-out; font-weight: 600; }
  tr.me { background: #eaf2f8; }
  @keyframes flash { from { background: #fff3b0; } to { background: transparent; } }
  .meta { color: #777; font-size: 12px; }
  #problem { color: #922b21; }
</style>
</head>
<body>
<header><h1>Top {{N}}</h1><span id="status">connecting</span>
<button id="play" title="clears the board, then the server plays score events for 5 seconds">new game, 5 s</button></header>
<table>
  <thead><tr><th>#</th><th>player</th><th class="points">points</th></tr></thead>
  <tbody id="board"></tbody>
</table>
<p id="follow"></p>
<p id="problem"></p>
<p class="meta">updates: <span id="updates">0</span> · last: <span id="last">never</span></p>
<p class="meta" id="game"></p>
<script>
const $ = (id) => document.getElementById(id);
const esc = (s) => String(s).replace(/[&<>"']/g, (c) => "&#" + c.charCodeAt(0) + ";");
let updates = 0, before = {};
function render(snap) {
  $("board").innerHTML = snap.top.map((e) => {
    const cls = [before[e.player] === undefined ? "new" : before[e.player] !== e.points ? "up" : "",
                 e.player === snap.follow.player ? "me" : ""].join(" ");
    return `<tr class="${cls}" data-player="${esc(e.player)}" data-points="${e.points}">` +
           `<td>${e.rank}</td><td>${esc(e.player)}</td><td class="points">${e.points}</td></tr>`;
  }).join("");
  before = Object.fromEntries(snap.top.map((e) => [e.player, e.points]));
  const f = snap.follow;
  const who = f.player === "you" ? "you are" : `${f.player} is`;
  $("follow").textContent = f.rank ? `${who} #${f.rank}` : `${who} not on the board yet`;
}
const source = new EventSource("events");  // relative: works behind a proxy prefix too
source.onopen = () => { $("status").textContent = "live"; $("status").className = "live"; };
source.addEventListener("board", (ev) => {
  render(JSON.parse(ev.data));
  $("problem").textContent = "";
  $("updates").textContent = ++updates;
  $("last").textContent = new Date().toLocaleTimeString();
});
source.addEventListener("problem", (ev) => { $("problem").textContent = JSON.parse(ev.data).problem; });
$("play").onclick = () => {
  $("play").disabled = true;
  setTimeout(() => { $("play").disabled = false; }, 5000);
  fetch("play", {method: "POST", headers: {"Content-Type": "application/json"}, body: '{"seconds": 5}'})
    .then((r) => r.json().then((j) => {
      if (!r.ok) { $("problem").textContent = j.error; return; }
      if (j.started) {
        $("game").textContent = `a new game: the board starts from zero, then ${j.seconds} s of score events ` +
          `(${new Date().toLocaleTimeString()})`;
      }
    }))
    .catch(() => { $("problem").textContent = "the service is not running"; });
};
source.onerror = () => {
  $("status").textContent = "reconnecting"; $("status").className = "down";
  fetch("board").then((r) => r.ok ? null : r.json().then((j) => { $("problem").textContent = j.error; }));
};
</script>
</body>
</html>
"""
