"""Duplicates under FastStream's test broker, with the real store: the handler
runs once."""

# --8<-- [start:test]
import asyncio
import uuid

from faststream.kafka import TestKafkaBroker

# the app of the page above, saved as faststream_app.py
from faststream_app import TOPIC, book, broker, open_store


async def main() -> None:
    await open_store()  # the test broker runs no start-up hooks
    key = f"k-{uuid.uuid4().hex[:8]}"
    headers = {"idempotency-key": key}
    async with TestKafkaBroker(broker) as br:
        await br.publish({"id": key, "cents": 100}, TOPIC, headers=headers)
        await br.publish({"id": key, "cents": 100}, TOPIC, headers=headers)
        # ran once; the publisher sent the result twice
        book.mock.assert_called_once()
    print("handled once")


asyncio.run(main())
# --8<-- [end:test]
