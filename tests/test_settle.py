"""The one settle path, without brokers: a recording transport with injected publish faults.

Invariants checked at each step boundary: nothing is acked before its dead letter or notice was
confirmed; a retry is never acked; a publish that did not complete leaves the delivery unacked;
a permanent refusal takes the documented fallback (a copy without the body, counted) and, if
that is refused too, the delivery is held (never acked) until the runner stops.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiokafka import ConsumerRecord
from aiokafka.errors import KafkaTimeoutError, MessageSizeTooLargeError, NotEnoughReplicasError

from consumer_idem import Action, Metrics, Verdict
from consumer_idem.backoff import Backoff
from consumer_idem.message import ConsumerMessage
from consumer_idem.notice import Notice
from consumer_idem.transports.kafka import PERMANENT_ERRORS
from consumer_idem.transports.kafka import dead_letter_headers as kafka_headers
from consumer_idem.transports.rabbit import SPENT_DELIVERIES, permanent, spent_deliveries
from consumer_idem.transports.settle import (
    DEAD_LETTER_BODY_DROPPED,
    MAX_ERROR_HEADER,
    PublishRefused,
    RunnerStats,
    Settled,
    error_header,
    process_holding,
    publish_notice,
    redispatch,
    settle,
)

# --- backoff ------------------------------------------------------------------------------------


def test_backoff_doubles_up_to_its_cap_with_full_jitter() -> None:
    exact = Backoff(0.5, 4.0, jitter=False)
    assert [exact.delay(n) for n in range(1, 7)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert exact.delay(10_000) == 4.0  # no overflow
    jittered = Backoff(0.5, 4.0, rng=random.Random(7))
    draws = [jittered.delay(3) for _ in range(200)]
    assert all(0.0 <= d <= 2.0 for d in draws) and len(set(draws)) > 100
    with pytest.raises(ValueError):
        Backoff(2.0, 1.0)


# --- a transport that records what happened, in order -------------------------------------------


class Store:
    """The store's metrics and its reconciliation part (``store.reconciliation``) in one."""

    def __init__(self) -> None:
        self.metrics = Metrics()
        self.published: list[tuple[str, str]] = []
        self.reconciliation = self

    async def mark_reconcile_published(self, scope: str, key: str) -> bool:
        self.published.append((scope, key))
        return True


@dataclass
class Fake:
    """``faults``: what each successive publish raises (None: it goes through)."""

    faults: list[BaseException | None] = field(default_factory=list)
    stop_after: int | None = None  #: stopping() turns true after this many publish attempts
    stats: RunnerStats = field(default_factory=RunnerStats)
    events: list[str] = field(default_factory=list)
    attempts: int = 0
    fake_store: Store = field(default_factory=Store)

    @property
    def store(self) -> Any:
        return self.fake_store

    def stopping(self) -> bool:
        return self.stop_after is not None and self.attempts >= self.stop_after

    def permanent(self, exc: BaseException) -> bool:
        return isinstance(exc, PERMANENT_ERRORS)

    async def ack(self, delivery: str) -> None:
        self.events.append(f"ack {delivery}")

    async def retry_later(self, delivery: str, verdict: Verdict) -> None:
        self.events.append(f"retry {delivery}")

    async def give_back(self, delivery: str) -> None:
        self.events.append(f"give_back {delivery}")

    def dead_letter_destination(self, delivery: str) -> str:
        return "dlq"

    def body_size(self, delivery: str) -> int:
        return 1234

    async def _publish(self, what: str) -> None:
        self.attempts += 1
        fault = self.faults.pop(0) if self.faults else None
        if fault is not None:
            self.events.append(f"refused {what}")
            raise fault
        self.events.append(f"published {what}")

    async def send_dead_letter(self, delivery: str, verdict: Verdict, body_dropped: bool) -> None:
        await self._publish(f"dead letter{' without body' if body_dropped else ''} {verdict.error}")

    def notice_body(self, delivery: str, verdict: Verdict, with_original: bool) -> bytes:
        return b"notice+original" if with_original else b"notice"

    async def send_notice(self, scope: str, key: str, body: bytes) -> None:
        await self._publish(f"notice {body.decode()}")

    async def send_redispatch(self, notice: Notice) -> None:
        await self._publish("redispatch")


@pytest.fixture(autouse=True)
def fast(monkeypatch: pytest.MonkeyPatch) -> None:
    """No real sleeping between publish attempts."""
    import consumer_idem.transports.settle as module

    monkeypatch.setattr(module, "PUBLISH_BACKOFF", Backoff(0.0, 0.0))


