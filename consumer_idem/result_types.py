"""Typed results: a replay returns what the first run returned, of the same type.

A result is stored as JSON (`consumer_idem.jsonable`), so a duplicate would read back a
``dict`` where the first delivery's handler returned a pydantic model, and ``"12.50"`` where
it returned ``Decimal("12.50")``. A [`ResultType`][consumer_idem.result_types.ResultType] reads
a replayed result back through pydantic's ``TypeAdapter`` of the handler's return type:
pydantic models, dataclasses, ``TypedDict``s, ``list``/``dict`` of them, ``Decimal``,
``datetime``, ``date``, ``UUID``, ``Enum``, any type pydantic validates.

The type is the handler's return annotation (resolved once, when the handler is decorated),
or an explicit ``result_type=``; ``result_type=None``, no annotation, ``-> None`` or
``-> Any`` keep the decoded JSON. A stored result that no longer validates (the model changed
between releases) raises
[`StoredResultMismatch`][consumer_idem.errors.StoredResultMismatch], naming the scope and key:
never a silent ``dict``. An annotation pydantic cannot build from JSON (an ORM class, any
plain class) is refused when the handler is decorated, with
[`UnsupportedResultType`][consumer_idem.result_types.UnsupportedResultType] (a ``TypeError``)
naming the handler and the type. Only a success is read back this way: a
[`DomainError`][consumer_idem.errors.DomainError]'s stored result is the error's, not the
handler's return type.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable, Sequence
from types import UnionType
from typing import Any, Final

from pydantic import PydanticUserError, TypeAdapter, ValidationError

from consumer_idem.errors import StoredResultMismatch
from consumer_idem.types import Outcome, OutcomeKind, ResultKind

__all__ = [
    "FROM_ANNOTATION",
    "ResultType",
    "UnsupportedResultType",
    "resolve_result_type",
    "result_type_of",
]


class _FromAnnotation:
    """The default of ``result_type=``: the handler's return annotation decides."""

    def __repr__(self) -> str:
        return "FROM_ANNOTATION"


#: ``result_type=`` left out: read the handler's return annotation
FROM_ANNOTATION: Final[Any] = _FromAnnotation()

#: annotations that mean "the decoded JSON as it is"
_UNTYPED: Final = (None, type(None), Any, object)


class ResultType:
    """How a replayed result is read back: through a ``TypeAdapter`` of ``annotation``, or as
    the decoded JSON (``annotation`` ``None``). Build it once (per handler), not per message."""

    __slots__ = ("adapter", "annotation")

    def __init__(self, annotation: Any = None, *, owner: str | None = None) -> None:
        self.annotation = None if annotation in _UNTYPED else annotation
        try:
            self.adapter: TypeAdapter[Any] | None = (
                None if self.annotation is None else TypeAdapter(self.annotation)
            )
        except PydanticUserError as exc:  # a type pydantic cannot read back: say so now
            raise UnsupportedResultType(annotation, owner) from exc

    def __repr__(self) -> str:
        return f"ResultType({self.annotation!r})"

    def read(self, outcome: Outcome) -> Outcome:
        """``outcome`` with a replayed success's result validated into the type; any other
        outcome as it is. Raises `StoredResultMismatch` when the stored JSON does not fit."""
        adapter = self.adapter
        if (
            adapter is None
            or outcome.kind is not OutcomeKind.REPLAYED
            or outcome.result_kind is ResultKind.DOMAIN_ERROR
        ):
            return outcome
        typed = self.validate(outcome.result, outcome.scope, outcome.key)
        return dataclasses.replace(outcome, result=typed)

    def validate(self, stored: Any, scope: str, key: str) -> Any:
        """``stored`` (a result's JSON form) read back as the type; raises
        `StoredResultMismatch`, naming ``scope`` and ``key``, when it does not fit."""
        if self.adapter is None:
            return stored
        try:
            return self.adapter.validate_python(stored)
        except ValidationError as exc:
            raise StoredResultMismatch(scope, key, _name(self.annotation), str(exc)) from exc


