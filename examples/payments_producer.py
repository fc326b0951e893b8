"""Publish N logical payments to `payments.requests`, re-sending a fraction of them.

    python -m examples.payments_producer --transport kafka|rabbit --count N \
        --duplicate-rate R [--seed S]

Each message is JSON {"payment_id", "customer_id", "amount_cents", "currency"} with its
idempotency key in the `idempotency-key` header. A re-sent payment has the same key and body,
exactly like a producer retry. Prints the distinct keys and the messages sent (one JSON line).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from consumer_idem.cli.settings import load_settings

TOPIC = "payments.requests"
PARTITIONS = 4


@dataclass(frozen=True)
class PlannedMessage:
    key: str
    body: bytes
    customer_id: str
    amount_cents: int


def plan(count: int, duplicate_rate: float, seed: int, run_id: str) -> list[PlannedMessage]:
    """The messages to send, in order: every payment once, plus re-sends of a random fraction,
    each placed somewhere after its original. Deterministic for a (seed, run_id)."""
    rng = random.Random(f"{seed}:{run_id}")
    customers = max(1, count // 10)
    ordered: list[tuple[float, PlannedMessage]] = []
    for i in range(count):
        customer = f"{run_id}-cust-{rng.randrange(customers)}"
        amount = rng.randrange(100, 100_000)
        body = {
            "payment_id": f"{run_id}-pay-{i}",
            "customer_id": customer,
            "amount_cents": amount,
            "currency": "EUR",
        }
        message = PlannedMessage(f"{run_id}:{i}", json.dumps(body).encode(), customer, amount)
        ordered.append((float(i), message))
    for i in rng.sample(range(count), round(count * duplicate_rate)):
        # a re-send goes anywhere after its original
        ordered.append((rng.uniform(i + 0.5, count), ordered[i][1]))
    ordered.sort(key=lambda pair: pair[0])
    return [message for _, message in ordered]


def expected_balances(messages: list[PlannedMessage]) -> dict[str, int]:
    seen: set[str] = set()
    balances: dict[str, int] = {}
    for m in messages:
        if m.key not in seen:
            seen.add(m.key)
            balances[m.customer_id] = balances.get(m.customer_id, 0) + m.amount_cents
    return balances


async def send_kafka(messages: list[PlannedMessage], topic: str) -> None:
    from aiokafka import AIOKafkaProducer
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic
    from aiokafka.errors import TopicAlreadyExistsError

    bootstrap = load_settings().kafka_bootstrap
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, PARTITIONS, 1)])
    except TopicAlreadyExistsError:
        pass
    finally:
        await admin.close()
    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap, acks="all", enable_idempotence=True, linger_ms=5
    )
    await producer.start()

    async def send(chunk: list[PlannedMessage]) -> None:
        futures = [
            await producer.send(
                topic,
                value=m.body,
                key=m.key.encode(),
                headers=[("idempotency-key", m.key.encode())],
            )
            for m in chunk
        ]
        await asyncio.gather(*futures)

    try:
        await with_retries(send, messages)
    finally:
        await producer.stop()


#: how long one chunk of publishes is retried (a broker restart) before the producer gives up
RETRY_FOR = 120.0
CHUNK = 256


async def with_retries(
    send: Callable[[list[PlannedMessage]], Awaitable[None]], messages: list[PlannedMessage]
) -> None:
    """Publish in chunks, each confirmed; a chunk that fails (the broker restarting) is sent
    again until it is confirmed: the copies it may leave are duplicates, which the consumer
    absorbs like the planned ones."""
    for start in range(0, len(messages), CHUNK):
        chunk = messages[start : start + CHUNK]
        deadline = time.monotonic() + RETRY_FOR
        while True:
            try:
                await send(chunk)
                break
            except Exception as exc:  # the client's connection errors vary by transport
                if time.monotonic() > deadline:
                    raise
                print(
                    f"producer: publishing failed ({type(exc).__name__}: {exc}); retrying",
                    file=sys.stderr,
                    flush=True,
                )
                await asyncio.sleep(1.0)


async def send_rabbit(messages: list[PlannedMessage], queue: str) -> None:
    import aio_pika

    # robust: the connection and channel come back by themselves after a broker restart
    connection = await aio_pika.connect_robust(load_settings().amqp_url)
    try:
        channel = await connection.channel(publisher_confirms=True)
        await channel.declare_queue(queue, durable=True, arguments={"x-queue-type": "quorum"})

        async def send(chunk: list[PlannedMessage]) -> None:
            await asyncio.gather(  # each publish confirmed by the broker
                *(
                    channel.default_exchange.publish(
                        aio_pika.Message(
                            m.body,
                            headers={"idempotency-key": m.key},
                            content_type="application/json",
                            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                        ),
                        routing_key=queue,
                    )
                    for m in chunk
                )
            )

        await with_retries(send, messages)
    finally:
        await connection.close()


async def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1] if __doc__ else None)
    parser.add_argument("--transport", choices=["kafka", "rabbit"], required=True)
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--duplicate-rate", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--run-id", default=None, help="prefix of keys and ids (default: random)")
    parser.add_argument("--topic", default=TOPIC, help="topic or queue (default payments.requests)")
    args = parser.parse_args(argv)
    if not 0 <= args.duplicate_rate <= 1:
        parser.error("--duplicate-rate must be between 0 and 1")
    run_id = args.run_id or uuid.uuid4().hex[:8]
    messages = plan(args.count, args.duplicate_rate, args.seed, run_id)
    if args.transport == "kafka":
        await send_kafka(messages, args.topic)
    else:
        await send_rabbit(messages, args.topic)
    summary = {
        "run_id": run_id,
        "distinct_keys": len({m.key for m in messages}),
        "messages_sent": len(messages),
    }
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
