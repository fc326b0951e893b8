"""Resolvers the CLI tests load by module:function, as an operator would."""

from __future__ import annotations

from consumer_idem import Executed
from consumer_idem.types import Record


async def gateway_says_charged(record: Record) -> Executed:
    return Executed({"resolved_by": "cli-reconciler", "key": record.key})
