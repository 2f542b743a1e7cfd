"""Hidden checks of chapter 05 (messaging under failure): ``ordered_consumer`` and ``replay_key``.

Every verdict is read from the servers: the rows the check's handler committed (the applied
order), the dead-letter stream, ``XPENDING``, the consumer's tables. Failures are injected
per message (a transient error for the first attempts, a permanent one, a kill), and time
is the check's own: the injected ``sleep`` records every backoff and returns at once (or
waits, in the head-of-line scenario, until the check has seen the other keys finish), the
injected ``clock`` moves only by those sleeps, and ``rand`` is seeded.

A kill is a process death made deterministic: :class:`ConsumerKilled` is raised at a named
point (inside the handler before or after its change, at the consumer's next Redis command
after the commit, right after the XACK), and from then on that replica's Redis client and
handler refuse to work, its leftover tasks are cancelled and its pool is closed, so its open
transaction rolls back. A second replica (the learner's answer cell run again) takes over.
"""

# The consumer's task registers first, then the replay's: the order selfcheck reports them in.
from autograder.checks.ch05 import consumer, replay  # noqa: F401, E402

#: The course's own reference implementation of each task (issue 26): while a task is graded,
#: a learner's answer that is, wraps or calls one of these earns nothing for it. The checks
#: themselves may still use them as rigs.
REFERENCES: dict[str, list[str]] = {
    "ordered_consumer": ["course.messaging:ordered_consumer"],
    "replay_key": ["course.messaging:replay_key"],
}
