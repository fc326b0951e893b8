"""The consumer options: one definition, checked once, shared by every entry point (pure)."""

from __future__ import annotations

import dataclasses
from typing import Any, get_type_hints

import pytest

from consumer_idem import ConsumerOptions, IdempotentConsumer, PostgresStore, idempotent_consumer
from consumer_idem.options import DEFAULT_KEY, ConsumerArgs, option_names


class _Pool:
    """Never used: building a consumer touches no connection."""


STORE = PostgresStore(_Pool())  # type: ignore[arg-type]


def test_the_keyword_form_lists_exactly_the_options_fields() -> None:
    keyword = set(get_type_hints(ConsumerArgs))
    assert keyword == option_names() - {"scope", "mode", "batch"}


def test_options_are_frozen_and_hold_no_mutable_list() -> None:
    fields = ["a", "b"]
    options = ConsumerOptions(scope="s", fingerprint_fields=fields)
    fields.append("c")
    assert options.fingerprint_fields == ("a", "b")
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.scope = "t"  # type: ignore[misc]
    assert ConsumerOptions(scope="s").key is DEFAULT_KEY


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mode": "two_phase", "batch": True}, "transactional only"),
        ({"local_writes": lambda conn, result: None}, "two-phase"),
        ({"max_attempts": 0}, "at least 1"),
    ],
)
def test_a_bad_combination_fails_at_decoration_time(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        idempotent_consumer(STORE, scope="s", **kwargs)


def test_the_decorator_builds_one_options_object() -> None:
    @idempotent_consumer(STORE, scope="orders", max_attempts=3, payload="bytes")
    async def handler(message: Any, conn: Any) -> None:
        return None

    assert isinstance(handler, IdempotentConsumer)
    assert handler.options == ConsumerOptions(scope="orders", max_attempts=3, payload="bytes")
    assert handler.max_attempts == 3 and handler.payload == "bytes"
