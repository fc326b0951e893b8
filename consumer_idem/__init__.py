"""consumer-idem: idempotent message consumers and HTTP endpoints on PostgreSQL.

The public API is re-exported here; submodules are one concept each.
"""

from consumer_idem.errors import (
    Ambiguous,
    ConsumerIdemError,
    DomainError,
    InvalidKey,
    LeaseLost,
    NotUnknown,
    Retryable,
    StoreUnavailable,
)
from consumer_idem.execution import Attempt, run_transactional, run_two_phase
from consumer_idem.fingerprint import (
    canonical_json,
    fingerprint_bytes,
    fingerprint_json,
    fingerprint_payload,
)
from consumer_idem.keys import normalize_key, validate_scope
from consumer_idem.metrics import Metrics
from consumer_idem.settings import Settings, load_settings
from consumer_idem.store import Executed, NotExecuted, PostgresStore, PrunePolicy, Resolution
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
    "Ambiguous",
    "Attempt",
    "ConsumerIdemError",
    "Decision",
    "DecisionKind",
    "DomainError",
    "Executed",
    "InvalidKey",
    "LeaseLost",
    "Metrics",
    "NotExecuted",
    "NotUnknown",
    "Outcome",
    "OutcomeKind",
    "PostgresStore",
    "PrunePolicy",
    "Record",
    "Resolution",
    "ResultKind",
    "Retryable",
    "Settings",
    "Status",
    "StoreUnavailable",
    "StoredResponse",
    "canonical_json",
    "fingerprint_bytes",
    "fingerprint_json",
    "fingerprint_payload",
    "load_settings",
    "normalize_key",
    "run_transactional",
    "run_two_phase",
    "validate_scope",
]
__version__ = "0.1.0"
