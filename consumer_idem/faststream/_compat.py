"""What FastStream keeps only in private attributes, read in one place.

Checked with FastStream 0.7.8; each reader says what it relies on, so a FastStream upgrade
that moves it breaks here, in one small function, and the startup check says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def subscriber_middlewares(subscriber: Any) -> Sequence[Any]:
    """The broker and router middlewares FastStream runs around ``subscriber``'s handler.

    FastStream 0.7 keeps them (broker's, then routers') in the subscriber's private
    ``_broker_middlewares``; subscribers themselves take no middlewares there.
    """
    middlewares = getattr(subscriber, "_broker_middlewares", None)
    if middlewares is None:
        raise RuntimeError(
            "this FastStream version no longer keeps a subscriber's middlewares in "
            "_broker_middlewares (checked with 0.7.8): consumer_idem cannot check its ack policy"
        )
    return tuple(middlewares)
