"""The faults [`assert_idempotent`][consumer_idem.testing.assert_idempotent] plays around the
handler.

Some faults cannot be armed on a connection: an ``Ambiguous`` failure before or after the
handler's call, a lease that runs out while the handler runs (two-phase: the sweeper parks the
key ``unknown``), the server ending the unit's session (transactional), and the handler's own
external call taking effect and then failing. The kit wraps the handler under test to play the
one armed for the scenario, once.
"""

from __future__ import annotations

import asyncio
from typing import Any

from consumer_idem.errors import Ambiguous
from consumer_idem.stores.postgres.store import ConnectionPool, PostgresStore
from consumer_idem.testing.expectations import Findings, NotIdempotent
from consumer_idem.testing.external_faults import ExternalFaults, Handler
from consumer_idem.testing.scenarios import Scenario


class HandlerFaults:
    def __init__(
        self,
        pool: ConnectionPool,
        table: str,
        plain: PostgresStore,
        scope: str,
        events: list[str],
        calls: ExternalFaults,
        findings: Findings,
    ) -> None:
        self.pool = pool
        self.table = table
        self.plain = plain
        self.scope = scope
        #: faults and injections fired, in order (shared with the kit)
        self.events = events
        self.calls = calls
        self.findings = findings
        #: the scenario running now (its redeliveries and reconciliation included)
        self.scenario: Scenario | None = None
        self.inject: str | None = None
        #: an owner that can no longer answer (its delivery ended): its lease may run out now
        self.owner_dead = True

    def arm(self, scenario: Scenario) -> None:
        """``scenario`` runs now: arm its fault for the next handler call."""
        self.scenario = scenario
        self.calls.reset()
        self.inject = scenario.inject
        self.owner_dead = not scenario.concurrent

    def disarm(self) -> None:
        self.inject = None
        self.owner_dead = True

    def wrap(self, handler: Handler) -> Handler:
        faults = self

        async def under_test(work: Any, context: Any) -> Any:
            inject, faults.inject = faults.inject, None
            if inject == "ambiguous_before":
                faults.events.append("ambiguous failure before the call")
                raise Ambiguous("injected: the request may have left (a connect timeout)")
            if inject == "took_effect":
                return await faults.calls.took_effect(handler, work, context)
            if faults.calls.fired:
                return await faults._run_again(handler, work, context)
            result = await handler(work, context)
            if inject == "ambiguous_after":
                faults.events.append("ambiguous failure after the call")
                raise Ambiguous("injected: the call was made, its answer was lost")
            if inject == "lease_lost":
                faults.events.append("lease lost during the call")
                await faults.expire_lease(context.key)
                await faults.plain.maintenance.sweep()  # the sweeper parks it as unknown
            if inject == "session_killed":
                faults.events.append("the server ended the unit's session")
                await faults.terminate(context)
            return result

        under_test.__name__ = getattr(handler, "__name__", "handler")
        under_test.__doc__ = handler.__doc__
        return under_test

    async def _run_again(self, handler: Handler, work: Any, context: Any) -> Any:
        """The handler runs again after its call took effect and failed: it must make the
        call again (see `ExternalFaults.forgotten`)."""
        result = await self.calls.after_took_effect(handler, work, context)
        detail = self.calls.forgotten()
        if detail is not None:
            assert self.scenario is not None
            self.findings.note(NotIdempotent(self.scenario.name, detail))
        return result

    async def expire_lease(self, key: str) -> None:
        async with self.pool.acquire(timeout=10) as conn:
            await conn.execute(
                f"UPDATE {self.table} SET locked_until = now() - interval '1 second'"
                # the token says in progress (see migration 8): no partial index is implied
                " WHERE scope = $1 AND key = $2 AND owner_token IS NOT NULL",
                self.scope,
                key,
            )

    async def terminate(self, conn: Any) -> None:
        """End the unit's session from the server side, as an operator, a statement timeout or a
        failover does, and wait until its backend is gone (its transaction rolled back)."""
        pid = conn.get_server_pid()
        async with self.pool.acquire(timeout=10) as admin:
            await admin.execute("SELECT pg_terminate_backend($1)", pid)
            for _ in range(500):
                if not await admin.fetchval(
                    "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = $1)", pid
                ):
                    return
                await asyncio.sleep(0.01)
