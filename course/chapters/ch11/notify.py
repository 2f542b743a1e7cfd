"""Chapter 11's notification pipeline, run on virtual time against the live servers.

The pipeline is built from earlier chapters' patterns, by import: chapter 03's claim
(:func:`course.idempotency.claim`) deduplicates per notification and channel, chapter 08's
token bucket (:class:`course.ratelimit.TokenBucket`, in Redis, with the time passed in)
paces each provider, chapter 01's full-jitter backoff spaces the retries, and chapter 05's
dead-letter entry (:func:`course.messaging.dlq_entry`) records what could not be sent. A claim is
completed when the provider accepted the message and released when it is dead-lettered, so a
replay (:func:`replayable`) or the caller's retry can send it; a claim left pending by a crash is
chapter 03's reaper's work. Delivery is therefore at least once, and a duplicate is dropped only
once its first copy was sent.
Quiet hours hold back what is not urgent; a priority order sends one-time codes first.

Time is a number the loop advances (each provider call takes ``call_time`` seconds of it),
so a 12-second outage runs in well under a second and the same run gives the same timeline.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from course import idempotency as idem
from course import messaging as mq
from course.backoff import FullJitter
from course.ratelimit import TokenBucket

PRIORITY = {"otp": 0, "comment": 1, "marketing": 2}  # lower is sent first
CHANNEL = {"otp": "sms", "comment": "push", "marketing": "email"}


@dataclass
class Request:
    key: str  # the caller's idempotency key for this notification
    user: str
    kind: str  # "otp", "comment" or "marketing"
    at: float  # when it arrived (virtual seconds)
    local_hour: int = 12  # the user's local hour when it arrived

    @property
    def channel(self) -> str:
        return CHANNEL[self.kind]

    @property
    def priority(self) -> int:
        return PRIORITY[self.kind]


@dataclass
class Job:
    request: Request
    ready: float
    seq: int
    claim: str = ""  # its key in chapter 03's idempotency_keys: completed when sent, released when dead
    attempts: int = 0
    first_failed: float | None = None


@dataclass
class Run:
    events: list[tuple[float, str, str, str]] = field(default_factory=list)  # (t, event, kind, key)
    dead: list[dict] = field(default_factory=list)
    end: float = 0.0

    def count(self, event: str, kind: str | None = None) -> int:
        return sum(1 for _, e, k, _ in self.events if e == event and (kind is None or k == kind))


class Provider:
    """A fake provider per channel: 503 during ``outage`` (virtual seconds), 400 for bad device tokens."""

    def __init__(self, channel: str, outage: tuple[float, float] | None = None, bad_users=()) -> None:
        self.channel = channel
        self.outage = outage
        self.bad_users = set(bad_users)
        self.delivered: list[tuple[float, str]] = []

    async def send(self, req: Request, now: float) -> None:
        if self.outage and self.outage[0] <= now < self.outage[1]:
            raise mq.TransientError(f"{self.channel} provider answered 503")
        if req.user in self.bad_users:
            raise mq.PermanentError(f"{self.channel} provider answered 400: device token not registered")
        self.delivered.append((now, req.key))


def quiet(hour: int, start: int = 22, end: int = 7) -> bool:
    return hour >= start or hour < end


async def run_pipeline(
    pool,
    redis,
    prefix: str,
    requests: list[Request],
    providers: dict[str, Provider],
    *,
    rates: dict[str, tuple[int, float]],
    max_attempts: int = 5,
    backoff: FullJitter = FullJitter(base=0.5, cap=4.0),
    call_time: float = 0.01,
    seed: int = 7,
) -> Run:
    """Route, deduplicate, hold back for quiet hours, then send by priority within each provider's
    token bucket; retry transient errors with backoff; dead-letter permanent or exhausted ones."""
    rand = random.Random(seed)
    run = Run()
    jobs: list[Job] = []
    for i, req in enumerate(sorted(requests, key=lambda r: r.at)):
        body = {"user": req.user, "kind": req.kind}
        claim = f"{prefix}:{req.key}:{req.channel}"
        if not await idem.claim(pool, claim, idem.request_hash(body), body):
            run.events.append((req.at, "duplicate", req.kind, req.key))
            continue
        if req.priority > 0 and quiet(req.local_hour):
            run.events.append((req.at, "held for quiet hours", req.kind, req.key))  # sent at 07:00 local
            continue
        jobs.append(Job(req, req.at, i, claim))
    buckets = {ch: TokenBucket(redis, cap, rate, prefix=f"{prefix}:tb") for ch, (cap, rate) in rates.items()}
    now = 0.0
    while jobs:
        ready = [j for j in jobs if j.ready <= now]
        if not ready:
            now = min(j.ready for j in jobs)
            continue
        # the most urgent ready job whose provider has a token; the others wait in the queue
        sent_one = False
        waits = []
        for job in sorted(ready, key=lambda j: (j.request.priority, j.ready, j.seq)):
            ch = job.request.channel
            decision = await buckets[ch].hit(ch, now=now)
            if not decision.allowed:
                waits.append(decision.retry_after)
                continue
            await _attempt(
                job, providers[ch], now, run, jobs, pool, redis, prefix, max_attempts, backoff, rand
            )
            now += call_time
            sent_one = True
            break
        if not sent_one:
            now += max(min(waits), 0.001)
    run.end = now
    return run


async def _attempt(
    job: Job,
    provider: Provider,
    now: float,
    run: Run,
    jobs: list[Job],
    pool,
    redis,
    prefix: str,
    max_attempts: int,
    backoff: FullJitter,
    rand: random.Random,
) -> None:
    req = job.request
    try:
        await provider.send(req, now)
    except Exception as err:  # noqa: BLE001 - every failure is classified below
        job.attempts += 1
        job.first_failed = job.first_failed if job.first_failed is not None else now
        permanent = not mq.is_transient(err)
        if permanent or job.attempts >= max_attempts:
            fields = {
                "id": req.key,
                "key": req.user,
                "type": req.kind,
                "seq": str(job.seq),
                "body": req.channel,
            }
            entry = mq.dlq_entry(
                fields,
                stream=f"{prefix}:{req.channel}",
                entry_id=f"0-{job.seq}",
                attempts=job.attempts,
                first_failed_at=job.first_failed,
                last_failed_at=now,
                error=err,
                reason="permanent" if permanent else "exhausted",
            )
            await redis.xadd(f"{prefix}:notify:dlq", entry)
            await idem.release(
                pool, job.claim
            )  # not sent: a replay (or the caller's retry) may claim it again
            run.dead.append(entry)
            run.events.append((now, "dead-lettered", req.kind, req.key))
            jobs.remove(job)
            return
        job.ready = now + backoff.delay(job.attempts - 1, rand=rand.random)
        run.events.append((now, "failed, will retry", req.kind, req.key))
        return
    await idem.complete(pool, job.claim, {"sent_at": now})  # done: a repeat from now on is a duplicate
    run.events.append((now, "sent", req.kind, req.key))
    jobs.remove(job)


def replayable(run: Run, at: float) -> list[Request]:
    """The dead letters worth sending again (retries exhausted; a permanent error would fail again),
    as requests arriving at ``at``: chapter 05's replay, once the provider is back."""
    return [
        Request(entry["id"], entry["key"], entry["type"], at)
        for entry in run.dead
        if entry["reason"] == "exhausted"
    ]


