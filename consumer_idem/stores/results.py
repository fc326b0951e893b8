"""How handler results are stored: JSON text, ``None`` as SQL NULL."""

from __future__ import annotations

from typing import Any

from consumer_idem.jsonable import to_json_text


def encode_result(result: Any) -> str | None:
    """Results are stored as JSON text (pydantic models and dataclasses as their JSON form:
    see `consumer_idem.jsonable`); ``None`` stays SQL NULL. Raises
    [`UnstorableResult`][consumer_idem.errors.UnstorableResult] for what JSON cannot hold."""
    return None if result is None else to_json_text(result)