class UnsupportedResultType(TypeError):
    """A result type (a return annotation or ``result_type=``) pydantic cannot read a stored
    result back as: refused when the handler is decorated, not on its first duplicate."""

    def __init__(self, annotation: Any, owner: str | None = None) -> None:
        where = "result_type=" if owner is None else f"the return annotation of {owner}"
        super().__init__(
            f"{where} names {_name(annotation)}, which a replay cannot be read back as: "
            "pydantic cannot build it from the stored JSON. Return a pydantic model, a "
            "dataclass, a TypedDict, a list or dict of them, or a Decimal, datetime, date, "
            "UUID, Enum or plain JSON value; or pass result_type=None to replay the stored "
            "JSON as it is (or result_type=<a type it fits>)"
        )
        self.annotation = annotation


#: the one ResultType of untyped results (no adapter: ``read`` returns the outcome as it is)
UNTYPED: Final = ResultType()


def resolve_result_type(
    handler: Callable[..., Any] | None, explicit: Any = FROM_ANNOTATION, *, batch: bool = False
) -> ResultType:
    """The `ResultType` of a handler: ``explicit`` when given (``None``: untyped), else its
    return annotation (``batch``: a batch handler returns a sequence of results, or ``None``:
    the element type). An annotation that does not resolve is a `TypeError` now, naming the
    handler, rather than an untyped replay later."""
    if isinstance(explicit, ResultType):
        return explicit
    if explicit is not FROM_ANNOTATION:
        return result_type_of(explicit)
    if handler is None:
        return UNTYPED
    try:
        annotation = _return_annotation(handler)
    except Exception as exc:  # NameError of a forward reference, and the like
        raise TypeError(
            f"the return annotation of {_handler_name(handler)} does not resolve ({exc}): "
            "pass result_type= (the type a replay is read back as, or None for the JSON)"
        ) from exc
    if batch and annotation not in _UNTYPED:
        annotation = _element_type(annotation)
    try:
        return result_type_of(annotation)
    except UnsupportedResultType as exc:  # name the handler whose annotation it is
        raise UnsupportedResultType(annotation, _handler_name(handler)) from exc.__cause__


def _return_annotation(handler: Callable[..., Any]) -> Any:
    """The evaluated return annotation of ``handler`` (or of its ``__call__``), alone: a
    parameter's annotation that does not resolve (an import under ``TYPE_CHECKING``) is none
    of this module's business."""
    target: Any = handler
    if not inspect.isfunction(inspect.unwrap(target)) and callable(target):
        target = getattr(type(target), "__call__", target)  # noqa: B004 - an async __call__
    raw = getattr(target, "__annotations__", {}).get("return")
    if raw is None:
        return None

    def probe() -> None: ...

    probe.__annotations__ = {"return": raw}
    namespace = getattr(inspect.unwrap(target), "__globals__", {})
    return typing.get_type_hints(probe, globalns=namespace, include_extras=False).get("return")


def result_type_of(annotation: Any) -> ResultType:
    """The `ResultType` of ``annotation`` (a type, or a `ResultType` as it is), built once per
    type: ``run_transactional(result_type=X)`` on every message costs a dictionary look-up."""
    if isinstance(annotation, ResultType):
        return annotation
    try:
        return _cached(annotation)
    except TypeError:  # an unhashable annotation (Annotated metadata): built each time
        return ResultType(annotation)


@functools.lru_cache(maxsize=256)
def _cached(annotation: Any) -> ResultType:
    return ResultType(annotation)


def _element_type(annotation: Any) -> Any:
    """``X`` of a batch handler's ``Sequence[X] | None`` (``list[X]``, ...); ``None`` when it
    names none."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, UnionType):
        return _element_type(args[0]) if len(args) == 1 else None
    origin = typing.get_origin(annotation)
    if isinstance(origin, type) and issubclass(origin, Sequence) and len(args) == 1:
        return args[0]
    return None


def _name(annotation: Any) -> str:
    if typing.get_origin(annotation) is None and isinstance(annotation, type):
        return annotation.__qualname__
    return repr(annotation)  # list[Charge], Decimal | None: the whole of it


def _handler_name(handler: Callable[..., Any]) -> str:
    return repr(getattr(handler, "__qualname__", handler))
