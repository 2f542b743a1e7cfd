"""Chapter 06 (sagas, two-phase commit, the transactional outbox, CDC): the chapter's demos.

- :mod:`.shop`: the three local services of the order saga (inventory, payments,
  shipping) and the orders table, their steps and compensations, an audit of what each
  service did; the chapter's tables (``ch06_*``) all belong here.
- :mod:`.crashes`: deterministic faults in PostgreSQL: "the process died before its k-th
  write" and "the next n refunds fail transiently", by triggers the checks arm.
- :mod:`.twopc`: ``PREPARE TRANSACTION`` live: a prepared participant keeps its locks.
- :mod:`.sagas`: saga runs, crash matrices, timelines, and a choreographed saga.
- :mod:`.events`: the dual write, the relay's ordering trap (gated, so it happens every
  time), relay latency, the downstream consumer.
- :mod:`.slots`: logical decoding from a replication slot, and WAL kept by an idle slot.
- :mod:`.temporal`: the order saga as a Temporal workflow on the dev server.
- :mod:`.plots`: the chapter's figures.

Patterns live in :mod:`course.saga`, :mod:`course.outbox` and :mod:`course.cdc`.
"""
