"""How a handler's return value is stored, and what FastStream publishes for a stored result."""

from __future__ import annotations

import base64
import logging
from typing import Any

from faststream import Response

from consumer_idem.errors import (
    PoisonMessage,
)
from consumer_idem.faststream.batch import (
    CurrentIdempotencyBatch as CurrentIdempotencyBatch,
)
from consumer_idem.faststream.batch import (
    IdempotencyBatchContext as IdempotencyBatchContext,
)

log = logging.getLogger("consumer_idem.faststream")


def _store_form(result: Any) -> dict[str, Any]:
    """How a handler's return value is stored: an envelope, so that bytes and plain-Response
    headers survive. The first run publishes this form too, so a replay publishes the same."""
    if isinstance(result, Response):
        if type(result) is not Response:
            raise PoisonMessage(
                "result_not_replayable",
                f"{type(result).__name__} carries broker-specific fields a replay cannot "
                "reproduce; return the body, or a plain faststream.Response(body, headers=...)",
            )
        form = _store_form(result.body)
        form["headers"] = {str(k): str(v) for k, v in result.headers.items()}
        return form
    if isinstance(result, bytes | bytearray | memoryview):
        return {"body_b64": base64.b64encode(bytes(result)).decode()}
    return {"body": _jsonable(result)}


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, str | int | float | bool):
        return value
    try:  # pydantic models, dataclasses, datetimes, UUIDs... (pydantic comes with FastStream)
        from pydantic_core import to_jsonable_python
    except ImportError:  # pragma: no cover - FastStream without pydantic
        return value
    return to_jsonable_python(value)


#: stored for a handler that raised FastStream's AckMessage: acked, nothing published
_ACK_ONLY = {"ack_only": True}
_NOTHING = object()


def _published_form(stored: Any) -> Any:
    """What FastStream publishes for a stored result (first run and replays alike)."""
    if stored == _ACK_ONLY:
        return _NOTHING
    if not isinstance(stored, dict):
        return stored  # a result stored by something else than this middleware
    if "body_b64" in stored:
        body: Any = base64.b64decode(stored["body_b64"])
    else:
        body = stored.get("body")
    if "headers" in stored:
        return Response(body, headers=dict(stored["headers"]))
    return body