DEAD = Verdict(Action.DEAD_LETTER, "s", "k", reason="poison", error="boom")
NOTICE = Verdict(Action.ACK, "s", "k", reason="unknown", reconcile=True)
DONE = Verdict(Action.ACK, "s", "k")
RETRY = Verdict(Action.RETRY, "s", "k", reason="failed_retryable", retry_after=0.01)


async def test_a_dead_letter_is_acked_only_after_the_broker_confirmed_it() -> None:
    t = Fake(faults=[KafkaTimeoutError(), NotEnoughReplicasError(), None])
    assert await settle(t, "d1", DEAD) is Settled.ACKED
    assert t.events == [
        "refused dead letter boom",
        "refused dead letter boom",
        "published dead letter boom",
        "ack d1",
    ]
    assert t.stats.dead_lettered == 1 and t.stats.processed == 1


async def test_a_publish_cut_short_by_stopping_is_never_acked() -> None:
    t = Fake(faults=[KafkaTimeoutError()] * 10, stop_after=3)
    assert await settle(t, "d1", DEAD) is Settled.UNSETTLED
    assert "ack d1" not in t.events and t.events[-1] == "give_back d1"
    t = Fake(faults=[KafkaTimeoutError()] * 10, stop_after=2)
    assert await settle(t, "d2", NOTICE) is Settled.UNSETTLED
    assert "ack d2" not in t.events and t.fake_store.published == []


async def test_a_copy_refused_for_good_goes_without_its_body_counted() -> None:
    t = Fake(faults=[MessageSizeTooLargeError()])
    assert await settle(t, "d1", DEAD) is Settled.ACKED
    assert t.events[0] == "refused dead letter boom"
    assert t.events[1].startswith("published dead letter without body boom; body dropped:")
    assert "MessageSizeTooLargeError" in t.events[1] and t.events[2] == "ack d1"
    assert t.fake_store.metrics.count("dead_letter_body_dropped", "s") == 1


async def test_a_destination_that_refuses_even_the_bare_copy_holds_the_delivery() -> None:
    t = Fake(faults=[MessageSizeTooLargeError()] * 20, stop_after=7)
    assert await settle(t, "d1", DEAD) is Settled.UNSETTLED
    assert "ack d1" not in t.events and not any(e.startswith("published") for e in t.events)
    assert t.fake_store.metrics.count("dead_letter_failed", "s") >= 3
    assert t.stats.dead_lettered == 0


async def test_a_notice_refused_for_good_goes_without_the_original_message() -> None:
    t = Fake(faults=[MessageSizeTooLargeError()])
    assert await settle(t, "d1", NOTICE) is Settled.ACKED
    assert t.events == ["refused notice notice+original", "published notice notice", "ack d1"]
    assert t.fake_store.metrics.count("notice_body_dropped", "s") == 1
    assert t.fake_store.published == [("s", "k")] and t.stats.reconcile_published == 1


async def test_the_sweepers_notice_refused_for_good_is_reported_not_held() -> None:
    t = Fake(faults=[MessageSizeTooLargeError()])
    with pytest.raises(PublishRefused):
        await publish_notice(t, "s", "k", b"notice", hold=False)
    assert t.fake_store.published == []


async def test_a_retry_is_never_acked_and_a_done_verdict_is_acked_at_once() -> None:
    t = Fake()
    assert await settle(t, "d1", RETRY) is Settled.RETRY
    assert await settle(t, "d2", DONE) is Settled.ACKED
    assert t.events == ["retry d1", "ack d2"] and t.stats.retries == 1


async def test_a_redispatch_is_confirmed_or_reported() -> None:
    notice = Notice("s", "k", source="payments", body=b"{}")
    assert await redispatch(Fake(faults=[KafkaTimeoutError()]), notice) is True
    with pytest.raises(PublishRefused):
        await redispatch(Fake(faults=[MessageSizeTooLargeError()]), notice)
    assert await redispatch(Fake(), Notice("s", "k")) is False  # nothing to send


