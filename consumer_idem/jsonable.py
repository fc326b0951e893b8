"""A handler's result as the JSON text the store keeps (and replays).

Plain JSON values (dicts, lists, strings, numbers, booleans, ``None``) are stored as they are.
A pydantic model is stored as its JSON form (``model_dump(mode="json")``: aliases, field
serializers, datetimes and UUIDs as strings), a dataclass instance as an object of its fields
(each a JSON value, a model or a dataclass in turn), at any depth. A replay reads that JSON
back as the handler's result type (its return annotation, or ``result_type=``: see
`consumer_idem.result_types`), else as the decoded JSON: a dict, not the model.

The everyday values of ``numeric``, ``timestamptz``, ``date``, ``time`` and ``uuid`` columns
are stored as JSON strings: a `Decimal` and a `UUID` as ``str()``
(``"12.50"``, ``"0b9c…"``), a `datetime`, `date` and
`time` in ISO 8601 (``"2026-11-27T23:05:00+00:00"``), an `Enum`
as its value (encoded the same way), at any depth. Without a result type **a replay returns
those strings**: the first delivery's handler returns ``Decimal("12.50")``, a duplicate gets
``"12.50"`` back; with ``-> Decimal`` it gets ``Decimal("12.50")``.

Anything else is refused with [`UnstorableResult`][consumer_idem.errors.UnstorableResult], naming
what and
why: a value JSON cannot hold (NaN, bytes, an arbitrary object), and an ORM object, which is a
view of rows rather than a value (turn it into a model first:
``OrderOut.model_validate(order, from_attributes=True)``). The refusal is deterministic: the
same handler returns the same value again, so a consumer dead-letters the delivery at once.
"""

from __future__ import annotations

import dataclasses
import datetime
import decimal
import enum
import json
import uuid
from typing import Any

from consumer_idem.errors import UnstorableResult

__all__ = ["to_json_text"]


def to_json_text(result: Any) -> str:
    """``result`` as compact JSON text (UTF-8 safe); raises
    [`UnstorableResult`][consumer_idem.jsonable.UnstorableResult]."""
    try:
        text = json.dumps(
            result, separators=(",", ":"), ensure_ascii=False, allow_nan=False, default=_convert
        )
    except UnstorableResult:
        raise
    except (TypeError, ValueError) as exc:
        raise UnstorableResult(f"handler result must be JSON-serialisable: {exc}") from exc
    try:  # a lone surrogate passes json.dumps but neither UTF-8 nor PostgreSQL's json
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise UnstorableResult(f"handler result is not valid Unicode: {exc}") from exc
    return text


def scalar_text(value: Any) -> Any:
    """The JSON form of a typed scalar JSON has no type for (``NotImplemented`` for anything
    else): ``str`` of a ``Decimal`` or ``UUID`` (exact: no float rounding of money), ISO 8601
    of a ``datetime``, ``date`` or ``time``, the value of an ``Enum``. The one place this
    encoding is defined, so reading typed results back can rely on it."""
    if isinstance(value, enum.Enum):
        return value.value  # json.dumps encodes it in turn (a Decimal value included)
    if isinstance(value, decimal.Decimal | uuid.UUID):
        return str(value)
    if isinstance(value, datetime.date | datetime.time):  # datetime is a date
        return value.isoformat()
    return NotImplemented


def _convert(value: Any) -> Any:
    """``json.dumps``'s hook for what it cannot encode itself: typed scalars, models and
    dataclasses (no import of pydantic: a model is recognised by its ``model_dump``)."""
    scalar = scalar_text(value)
    if scalar is not NotImplemented:
        return scalar
    kind = type(value).__name__
    if hasattr(value, "_sa_instance_state"):
        raise UnstorableResult(
            f"handler result holds an SQLAlchemy ORM object ({kind}): return a dict, a "
            "dataclass or a pydantic model of it (e.g. Model.model_validate(obj, "
            "from_attributes=True))"
        )
    dump = getattr(value, "model_dump", None)
    is_dataclass = dataclasses.is_dataclass(value) and not isinstance(value, type)
    if not callable(dump) and not is_dataclass:
        raise TypeError(f"Object of type {kind} is not JSON serializable")
    if callable(dump):  # a pydantic model: its own JSON mode (aliases, serializers)
        try:
            return dump(mode="json")
        except Exception as exc:
            raise UnstorableResult(
                f"handler result ({kind}) cannot be stored as JSON: {exc}"
            ) from exc
    # a dataclass: its fields, each encoded in turn (a JSON value, a model, a dataclass)
    return {field.name: getattr(value, field.name) for field in dataclasses.fields(value)}
