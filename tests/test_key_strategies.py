"""Key strategies (pure functions of a message)."""

from __future__ import annotations

import json

import pytest

from consumer_idem import (
    ConsumerMessage,
    InvalidKey,
    amqp_message_id,
    cloudevents,
    first_of,
    from_callable,
    header,
    kafka_coordinates,
    payload_field,
)


def test_header_strategy_is_case_insensitive_and_ordered() -> None:
    msg = ConsumerMessage(b"{}", {"Idempotency-Key": b"k1", "x-request-id": b"r1"})
    assert header("idempotency-key")(msg) == b"k1"
    assert header("missing", "x-request-id")(msg) == b"r1"
    assert header("missing")(msg) is None


def test_cloudevents_binary_kafka_amqp_and_structured() -> None:
    kafka = ConsumerMessage(b"{}", {"ce_id": b"e1", "ce_source": b"/orders"})
    amqp_underscore = ConsumerMessage(b"{}", {"cloudEvents_id": b"e2", "cloudEvents_source": b"/a"})
    amqp_colon = ConsumerMessage(b"{}", {"cloudEvents:id": b"e3", "cloudEvents:source": b"/b"})
    body = json.dumps({"specversion": "1.0", "id": "e4", "source": "/c", "type": "t"}).encode()
    structured = ConsumerMessage(body, content_type="application/cloudevents+json")
    strategy = cloudevents()
    assert strategy(kafka) == "/orders#e1"
    assert strategy(amqp_underscore) == "/a#e2"
    assert strategy(amqp_colon) == "/b#e3"
    assert strategy(structured) == "/c#e4"
    assert strategy(ConsumerMessage(b'{"id": 1}')) is None


def test_kafka_coordinates_and_dead_letter_copies_keep_their_origin() -> None:
    live = ConsumerMessage(b"", topic="orders", partition=2, offset=41)
    assert kafka_coordinates()(live) == "orders/2/41"
    ours = ConsumerMessage(
        b"",
        {"x-original-topic": b"orders", "x-original-partition": b"2", "x-original-offset": b"41"},
        topic="orders.dlq",
        partition=0,
        offset=7,
    )
    assert kafka_coordinates()(ours) == "orders/2/41"
    spring = ConsumerMessage(
        b"",
        {
            "kafka_dlt-original-topic": b"orders",
            "kafka_dlt-original-partition": (2).to_bytes(4, "big"),
            "kafka_dlt-original-offset": (41).to_bytes(8, "big"),
        },
        topic="orders-dlt",
        partition=0,
        offset=3,
    )
    assert kafka_coordinates()(spring) == "orders/2/41"
    broken = ConsumerMessage(b"", {"x-original-topic": b"orders"}, topic="d", partition=0, offset=1)
    with pytest.raises(InvalidKey):
        kafka_coordinates()(broken)


def test_payload_field_amqp_message_id_callable_and_fallback() -> None:
    msg = ConsumerMessage(b'{"payment": {"id": "p-9"}}', message_id="m-1")
    assert payload_field("payment.id")(msg) == "p-9"
    assert payload_field("payment.missing")(msg) is None
    assert payload_field("x")(ConsumerMessage(b"not json")) is None
    assert amqp_message_id()(msg) == "m-1"
    assert from_callable(lambda m: "custom")(msg) == "custom"
    chain = first_of(header("idempotency-key"), payload_field("payment.id"), amqp_message_id())
    assert chain(msg) == "p-9"
    assert chain(ConsumerMessage(b"{}", {"idempotency-key": b"h"})) == b"h"
