"""The testing kit for users' handlers (``consumer_idem.testing``), on the real PostgreSQL.

``assert_idempotent`` must pass a correct handler in every mode and catch unsafe ones, naming
the scenario; the ``idem_store`` fixture must give a migrated store in a schema of its own and
drop it (where it finds its PostgreSQL: ``test_testing_kit_plugin.py``).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import textwrap
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from consumer_idem import (
    Ambiguous,
    Attempt,
    ConsumerMessage,
    Executed,
    NotExecuted,
    PostgresStore,
    idempotent_consumer,
    savepoint,
)
from consumer_idem.testing import NotIdempotent, assert_idempotent, scenario_names
from consumer_idem.testing.postgres import DSN_ENV
from consumer_idem.types import Record

ROOT = Path(__file__).resolve().parent.parent

EFFECTS = "CREATE TABLE IF NOT EXISTS kit_effects (key text NOT NULL)"  # no unique: doubles show


def make_message() -> ConsumerMessage:
    key = uuid.uuid4().hex
    return ConsumerMessage(
        body=json.dumps({"key": key, "amount": 5}).encode(),
        headers={"idempotency-key": key.encode()},
    )


async def rows(conn: asyncpg.Connection, message: ConsumerMessage) -> int:
    count: int = await conn.fetchval(
        "SELECT count(*) FROM kit_effects WHERE key = $1", message.json()["key"]
    )
    return count


@pytest.fixture
async def store(idem_store: PostgresStore) -> PostgresStore:
    """The kit's fixture, with the handlers' table in its schema."""
    await idem_store.pool.execute(EFFECTS)
    return idem_store


# --- a correct handler passes, in every mode ----------------------------------------------------


async def test_a_correct_transactional_handler_passes(store: PostgresStore) -> None:
    @idempotent_consumer(store, scope="kit.book")
    async def book(message: ConsumerMessage, conn: asyncpg.Connection) -> dict[str, Any]:
        key = message.json()["key"]
        await conn.execute("INSERT INTO kit_effects VALUES ($1)", key)
        return {"booked": key}

    report = await assert_idempotent(book, make_message, rows)
    assert report.clean_effect == 1
    assert report.passed == scenario_names(book) and not report.not_applicable
    assert "lease lost" in report.passed and "commit rolled back" in report.passed


async def test_a_correct_batch_handler_passes(store: PostgresStore) -> None:
    @idempotent_consumer(store, scope="kit.batch", batch=True)
    async def book(messages: list[ConsumerMessage], conn: asyncpg.Connection) -> None:
        await conn.executemany(
            "INSERT INTO kit_effects VALUES ($1)", [(m.json()["key"],) for m in messages]
        )

    report = await assert_idempotent(book, make_message, rows)
    assert report.passed == scenario_names(book) and not report.not_applicable
    assert "duplicate in one batch" in report.passed


class Gateway:
    """A far side that dedupes by the idempotency key it is given (as real gateways do)."""

    def __init__(self) -> None:
        self.charges: dict[str, str] = {}  # idempotency key -> our key
        self.calls: Counter[str] = Counter()  # our key -> requests received

    async def charge(self, key: str, idempotency_key: str | None) -> dict[str, Any]:
        self.calls[key] += 1
        if idempotency_key is None:
            idempotency_key = uuid.uuid4().hex  # no key given: every request is a new charge
        self.charges.setdefault(idempotency_key, key)
        return {"charge": idempotency_key}

    def charged(self, key: str) -> int:
        return sum(1 for ours in self.charges.values() if ours == key)


async def test_a_correct_two_phase_handler_passes(store: PostgresStore) -> None:
    gateway = Gateway()

    @idempotent_consumer(store, scope="kit.charge", mode="two_phase")
    async def charge(message: ConsumerMessage, attempt: Attempt) -> dict[str, Any]:
        key = message.json()["key"]
        return await gateway.charge(key, attempt.downstream_key)

    async def effect(conn: asyncpg.Connection, message: ConsumerMessage) -> int:
        return gateway.charged(message.json()["key"])

    report = await assert_idempotent(charge, make_message, effect)
    assert report.clean_effect == 1
    # no local writes: the completion has no COMMIT of its own to roll back; and the call
    # was not given to the kit (external=): the kit cannot make it take effect, then fail
    skipped = ["commit rolled back", "the call took effect, then failed"]
    assert report.not_applicable == skipped
    assert report.passed == [n for n in scenario_names(charge) if n not in skipped]


async def test_two_phase_local_writes_and_a_reconciled_outcome(store: PostgresStore) -> None:
    """Local writes commit with the completion; when the completion is lost and reconciliation
    resolves the outcome "executed", the reconciler commits them with the resolution (it is
    given the consumer's ``local_writes``), so no local row is lost in any scenario."""
    gateway = Gateway()

    async def record(conn: asyncpg.Connection, result: Any) -> None:
        await conn.execute("INSERT INTO kit_effects VALUES ($1)", result["key"])

    @idempotent_consumer(store, scope="kit.local", mode="two_phase", local_writes=record)
    async def charge(message: ConsumerMessage, attempt: Attempt) -> dict[str, Any]:
        key = message.json()["key"]
        await gateway.charge(key, attempt.downstream_key)
        return {"key": key}

    async def effect(conn: asyncpg.Connection, message: ConsumerMessage) -> tuple[int, int]:
        return gateway.charged(message.json()["key"]), await rows(conn, message)

    async def ask_the_gateway(record: Record) -> Executed | NotExecuted:
        """The operator's resolver: it returns what the handler would have (its local writes
        need that result)."""
        if gateway.charged(record.key):
            return Executed({"key": record.key})
        return NotExecuted("the gateway has no such charge")

    report = await assert_idempotent(charge, make_message, effect, resolver=ask_the_gateway)
    assert report.clean_effect == (1, 1) and "crash before commit" in report.passed


async def test_a_store_on_an_sqlalchemy_engine_works_too(store: PostgresStore, pg_dsn: str) -> None:
    """The kit only acquires from the store's pool: an ``EnginePool`` adapter serves as well."""
    from sqlalchemy.ext.asyncio import create_async_engine

    from consumer_idem.sqlalchemy import EnginePool

    engine = create_async_engine(
        pg_dsn.replace("postgresql://", "postgresql+asyncpg://", 1),
        connect_args={"server_settings": {"search_path": store.schema}},
    )
    shared = PostgresStore(EnginePool(engine), schema=store.schema)

    @idempotent_consumer(shared, scope="kit.engine")
    async def book(message: ConsumerMessage, conn: asyncpg.Connection) -> None:
        await conn.execute("INSERT INTO kit_effects VALUES ($1)", message.json()["key"])

    try:
        report = await assert_idempotent(book, make_message, rows)
    finally:
        await engine.dispose()
    assert report.passed == scenario_names(book)


# --- unsafe handlers fail, naming the scenario ---------------------------------------------------


async def test_a_write_through_a_second_connection_is_caught(store: PostgresStore) -> None:
    pool = store.pool

    @idempotent_consumer(store, scope="kit.second")
    async def book(message: ConsumerMessage, conn: asyncpg.Connection) -> None:
        # autocommitted on its own connection: not rolled back with the unit
        await pool.execute("INSERT INTO kit_effects VALUES ($1)", message.json()["key"])

    with pytest.raises(NotIdempotent) as caught:
        await assert_idempotent(book, make_message, rows)
    assert caught.value.scenario == "crash before commit"
    assert "not in the idempotency transaction" in str(caught.value)
    assert "the effect is 1 where it was 0" in str(caught.value)


async def test_an_external_call_in_transactional_mode_is_caught(store: PostgresStore) -> None:
    emails: Counter[str] = Counter()  # a mail service: the call cannot be rolled back

    @idempotent_consumer(store, scope="kit.email")
    async def book(message: ConsumerMessage, conn: asyncpg.Connection) -> None:
        key = message.json()["key"]
        await conn.execute("INSERT INTO kit_effects VALUES ($1)", key)
        emails[key] += 1  # "send the confirmation e-mail"

    async def effect(conn: asyncpg.Connection, message: ConsumerMessage) -> tuple[int, int]:
        return await rows(conn, message), emails[message.json()["key"]]

    with pytest.raises(NotIdempotent) as caught:
        await assert_idempotent(book, make_message, effect)
    assert caught.value.scenario == "crash before commit"
    assert "the effect is (0, 1) where it was (0, 0)" in str(caught.value)


async def test_a_handler_ending_the_transaction_itself_is_caught(store: PostgresStore) -> None:
    @idempotent_consumer(store, scope="kit.commits")
    async def book(message: ConsumerMessage, conn: asyncpg.Connection) -> None:
        await conn.execute("INSERT INTO kit_effects VALUES ($1)", message.json()["key"])
        await conn.execute("COMMIT")  # "make sure it is saved"

    with pytest.raises(NotIdempotent) as caught:
        await assert_idempotent(book, make_message, rows)
    assert caught.value.scenario == "clean delivery"
    assert "duplicate" in str(caught.value)  # its own COMMIT took the claim: never "executed"


async def test_a_handler_swallowing_a_database_error_is_caught(store: PostgresStore) -> None:
    @idempotent_consumer(store, scope="kit.swallows")
    async def book(message: ConsumerMessage, conn: asyncpg.Connection) -> None:
        try:
            async with savepoint(conn):
                await conn.execute("INSERT INTO kit_effects VALUES ($1)", message.json()["key"])
        except asyncpg.PostgresError:
            pass  # "it is only the audit row": the message is acked without its effect

    with pytest.raises(NotIdempotent) as caught:
        await assert_idempotent(book, make_message, rows)
    assert caught.value.scenario == "server refuses a handler statement"
    assert "the effect is 0; one clean delivery gives 1" in str(caught.value)


async def test_an_in_memory_dedupe_is_caught(store: PostgresStore) -> None:
    seen: set[str] = set()

    @idempotent_consumer(store, scope="kit.seen")
    async def book(message: ConsumerMessage, conn: asyncpg.Connection) -> None:
        key = message.json()["key"]
        if key in seen:  # "already handled": but that attempt was rolled back
            return
        seen.add(key)
        await conn.execute("INSERT INTO kit_effects VALUES ($1)", key)

    with pytest.raises(NotIdempotent) as caught:
        await assert_idempotent(book, make_message, rows)
    assert caught.value.scenario == "crash before commit"
    assert "after redelivery, the effect is 0; one clean delivery gives 1" in str(caught.value)


async def test_a_two_phase_call_without_the_downstream_key_is_caught(
    store: PostgresStore,
) -> None:
    gateway = Gateway()

    @idempotent_consumer(store, scope="kit.nokey", mode="two_phase")
    async def charge(message: ConsumerMessage, attempt: Attempt) -> None:
        await gateway.charge(message.json()["key"], None)  # no downstream key

    async def resolver(record: Record) -> Executed | NotExecuted:
        # the operator's resolver asks the gateway by the key the handler should have sent
        done = Attempt(record.scope, record.key, uuid.uuid4(), 1).downstream_key
        return Executed(None) if done in gateway.charges else NotExecuted("no such charge")

    async def effect(conn: asyncpg.Connection, message: ConsumerMessage) -> int:
        return gateway.charged(message.json()["key"])

    with pytest.raises(NotIdempotent) as caught:
        await assert_idempotent(charge, make_message, effect, resolver=resolver)
    # the completion was lost; the resolver, asking by the key, answers "not executed"; the
    # re-sent original charges again
    assert caught.value.scenario == "crash before commit"
    assert "the effect is 2; one clean delivery gives 1" in str(caught.value)


async def test_the_default_resolver_reads_the_truth_from_effect(store: PostgresStore) -> None:
    """Without a resolver, an ambiguous outcome is settled by what effect() shows: executed when
    the effect is there (not run again), not executed when it is not (run once more)."""
    gateway = Gateway()

    @idempotent_consumer(store, scope="kit.ambiguous", mode="two_phase")
    async def charge(message: ConsumerMessage, attempt: Attempt) -> None:
        await gateway.charge(message.json()["key"], attempt.downstream_key)

    async def effect(conn: asyncpg.Connection, message: ConsumerMessage) -> int:
        return gateway.charged(message.json()["key"])

    wanted = ["ambiguous failure before the call", "ambiguous failure after the call"]
    report = await assert_idempotent(charge, make_message, effect, scenarios=wanted)
    assert report.passed == ["clean delivery", *wanted]
    # clean delivery 1 call; before the call: 0 then 1 after "not executed"; after: 1, settled
    assert sorted(gateway.calls.values()) == [1, 1, 1]


async def test_a_handler_that_raises_ambiguous_for_everything_is_caught(
    store: PostgresStore,
) -> None:
    @idempotent_consumer(store, scope="kit.always")
    async def book(message: ConsumerMessage, conn: asyncpg.Connection) -> None:
        raise Ambiguous("every time")

    with pytest.raises(NotIdempotent) as caught:
        await assert_idempotent(book, make_message, rows)
    assert caught.value.scenario == "clean delivery"


async def test_usage_errors_are_not_reported_as_unsafe_handlers(store: PostgresStore) -> None:
    @idempotent_consumer(store, scope="kit.usage")
    async def book(message: ConsumerMessage, conn: asyncpg.Connection) -> None:
        await conn.execute("INSERT INTO kit_effects VALUES ($1)", message.json()["key"])

    same = make_message()
    with pytest.raises(ValueError, match="twice"):
        await assert_idempotent(book, lambda: same.fresh(), rows)

    async def blind(conn: asyncpg.Connection, message: ConsumerMessage) -> int:
        return 0

    with pytest.raises(NotIdempotent, match="does not see the handler's effect"):
        await assert_idempotent(book, make_message, blind)
    with pytest.raises(ValueError, match="no such scenario"):
        await assert_idempotent(book, make_message, rows, scenarios=["crash in the middle"])


# --- the fixture -------------------------------------------------------------------------------


async def test_the_store_fixture_is_migrated_in_a_schema_of_its_own(
    idem_store: PostgresStore,
) -> None:
    schema = idem_store.schema
    assert schema.startswith("ci_test_") and schema != "consumer_idem"
    assert await idem_store.pool.fetchval("SELECT current_schema()") == schema
    await idem_store.check_schema()  # migrated to this library's version
    await idem_store.pool.execute("CREATE TABLE mine (x int)")  # lands in that schema
    table = await idem_store.pool.fetchval("SELECT to_regclass($1)", f"{schema}.mine")
    assert table is not None


def run_pytest(test: str, tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Run pytest on ``test`` in a fresh process, as a user of the installed package would: the
    plugin comes from the ``pytest11`` entry point, nothing from this repository's conftest."""
    path = tmp_path / "test_user.py"
    path.write_text(textwrap.dedent(test))
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CONSUMER_IDEM_", "PYTEST"))}
    return {**env, **extra}


async def test_the_fixture_drops_its_schema_afterwards(pg_dsn: str, tmp_path: Path) -> None:
    seen = tmp_path / "schema.txt"
    test = f"""
        import pytest

        @pytest.mark.asyncio
        async def test_uses_it(idem_store):
            await idem_store.pool.execute("CREATE TABLE mine (x int)")
            open({str(seen)!r}, "w").write(idem_store.schema)
    """
    result = await asyncio.to_thread(run_pytest, test, tmp_path, clean_env(**{DSN_ENV: pg_dsn}))
    assert result.returncode == 0, result.stdout + result.stderr
    schema = seen.read_text()
    conn = await asyncpg.connect(pg_dsn)
    try:
        left = await conn.fetchval("SELECT count(*) FROM pg_namespace WHERE nspname = $1", schema)
    finally:
        await conn.close()
    assert schema.startswith("ci_test_") and left == 0


async def test_the_readme_example_passes_as_a_user_runs_it(pg_dsn: str) -> None:
    """``examples/test_handler_idempotency.py`` (the README's example) in a pytest of its own,
    with only ``CONSUMER_IDEM_PG_DSN`` set, as the README says to run it."""
    example = ROOT / "examples" / "test_handler_idempotency.py"
    result = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(example)],
        cwd=ROOT,
        env=clean_env(**{DSN_ENV: pg_dsn}),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 passed" in result.stdout


def test_the_docs_show_the_example_as_it_is() -> None:
    """A code block opening with ``# examples/test_handler_idempotency.py`` (README, docs) is
    that file's text, verbatim: the file is run, so the block cannot rot either."""
    example = (ROOT / "examples" / "test_handler_idempotency.py").read_text()
    marker = "# examples/test_handler_idempotency.py\n"
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    texts = [doc.read_text() for doc in docs if doc.exists()]
    blocks = [
        block.removeprefix(marker)
        for text in texts
        for block in re.findall(r"```python\n(.*?)```", text, re.S)
        if block.startswith(marker)
    ]
    assert blocks or any("examples/test_handler_idempotency.py" in t for t in texts)
    for block in blocks:
        assert block in example, f"the docs show another text than the example file:\n{block}"
