"""``on_execute`` / ``on_replay``: called with the verdict of each real execution and each
replay, against the real store; a failing hook never changes a delivery's fate."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import asyncpg
import pytest

from consumer_idem import (
    Action,
    Attempt,
    ConsumerMessage,
    PostgresStore,
    Verdict,
    header,
    idempotent_consumer,
)


def message(key: str, body: bytes = b'{"n": 1}') -> ConsumerMessage:
    return ConsumerMessage(body, {"idempotency-key": key.encode()})


async def test_hooks_count_real_executions_and_replays(store: PostgresStore, scope: str) -> None:
    executed: list[Verdict] = []
    replayed: list[Verdict] = []

    async def handler(msg: ConsumerMessage, conn: asyncpg.Connection) -> int:
        return int(await conn.fetchval("SELECT 41 + 1"))

    consumer = idempotent_consumer(
        store,
        scope=scope,
        key=header("idempotency-key"),
        on_execute=executed.append,
        on_replay=replayed.append,
    )(handler)
    for key in ("a", "a", "b", "a"):
        await consumer.process(message(key))
    misuse = await consumer.process(message("b", b'{"n": 2}'))  # neither ran nor replayed
    assert misuse.action is Action.DEAD_LETTER
    assert [(v.key, v.duplicate, v.result) for v in executed] == [
        ("a", False, 42),
        ("b", False, 42),
    ]
    assert [(v.key, v.duplicate, v.result) for v in replayed] == [("a", True, 42), ("a", True, 42)]


async def test_batch_mode_calls_the_hooks_per_message(store: PostgresStore, scope: str) -> None:
    seen: list[tuple[str | None, bool]] = []

    async def handler(msgs: list[ConsumerMessage], conn: asyncpg.Connection) -> list[int]:
        return [1 for _ in msgs]

    def note(verdict: Verdict) -> None:
        seen.append((verdict.key, verdict.duplicate))

    consumer = idempotent_consumer(
        store,
        scope=scope,
        batch=True,
        key=header("idempotency-key"),
        on_execute=note,
        on_replay=note,
    )(handler)
    await consumer.process_batch([message("a"), message("b")])
    await consumer.process_batch([message("a"), message("c"), message("c")])
    await consumer.process_batch([message("a"), message("b")])  # nothing to run
    assert sorted(seen) == [
        ("a", False),
        ("a", True),
        ("a", True),
        ("b", False),
        ("b", True),
        ("c", False),
        ("c", True),
    ]


async def test_a_failing_hook_does_not_change_the_verdict(
    store: PostgresStore, scope: str, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(verdict: Verdict) -> Any:
        raise RuntimeError("metrics backend down")

    async def handler(msg: ConsumerMessage, conn: asyncpg.Connection) -> str:
        return "done"

    consumer = idempotent_consumer(
        store, scope=scope, key=header("idempotency-key"), on_execute=broken, on_replay=broken
    )(handler)
    first = await consumer.process(message("k"))
    again = await consumer.process(message("k"))
    assert first.action is Action.ACK and first.result == "done" and not first.duplicate
    assert again.action is Action.ACK and again.duplicate
    assert "a verdict hook failed" in caplog.text


async def test_a_batch_that_falls_back_calls_each_replay_hook_once(
    store: PostgresStore, scope: str
) -> None:
    replays: list[str | None] = []

    async def handler(msgs: list[ConsumerMessage], conn: asyncpg.Connection) -> list[int]:
        if any(m.headers["idempotency-key"] == b"bad" for m in msgs):
            raise RuntimeError("this member fails")
        return [1 for _ in msgs]

    consumer = idempotent_consumer(
        store,
        scope=scope,
        batch=True,
        key=header("idempotency-key"),
        on_replay=lambda verdict: replays.append(verdict.key),
    )(handler)
    await consumer.process_batch([message("a")])
    verdicts = await consumer.process_batch([message("a"), message("bad")])
    assert verdicts[0].duplicate and verdicts[1].action is Action.RETRY
    assert replays == ["a"]


async def test_two_phase_hooks_see_the_typed_result_of_each_execution_and_replay(
    store: PostgresStore, scope: str
) -> None:
    seen: list[tuple[bool, Any]] = []

    async def handler(msg: ConsumerMessage, attempt: Attempt) -> Decimal:
        return Decimal("12.50")

    consumer = idempotent_consumer(
        store,
        scope=scope,
        mode="two_phase",
        key=header("idempotency-key"),
        on_execute=lambda v: seen.append((v.duplicate, v.result)),
        on_replay=lambda v: seen.append((v.duplicate, v.result)),
    )(handler)
    await consumer.process(message("k"))
    await consumer.process(message("k"))
    assert seen == [(False, Decimal("12.50")), (True, Decimal("12.50"))]
    assert all(type(result) is Decimal for _, result in seen)
