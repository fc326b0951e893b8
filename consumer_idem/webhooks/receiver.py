"""The endpoint: verify, then run each event's effect once, then answer the way the sender
expects.

Each verified event (each item of an Adyen batch) runs in its own idempotency transaction,
keyed by the sender's event identity in scope ``webhook:<provider>``: the handler's writes
commit with the record, a duplicate is answered 2xx without running, and a batch is answered
as accepted only after every item's effect is committed. Errors are problem+json, as the HTTP
middleware's: 400 a malformed request (naming what is wrong), 401 a signature that does not
verify, 422 an event id reused with another payload, 500 a handler that failed (logged with
its traceback; the sender retries), 503 the store unreachable.
"""

from __future__ import annotations

import inspect
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol, runtime_checkable

import asyncpg
from starlette.requests import Request  # a real annotation: FastAPI injects by it
from starlette.responses import JSONResponse, PlainTextResponse, Response

from consumer_idem.errors import (
    Ambiguous,
    DomainError,
    InvalidKey,
    NotUnknown,
    StoreUnavailable,
    WebhookVerificationError,
)
from consumer_idem.execution import run_transactional
from consumer_idem.fingerprint import fingerprint_bytes, fingerprint_payload
from consumer_idem.keys import normalize_key
from consumer_idem.stores.postgres.store import PostgresStore
from consumer_idem.types import Outcome, OutcomeKind, Resolution
from consumer_idem.webhooks._verify import json_object
from consumer_idem.webhooks.horizons import RETRY_HORIZONS, checked_retention

log = logging.getLogger("consumer_idem.webhooks")

EventHandler = Callable[[dict[str, Any], asyncpg.Connection], Awaitable[Any]]
#: ``with_delivery=True``: the handler gets the whole :class:`Delivery` (its event id too)
DeliveryHandler = Callable[["Delivery", asyncpg.Connection], Awaitable[Any]]
Verifier = Callable[[bytes, Mapping[str, str]], str]  # returns the event id
#: the same problem types as the HTTP middleware's
PROBLEM_TYPE = "urn:consumer-idem:problem:"
_PROBLEMS = {
    400: ("webhook-malformed", "Malformed webhook"),
    401: ("webhook-signature", "Webhook signature does not verify"),
    422: ("webhook-id-reused", "Webhook event id reused with another payload"),
    500: ("webhook-not-processed", "Webhook not processed, retry"),
    503: ("store-unavailable", "Store unavailable, retry"),
}


@dataclass(frozen=True, slots=True)
class Delivery:
    """One event to run once: its identity, what the handler gets, and its fingerprint."""

    event_id: str
    event: dict[str, Any]
    fingerprint: str
    #: a signature that covers less than the body (PayPal signs its CRC32, forgeable): the
    #: signed transmission's id, bound to this body before the effect runs
    seal: str | None = None


@runtime_checkable
class DeliveryVerifier(Protocol):
    """A verifier that yields the deliveries of a request itself (a batch, or events that
    need I/O to verify: PayPal's certificate, Toss's fetch-to-verify)."""

    sender: str

    async def deliveries(self, body: bytes, headers: Mapping[str, str]) -> list[Delivery]: ...


def problem(status: int, detail: str) -> Response:
    kind, title = _PROBLEMS[status]
    body = {"type": PROBLEM_TYPE + kind, "title": title, "status": status, "detail": detail}
    return Response(json.dumps(body), status, media_type="application/problem+json")


