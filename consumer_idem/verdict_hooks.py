"""``on_execute`` and ``on_replay``: a consumer's callbacks on the verdict of a delivery whose
handler ran and committed, or that replayed a stored result (for metrics, headers, logs).

A hook runs synchronously, after the outcome is settled in the store, so it sees only what
happened: an ``on_execute`` call is one real execution. It must not block. What it raises is
logged and dropped: the effect is committed, so a failing counter never turns into a retry."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from consumer_idem.types import OutcomeKind
from consumer_idem.verdict import Action, Verdict

__all__ = ["VerdictHook", "call_hook", "call_settled"]

log = logging.getLogger("consumer_idem.hooks")

#: ``callback(verdict)``; its return value is ignored
VerdictHook = Callable[[Verdict], object]


def call_hook(hook: VerdictHook, verdict: Verdict) -> None:
    """``hook(verdict)``, with a failure logged instead of raised."""
    try:
        hook(verdict)
    except Exception:
        log.exception(
            "scope=%s key=%s: a verdict hook failed (%r)",
            verdict.scope,
            verdict.key,
            hook,
            extra={"scope": verdict.scope, "key": verdict.key},
        )


def call_settled(
    on_execute: VerdictHook | None, on_replay: VerdictHook | None, verdicts: Iterable[Verdict]
) -> None:
    """``on_execute`` / ``on_replay`` for verdicts whose fate is settled: an acked execution,
    or a duplicate acked with the stored result. Any other verdict calls neither."""
    for verdict in verdicts:
        outcome = verdict.outcome
        if verdict.action is not Action.ACK or outcome is None:
            continue
        if outcome.kind not in (OutcomeKind.EXECUTED, OutcomeKind.REPLAYED):
            continue
        hook = on_replay if verdict.duplicate else on_execute
        if hook is not None:
            call_hook(hook, verdict)
