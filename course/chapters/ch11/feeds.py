"""Chapter 11's feed demo: fan-out on write, on read, and the hybrid, on one synthetic graph in Redis.

A follower graph with a heavy tail (a few celebrities followed by a large share of the
users) is built in memory; posts are published and feeds read against the notebook's Redis
with each strategy, and the costs are measured: Redis writes per post (write amplification),
the time to publish, and the time and commands to read one feed.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

from course.kit.stats import percentile as pct

FEED_LEN = 500  # ids kept per stored feed (LTRIM)
PAGE = 20  # a feed read returns the newest PAGE post ids


@dataclass
class Graph:
    followers: dict[int, list[int]]
    following: dict[int, list[int]]
    celebrities: list[int]

    @property
    def users(self) -> int:
        return len(self.following)


def make_graph(
    users: int, *, follows: int = 40, celebrities: int = 4, celebrity_share: float = 0.5, seed: int = 11
) -> Graph:
    """``users`` users; each follows about ``follows`` others picked with a heavy tail (popular users
    are picked more), and ``celebrity_share`` of the users also follow each of the celebrities."""
    rand = random.Random(seed)
    weights = [1.0 / (i + 1) ** 0.8 for i in range(users)]  # user 0 is the most popular
    celebs = list(range(celebrities))
    following: dict[int, set[int]] = {u: set() for u in range(users)}
    pool = list(range(celebrities, users))
    tail_weights = weights[celebrities:]
    for u in range(users):
        for v in rand.choices(pool, tail_weights, k=follows):
            if v != u:
                following[u].add(v)
        for c in celebs:
            if c != u and rand.random() < celebrity_share:
                following[u].add(c)
    followers: dict[int, list[int]] = {u: [] for u in range(users)}
    for u, vs in following.items():
        for v in vs:
            followers[v].append(u)
    return Graph(followers, {u: sorted(vs) for u, vs in following.items()}, celebs)


@dataclass
class FeedRun:
    strategy: str
    writes: list[int] = field(default_factory=list)  # Redis writes per post
    by_celebrity: list[bool] = field(default_factory=list)  # per post: was its author a celebrity?
    publish_ms: list[float] = field(default_factory=list)
    read_ms: list[float] = field(default_factory=list)
    read_commands: list[int] = field(default_factory=list)

    @property
    def mean_writes(self) -> float:
        return sum(self.writes) / len(self.writes)

    @property
    def celebrity_writes(self) -> int:
        """The most Redis writes one celebrity's post cost."""
        return max((w for w, c in zip(self.writes, self.by_celebrity, strict=True) if c), default=0)

    @property
    def other_writes(self) -> int:
        """The most Redis writes one post by anyone else cost."""
        return max((w for w, c in zip(self.writes, self.by_celebrity, strict=True) if not c), default=0)


async def _clear(redis, prefix: str) -> None:
    keys = [k async for k in redis.scan_iter(f"{prefix}:*", count=1000)]
    for i in range(0, len(keys), 1000):
        await redis.unlink(*keys[i : i + 1000])


async def publish(redis, prefix: str, g: Graph, author: int, post_id: int, *, threshold: float) -> int:
    """Store the post in its author's timeline, and push its id into each follower's feed unless the
    author has more than ``threshold`` followers. Returns the number of Redis writes."""
    pipe = redis.pipeline(transaction=False)
    pipe.lpush(f"{prefix}:tl:{author}", post_id)
    pipe.ltrim(f"{prefix}:tl:{author}", 0, FEED_LEN - 1)
    writes = 1
    fans = g.followers[author]
    if len(fans) <= threshold:
        for f in fans:
            pipe.lpush(f"{prefix}:feed:{f}", post_id)
            pipe.ltrim(f"{prefix}:feed:{f}", 0, FEED_LEN - 1)
        writes += len(fans)
    await pipe.execute()
    return writes


async def read_feed(redis, prefix: str, g: Graph, user: int, *, threshold: float) -> tuple[list[int], int]:
    """The newest PAGE ids: the stored feed, merged with the timelines of the followed authors whose
    posts were not fanned out (all of them on read, the celebrities in the hybrid)."""
    pipe = redis.pipeline(transaction=False)
    pulled = [a for a in g.following[user] if len(g.followers[a]) > threshold]
    if threshold != float("-inf"):
        pipe.lrange(f"{prefix}:feed:{user}", 0, PAGE - 1)
    for a in pulled:
        pipe.lrange(f"{prefix}:tl:{a}", 0, PAGE - 1)
    replies = await pipe.execute()
    ids = {int(x) for reply in replies for x in reply}
    return sorted(ids, reverse=True)[:PAGE], len(replies)


async def feed_page(
    redis, prefix: str, g: Graph, user: int, *, threshold: float, before: int | None = None, limit: int = 5
) -> tuple[list[int], int | None]:
    """One page of ``user``'s home feed as a product serves it: the stored feed, the pulled timelines
    and the user's own posts, merged; ids in the deleted set (``{prefix}:deleted``) left out; older
    than the cursor ``before`` (a post id: ids grow with time). Returns the ids and the next cursor."""
    pipe = redis.pipeline(transaction=False)
    sources = [f"{prefix}:tl:{user}"]  # the author's own posts: never fanned out to themselves
    sources += [f"{prefix}:tl:{a}" for a in g.following[user] if len(g.followers[a]) > threshold]
    if threshold != float("-inf"):
        sources.append(f"{prefix}:feed:{user}")
    for key in sources:
        pipe.lrange(key, 0, FEED_LEN - 1)
    pipe.smembers(f"{prefix}:deleted")
    *replies, deleted = await pipe.execute()
    gone = {int(x) for x in deleted}
    ids = sorted({int(x) for reply in replies for x in reply} - gone, reverse=True)
    if before is not None:
        ids = [i for i in ids if i < before]
    page = ids[:limit]
    return page, (page[-1] if len(ids) > limit else None)


