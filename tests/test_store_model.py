"""A hypothesis state machine drives the real store and a plain in-memory model side by side.

Every decision and every final row must agree with the model.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from typing import Any

import asyncpg
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    multiple,
    rule,
)

from consumer_idem import (
    DecisionKind,
    Executed,
    LeaseLost,
    NotExecuted,
    NotUnknown,
    PostgresStore,
    PrunePolicy,
)

KEYS = st.sampled_from(["k1", "k2", "k3"])
FINGERPRINTS = st.sampled_from(["fp-a", "fp-b"])


@dataclass
class Row:
    fingerprint: str
    status: str
    token: uuid.UUID | None
    attempts: int = 1
    result: Any = None
    lease_expired: bool = False
    aged: bool = False


def make_machine(dsn: str) -> type[RuleBasedStateMachine]:
    class StoreModel(RuleBasedStateMachine):
        tokens = Bundle("tokens")

        def __init__(self) -> None:
            super().__init__()
            self.loop = asyncio.new_event_loop()
            self.pool: asyncpg.Pool = self.run(self._pool())
            self.store = PostgresStore(self.pool)
            self.scope = f"model-{uuid.uuid4().hex[:10]}"
            self.model: dict[str, Row] = {}

        async def _pool(self) -> asyncpg.Pool:
            # created inside the coroutine, so the pool binds to this machine's own loop
            return await asyncpg.create_pool(dsn, min_size=1, max_size=2)

        def run(self, coro: Any) -> Any:
            return self.loop.run_until_complete(coro)

        def teardown(self) -> None:
            self.run(self.pool.close())
            self.loop.close()

        # --- rules -----------------------------------------------------------------------

        @rule(target=tokens, key=KEYS, fp=FINGERPRINTS)
        def reserve(self, key: str, fp: str) -> Any:
            decision = self.run(self.store.reserve(self.scope, key, fp, lease=60))
            row = self.model.get(key)
            if row is None or row.status == "expired":
                expected = DecisionKind.EXECUTE
                self.model[key] = Row(fp, "in_progress", decision.record.owner_token)
            elif row.fingerprint != fp:
                expected = DecisionKind.MISUSE
            elif row.status == "completed":
                expected = DecisionKind.REPLAY
                assert decision.record.result == row.result
            elif row.status == "unknown":
                expected = DecisionKind.UNKNOWN
            elif row.status == "failed_retryable":
                expected = DecisionKind.EXECUTE
                row.status, row.token = "in_progress", decision.record.owner_token
                row.attempts += 1
                row.lease_expired = False
                row.aged = False  # re-acquired: it lives its full retention again
            elif row.lease_expired:
                expected = DecisionKind.UNKNOWN
                assert decision.zombie
                row.status, row.token, row.lease_expired = "unknown", None, False
            else:
                expected = DecisionKind.IN_PROGRESS
            assert decision.kind is expected, (decision.kind, expected, row)
            if decision.kind is DecisionKind.EXECUTE:
                return (key, decision.token)
            return multiple()

        def owned(self, key: str, token: uuid.UUID) -> Row | None:
            row = self.model.get(key)
            if row is not None and row.status == "in_progress" and row.token == token:
                return row
            return None

        @rule(held=consumes(tokens), result=st.integers(0, 1000))
        def complete(self, held: tuple[str, uuid.UUID], result: int) -> None:
            key, token = held
            row = self.owned(key, token)
            if row is None:
                with pytest.raises(LeaseLost):
                    self.run(self.store.complete(self.scope, key, token, result))
                return
            self.run(self.store.complete(self.scope, key, token, result))
            row.status, row.token, row.result, row.aged = "completed", None, result, False

        @rule(held=consumes(tokens), ambiguous=st.booleans())
        def fail(self, held: tuple[str, uuid.UUID], ambiguous: bool) -> None:
            key, token = held
            row = self.owned(key, token)
            op = self.store.mark_unknown if ambiguous else self.store.fail_retryable
            if row is None:
                with pytest.raises(LeaseLost):
                    self.run(op(self.scope, key, token))
                return
            self.run(op(self.scope, key, token))
            row.status, row.token = ("unknown" if ambiguous else "failed_retryable"), None

        @rule(key=KEYS, executed=st.booleans(), result=st.integers(0, 9))
        def resolve(self, key: str, executed: bool, result: int) -> None:
            row = self.model.get(key)
            resolution = Executed(result) if executed else NotExecuted()
            if row is None or row.status != "unknown":
                with pytest.raises(NotUnknown):
                    self.run(self.store.resolve(self.scope, key, resolution))
                return
            self.run(self.store.resolve(self.scope, key, resolution))
            if executed:
                row.status, row.result, row.aged = "completed", result, False
            else:  # free to run again, for its full retention
                row.status, row.aged = "failed_retryable", False

        @rule(key=KEYS)
        def expire_lease(self, key: str) -> None:
            row = self.model.get(key)
            if row is not None and row.status == "in_progress":
                self.run(
                    self.pool.execute(
                        f"UPDATE {self.store.table} SET locked_until = now() - interval '1 s'"
                        " WHERE scope = $1 AND key = $2",
                        self.scope,
                        key,
                    )
                )
                row.lease_expired = True

        @rule()
        def sweep(self) -> None:
            self.run(self.store.maintenance.sweep())
            for row in self.model.values():
                if row.status == "in_progress" and row.lease_expired:
                    row.status, row.token, row.lease_expired = "unknown", None, False

        @rule(key=KEYS)
        def age(self, key: str) -> None:
            if key in self.model:
                self.run(
                    self.pool.execute(
                        f"UPDATE {self.store.table} SET expires_at = now() - interval '1 s'"
                        " WHERE scope = $1 AND key = $2",
                        self.scope,
                        key,
                    )
                )
                self.model[key].aged = True

        @rule(soft=st.booleans())
        def prune(self, soft: bool) -> None:
            policy = PrunePolicy.SOFT if soft else PrunePolicy.DELETE
            self.run(self.store.maintenance.prune(policy=policy, audit_retention=0))
            for key, row in list(self.model.items()):
                if not row.aged or row.status in ("in_progress", "unknown"):
                    continue
                if soft and row.status != "expired":
                    row.status = "expired"  # audit_retention=0: already aged again
                else:
                    del self.model[key]

        # --- the store must agree with the model after every step ------------------------

        @invariant()
        def rows_match_model(self) -> None:
            rows = self.run(
                self.pool.fetch(
                    f"SELECT key, fingerprint, status, owner_token, attempts, result::text"
                    f" FROM {self.store.table} WHERE scope = $1",
                    self.scope,
                )
            )
            actual = {r["key"]: r for r in rows}
            assert set(actual) == set(self.model), (set(actual), self.model)
            for key, row in self.model.items():
                got = actual[key]
                assert got["status"] == row.status, (key, got, row)
                assert got["fingerprint"] == row.fingerprint
                if row.status != "expired":
                    assert got["attempts"] == row.attempts, (key, got, row)
                if row.status == "in_progress":
                    assert got["owner_token"] == row.token
                else:
                    assert got["owner_token"] is None
                if row.status == "completed":
                    assert got["result"] == str(row.result)

    return StoreModel


def test_store_agrees_with_reference_model(pg_dsn: str, store: PostgresStore) -> None:
    machine = make_machine(pg_dsn)
    machine.TestCase.settings = settings(
        max_examples=60,
        stateful_step_count=40,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    machine.TestCase().runTest()
