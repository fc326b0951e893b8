"""The endpoint's response, captured rather than sent, so that it is stored before a byte of
it goes out. A stream (more than one body chunk) is passed through as it comes, except its
last message: the client gets a complete response only once its outcome is committed (or,
for a 5xx, rolled back or parked); when that fails, the response is cut short."""

from __future__ import annotations

from collections.abc import Set
from dataclasses import dataclass, field

from consumer_idem.http.asgi import Message, Scope
from consumer_idem.http.context import IdempotencyContext
from consumer_idem.http.responses import Started
from consumer_idem.types import StoredResponse

#: ASGI response extensions whose messages carry no body to capture
_BY_REFERENCE = frozenset(
    ("http.response.pathsend", "http.response.zerocopysend", "http.response.trailers")
)


class EndpointFailed(Exception):
    """The endpoint answered with a 5xx: not a result, nothing of it is stored."""

    def __init__(self, status: int) -> None:
        super().__init__(f"http {status}")
        self.status = status


class StreamIncomplete(Exception):
    """The endpoint returned without the last message of its stream (cancelled when the client
    went away, say): the stream did not end well, so it is no result."""


def endpoint_scope(scope: Scope, context: IdempotencyContext) -> Scope:
    """The scope the endpoint runs with: ``state.idempotency`` set, and no response extension
    that would send a body past the capture."""
    inner = dict(scope)
    inner["state"] = {**(scope.get("state") or {}), "idempotency": context}
    extensions = scope.get("extensions")
    if extensions:
        # responses sent by reference (a file path) or with trailers would bypass the
        # capture: the app falls back to plain body messages, which are stored
        inner["extensions"] = {
            name: value for name, value in extensions.items() if name not in _BY_REFERENCE
        }
    return inner


@dataclass
class Captured:
    """The endpoint's ``send``: what it answered, kept; a stream's first chunks passed on."""

    send: Started
    status: int = 500
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytearray = field(default_factory=bytearray)
    #: more than one body chunk: passed through as it comes, except its last message
    streaming: bool = False
    #: a stream's last body message, held back until its outcome is committed
    final: Message | None = None

    @property
    def incomplete(self) -> bool:
        """A stream the endpoint stopped before its last message."""
        return self.streaming and self.final is None

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            self.headers = list(message.get("headers", []))
        elif message["type"] == "http.response.body":
            chunk = message.get("body", b"")
            more = message.get("more_body", False)
            if self.streaming:
                if more:
                    await self.send.raw(message)
                else:
                    self.final = message
            elif more:
                await self._start_stream(chunk)
            else:
                self.body += chunk

    async def _start_stream(self, chunk: bytes) -> None:
        """A second chunk is coming: pass on the start and what came so far."""
        self.streaming = True
        headers = self.headers
        if self.status < 500:  # a 5xx is never stored
            headers = [*headers, (b"idempotency-stored", b"headers-only")]
        await self.send.raw(
            {"type": "http.response.start", "status": self.status, "headers": headers}
        )
        await self.send.raw(
            {"type": "http.response.body", "body": bytes(self.body) + chunk, "more_body": True}
        )

    def stored(self, stored_headers: Set[bytes]) -> StoredResponse:
        """The response as the record keeps it: status, the chosen headers, the body (a
        stream's status and headers only)."""
        headers = {
            k.decode("latin-1"): v.decode("latin-1")
            for k, v in self.headers
            if k.lower() in stored_headers
        }
        if self.streaming:
            headers["idempotency-stored"] = "headers-only"
        return StoredResponse(self.status, headers, b"" if self.streaming else bytes(self.body))

    async def respond(self) -> None:
        """Send the endpoint's answer, its outcome settled: the whole response, or the last
        message of a stream whose body went out as it came."""
        if self.final is not None:
            await self.send.raw(self.final)
        else:
            await self.send.response(self.status, self.headers, bytes(self.body))
