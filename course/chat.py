"""Chat ordering: per-conversation sequence numbers (taught in chapter 11).

A message is stored with the next number of its conversation, and that number, not a
clock, is its order: device and server clocks disagree, and two messages in one
millisecond still need an order. The number comes from a counter row per conversation,
taken with ``UPDATE ... RETURNING`` in the transaction that inserts the message, so:

- two senders in one conversation queue on that row only (one conversation's load never
  blocks another);
- a failed insert rolls the increment back (no gap);
- a message is committed before the next number is handed out, so a reader never sees
  ``seq`` 5 before 4 exists (a sequence or a Redis ``INCR`` would allow it).

Clients remember the last ``seq`` per conversation; one that sees 41 and then 43 fetches 42.
A client sends its own id with each message (``client_msg_id``), so a send it retries after a
lost acknowledgement gets the first one's number back instead of storing the message twice.
"""

from __future__ import annotations

SCHEMA = """
-- the counter row of each conversation: the last number handed out
CREATE TABLE IF NOT EXISTS chat_conversations (
    id       text PRIMARY KEY,
    last_seq bigint NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS chat_messages (
    conversation_id text NOT NULL,
    seq             bigint NOT NULL,
    sender          text NOT NULL,
    body            text NOT NULL,
    sent_at         timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (conversation_id, seq)
);
-- the id the client made for the message: a send retried after a lost acknowledgement finds it
ALTER TABLE chat_messages ADD COLUMN IF NOT EXISTS client_msg_id text;
CREATE UNIQUE INDEX IF NOT EXISTS chat_messages_client_msg_id
    ON chat_messages (conversation_id, client_msg_id) WHERE client_msg_id IS NOT NULL;
"""


async def setup_schema(pool) -> None:
    """Create ``chat_conversations`` and ``chat_messages`` (idempotent)."""
    async with pool.connection() as conn:
        await conn.execute(SCHEMA)


class _Repeat(Exception):
    def __init__(self, seq: int) -> None:
        self.seq = seq


async def send_message(
    pool, conversation_id: str, sender: str, body: str, *, client_msg_id: str | None = None
) -> int:
    """Store a message with its conversation's next sequence number; return that number.

    ``client_msg_id`` is the id the client made for this message: a send retried after its
    acknowledgement was lost returns the stored message's number instead of storing a copy.
    The lookup runs after the counter row is locked, so a concurrent retry waits for the first.
    """
    try:
        async with pool.connection() as conn, conn.transaction():
            cur = await conn.execute(
                "INSERT INTO chat_conversations AS c (id, last_seq) VALUES (%s, 1) "
                "ON CONFLICT (id) DO UPDATE SET last_seq = c.last_seq + 1 RETURNING last_seq",
                (conversation_id,),
            )
            (seq,) = await cur.fetchone()
            if client_msg_id is not None:
                cur = await conn.execute(
                    "SELECT seq FROM chat_messages WHERE conversation_id = %s AND client_msg_id = %s",
                    (conversation_id, client_msg_id),
                )
                stored = await cur.fetchone()
                if stored is not None:
                    raise _Repeat(stored[0])  # rolls the counter back: the retry uses up no number
            await conn.execute(
                "INSERT INTO chat_messages (conversation_id, seq, sender, body, client_msg_id) "
                "VALUES (%s, %s, %s, %s, %s)",
                (conversation_id, seq, sender, body, client_msg_id),
            )
    except _Repeat as repeat:
        return repeat.seq
    return seq


async def messages_after(pool, conversation_id: str, after_seq: int = 0, limit: int = 100) -> list[tuple]:
    """``(seq, sender, body)`` after ``after_seq``: what a client fetches to fill a gap or catch up."""
    async with pool.connection() as conn:
        cur = await conn.execute(
            "SELECT seq, sender, body FROM chat_messages WHERE conversation_id = %s AND seq > %s ORDER BY seq LIMIT %s",
            (conversation_id, after_seq, limit),
        )
        return await cur.fetchall()


class ChatClient:
    """A client's view of one conversation: applies pushed messages in ``seq`` order, fetches gaps.

    ``receive`` takes a pushed message (pushes may arrive late, twice or not at all); a
    message beyond ``last_seq + 1`` means one is missing, so the client fetches from
    ``last_seq`` before it shows anything newer.
    """

    def __init__(self, pool, conversation_id: str) -> None:
        self.pool = pool
        self.conversation_id = conversation_id
        self.last_seq = 0
        self.shown: list[int] = []
        self.fetches = 0

    async def receive(self, seq: int) -> None:
        if seq <= self.last_seq:
            return  # a duplicate push
        if seq > self.last_seq + 1:
            self.fetches += 1
            for got, _, _ in await messages_after(self.pool, self.conversation_id, self.last_seq):
                self._show(got)
            return
        self._show(seq)

    def _show(self, seq: int) -> None:
        if seq == self.last_seq + 1:
            self.shown.append(seq)
            self.last_seq = seq
