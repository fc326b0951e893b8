"""Every state change an operator cares about is one log line that names scope and key in its
text (a default formatter shows no ``extra``), with the reason."""

from __future__ import annotations

import asyncio
import logging

import pytest

from consumer_idem import Executed, NotExecuted, PostgresStore

FP = "v1:jcs:x"


def lines(caplog: pytest.LogCaptureFixture, scope: str, key: str) -> list[tuple[int, str]]:
    return [
        (r.levelno, r.getMessage())
        for r in caplog.records
        if r.getMessage().startswith(f"scope={scope} key={key}: ")
    ]


async def test_parked_zombie_reconciled_and_operator_lines(
    store: PostgresStore, scope: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="consumer_idem")

    d = await store.reserve(scope, "parked", FP)
    await store.mark_unknown(scope, "parked", d.token, "gateway timeout")
    [(level, text)] = lines(caplog, scope, "parked")
    assert level == logging.WARNING and "parked as unknown" in text and "gateway timeout" in text

    await store.reserve(scope, "zombie", FP, lease=0.05)
    await asyncio.sleep(0.1)
    await store.reserve(scope, "zombie", FP)  # the next delivery finds the lease expired
    [(level, text)] = lines(caplog, scope, "zombie")
    assert level == logging.WARNING and "lease expired" in text and "parked as unknown" in text

    await store.resolve(scope, "parked", Executed({"ok": True}))
    (level, text) = lines(caplog, scope, "parked")[-1]
    assert level == logging.INFO and text.endswith("reconciled: executed -> completed")

    await store.resolve(scope, "zombie", NotExecuted("no charge at the gateway"))
    (level, text) = lines(caplog, scope, "zombie")[-1]
    assert level == logging.INFO and "reconciled: not executed -> failed_retryable" in text

    d = await store.reserve(scope, "stuck", FP)
    await store.mark_unknown(scope, "stuck", d.token, "timeout")
    await store.reconciliation.hand_to_operator(scope, "stuck", "still unknown after 8 attempts")
    (level, text) = lines(caplog, scope, "stuck")[-1]
    assert level >= logging.WARNING and "handed to an operator" in text
    assert "still unknown after 8 attempts" in text
