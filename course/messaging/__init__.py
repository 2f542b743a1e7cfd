"""Messaging under failure: retries, dead letters, per-key order (chapter 05).

A consumer over a Redis Stream and a consumer group, with its state in PostgreSQL:

- **classify** every handler error (:func:`classify`): transient and uncertain errors are retried
  with chapter 01's capped exponential backoff and full jitter (:func:`course.retry.retry_call`);
  permanent ones go straight to the dead-letter stream;
- **apply once**: the message id is recorded in ``mq_processed`` in the transaction of the change
  (chapter 03's idempotent consumer); ``XACK`` only after that commit;
- **dead-letter** with what an operator needs (:func:`dlq_entry`), then **block the key**: its
  later messages are **parked** in ``mq_parked``, not applied, not lost;
- **one key in order, keys in parallel**: one lane (an asyncio task) per ordering key (``lane_of``);
- **one owner per stream** (:func:`take_ownership`): chapter 04's Redis lock as a lease, renewed
  while running, and its **fencing token** checked in every transaction (``mq_fence``); the new
  owner takes the **whole** pending list before it reads a new entry;
- **bounded**: ``max_in_flight`` entries read and not finished; past ``max_deliveries`` (Redis's
  ``times_delivered``) a message is dead-lettered untried; an outage of the dependency **pauses**
  the consumer (chapter 02's breaker) instead of dead-lettering every key;
- **replay** a blocked key once its cause is fixed (:func:`replay_key`): the dead message, then the
  parked ones in stream order, ``batch`` per transaction, unblock last; :func:`metrics` to alert on.

The handler is ``await handle(conn, fields)``: it makes the change on ``conn``, inside the
consumer's transaction, and raises to fail. Scale out with more streams (partitions, each with
its owner), never with two consumers racing on one key's messages.

The consumer is in :mod:`course.messaging.consumer`, the owner's lease in
:mod:`course.messaging.ownership`, replay and metrics in :mod:`course.messaging.replay`;
everything is importable from here.
"""

from course.backoff import FullJitter  # noqa: F401 - what a policy is made of, at hand for the notebook
from course.messaging.consumer import (  # noqa: F401 - the package's names
    CLAIM_IDLE_MS,
    DEFAULT_POLICY,
    DLQ_FIELDS,
    FIELDS,
    MAX_DELIVERIES,
    MAX_IN_FLIGHT,
    ORDER_BY_ENTRY,
    RETRYABLE_DB_ERRORS,
    SCHEMA,
    BusinessRuleViolation,
    ConsumerKilled,
    DeliveryLimitExceeded,
    Handler,
    MalformedMessage,
    PermanentError,
    TransientError,
    UnsupportedSchema,
    Wiring,
    apply_once,
    by_key,
    by_partition,
    claim_stale,
    classify,
    dead_letter,
    delivery_counts,
    dependency_down,
    dlq_entry,
    ensure_group,
    entry_order,
    is_transient,
    make_message,
    one_lane,
    ordered_consumer,
    outage_breaker,
    process_entry,
    read_new,
    read_own_pending,
    setup_schema,
    take_pending,
)
from course.messaging.ownership import (  # noqa: F401
    LEASE_MS,
    LeaseLost,
    check_fence,
    lease_key,
    renew_lease,
    take_ownership,
)
from course.messaging.replay import (  # noqa: F401 - the package's names
    metrics,
    replay_blocked,
    replay_key,
)
from course.retry import RetryPolicy, RetryState, retry_call  # noqa: F401
