"""consumer-idem: idempotent message consumers and HTTP endpoints on PostgreSQL.

The public API is re-exported here; submodules are one concept each.
"""

from consumer_idem.backoff import Backoff
from consumer_idem.commit import savepoint
from consumer_idem.consumer import (
    Action,
    IdempotentConsumer,
    Verdict,
    idempotent_consumer,
    reconcile_notice,
)
from consumer_idem.errors import (
    Ambiguous,
    CommitRolledBack,
    ConfigurationError,
    ConsumerIdemError,
    DomainError,
    InvalidKey,
    KeyInFlight,
    LeaseLost,
    NotUnknown,
    PoisonMessage,
    Retryable,
    SchemaMissing,
    StoreRejected,
    StoreUnavailable,
    UnstorableResult,
)
from consumer_idem.execution import Attempt, run_transactional, run_two_phase
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
from consumer_idem.keys import normalize_key, validate_scope
from consumer_idem.message import ConsumerMessage, InvalidPayload
from consumer_idem.metrics import Metrics
from consumer_idem.settings import Settings, load_settings
from consumer_idem.stores.cache import CompletedCache
from consumer_idem.stores.postgres.store import (
    Executed,
    NotExecuted,
    PostgresStore,
    PrunePolicy,
    Resolution,
)
from consumer_idem.stores.redis import RedisStore
from consumer_idem.transports.settle import PublishRefused, RunnerStats
from consumer_idem.types import (
    Decision,
    DecisionKind,
    Outcome,
    OutcomeKind,
    Record,
    ResultKind,
    Status,
    StoredResponse,
)

__all__ = [
    "Action",
    "Ambiguous",
    "Attempt",
    "Backoff",
    "CommitRolledBack",
    "CompletedCache",
    "ConfigurationError",
    "ConsumerIdemError",
    "ConsumerMessage",
    "Decision",
    "DecisionKind",
    "DomainError",
    "Executed",
    "IdempotentConsumer",
    "InvalidKey",
    "InvalidPayload",
    "KeyInFlight",
    "LeaseLost",
    "Metrics",
    "NotExecuted",
    "NotUnknown",
    "Outcome",
    "OutcomeKind",
    "PoisonMessage",
    "PostgresStore",
    "PrunePolicy",
    "PublishRefused",
    "Record",
    "RedisStore",
    "Resolution",
    "ResultKind",
    "Retryable",
    "RunnerStats",
    "SchemaMissing",
    "Settings",
    "Status",
    "StoreRejected",
    "StoreUnavailable",
    "StoredResponse",
    "UnstorableResult",
    "Verdict",
    "amqp_message_id",
    "canonical_json",
    "cloudevents",
    "fingerprint_bytes",
    "fingerprint_json",
    "fingerprint_payload",
    "first_of",
    "from_callable",
    "header",
    "idempotent_consumer",
    "kafka_coordinates",
    "load_settings",
    "normalize_key",
    "payload_field",
    "reconcile_notice",
    "run_transactional",
    "run_two_phase",
    "savepoint",
    "validate_scope",
]
__version__ = "0.1.0"