async def test_waits_are_processed_again_in_hand_until_they_settle() -> None:
    stats = RunnerStats()
    verdicts = [
        Verdict(Action.RETRY, "s", "k", reason="store_unavailable", retry_after=0.01),
        Verdict(Action.RETRY, "s", "k", reason="in_progress", retry_after=0.01),
        DONE,
    ]
    calls = 0

    async def process() -> Verdict:
        nonlocal calls
        calls += 1
        return verdicts[calls - 1]

    assert (
        await process_holding(process, stats=stats, stopping=lambda: False, max_hold=None) == DONE
    )
    assert calls == 3 and stats.retries == 2
    # a handler failure is not a wait: it goes to the transport at once
    calls = 0
    verdicts[0] = RETRY
    assert (
        await process_holding(process, stats=stats, stopping=lambda: False, max_hold=None) == RETRY
    )
    assert calls == 1


async def test_a_wait_ends_when_the_runner_stops_or_the_hold_is_over() -> None:
    wait = Verdict(Action.RETRY, "s", "k", reason="store_unavailable", retry_after=0.01)

    async def process() -> Verdict:
        return wait

    stops = iter([False, False, True])
    held = await process_holding(
        process, stats=RunnerStats(), stopping=lambda: next(stops, True), max_hold=None
    )
    assert held == wait
    assert (
        await process_holding(process, stats=RunnerStats(), stopping=lambda: False, max_hold=0.05)
        == wait
    )


# --- dead-letter headers ------------------------------------------------------------------------


def test_the_error_text_goes_into_the_dead_letter_headers_cut_to_size() -> None:
    assert error_header(DEAD) == "boom"
    assert error_header(Verdict(Action.DEAD_LETTER, "s")) is None
    long = error_header(Verdict(Action.DEAD_LETTER, "s", error="é" * 5000))
    assert long is not None and len(long) == MAX_ERROR_HEADER and long.endswith("…")
    record: ConsumerRecord[bytes, bytes] = ConsumerRecord(
        "t",
        0,
        7,
        0,
        0,
        b"k",
        b"body",
        None,
        4,
        4,
        [("x-dead-letter-error", b"old"), ("idempotency-key", b"k")],
    )
    headers = kafka_headers(record, Verdict(Action.DEAD_LETTER, "s", "k", reason="r", error="e"))
    assert ("x-dead-letter-error", b"e") in headers and ("idempotency-key", b"k") in headers
    assert [v for k, v in headers if k == "x-dead-letter-error"] == [b"e"]
    assert all(k != DEAD_LETTER_BODY_DROPPED for k, _ in headers)
    dropped = dict(kafka_headers(record, DEAD, body_dropped=True))
    assert dropped[DEAD_LETTER_BODY_DROPPED] == b"4" and dropped["x-original-offset"] == b"7"


def test_rabbit_dead_letter_headers_carry_the_error_and_the_dropped_size() -> None:
    from consumer_idem.transports.rabbit import dead_letter_headers

    class Incoming:
        headers = {"x-dead-letter-error": "old", "idempotency-key": "k"}
        body = b"12345"

    headers = dead_letter_headers(Incoming(), DEAD, "q", body_dropped=True)  # type: ignore[arg-type]
    assert headers["x-dead-letter-error"] == "boom" and headers["x-original-queue"] == "q"
    assert headers[DEAD_LETTER_BODY_DROPPED] == 5 and headers["idempotency-key"] == "k"
    assert "x-dead-letter-error" not in dead_letter_headers(
        Incoming(),
        Verdict(Action.DEAD_LETTER, "s", reason="r"),
        "q",  # type: ignore[arg-type]
    )


# --- classification -----------------------------------------------------------------------------


def test_permanent_publish_errors_are_told_from_transient_ones() -> None:
    import aiormq

    assert isinstance(MessageSizeTooLargeError(), PERMANENT_ERRORS)
    assert not isinstance(KafkaTimeoutError(), PERMANENT_ERRORS)
    assert not isinstance(NotEnoughReplicasError(), PERMANENT_ERRORS)
    too_big = aiormq.exceptions.ChannelPreconditionFailed(
        "PRECONDITION_FAILED - message size 200 is larger than configured max size 100"
    )
    assert permanent(too_big)
    assert not permanent(aiormq.exceptions.ChannelInvalidStateError("closed"))
    assert not permanent(ConnectionError())


def test_a_handed_back_copy_keeps_the_deliveries_it_spent() -> None:
    assert spent_deliveries(ConsumerMessage(b"", {})) is None
    assert spent_deliveries(ConsumerMessage(b"", {}, delivery_count=3)) == 3
    carried = ConsumerMessage(b"", {SPENT_DELIVERIES: b"4"}, delivery_count=1)
    assert spent_deliveries(carried) == 5
