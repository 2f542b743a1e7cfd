"""Chapter 11's chat demos: timestamps that misorder a conversation, racing senders, a client filling a gap."""

from __future__ import annotations

import asyncio
import time

from course import chat


async def reset(pool, *conversations: str) -> None:
    async with pool.connection() as conn:
        await conn.execute(
            "DELETE FROM chat_messages WHERE conversation_id = ANY(%s)", (list(conversations),)
        )
        await conn.execute("DELETE FROM chat_conversations WHERE id = ANY(%s)", (list(conversations),))


async def skewed_conversation(pool, conversation: str, skew: dict[str, float]) -> list[dict]:
    """A question and its answers, sent in this real order, each stamped by its sender's clock
    (``skew[sender]`` seconds off) and numbered by the server."""
    await reset(pool, conversation)
    script = [
        ("ana", "lunch at noon?"),
        ("ben", "yes! the usual place"),
        ("ana", "great, see you there"),
        ("ben", "running 5 min late"),
    ]
    out = []
    for sender, text in script:
        device_time = time.time() + skew[sender]
        seq = await chat.send_message(pool, conversation, sender, text)
        out.append({"sender": sender, "text": text, "device_time": device_time, "seq": seq})
        await asyncio.sleep(0.05)  # each answer comes 50 ms after the message before it
    return out


async def max_plus_one(pool, conversation_id: str, sender: str, body: str, *, after_read=None) -> int:
    """The number from ``max(seq) + 1``, read without a lock. ``after_read`` (awaited between the
    read and the insert) lets a demo hold every sender there, so they all read the same max."""
    async with pool.connection() as conn, conn.transaction():
        cur = await conn.execute(
            "SELECT coalesce(max(seq), 0) + 1 FROM chat_messages WHERE conversation_id = %s",
            (conversation_id,),
        )
        (seq,) = await cur.fetchone()
        if after_read is not None:
            await after_read()
        await conn.execute(
            "INSERT INTO chat_messages (conversation_id, seq, sender, body) VALUES (%s, %s, %s, %s)",
            (conversation_id, seq, sender, body),
        )
    return seq


def racing_max_plus_one(senders: int):
    """``max_plus_one`` whose callers wait for each other after their read (an ``asyncio.Barrier``
    of ``senders``): the window between read and write, made as wide as a busy server makes it."""
    barrier = asyncio.Barrier(senders)

    async def send(pool, conversation_id: str, sender: str, body: str) -> int:
        return await max_plus_one(pool, conversation_id, sender, body, after_read=barrier.wait)

    return send


async def race(pool, send, conversation: str, senders: int = 8) -> list:
    """``senders`` messages to one conversation at once; what each call returned or raised."""
    await reset(pool, conversation)
    return await asyncio.gather(
        *(send(pool, conversation, f"user{i}", f"message {i}") for i in range(senders)),
        return_exceptions=True,
    )


async def gap_fill(pool, conversation: str, pushes: list[int]) -> tuple[list[int], int]:
    """A client receiving ``pushes`` (some lost, some late or repeated): what it showed, and fetches."""
    client = chat.ChatClient(pool, conversation)
    for seq in pushes:
        await client.receive(seq)
    return client.shown, client.fetches


def outcomes(results: list) -> str:
    """``numbers [1], errors: 7 x UniqueViolation``: what concurrent sends returned and raised."""
    numbers = sorted(x for x in results if isinstance(x, int))
    errors: dict[str, int] = {}
    for x in results:
        if isinstance(x, BaseException):
            errors[type(x).__name__] = errors.get(type(x).__name__, 0) + 1
    text = f"numbers {numbers}"
    if errors:
        text += ", errors: " + ", ".join(f"{n} x {name}" for name, n in errors.items())
    return text
