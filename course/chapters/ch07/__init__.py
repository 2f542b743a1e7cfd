"""Chapter 07's demos (CQRS, event sourcing, search indexing): what only this chapter shows.

- :mod:`.rig`: the fault rig on the live database (a gate that holds writers inside
  PostgreSQL until every one has read, one-shot crashes at a chosen table) and ``race``,
  which runs concurrent writers through the gate; the notebook and the checks share it;
- :mod:`.streams`: event-sourcing demos (the overdraft race, the double-clicked deposit
  and its idempotency key, fold time and snapshots, upcasting, the projector that skips a
  late commit, projection lag, a crash between apply and checkpoint);
- :mod:`.shredding`: crypto-shredding (per-person keys outside the event store);
- :mod:`.indexing`: the dual-write drift, the outbox path, PostgreSQL full-text search
  beside tantivy on one corpus;
- :mod:`.library`: the ``eventsourcing`` package on the same PostgreSQL.
"""
