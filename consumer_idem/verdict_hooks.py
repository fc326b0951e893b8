"""``on_execute`` and ``on_replay``: a consumer's callbacks on the verdict of a delivery whose
handler ran and committed, or that replayed a stored result (for metrics, headers, logs).

A hook runs synchronously, after the outcome is settled in the store, so it sees only what
happened: an ``on_execute`` call is one real execution. It must not block. What it raises is
logged and dropped: the effect is committed, so a failing counter never turns into a retry."""

from __future__ import annotations

import logging
from collections.abc import Callable

from consumer_idem.verdict import Verdict

__all__ = ["VerdictHook", "call_hook"]

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
