"""The FastStream middleware on NATS batch pull subscribers (``PullSub(n, batch=True)``), on
a real NATS server with JetStream: one transaction per batch, each member acked or naked on
its own."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import nats
import pytest
from faststream import AckPolicy
from faststream.nats import JStream, NatsBroker, NatsRouter, PullSub

from consumer_idem import PostgresStore
from consumer_idem.faststream import CurrentIdempotencyBatch, Idempotency, IdempotentConnection
from tests._payments import wait_until
from tests.conftest import unique


@pytest.fixture
async def subject(nats_url: str) -> AsyncIterator[str]:
    """A subject of its own, in a stream of its own (with its ``.dlq``), deleted after."""
    name = unique("fsnb")
    yield name
    client = await nats.connect(nats_url)
    try:
        await client.jsm().delete_stream(name)
    except Exception:  # never created
        pass
    finally:
        await client.close()


async def effects_by_key(pool: asyncpg.Pool, scope: str) -> Counter[str]:
    rows = await pool.fetch("SELECT key FROM fs_effects WHERE scope = $1", scope)
    return Counter(r["key"] for r in rows)


async def pending(nats_url: str, subject: str) -> tuple[int, int]:
    client = await nats.connect(nats_url)
    try:
        info = await client.jsm().consumer_info(subject, "worker")
        return info.num_pending, info.num_ack_pending
    finally:
        await client.close()


def batch_app(
    nats_url: str, store: Any, scope: str, subject: str, **options: Any
) -> tuple[NatsBroker, Idempotency, list[list[str]]]:
    """A batch pull subscriber writing one effect per member; a member marked ``poison``
    always fails, one marked ``fail_once`` fails its first run."""
    broker = NatsBroker(nats_url)
    idem = Idempotency(store, broker=broker, scope=scope, **options)
    router = NatsRouter(middlewares=[idem])
    calls: list[list[str]] = []
    failed: set[str] = set()

    @router.subscriber(
        subject,
        stream=JStream(subject, subjects=[subject, f"{subject}.dlq"]),
        durable="worker",
        pull_sub=PullSub(10, timeout=0.3, batch=True),
        ack_policy=AckPolicy.MANUAL,
    )
    async def handle(
        bodies: list[dict[str, Any]],
        conn: IdempotentConnection,
        current: CurrentIdempotencyBatch,
    ) -> None:
        calls.append(list(current.keys))
        for key, body in zip(current.keys, bodies, strict=True):
            if body.get("poison"):
                raise ConnectionError("the far side refuses it")
            if body.get("fail_once") and key not in failed:
                failed.add(key)
                raise ConnectionError("first attempt fails")
        await conn.executemany(
            "INSERT INTO fs_effects (scope, key, n) VALUES ($1, $2, $3)",
            [(scope, key, body["n"]) for key, body in zip(current.keys, bodies, strict=True)],
        )

    broker.include_router(router)
    return broker, idem, calls


async def publish(
    broker: NatsBroker, subject: str, items: list[tuple[str, dict[str, Any]]]
) -> None:
    for i, (key, body) in enumerate(items):
        await broker.publish(
            body, subject, headers={"idempotency-key": key, "Nats-Msg-Id": f"{key}-{i}"}
        )


async def test_nats_batch_duplicates_a_retry_and_poison_each_settled_on_its_own(
    nats_url: str,
    store: PostgresStore,
    scope: str,
    pg_pool: asyncpg.Pool,
    effects: None,
    subject: str,
) -> None:
    broker, idem, calls = batch_app(
        nats_url, store, scope, subject, backoff=(0.05, 0.1), max_attempts=50, max_deliveries=3
    )
    items = [(f"k{i}", {"n": i, "fail_once": i == 7}) for i in range(20)]
    items.insert(5, ("poison", {"n": -1, "poison": True}))
    items += items[:5]  # duplicates, in later batches
    await broker.start()
    try:
        await publish(broker, subject, items)

        async def all_acked() -> bool:
            return idem.stats.dead_lettered == 1 and await pending(nats_url, subject) == (0, 0)

        await wait_until(all_acked, 30, "every member settled")
    finally:
        await broker.stop()
    assert await effects_by_key(pg_pool, scope) == Counter({f"k{i}": 1 for i in range(20)})
    assert sum(keys.count("poison") for keys in calls) >= 3  # run per delivery until the 3rd
    assert max(len(keys) for keys in calls) > 1  # members did run together
    client = await nats.connect(nats_url)
    try:
        dead = await client.jsm().get_last_msg(subject, f"{subject}.dlq")
    finally:
        await client.close()
    assert json.loads(dead.data) == {"n": -1, "poison": True}
    assert dead.headers is not None
    assert dead.headers["x-dead-letter-reason"] == "max_deliveries_exceeded"
    assert "the far side refuses it" in dead.headers["x-dead-letter-error"]
    assert dead.headers["x-dead-letter-key"] == "poison"


async def test_nats_batch_postgres_outage_holds_the_batch_unacked_then_resumes(
    nats_url: str,
    pg_dsn: str,
    store: PostgresStore,
    scope: str,
    pg_pool: asyncpg.Pool,
    effects: None,
    subject: str,
) -> None:
    from tests._broker import Outage

    outage = await Outage.start(store, pg_dsn)
    broker, idem, _ = batch_app(
        nats_url, outage.down, scope, subject, backoff=(0.05, 0.2), max_deliveries=2
    )
    await broker.start()
    try:
        await publish(broker, subject, [(f"k{i}", {"n": i}) for i in range(12)])
        await asyncio.sleep(2.5)  # more deliveries than max_deliveries=2 meanwhile
        assert idem.stats.dead_lettered == 0 and idem.stats.processed == 0
        assert sum(await pending(nats_url, subject)) == 12  # none acked
        outage.end()

        async def all_acked() -> bool:
            return await pending(nats_url, subject) == (0, 0)

        await wait_until(all_acked, 20, "every member to run once the store is back")
    finally:
        await broker.stop()
    assert idem.stats.dead_lettered == 0
    assert await effects_by_key(pg_pool, scope) == Counter({f"k{i}": 1 for i in range(12)})


async def test_nats_batch_members_gathered_before_a_fetch_timeout_run_at_once(
    nats_url: str,
    store: PostgresStore,
    scope: str,
    pg_pool: asyncpg.Pool,
    effects: None,
    subject: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """nats-py's fetch of several messages raises the plain ``asyncio.TimeoutError`` (not its
    own) when the server's request-timeout status beats the client's timer: a race, lost now
    and then under load. Here it is always lost. The members gathered by the fetches before it
    must run at once, not wait in limbo for JetStream's ``ack_wait`` (30 s)."""
    from nats.errors import TimeoutError as NatsTimeout
    from nats.js.client import JetStreamContext

    original = JetStreamContext.PullSubscription._fetch_n

    async def race_lost(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return await original(self, *args, **kwargs)
        except NatsTimeout:
            raise TimeoutError from None  # what nats-py raises when the status wins

    monkeypatch.setattr(JetStreamContext.PullSubscription, "_fetch_n", race_lost)
    client = await nats.connect(nats_url)
    try:  # stored before the subscriber starts: its first fetch gathers all three at once
        js = client.jetstream()
        await js.add_stream(name=subject, subjects=[subject, f"{subject}.dlq"])
        for i in range(3):
            await js.publish(
                subject, json.dumps({"n": i}).encode(), headers={"idempotency-key": f"k{i}"}
            )
    finally:
        await client.close()
    broker, _, calls = batch_app(nats_url, store, scope, subject)
    await broker.start()
    try:

        async def all_acked() -> bool:
            return await pending(nats_url, subject) == (0, 0)

        await wait_until(all_acked, 10, "the gathered members to run (ack_wait is 30 s)")
    finally:
        await broker.stop()
    assert await effects_by_key(pg_pool, scope) == Counter({f"k{i}": 1 for i in range(3)})
    assert calls == [["k0", "k1", "k2"]]
