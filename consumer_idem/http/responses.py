"""What the middleware answers itself: problem+json documents, replays, and the ``send`` that
knows whether a response has begun."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable

from consumer_idem import tracing
from consumer_idem.http.asgi import Message, Send
from consumer_idem.types import StoredResponse

PROBLEM_TYPE = "urn:consumer-idem:problem:"

#: a whole response: status, headers, body
Response = tuple[int, list[tuple[bytes, bytes]], bytes]


def problem(
    status: int,
    kind: str,
    title: str,
    detail: str = "",
    headers: Iterable[tuple[bytes, bytes]] = (),
) -> Response:
    body = json.dumps(
        {"type": PROBLEM_TYPE + kind, "title": title, "status": status, "detail": detail}
    ).encode()
    return status, [(b"content-type", b"application/problem+json"), *headers], body


def in_progress(retry_after: float) -> Response:
    wait = str(max(1, math.ceil(retry_after))).encode()
    return problem(
        409,
        "request-in-progress",
        "Request in progress",
        "a request with this key is being processed",
        [(b"retry-after", wait)],
    )


def key_missing(method: str, route: str) -> Response:
    return problem(
        400,
        "idempotency-key-missing",
        "Idempotency-Key header required",
        f"{method} {route} needs one",
    )


def key_invalid(why: str) -> Response:
    return problem(400, "idempotency-key-invalid", "Invalid Idempotency-Key", why)


def body_too_large(limit: int) -> Response:
    return problem(
        413,
        "body-too-large",
        "Request body too large",
        f"the body may be at most {limit} bytes long",
    )


CALLER_UNKNOWN = problem(
    400, "caller-unknown", "Caller unknown", "the request does not say whose it is"
)
CALLER_MISSING = problem(
    401,
    "caller-missing",
    "Caller missing",
    "the request names no caller, and this route takes no anonymous requests",
)
KEY_REUSED = problem(
    422,
    "idempotency-key-reused",
    "Idempotency-Key reused with another request",
    "this key was used with a different method, path, query or body",
)
OUTCOME_BEING_RECONCILED = problem(
    409,
    "outcome-unknown",
    "Outcome being reconciled",
    "the first request's outcome is not known yet",
    [(b"retry-after", b"30")],
)
RETRYABLE = problem(
    503,
    "retryable",
    "Temporarily unavailable",
    "the request was not processed; retry later",
    [(b"retry-after", b"1")],
)
STORE_UNAVAILABLE = problem(
    503,
    "store-unavailable",
    "Idempotency store unavailable",
    "the request was not processed; retry later",
    [(b"retry-after", b"5")],
)
NOT_RECORDED = problem(
    503,
    "outcome-unknown",
    "Outcome being reconciled",
    "the request was processed but its outcome could not be recorded; retrying is safe",
    [(b"retry-after", b"30")],
)
OUTCOME_UNCONFIRMED = problem(
    503,
    "outcome-unknown",
    "Outcome not confirmed",
    "the request ran, but the store failed before its outcome was recorded; retry with the"
    " same key: it is never applied twice",
    [(b"retry-after", b"5")],
)
NOT_COMMITTED = problem(
    500,
    "request-not-committed",
    "The request's changes were not committed",
    "nothing of this request was saved; retrying runs it again",
)


def replayed(stored: StoredResponse | None, result_json: str | None) -> Response:
    """A stored response as a replay says it (``Idempotent-Replayed: true``); a record resolved
    without a response gives its stored result."""
    if stored is None:
        stored = StoredResponse(
            200, {"content-type": "application/json"}, (result_json or "null").encode()
        )
    headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in stored.headers.items()]
    return stored.status, [*headers, (b"idempotent-replayed", b"true")], stored.body


class Started:
    """``send``, remembering whether a response has begun (then no problem can be sent)."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self.started = False

    async def raw(self, message: Message) -> None:
        self.started = True
        if message["type"] == "http.response.start":
            tracing.http_status(message["status"])
        await self._send(message)

    async def response(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        headers = [(k, v) for k, v in headers if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        await self.raw({"type": "http.response.start", "status": status, "headers": headers})
        await self.raw({"type": "http.response.body", "body": body, "more_body": False})


async def send_response(send: Send | Started, response: Response) -> None:
    target = send if isinstance(send, Started) else Started(send)
    await target.response(*response)


def with_header(send: Send, name: bytes, value: bytes) -> Send:
    """``send``, adding a header to the response's start."""

    async def wrapped(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), (name, value)]}
        await send(message)

    return wrapped