class WebhookReceiver:
    """An endpoint: mount ``receiver.handle`` (a ``Request -> Response`` coroutine), in FastAPI
    ``app.add_api_route("/webhooks/stripe", receiver.handle, methods=["POST"])`` and in Starlette
    ``Route("/webhooks/stripe", receiver.handle, methods=["POST"])``. Not the receiver itself:
    FastAPI would read its ``request`` as a query parameter, Starlette would take it for an
    ASGI app.

    ``handler(event, conn)`` runs once per (provider, event id), inside the transaction that
    records the event as processed. ``retention``: how long records are kept; for a sender of
    `RETRY_HORIZONS` (named by the verifier, or ``provider``)
    one shorter than its retry horizon plus a margin is refused here, and the default is the
    longer of 30 days and that floor. ``with_delivery=True``: ``handler(delivery, conn)`` gets
    the [`Delivery`][consumer_idem.webhooks.receiver.Delivery] (``event_id`` and ``event``), for a
    handler that records the id a
    header carries.
    """

    def __init__(
        self,
        store: PostgresStore | Callable[[], PostgresStore],
        provider: str,
        verify: Verifier | DeliveryVerifier,
        handler: EventHandler | DeliveryHandler,
        *,
        retention: timedelta | None = None,
        with_delivery: bool = False,
    ) -> None:
        self._store = store
        self.provider = provider
        self.scope = f"webhook:{provider}"
        self.verify = verify
        self.handler = handler
        self.with_delivery = with_delivery
        named = getattr(verify, "sender", None)
        self.sender: str | None = named or (provider if provider in RETRY_HORIZONS else None)
        self.retention = checked_retention(self.sender, retention)

    @property
    def store(self) -> PostgresStore:
        """The store, or a factory of it (an app that creates its pool at start-up)."""
        return self._store if isinstance(self._store, PostgresStore) else self._store()

    async def __call__(self, request: Request) -> Response:
        body = await request.body()
        try:
            deliveries = await self.deliveries(body, request.headers)
        except WebhookVerificationError as exc:
            return problem(exc.status, exc.reason)
        outcomes: list[Outcome] = []
        # an event refused or failing answers the request, but only once the batch's others
        # ran: a failure that lasts (a 422 always does) must not hold them back until the
        # sender gives up; the sender resends the batch and what ran replays
        refused: Response | None = None
        for delivery in deliveries:
            try:
                if not await self._sealed(delivery, body):
                    return problem(401, "this signed transmission was seen with another body")
                outcome = await self._run(delivery)
            except StoreUnavailable:
                return problem(503, "the idempotency store cannot be reached: retry later")
            except InvalidKey:
                return problem(400, "the event id is empty")
            if outcome.kind is OutcomeKind.MISUSE:
                detail = f"event {delivery.event_id!r} was seen with another payload"
                refused = refused or problem(422, detail)
            elif outcome.kind not in _RECORDED:  # failed or in progress: the sender retries
                refused = refused or problem(500, f"event {delivery.event_id!r} was not processed")
            outcomes.append(outcome)
        return refused or self.accepted(outcomes)

    handle = __call__  #: the endpoint as a method, for Starlette's ``Route``

    async def deliveries(self, body: bytes, headers: Mapping[str, str]) -> list[Delivery]:
        """The verified events of one request (raises
        [`WebhookVerificationError`][consumer_idem.WebhookVerificationError])."""
        verify = self.verify
        if isinstance(verify, DeliveryVerifier):
            return await verify.deliveries(body, headers)
        checked = getattr(verify, "event", None)
        if checked is not None:  # an HmacVerifier: the id and the event in one pass
            event_id, event = checked(body, headers)
        else:
            found: Any = verify(body, headers)
            event_id = await found if inspect.isawaitable(found) else found
            event = json_object(body)
        return [Delivery(event_id, event, fingerprint_payload(body))]

    async def _sealed(self, delivery: Delivery, body: bytes) -> bool:
        """Bind a sealed delivery's transmission to its body: a second body under one signed
        transmission (a forged body with the signed CRC32, replayed within the tolerance) is
        refused, a resend of the same body passes."""
        if delivery.seal is None:
            return True

        async def bind(conn: asyncpg.Connection) -> None:
            return None

        key = normalize_key(delivery.seal, hash_invalid=True)
        outcome = await run_transactional(
            self.store, f"{self.scope}:transmission", key, fingerprint_bytes(body), bind,
            retention=self.retention,
        )  # fmt: skip
        return outcome.kind is not OutcomeKind.MISUSE

    async def _run(self, delivery: Delivery) -> Outcome:
        # an id past the key length limit (or with control characters) is kept as its hash
        key = normalize_key(delivery.event_id, hash_invalid=True)

        async def handle(conn: asyncpg.Connection) -> Any:
            try:
                given: Any = delivery if self.with_delivery else delivery.event
                return await self.handler(given, conn)
            except (DomainError, Ambiguous):
                raise  # classified outcomes, not bugs
            except Exception:
                log.exception(
                    "webhook handler failed; the sender will retry",
                    extra={"scope": self.scope, "key": key},
                )
                raise

        return await run_transactional(
            self.store, self.scope, key, delivery.fingerprint, handle, retention=self.retention
        )

    def accepted(self, outcomes: list[Outcome]) -> Response:
        """The answer the sender expects once every event is recorded."""
        if self.sender == "adyen":  # Adyen reads this exact body as the acknowledgement
            return PlainTextResponse("[accepted]")
        if any(o.kind is OutcomeKind.UNKNOWN for o in outcomes):
            return JSONResponse({"received": True, "outcome": "unknown"}, status_code=202)
        duplicate = bool(outcomes) and all(o.kind is OutcomeKind.REPLAYED for o in outcomes)
        return JSONResponse({"received": True, "duplicate": duplicate})


_RECORDED = (OutcomeKind.EXECUTED, OutcomeKind.REPLAYED, OutcomeKind.UNKNOWN)


async def resolve_unknown(
    store: PostgresStore,
    scope: str,
    key: str,
    resolution: Resolution,
    *,
    conn: asyncpg.Connection | None = None,
) -> bool:
    """Let an authoritative event (a payment gateway's webhook) settle an ``unknown`` record.
    Returns False if the record is not unknown (already settled: nothing to do)."""
    try:
        await store.resolve(scope, key, resolution, conn=conn)
    except NotUnknown:
        return False
    return True
