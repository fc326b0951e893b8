"""consumer-idem: idempotent message consumers and HTTP endpoints on PostgreSQL.

The public API is re-exported here; submodules are one concept each. Integrations that need an
optional client live in their own modules and are imported from there: the runners in
``consumer_idem.transports.kafka`` / ``.rabbit``, ``consumer_idem.http``,
``consumer_idem.webhooks``, ``consumer_idem.faststream``, ``consumer_idem.sqlalchemy``.
"""

from consumer_idem.commit import savepoint
from consumer_idem.consumer import (
    Action,
    IdempotentConsumer,
    Verdict,
    idempotent_consumer,
)
from consumer_idem.downstream import downstream_key_for
from consumer_idem.errors import (
    Ambiguous,
    CommitRolledBack,
    ConfigurationError,
    ConsumerIdemError,
    DomainError,
    IdempotencyConfigError,
    InvalidKey,
    InvalidPayload,
    KeyHeaderError,
    KeyHeld,
    KeyInFlight,
    LeaseLost,
    NoOutbox,
    NotInTransaction,
    NotUnknown,
    OutboxMessagesLost,
    PoisonMessage,
    PublishRefused,
    Retryable,
    SchemaMissing,
    SessionRolledBack,
    StoredResultMismatch,
    StoreRejected,
    StoreUnavailable,
    StreamCutShort,
    UnstorableResult,
    WebhookSecretError,
    WebhookVerificationError,
)
from consumer_idem.execution import Attempt, run_transactional, run_two_phase
from consumer_idem.extras import MissingExtra
from consumer_idem.fingerprint import (
    canonical_json,
    fingerprint_bytes,
    fingerprint_json,
    fingerprint_payload,
)
from consumer_idem.key_strategies import (
    amqp_message_id,
    cloudevents,
    first_of,
    from_callable,
    header,
    kafka_coordinates,
    payload_field,
)
from consumer_idem.message import ConsumerMessage
from consumer_idem.metrics import Metrics
from consumer_idem.options import ConsumerOptions
from consumer_idem.outbox import OutboxRelay, OutboxService, UnitOutbox, outbox_for
from consumer_idem.result_types import UnsupportedResultType
from consumer_idem.stores.base import MAX_RETENTION, Store
from consumer_idem.stores.cache import CompletedCache
from consumer_idem.stores.postgres.maintenance import (
    KeyInfo,
    KeyPage,
    PrunePolicy,
    PruneReport,
    ScopeCounts,
    StoreStats,
    SweepReport,
)
from consumer_idem.stores.postgres.pooler import Pooler, create_pool, detect_pooler
from consumer_idem.stores.postgres.store import PostgresStore
from consumer_idem.stores.redis import RedisStore
from consumer_idem.transports.settle import RunnerStats
from consumer_idem.types import (
    Decision,
    DecisionKind,
    Eviction,
    Executed,
    NotExecuted,
    Outcome,
    OutcomeKind,
    Record,
    Resolution,
    ResultKind,
    Status,
    StoredResponse,
)

__all__ = [
    "MAX_RETENTION",
    "Action",
    "Ambiguous",
    "Attempt",
    "CommitRolledBack",
    "CompletedCache",
    "ConfigurationError",
    "ConsumerIdemError",
    "ConsumerMessage",
    "ConsumerOptions",
    "Decision",
    "DecisionKind",
    "DomainError",
    "Eviction",
    "Executed",
    "IdempotencyConfigError",
    "IdempotentConsumer",
    "InvalidKey",
    "InvalidPayload",
    "KeyHeaderError",
    "KeyHeld",
    "KeyInFlight",
    "KeyInfo",
    "KeyPage",
    "LeaseLost",
    "Metrics",
    "MissingExtra",
    "NoOutbox",
    "NotExecuted",
    "NotInTransaction",
    "NotUnknown",
    "OutboxMessagesLost",
    "OutboxRelay",
    "OutboxService",
    "Outcome",
    "OutcomeKind",
    "PoisonMessage",
    "Pooler",
    "PostgresStore",
    "PrunePolicy",
    "PruneReport",
    "PublishRefused",
    "Record",
    "RedisStore",
    "Resolution",
    "ResultKind",
    "Retryable",
    "RunnerStats",
    "SchemaMissing",
    "ScopeCounts",
    "SessionRolledBack",
    "Status",
    "Store",
    "StoreRejected",
    "StoreStats",
    "StoreUnavailable",
    "StoredResponse",
    "StoredResultMismatch",
    "StreamCutShort",
    "SweepReport",
    "UnitOutbox",
    "UnstorableResult",
    "UnsupportedResultType",
    "Verdict",
    "WebhookSecretError",
    "WebhookVerificationError",
    "amqp_message_id",
    "canonical_json",
    "cloudevents",
    "create_pool",
    "detect_pooler",
    "downstream_key_for",
    "fingerprint_bytes",
    "fingerprint_json",
    "fingerprint_payload",
    "first_of",
    "from_callable",
    "header",
    "idempotent_consumer",
    "kafka_coordinates",
    "outbox_for",
    "payload_field",
    "run_transactional",
    "run_two_phase",
    "savepoint",
]
__version__ = "0.1.0"
