"""FastStream's handler call on a guarded delivery, its exceptions turned into the core's."""

from __future__ import annotations

import copy
import functools
import logging
from typing import Any

from faststream import StreamMessage
from faststream.exceptions import AckMessage, NackMessage, RejectMessage
from faststream.message import AckStatus

from consumer_idem.errors import (
    PoisonMessage,
)
from consumer_idem.faststream.batch import (
    CurrentIdempotencyBatch as CurrentIdempotencyBatch,
)
from consumer_idem.faststream.batch import (
    IdempotencyBatchContext as IdempotencyBatchContext,
)
from consumer_idem.faststream.context import CONTEXT_NAME, _Call

log = logging.getLogger("consumer_idem.faststream")


#: what :func:`_call` answers for a handler that raised FastStream's AckMessage
_ACKED = object()


def guarded(message: StreamMessage[Any]) -> StreamMessage[Any]:
    """The delivery as the handler sees it (its ``message`` too): a copy whose ``ack()``,
    ``nack()`` and ``reject()`` do nothing. The middleware settles the delivery after the
    commit; a handler's own ack would commit the Kafka offset (of every partition, for
    FastStream) or ack the AMQP delivery before it, and a crash then would lose the message.
    The copy also decodes its body afresh (its decoded cache is its own)."""
    handed = copy.copy(message)
    handed.committed = AckStatus.ACKED
    return handed


async def _call(call: _Call, current: Any, message: StreamMessage[Any]) -> Any:
    """FastStream's handler call on ``message`` (injected as ``message`` as well), with
    ``current`` as the idempotency context; its own exceptions turned into the core's."""
    try:
        with call.context.scopes(((CONTEXT_NAME, current), ("message", message))):
            return await call.call_next(message)
    except AckMessage:  # "done, ack it": what was written so far commits, unpublished
        return _ACKED
    except NackMessage as exc:  # "deliver it again": roll back, retry with backoff
        raise RuntimeError("the handler asked for redelivery (NackMessage)") from exc
    except RejectMessage as exc:
        raise PoisonMessage("rejected", "the handler rejected the message") from exc
    except _validation_errors() as exc:  # the body does not fit the handler's types
        raise PoisonMessage("invalid_payload", str(exc)[:500]) from exc


@functools.cache  # once: it runs on every handler call
def _validation_errors() -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = []
    try:
        from fast_depends.exceptions import ValidationError as DependsValidationError

        errors.append(DependsValidationError)
    except ImportError:  # pragma: no cover
        pass
    try:
        from pydantic import ValidationError

        errors.append(ValidationError)
    except ImportError:  # pragma: no cover
        pass
    return tuple(errors)