def workload(
    n: int, *, seconds: float = 10.0, duplicate_share: float = 0.1, night_share: float = 0.15, seed: int = 3
) -> list[Request]:
    """``n`` notifications over ``seconds``: one in six a login code (SMS), half comments (push), the
    rest marketing (e-mail); some sent twice by their caller, some to users whose night it is."""
    rand = random.Random(seed)
    out = []
    for i in range(n):
        r = rand.random()
        kind = "otp" if r < 1 / 6 else "comment" if r < 2 / 3 else "marketing"
        hour = rand.choice([23, 2, 5]) if rand.random() < night_share else rand.randrange(8, 22)
        req = Request(f"n{i}", f"user-{rand.randrange(n // 3)}", kind, rand.uniform(0, seconds), hour)
        out.append(req)
        if rand.random() < duplicate_share:
            out.append(
                Request(req.key, req.user, kind, req.at + rand.uniform(0, 1), hour)
            )  # a caller's retry
    return out


def plot_run(run: Run, outage: tuple[float, float], bin_s: float = 0.5):
    from course.kit.plotting import COLORS, figure, legend_outside

    fig, ax = figure(12, 3.2)
    end = max(run.end, max(t for t, *_ in run.events)) + bin_s
    bins = [i * bin_s for i in range(int(end / bin_s) + 1)]

    def series(event: str, kind: str | None = None) -> list[int]:
        counts = [0] * len(bins)
        for t, e, k, _ in run.events:
            if e == event and (kind is None or k == kind):
                counts[min(int(t / bin_s), len(bins) - 1)] += 1
        return counts

    ax.axvspan(*outage, color=COLORS["bad"], alpha=0.08, label="push provider down (503)")
    for kind, color in (("otp", COLORS["ok"]), ("comment", COLORS["fix"]), ("marketing", COLORS["neutral"])):
        ax.step(
            bins, series("sent", kind), where="post", color=color, label=f"sent: {kind} ({CHANNEL[kind]})"
        )
    ax.step(
        bins,
        series("failed, will retry"),
        where="post",
        color=COLORS["warn"],
        linestyle="--",
        label="failed, retried later",
    )
    dead = [t for t, e, *_ in run.events if e == "dead-lettered"]
    ax.scatter(
        dead,
        [0.3] * len(dead),
        marker="x",
        color=COLORS["bad"],
        zorder=5,
        label=f"dead-lettered ({len(dead)})",
    )
    ax.set_xlabel("virtual seconds")
    ax.set_ylabel(f"notifications per {bin_s:g} s")
    legend_outside(ax)
    return fig
