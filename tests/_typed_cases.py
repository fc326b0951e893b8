"""The kinds of typed results every entry point's tests replay: one value per kind, its
annotation, and `same` (equal, and of the same type all the way down)."""

from __future__ import annotations

import dataclasses
import datetime
import enum
import uuid
from collections.abc import Callable
from decimal import Decimal
from typing import Any

import pydantic
from typing_extensions import TypedDict  # pydantic reads typing's only from 3.12


class Charge(pydantic.BaseModel):
    id: uuid.UUID
    amount: Decimal
    at: datetime.datetime


class ChargeV2(pydantic.BaseModel):  # a later release: a field the stored result lacks
    id: uuid.UUID
    amount: Decimal
    at: datetime.datetime
    currency: str


@dataclasses.dataclass
class Line:
    sku: str
    qty: int
    price: Decimal


class Totals(TypedDict):
    count: int
    day: datetime.date


class Colour(enum.Enum):
    RED = "red"
    BLUE = "blue"


ID = uuid.UUID("0b9c6a7e-1f1c-4d1e-9a55-3a7f4c2f8e01")
AT = datetime.datetime(2026, 11, 27, 23, 5, tzinfo=datetime.UTC)

#: (annotation, the value the handler returns): one per kind of type
CASES: dict[str, tuple[Any, Any]] = {
    "model": (Charge, Charge(id=ID, amount=Decimal("12.50"), at=AT)),
    "dataclass": (Line, Line("sku-1", 2, Decimal("3.10"))),
    "typeddict": (Totals, Totals(count=3, day=datetime.date(2026, 11, 27))),
    "list_of_models": (list[Charge], [Charge(id=ID, amount=Decimal("1"), at=AT)]),
    "dict_of_dataclasses": (dict[str, Line], {"a": Line("a", 1, Decimal("0.01"))}),
    "decimal": (Decimal, Decimal("12.50")),
    "datetime": (datetime.datetime, AT),
    "date": (datetime.date, datetime.date(2026, 2, 28)),
    "uuid": (uuid.UUID, ID),
    "enum": (Colour, Colour.BLUE),
}


def same(first: Any, again: Any) -> None:
    """Equal, and of the same type all the way down (a list's items, a dict's values)."""
    assert again == first
    assert type(again) is type(first)
    if isinstance(first, list):
        for a, b in zip(first, again, strict=True):
            same(a, b)
    if isinstance(first, dict):
        for name in first:
            same(first[name], again[name])


def annotated(func: Callable[..., Any], annotation: Any) -> Callable[..., Any]:
    func.__annotations__ = {**func.__annotations__, "return": annotation}
    return func
