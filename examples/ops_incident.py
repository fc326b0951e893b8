"""Stage a small incident to operate with the CLI (the README's operations session).

    uvicorn examples.fake_gateway:app --port 8081 &     # the stand-in payment gateway
    python -m examples.ops_incident                     # then: consumer-idem stats, list, ...

Against the real services (``CONSUMER_IDEM_*`` settings; it migrates the store):

* ``payments.charge``, a two-phase consumer charging the gateway: 8 payments charge normally;
  the gateway takes 2 more and hangs before it answers (the worker times out: parked
  ``unknown``, although the money moved); it is unavailable for 2 (``failed_retryable``:
  provably not charged); and a worker claims 1 and dies before it calls the gateway (its lease
  expires: a zombie for the sweeper, never charged).
* ``payments.requests.dlq``: 8 dead-lettered copies of ledger payments (the demo's
  ``handlers.payments:ledger_consumer``): 3 were booked before they were dead-lettered, 4 were
  dead-lettered during a database outage and never booked, 1 is malformed (amount 0).

:func:`ask_gateway` is the resolver to reconcile ``payments.charge`` with.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os

import asyncpg
import httpx
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError, UnknownTopicOrPartitionError

from consumer_idem import (
    ConsumerMessage,
    Executed,
    IdempotentConsumer,
    NotExecuted,
    PostgresStore,
    downstream_key_for,
    header,
    idempotent_consumer,
)
from consumer_idem.cli.settings import load_settings
from consumer_idem.operations.reconcile import Answer, StillUnknown
from consumer_idem.types import Record
from handlers.gateway import DEFAULT_GATEWAY_URL, GatewayClient, charge_handler
from handlers.payments import ensure_tables, ledger_consumer

CHARGE_SCOPE = "payments.charge"
DLQ = "payments.requests.dlq"
RECONCILE = "consumer_idem.reconcile"


def gateway_url() -> str:
    return os.environ.get("GATEWAY_URL", DEFAULT_GATEWAY_URL)


async def ask_gateway(record: Record) -> Answer:
    """Reconcile a ``payments.charge`` key: the gateway knows whether it charged it (it is
    asked for the charge made under the key's downstream idempotency key)."""
    key = downstream_key_for(record.scope, record.key)
    async with httpx.AsyncClient(base_url=gateway_url(), timeout=5) as http:
        try:
            response = await http.get(f"/charges/{key}")
        except httpx.HTTPError as exc:
            return StillUnknown(f"gateway unreachable: {exc!r}")
    if response.status_code == 404:
        return NotExecuted("no charge at the gateway")
    if response.status_code != 200:
        return StillUnknown(f"gateway answered {response.status_code}")
    return Executed(response.json())


def payment(n: int, amount: int = 1250) -> ConsumerMessage:
    body = {
        "payment_id": f"pay-{n}",
        "customer_id": f"cus-{n % 3}",
        "amount_cents": amount,
        "currency": "EUR",
    }
    return ConsumerMessage(json.dumps(body).encode(), {"idempotency-key": f"pay-{n}".encode()})


async def faults(**counts: int) -> None:
    async with httpx.AsyncClient(base_url=gateway_url()) as http:
        (await http.post("/_faults", json=counts)).raise_for_status()


async def stage_charges(store: PostgresStore) -> None:
    client = GatewayClient(timeout=1.0)
    charge: IdempotentConsumer = idempotent_consumer(
        store, scope=CHARGE_SCOPE, mode="two_phase", key=header("idempotency-key"), lease=30
    )(charge_handler(client))
    try:
        for n in range(1001, 1009):
            await charge.process(payment(n))
        await faults(timeout_after_charge=2)
        for n in (1009, 1010):
            await charge.process(payment(n))  # charged, but no answer: unknown
        await faults(fail_before_charge=2)
        for n in (1011, 1012):
            await charge.process(payment(n))  # 503 before charging: failed_retryable
        prepared = charge.prepare(payment(1013))
        assert isinstance(prepared, tuple)
        # a worker claims pay-1013 and is killed before it calls the gateway
        await store.reserve(CHARGE_SCOPE, prepared[0], prepared[1], lease=5)
    finally:
        await client.aclose()


async def stage_dead_letters(store: PostgresStore, pool: asyncpg.Pool, bootstrap: str) -> None:
    await ensure_tables(pool)
    ledger = ledger_consumer(store)
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        with contextlib.suppress(UnknownTopicOrPartitionError):
            await admin.delete_topics([DLQ])
            await asyncio.sleep(1)  # let the deletion settle before the topic is made again
        await admin.create_topics([NewTopic(DLQ, 1, 1)])
        for topic in (RECONCILE, f"{RECONCILE}.operator"):  # a deployment has its topics
            with contextlib.suppress(TopicAlreadyExistsError):
                await admin.create_topics([NewTopic(topic, 1, 1)])
    finally:
        await admin.close()
    copies = [(payment(n), "store_unavailable") for n in range(2001, 2008)]
    copies.append((payment(2008, amount=0), "invalid_payment"))
    for message, _ in copies[:3]:
        await ledger.process(message)  # booked before its copy was dead-lettered
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        for offset, (message, reason) in enumerate(copies):
            headers = list(message.headers.items())
            headers += [
                ("x-original-topic", b"payments.requests"),
                ("x-original-partition", b"0"),
                ("x-original-offset", str(4100 + offset).encode()),
                ("x-dead-letter-reason", reason.encode()),
            ]
            await producer.send_and_wait(DLQ, value=message.body, headers=headers)
    finally:
        await producer.stop()


async def main() -> None:
    settings = load_settings()
    pool = await asyncpg.create_pool(settings.pg_dsn, min_size=1, max_size=4)
    assert pool is not None
    try:
        store = PostgresStore(pool, schema=settings.schema_name)
        await store.migrate()
        await stage_charges(store)
        await stage_dead_letters(store, pool, settings.kafka_bootstrap)
    finally:
        await pool.close()
    print(f"staged: {CHARGE_SCOPE} keys in every state, {DLQ} with 8 dead letters")


if __name__ == "__main__":
    asyncio.run(main())
