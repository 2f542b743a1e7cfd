"""Chapter 12's overload demo: a click recorder that cannot reach its stream samples instead of growing."""

from __future__ import annotations

import random

from course import shortener


def sampling_demo(
    clicks: int = 20_000, *, high_water: int = 1_000, sample_every: int = 10, seed: int = 12
) -> dict:
    """A recorder whose stream is unreachable takes ``clicks`` clicks: how many events does it
    keep, and how close is the weighted total to the truth?"""
    rnd = random.Random(seed)
    rec = shortener.ClickRecorder(
        None, "unused", high_water=high_water, sample_every=sample_every, rand=rnd.random
    )
    for i in range(clicks):
        rec.record(f"c{i % 50}")
    return {
        "clicks": clicks,
        "events_kept": len(rec.buffer),
        "estimate": rec.buffered,
        "sampled_out": rec.sampled_out,
    }
