"""Duplicates under FastStream's test broker, with the real store: the handler runs once."""

import asyncio
import uuid

from faststream.kafka import TestKafkaBroker
from faststream_app import TOPIC, book, broker, open_store  # the app of the page above


async def main() -> None:
    await open_store()  # the test broker runs no start-up hooks
    key = f"k-{uuid.uuid4().hex[:8]}"
    # --8<-- [start:test]
    async with TestKafkaBroker(broker) as br:
        await br.publish({"id": key, "cents": 100}, TOPIC, headers={"idempotency-key": key})
        await br.publish({"id": key, "cents": 100}, TOPIC, headers={"idempotency-key": key})
        book.mock.assert_called_once()  # ran once; the publisher sent the result twice
    # --8<-- [end:test]
    print("handled once")


asyncio.run(main())
