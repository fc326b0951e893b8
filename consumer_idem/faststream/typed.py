"""Typed results through [`Idempotency`][consumer_idem.faststream.Idempotency]: what a
subscriber's handler returned, read back as its return annotation (or ``result_type=``) on the
first run and on every replay alike, and the ``on_execute`` / ``on_replay`` hooks called with it.

The core stores the handler's result in its envelope (`consumer_idem.faststream.results`); the
envelope's body is validated into the handler's type here, so the first run and each duplicate
publish (and hand the hooks) an equal value of the same type, and serialise it to the same
bytes. A body that no longer fits (the model changed between releases) dead-letters the
delivery with reason ``stored_result_mismatch``, naming the scope and key."""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any

from faststream import Response

from consumer_idem.errors import IdempotencyConfigError, StoredResultMismatch
from consumer_idem.faststream import _compat
from consumer_idem.faststream.results import _NOTHING, _published_form
from consumer_idem.result_types import (
    FROM_ANNOTATION,
    UNTYPED,
    ResultType,
    UnsupportedResultType,
    resolve_result_type,
)
from consumer_idem.types import OutcomeKind, ResultKind
from consumer_idem.verdict import Action, Verdict, error_text
from consumer_idem.verdict_hooks import call_settled

if TYPE_CHECKING:
    from consumer_idem.faststream.idempotency import Idempotency

log = logging.getLogger("consumer_idem.faststream")


class SubscriberTypes:
    """The result type of each subscriber, resolved on its first delivery and kept."""

    def __init__(self, explicit: Any = FROM_ANNOTATION) -> None:
        self.explicit = explicit
        self._types: dict[tuple[int, bool], ResultType] = {}

    def of(self, subscriber: Any, *, batch: bool = False) -> ResultType:
        found = self._types.get((id(subscriber), batch))
        if found is None:
            try:
                found = self._resolve(subscriber, batch)
            except TypeError as exc:  # an annotation no replay can be read back as
                raise IdempotencyConfigError(str(exc)) from exc
            self._types[(id(subscriber), batch)] = found
        return found

    def _resolve(self, subscriber: Any, batch: bool) -> ResultType:
        if self.explicit is not FROM_ANNOTATION:
            return resolve_result_type(None, self.explicit, batch=batch)
        handlers = [_compat.handler_function(c) for c in _compat.handler_calls(subscriber)]
        types = [_type_of(h, batch) for h in handlers if h is not None]
        annotations = {repr(t.annotation) for t in types}
        if len(annotations) > 1:  # which handler ran is FastStream's routing, not ours
            raise IdempotencyConfigError(
                f"the handlers of one subscriber return different types ({sorted(annotations)}): "
                "pass Idempotency(result_type=...) (or None for the stored JSON), or give them "
                "one return annotation"
            )
        return types[0] if types else UNTYPED


def _type_of(handler: Any, batch: bool) -> ResultType:
    try:
        return resolve_result_type(handler, batch=batch)
    except UnsupportedResultType as exc:
        annotation = exc.annotation
        if isinstance(annotation, type) and issubclass(annotation, Response):
            return UNTYPED  # its body is published as it was stored, untyped
        raise


def typed(verdict: Verdict, result_type: ResultType) -> Verdict:
    """``verdict`` with its stored envelope's body read back as ``result_type`` (a success,
    executed or replayed); a body that does not fit turns it into a dead letter."""
    outcome = verdict.outcome
    stored = verdict.result
    if (
        result_type.adapter is None
        or outcome is None
        or verdict.action is not Action.ACK
        or outcome.kind not in (OutcomeKind.EXECUTED, OutcomeKind.REPLAYED)
        or outcome.result_kind is not ResultKind.SUCCESS
        or not isinstance(stored, dict)
        or "body" not in stored
    ):
        return verdict
    try:
        body = result_type.validate(stored["body"], verdict.scope, verdict.key or "")
    except StoredResultMismatch as exc:  # the same on every try: dead-lettered, kept
        log.error("%s", exc, extra={"scope": verdict.scope, "key": verdict.key})
        return dataclasses.replace(
            verdict, action=Action.DEAD_LETTER, reason=exc.reason, error=error_text(exc)
        )
    result = {**stored, "body": body}
    return dataclasses.replace(verdict, outcome=dataclasses.replace(outcome, result=result))


def call_hooks(idem: Idempotency, verdicts: list[Verdict]) -> None:
    """``on_execute`` / ``on_replay`` of ``idem``, each with what the handler returned (its
    typed result, as published: `Verdict.result`), not the stored envelope."""
    if idem.on_execute is None and idem.on_replay is None:
        return
    handed = []
    for verdict in verdicts:
        outcome = verdict.outcome
        if outcome is not None and outcome.result_kind is ResultKind.SUCCESS:
            published = _published_form(outcome.result)
            result = None if published is _NOTHING else published
            outcome = dataclasses.replace(outcome, result=result)
            verdict = dataclasses.replace(verdict, outcome=outcome)
        handed.append(verdict)
    call_settled(idem.on_execute, idem.on_replay, handed)