async def delete_post(redis, prefix: str, post_id: int) -> None:
    """A deleted post stays in the feeds it was pushed to; readers drop it (a tombstone set)."""
    await redis.sadd(f"{prefix}:deleted", post_id)


async def publish_all(redis, prefix: str, g: Graph, authors: list[int], *, threshold: float) -> None:
    """Publish one post per author in ``authors`` (post ids 1, 2, ...), from a clean slate."""
    await _clear(redis, prefix)
    for post_id, author in enumerate(authors, 1):
        await publish(redis, prefix, g, author, post_id, threshold=threshold)


STRATEGIES = {
    "fan-out on write": float("inf"),
    "fan-out on read": float("-inf"),
}


async def compare(
    redis, prefix: str, g: Graph, *, posts: int, reads: int, celebrity_threshold: int, seed: int = 12
) -> list[FeedRun]:
    """Publish the same ``posts`` and read the same ``reads`` feeds with each strategy."""
    rand = random.Random(seed)
    authors = [
        g.celebrities[i % len(g.celebrities)] if i % 10 == 0 else rand.randrange(g.users)
        for i in range(posts)
    ]  # one post in ten by a celebrity
    readers = [rand.randrange(g.users) for _ in range(reads)]
    strategies = dict(STRATEGIES)
    strategies[f"hybrid (pull above {celebrity_threshold:,} followers)"] = celebrity_threshold
    runs = []
    expected = None
    for name, threshold in strategies.items():
        await _clear(redis, prefix)
        run = FeedRun(name)
        for post_id, author in enumerate(authors, 1):
            t0 = time.perf_counter()
            run.writes.append(await publish(redis, prefix, g, author, post_id, threshold=threshold))
            run.by_celebrity.append(author in g.celebrities)
            run.publish_ms.append((time.perf_counter() - t0) * 1000)
        feeds = []
        for user in readers:
            t0 = time.perf_counter()
            ids, commands = await read_feed(redis, prefix, g, user, threshold=threshold)
            run.read_ms.append((time.perf_counter() - t0) * 1000)
            run.read_commands.append(commands)
            feeds.append(ids)
        if expected is None:
            expected = feeds
        assert feeds == expected, f"{name} read different feeds"  # same feeds, different costs
        runs.append(run)
    await _clear(redis, prefix)
    return runs


def table(runs: list[FeedRun]) -> list[str]:
    lines = [
        f"{'strategy':42} {'writes/post':>11} {'celebrity':>9} {'publish p99':>11} {'read p50':>9} "
        f"{'read p99':>9} {'cmds/read':>9}"
    ]
    for r in runs:
        lines.append(
            f"{r.strategy:42} {r.mean_writes:>11.1f} {r.celebrity_writes:>9,} {pct(r.publish_ms, 99):>9.2f}ms "
            f"{pct(r.read_ms, 50):>7.2f}ms {pct(r.read_ms, 99):>7.2f}ms "
            f"{sum(r.read_commands) / len(r.read_commands):>9.1f}"
        )
    return lines


def _handles(solid: str, hatched: str) -> list:
    """Legend entries for the two kinds of bar (the colours name the strategies, on the x axis)."""
    from matplotlib.patches import Patch

    from course.kit.plotting import COLORS

    return [
        Patch(facecolor=COLORS["neutral"], label=solid),
        Patch(facecolor=COLORS["neutral"], alpha=0.45, hatch="//", label=hatched),
    ]


def plot(runs: list[FeedRun], g: Graph):
    from course.kit.plotting import COLORS, figure, legend_outside

    fig, axes = figure(12, 3.0, ncols=2)
    names = [r.strategy.split(" (")[0] for r in runs]
    colors = [COLORS["bad"], COLORS["warn"], COLORS["ok"]]
    ax = axes[0]
    x = range(len(runs))
    ax.bar(
        [i - 0.2 for i in x], [r.mean_writes for r in runs], 0.4, color=colors, label="mean writes per post"
    )
    ax.bar(
        [i + 0.2 for i in x],
        [r.celebrity_writes for r in runs],
        0.4,
        color=colors,
        alpha=0.45,
        hatch="//",
        label="writes for a celebrity's post",
    )
    ax.set_yscale("log")
    ax.set_xticks(list(x), names)
    ax.set_ylabel("Redis writes per post (log)")
    legend_outside(
        ax,
        "below",
        ncols=1,
        handles=_handles("mean writes per post", "writes for one celebrity's post (the most)"),
    )
    ax = axes[1]
    ax.bar([i - 0.2 for i in x], [pct(r.read_ms, 50) for r in runs], 0.4, color=colors, label="read p50")
    ax.bar(
        [i + 0.2 for i in x],
        [pct(r.read_ms, 99) for r in runs],
        0.4,
        color=colors,
        alpha=0.45,
        hatch="//",
        label="read p99",
    )
    ax.set_xticks(list(x), names)
    ax.set_ylabel("time to read one feed, ms")
    legend_outside(ax, "below", ncols=2, handles=_handles("read p50", "read p99"))
    fig.suptitle(
        f"{g.users:,} users, {len(g.celebrities)} celebrities with "
        f"{min(len(g.followers[c]) for c in g.celebrities):,}+ followers each",
        fontsize="medium",
    )
    return fig
