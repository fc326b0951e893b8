"""Who caused a database error decides what happens to the message (issue 33).

Each SQLSTATE class on the boundary is produced by a real PostgreSQL: only what the message's
data caused (classes 22, 23, 54) is :class:`StoreRejected` (dead-letter); read-only, recovery,
prepared statements gone or duplicated (a transaction pooler), unsupported features, syntax
and everything else wait (:class:`StoreUnavailable`). A read-only database is waited out,
said once, and its connections let go so that the pool finds the writable server again.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import asyncpg
import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from consumer_idem import (
    MAX_RETENTION,
    Action,
    Attempt,
    ConsumerMessage,
    OutcomeKind,
    PostgresStore,
    fingerprint_json,
    header,
    idempotent_consumer,
    run_two_phase,
)
from consumer_idem.completion_waiters import waiters_for
from consumer_idem.errors import (
    ConfigurationError,
    SchemaMissing,
    StoreRejected,
    StoreUnavailable,
)
from consumer_idem.http import IdempotencyMiddleware, idempotent
from consumer_idem.stores.postgres.errors import (
    describe,
    is_database_outage,
    kind_of,
    wrong_node,
)
from consumer_idem.transports.delivery_budget import DeliveryBudget
from tests._failover import FailoverPair, on_database
from tests._wraparound import end_episode, takes_writes, until_writable, wrapped_cluster

FP = fingerprint_json({"n": 1})


def msg(key: str, body: Any) -> ConsumerMessage:
    return ConsumerMessage(
        body=json.dumps(body).encode(), headers={"idempotency-key": key.encode()}
    )


async def error_of(conn: asyncpg.Connection, sql: str) -> asyncpg.PostgresError:
    """The error a real server answers ``sql`` with (run in a transaction rolled back)."""
    with pytest.raises(asyncpg.PostgresError) as raised:
        async with conn.transaction():
            await conn.execute(sql)
    return raised.value


@pytest.fixture
async def conn(pg_pool: asyncpg.Pool) -> AsyncIterator[asyncpg.Connection]:
    async with pg_pool.acquire() as c:
        yield c


#: (what, SQL that makes a real server answer with it, its SQLSTATE, the library's error)
CASES = [
    ("division by zero", "SELECT 1 / 0", "22012", StoreRejected),
    ("invalid text", "SELECT 'x'::int", "22P02", StoreRejected),
    ("NUL in jsonb", "SELECT '\"\\u0000\"'::jsonb", "22P05", StoreRejected),
    (
        "unique violation",
        "CREATE TEMP TABLE u (k int PRIMARY KEY); INSERT INTO u VALUES (1), (1)",
        "23505",
        StoreRejected,
    ),
    (
        "index row too big",
        "CREATE TEMP TABLE big (t text); CREATE INDEX ON big (t);"
        " INSERT INTO big SELECT string_agg(md5(random()::text), '') FROM generate_series(1, 400)",
        "54000",
        StoreRejected,
    ),
    (
        "read-only transaction",
        "SET LOCAL transaction_read_only = on; CREATE TEMP TABLE ro (k int)",
        "25006",
        StoreUnavailable,
    ),
    ("prepared statement missing", "EXECUTE consumer_idem_gone", "26000", StoreUnavailable),
    (
        "prepared statement twice",
        "PREPARE ci_twice AS SELECT 1; PREPARE ci_twice AS SELECT 1",
        "42P05",
        StoreUnavailable,
    ),
    (
        "feature not supported",
        "SELECT count(*) FROM pg_class FOR UPDATE",
        "0A000",
        StoreUnavailable,
    ),
    ("syntax error", "SELEC 1", "42601", StoreUnavailable),
    ("undefined table", "SELECT * FROM consumer_idem_no_such_table", "42P01", SchemaMissing),
]


@pytest.mark.parametrize(
    ("what", "sql", "state", "kind"),
    CASES,
    ids=[c[0] for c in CASES],
)
async def test_only_what_the_data_caused_is_rejected(
    conn: asyncpg.Connection, what: str, sql: str, state: str, kind: type
) -> None:
    exc = await error_of(conn, sql)
    assert exc.sqlstate == state, (what, exc)
    assert kind_of(exc) is kind, (what, exc)
    assert wrong_node(exc) is (state == "25006")
    # a prepared statement gone or there twice names the likely cause and its setting
    assert ("pooler='transaction'" in describe("claim", exc)) is (state in ("26000", "42P05"))


async def test_the_handlers_own_sql_bug_is_its_failure_and_a_read_only_server_an_outage(
    conn: asyncpg.Connection,
) -> None:
    # class 42 in a handler's own statement: its code is wrong, waiting never cures it
    assert not is_database_outage(await error_of(conn, "SELEC 1"))
    assert not is_database_outage(await error_of(conn, "SELECT 1 / 0"))
    read_only = "SET LOCAL transaction_read_only = on; CREATE TEMP TABLE ro (k int)"
    assert is_database_outage(await error_of(conn, read_only))
    assert is_database_outage(await error_of(conn, "EXECUTE consumer_idem_gone"))
    # the server's own words for a standby or a server starting up, as asyncpg raises them
    assert kind_of(asyncpg.exceptions.CannotConnectNowError("in recovery")) is StoreUnavailable
    assert wrong_node(asyncpg.exceptions.CannotConnectNowError("in recovery"))
    assert kind_of(asyncpg.exceptions.InternalServerError("XX000")) is StoreUnavailable


async def test_no_host_of_the_wanted_kind_is_an_outage_of_the_wrong_node(pg_dsn: str) -> None:
    # what target_session_attrs=read-write answers while no host is the primary, made real
    # with the one attribute our only server lacks
    with pytest.raises(asyncpg.exceptions.TargetServerAttributeNotMatched) as raised:
        await asyncpg.connect(pg_dsn, target_session_attrs="read-only")
    assert kind_of(raised.value) is StoreUnavailable and wrong_node(raised.value)


async def test_a_read_only_database_is_waited_out_said_once_and_resumed(
    own_database: str, caplog: pytest.LogCaptureFixture
) -> None:
    admin = await asyncpg.connect(own_database)
    pool = await asyncpg.create_pool(own_database, min_size=2, max_size=2)
    try:
        store = PostgresStore(pool)
        await store.migrate()
        await admin.execute("CREATE TABLE booked (key text PRIMARY KEY)")

        @idempotent_consumer(store, scope="ro", max_attempts=1, backoff=(0.01, 0.05))
        async def book(message: ConsumerMessage, c: asyncpg.Connection) -> None:
            await c.execute("INSERT INTO booked VALUES ($1)", json.loads(message.body)["k"])

        database = (await admin.fetchval("SELECT current_database()")).replace('"', '""')
        # what a demoted primary or a maintenance window answers: every write 25006
        await admin.execute(f'ALTER DATABASE "{database}" SET default_transaction_read_only = on')
        await pool.expire_connections()  # sessions take the database's default at connect
        caplog.set_level(logging.DEBUG, logger="consumer_idem")
        waits = [await book.process(msg(f"k{i}", {"k": f"k{i}"})) for i in range(6)]
        assert [v.action for v in waits] == [Action.RETRY] * 6, waits
        assert {v.reason for v in waits} == {"store_unavailable"}
        # one warning for the episode, none per delivery
        said = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(said) == 1, [r.getMessage() for r in said]
        assert "cannot take writes" in said[0].getMessage()
        assert "target_session_attrs=read-write" in said[0].getMessage()

        await admin.execute(f'ALTER DATABASE "{database}" RESET default_transaction_read_only')
        # no reconnect of ours: the store lets go of each read-only session it meets, so a
        # retry or two later (a session opened during the episode) every delivery goes through
        tries = 0
        for i in range(6):
            verdict = await book.process(msg(f"k{i}", {"k": f"k{i}"}))
            while verdict.action is Action.RETRY and tries < 4:
                tries += 1
                verdict = await book.process(msg(f"k{i}", {"k": f"k{i}"}))
            assert verdict.action is Action.ACK, verdict
        assert await admin.fetchval("SELECT count(*) FROM booked") == 6
    finally:
        await pool.close()
        await admin.close()


async def test_store_calls_on_its_own_pooled_connections_wait_out_a_standby_and_let_it_go(
    failover_pair: FailoverPair,
) -> None:
    """A DSN that reaches the hot standby (a stale name after a fail-over): the writes the store
    makes on a connection of its own pool (the delivery budget's count, its claim probe) are an
    outage to wait out, like those on a connection the handler holds, and the standby's session
    is closed so that the pool's next connection can find the writable node."""
    primary = await asyncpg.create_pool(
        on_database(failover_pair.primary_dsn, failover_pair.database), min_size=1, max_size=1
    )
    standby = await asyncpg.create_pool(
        on_database(failover_pair.standby_dsn, failover_pair.database), min_size=1, max_size=1
    )
    try:
        await PostgresStore(primary).migrate()
        store = PostgresStore(standby)
        for _ in range(100):  # the standby replays the migration
            if await standby.fetchval("SELECT to_regclass('consumer_idem.delivery_attempts')"):
                break
            await asyncio.sleep(0.05)

        @idempotent_consumer(store, scope="sb", key=header("idempotency-key"))
        async def handle(conn: asyncpg.Connection) -> None:
            raise AssertionError("never runs on a standby")

        budget = DeliveryBudget(handle, 1)
        session = await standby.fetchval("SELECT pg_backend_pid()")
        with pytest.raises(StoreUnavailable, match="read-only"):
            await budget.attempts.count("sb", "k", 1)
        assert await standby.fetchval("SELECT pg_backend_pid()") != session, "not let go"
        with pytest.raises(StoreUnavailable, match="read-only"):
            await store.fast_path.probe_claim("sb", "k")
        verdict = await budget.admit("k", [])
        assert verdict is not None
        assert (verdict.action, verdict.reason) == (Action.RETRY, "store_unavailable")
        # the HTTP wait= path's LISTEN, refused during recovery, on a connection of its own
        session = await standby.fetchval("SELECT pg_backend_pid()")
        with pytest.raises(StoreUnavailable, match="recovery"):
            async with waiters_for(store).watch("sb", "k"):
                raise AssertionError("listening on a standby")
        assert await standby.fetchval("SELECT pg_backend_pid()") != session, "not let go"
    finally:
        await standby.close()
        await primary.close()


async def test_two_phase_local_writes_wait_out_a_read_only_server_and_park_their_own_bug(
    store: PostgresStore, scope: str
) -> None:
    """After the external call, the work's local writes commit with the completion: a server
    that cannot take writes is waited out (the delivery comes again and completes), while a
    syntax error of the handler's own SQL is its own failure: parked ``unknown`` for
    reconciliation, never waited on for ever."""

    async def charge(attempt: Attempt) -> Any:
        return {"charged": True}

    async def read_only(conn: asyncpg.Connection, result: Any) -> None:
        await conn.execute("SET LOCAL transaction_read_only = on; CREATE TEMP TABLE ro (k int)")

    with pytest.raises(StoreUnavailable):
        await run_two_phase(store, scope, "ro", FP, charge, local_writes=read_only)

    async def buggy(conn: asyncpg.Connection, result: Any) -> None:
        await conn.execute("INSERT INTO nowhere VALUES (")

    outcome = await run_two_phase(store, scope, "bug", FP, charge, local_writes=buggy)
    assert outcome.kind is OutcomeKind.UNKNOWN and outcome.parked_now


async def test_a_server_refusing_every_write_for_xid_wraparound_is_waited_out() -> None:
    """SQLSTATE 54000 is the class of "this key's index row is too big" and also of the
    server's XID wraparound protection, which refuses every write until vacuum catches up:
    before blaming the message, the store asks the server for a write that carries no message
    data, so the delivery waits (never dead-lettered) and goes through once writes are taken."""

    async def prepare(dsn: str) -> None:
        pool = await asyncpg.create_pool(dsn, min_size=1, max_size=1)
        try:
            await PostgresStore(pool).migrate()
            await pool.execute("CREATE TABLE booked (key text PRIMARY KEY)")
        finally:
            await pool.close()

    async with wrapped_cluster(prepare) as cluster:
        pool = await asyncpg.create_pool(cluster.dsn, min_size=1, max_size=2)
        try:
            store = PostgresStore(pool)

            @idempotent_consumer(store, scope="wrap", max_attempts=1, backoff=(0.01, 0.05))
            async def book(message: ConsumerMessage, c: asyncpg.Connection) -> None:
                await c.execute("INSERT INTO booked VALUES ($1)", json.loads(message.body)["k"])

            assert not await takes_writes(cluster.dsn)  # the episode is on
            verdicts = [await book.process(msg(f"k{i}", {"k": f"k{i}"})) for i in range(3)]
            assert [v.action for v in verdicts] == [Action.RETRY] * 3, verdicts
            assert {v.reason for v in verdicts} == {"store_unavailable"}
            with pytest.raises(StoreUnavailable, match="VACUUM"):
                await store.run("claim", "wrap", None, lambda c: c.execute("SELECT 1 / 0"))

            await end_episode(cluster)
            await until_writable(cluster.dsn)
            for i in range(3):
                verdict = await book.process(msg(f"k{i}", {"k": f"k{i}"}))
                assert verdict.action is Action.ACK, verdict
            assert await pool.fetchval("SELECT count(*) FROM booked") == 3
            # a server that takes writes: a refusal of the data is the data's again
            with pytest.raises(StoreRejected):
                await store.run("claim", "wrap", None, lambda c: c.execute("SELECT 1 / 0"))
        finally:
            await pool.close()


async def test_an_http_endpoint_on_a_read_only_database_answers_503_and_says_it_once(
    own_database: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The HTTP middleware meets a read-only episode as the consumer does: every request is
    503 (nothing recorded, nothing run) and the log says so once for the episode, not once
    per request."""
    admin = await asyncpg.connect(own_database)
    pool = await asyncpg.create_pool(own_database, min_size=1, max_size=4)
    runs: list[str] = []
    try:
        store = PostgresStore(pool)
        await store.migrate()

        async def create(request: Request) -> Any:
            runs.append(request.state.idempotency.key)
            return JSONResponse({"ok": True}, status_code=201)

        app = Starlette(routes=[Route("/things", idempotent()(create), methods=["POST"])])
        app.add_middleware(IdempotencyMiddleware, store=store, shared_keys=True)
        database = (await admin.fetchval("SELECT current_database()")).replace('"', '""')
        await admin.execute(f'ALTER DATABASE "{database}" SET default_transaction_read_only = on')
        await pool.expire_connections()
        caplog.set_level(logging.DEBUG, logger="consumer_idem")
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            codes = [
                (
                    await client.post("/things", json={}, headers={"Idempotency-Key": f"k{i}"})
                ).status_code
                for i in range(6)
            ]
        assert codes == [503] * 6 and runs == []
        said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(said) == 1, said
        assert "cannot take writes" in said[0]
    finally:
        await pool.close()
        await admin.close()


async def test_a_retention_no_expiry_can_be_dated_for_is_refused_at_set_up_not_each_message(
    store: PostgresStore, scope: str
) -> None:
    """``timedelta.max`` ("keep for ever") made every claim fail with "timestamp out of range",
    a data exception: each message was dead-lettered for a setting. It is refused where it is
    set; :data:`MAX_RETENTION` keeps records for ever and every message goes through."""
    with pytest.raises(ConfigurationError, match="MAX_RETENTION"):
        PostgresStore(store.pool, retention=timedelta.max)
    with pytest.raises(ConfigurationError, match="MAX_RETENTION"):
        idempotent_consumer(store, scope=scope, retention=timedelta.max)
    # a lease dates a record the same way (its locked_until)
    with pytest.raises(ConfigurationError, match=r"lease=.*MAX_RETENTION"):
        PostgresStore(store.pool, lease=timedelta.max)
    with pytest.raises(ConfigurationError, match=r"lease=.*MAX_RETENTION"):
        idempotent_consumer(store, scope=scope, mode="two_phase", lease=timedelta.max)
    # a policy is asked per scope: its answer is checked where it is used, never blamed on data
    policed = PostgresStore(store.pool, retention=lambda scope: timedelta.max)
    with pytest.raises(ConfigurationError, match="MAX_RETENTION"):
        policed.retention_for(scope)

    @idempotent_consumer(store, scope=scope, retention=MAX_RETENTION)
    async def book(message: ConsumerMessage, c: asyncpg.Connection) -> None:
        return None

    verdict = await book.process(msg("forever", {"n": 1}))
    assert verdict.action is Action.ACK, verdict
    years = await store.pool.fetchval(
        f"SELECT extract(year FROM expires_at) - extract(year FROM now()) FROM {store.table}"
        " WHERE scope = $1 AND key = 'forever'",
        scope,
    )
    assert years >= 9_999
