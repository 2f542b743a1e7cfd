"""Hidden checks of chapter 11: ``view_counter`` (:mod:`.counter`) and ``send_message`` (:mod:`.sequences`).

Both run as two replicas of the learner's answer (``r.replicas``). Races are forced, never
left to timing: the check holds a ``view_counts`` row (``SELECT ... FOR UPDATE`` in an open
transaction) until every flush it started is waiting on it, holds a chat INSERT inside
PostgreSQL (the rig's ``hold:`` trigger waits on an advisory lock the check owns), or takes
``SHARE`` on ``chat_messages`` so that every sender has read before any can insert, and takes it
again for every later round (a sender that retries after a duplicate key reads again before any
of that round inserts: :func:`sequences._in_rounds`). A failed flush is a one-shot trigger on the N-th row
written (:mod:`course.chapters.ch11.rig`). A timer the answer leaves running (a ticker started in
``__init__``, a delayed flush) is fired at once, however long its interval (:func:`counter._fire_timers`):
a grading run is far shorter than any real interval, so waiting for it would prove nothing.
"""

from __future__ import annotations

# Imported in the order the chapter's tasks are reported in.
from autograder.checks.ch11 import counter, sequences  # noqa: F401
from autograder.rules import Rule

# ============================================================================= issue 28's tables

RULES: dict[str, list[Rule]] = {
    "view_counter": [
        Rule(
            "Nothing is written to the database until max_views views are buffered",
            "check_view_counter: 9 views with max_views=10 must leave view_counts empty",
            wrong="one UPDATE per view",
        ),
        Rule(
            "Nothing is written to the database until max_views views are buffered",
            "check_view_counter: after 9 views with max_views=10 every timer the counter left running is fired "
            "at once (a ticker's sleep, a delayed flush); view_counts must still be empty",
            wrong="a ticker in __init__",
        ),
        Rule(
            "The view that fills the buffer to max_views flushes it",
            "check_view_counter: the 10th view must put all 10 in view_counts without a flush() call",
            wrong="flushes only on close",
        ),
        Rule(
            "close() is the graceful shutdown: it flushes everything still buffered",
            "check_view_counter: views after the last flush must be in view_counts after close()",
            wrong="close drops the buffer",
        ),
        Rule(
            "Views that arrive while a flush is writing are not lost",
            "check_view_counter: holds v1's row during a flush and adds 15 views meanwhile",
            wrong="clear after the write",
        ),
        Rule(
            "Two replicas flushing the same item at the same time must both count",
            "check_view_counter: holds v2's row until both replicas' flushes wait on it, then compares totals",
            wrong="read, then write the total",
        ),
        Rule(
            "A flush the database refuses keeps its views",
            "check_view_counter: the 2nd row of a flush fails once; the retry must count each view once",
            wrong="drop the batch on failure",
        ),
        Rule(
            "a retry never counts a view twice",
            "check_view_counter: a flush whose 2nd row fails must not count the 1st row twice on retry",
            wrong="item by item, all put back",
        ),
        Rule(
            "at most one row per item per flush",
            "check_view_counter: counts rows written (a trigger and a sequence) for 860 views on two replicas",
            wrong="a +1 per buffered view in the flush",
        ),
        Rule(
            "the batched counter of this chapter",
            "check_view_counter: counts rows written (a trigger and a sequence) for 860 views on two replicas",
            wrong="one UPDATE per view",
        ),
        Rule(
            "adding to what is there",
            "check_view_counter: holds v2's row until both replicas' flushes wait on it, then compares totals",
            wrong="read, then write the total",
        ),
        Rule(
            "the checks call it directly",
            "check_view_counter: calls flush() while holding v1's row and adds views meanwhile",
            wrong="clear after the write",
        ),
        Rule(
            "What must hold, and what the hidden checks do to see it",
            "check_view_counter: the list below it, each rule with its own row here",
            wrong="read, then write the total",
        ),
        Rule(
            "so both flushes are waiting on it when it is released",
            "check_view_counter: holds v2's row until both replicas' flushes wait on it, then compares totals",
            wrong="read, then write the total",
        ),
    ],
    "send_message": [
        Rule(
            "The first message of a conversation gets 1",
            "check_send_message: 3 sends to a new conversation must return 1, 2, 3",
            wrong="timestamp as order",
        ),
        Rule(
            "numbers are per conversation",
            "check_send_message: a second conversation's first message must return 1",
            wrong="one global sequence",
        ),
        Rule(
            "under concurrent senders on two replicas",
            "check_send_message: 10 senders held under SHARE on chat_messages until all have read",
            wrong="max(seq) + 1 without a lock",
        ),
        Rule(
            "numbers are per conversation, unique and gap-free",
            "check_send_message: 10 senders in rounds: SHARE on chat_messages is taken again before each round "
            "of retries is let go, so a retry reads before any of its round inserts (3 tries: 3 numbers, 7 errors)",
            wrong="max(seq) + 1, three tries",
        ),
        Rule(
            "A send that fails uses up no number",
            "check_send_message: a refused INSERT, then the next send must get the next number",
            wrong="separate counter statement",
        ),
        Rule(
            "never sees a hole",
            "check_send_message: holds message 2 in its INSERT and reads committed seqs while another send runs",
            wrong="counter committed before the message",
        ),
        Rule(
            "A send to another conversation is never blocked",
            "check_send_message: a send to another conversation must finish while one is held",
            wrong="one lock for all conversations",
        ),
        Rule(
            "return its sequence number within its conversation",
            "check_send_message: a second conversation's first message must return 1",
            wrong="one global sequence",
        ),
        Rule(
            "The check sends 10 messages to one conversation at once",
            "check_send_message: 10 senders held under SHARE on chat_messages until all have read",
            wrong="max(seq) + 1 without a lock",
        ),
        Rule(
            "let the error reach the caller; the next message must get the next number",
            "check_send_message: a refused INSERT, then the next send must get the next number",
            wrong="separate counter statement",
        ),
        Rule(
            "3 must not be committed while 2 is not",
            "check_send_message: holds message 2 in its INSERT and reads committed seqs while another send runs",
            wrong="counter committed before the message",
        ),
        Rule(
            "the same replica sends to another conversation, which must finish",
            "check_send_message: a send to another conversation must finish while one is held",
            wrong="one lock for all conversations",
        ),
    ],
}

REFERENCES: dict[str, list[str]] = {
    "view_counter": ["course.counters:BatchedCounter"],
    "send_message": ["course.chat:send_message"],
}

#: Learner processes these checks use at once (process i holds replica i of an answer): a grading run
#: starts them together and runs every cell in each (autograder/session.py).
PROCESSES = 2
