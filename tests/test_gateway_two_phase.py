"""The reference two-phase handler charging a real (loopback) HTTP gateway through Kafka."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import asyncpg
import httpx
from aiokafka import AIOKafkaProducer

from consumer_idem import PostgresStore, ResultKind, Status, header, idempotent_consumer
from consumer_idem.cli.settings import Settings
from consumer_idem.transports.kafka import KafkaRunner
from handlers.gateway import CHARGES_SQL, GatewayClient, charge_handler, record_charge
from tests._payments import read_topic, send_raw, wait_until


def pay(run: str, n: int, amount: int) -> tuple[dict[str, bytes], bytes]:
    body = {
        "payment_id": f"{run}-{n}",
        "customer_id": "cust",
        "amount_cents": amount,
        "currency": "EUR",
    }
    return {"idempotency-key": f"{run}-{n}".encode()}, json.dumps(body).encode()


async def test_gateway_is_charged_once_per_key_and_failures_are_classified(
    settings: Settings,
    store: PostgresStore,
    pg_pool: asyncpg.Pool,
    kafka_topic_factory: Any,
    kafka_producer: AIOKafkaProducer,
    gateway_url: str,
    scope: str,
) -> None:
    await pg_pool.execute(CHARGES_SQL)
    run = uuid.uuid4().hex[:8]
    topic = await kafka_topic_factory("charges", partitions=1)
    client = GatewayClient(gateway_url, timeout=1.0)
    consumer = idempotent_consumer(
        store,
        scope=scope,
        key=header("idempotency-key"),
        mode="two_phase",
        local_writes=record_charge,
        lease=10,
        backoff=(0.1, 0.5),
    )(charge_handler(client))
    runner = KafkaRunner(
        consumer,
        topics=[topic],
        group_id=run,
        reconcile_topic=f"{topic}.rec",
        consumer_options={"session_timeout_ms": 6000},
    )
    stop = asyncio.Event()
    task = asyncio.create_task(runner.run(stop))
    http = httpx.AsyncClient(base_url=gateway_url)

    async def settled(n: int) -> None:
        async def check() -> bool:
            return runner.stats.processed >= n

        await wait_until(check, 30, f"{n} deliveries settled")

    try:
        # success, success, a duplicate of it, a decline (amount ending in 13)
        await send_raw(
            kafka_producer,
            topic,
            [pay(run, 1, 1000), pay(run, 2, 2000), pay(run, 2, 2000), pay(run, 3, 1013)],
        )
        await settled(4)
        # the gateway refuses twice without charging: retried, then charged once
        await http.post("/_faults", json={"fail_before_charge": 2})
        await send_raw(kafka_producer, topic, [pay(run, 4, 4000)])
        await settled(5)
        # the gateway charges and then never answers: unknown, never re-sent
        await http.post("/_faults", json={"timeout_after_charge": 1})
        await send_raw(kafka_producer, topic, [pay(run, 5, 5000), pay(run, 5, 5000)])
        await settled(7)
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)
        await client.aclose()
    gateway = (await http.get("/_stats")).json()
    await http.aclose()
    assert gateway["charges"] == 5  # one per distinct key, the decline included
    assert runner.stats.retries >= 2 and runner.stats.duplicates == 2

    declined = await store.get(scope, f"{run}-3")
    assert declined is not None and declined.result_kind is ResultKind.DOMAIN_ERROR
    retried = await store.get(scope, f"{run}-4")
    assert retried is not None and retried.status is Status.COMPLETED and retried.attempts == 3
    parked = await store.get(scope, f"{run}-5")
    assert parked is not None and parked.status is Status.UNKNOWN
    notices = await read_topic(settings.kafka_bootstrap, f"{topic}.rec", 1)
    assert [dict(n.headers)["x-consumer-idem-key"] for n in notices] == [f"{run}-5".encode()]
    local = await pg_pool.fetch(
        "SELECT payment_id FROM demo_charges WHERE payment_id LIKE $1 ORDER BY 1", f"{run}-%"
    )
    assert [r["payment_id"] for r in local] == [f"{run}-1", f"{run}-2", f"{run}-4"]
