"""Long CLI commands as an operator lives with them: progress on a terminal and in a pipe,
honest endings (summary, exit code), failures that stay findable, a dry run that logs nothing,
and one clear line for a missing schema. Real subprocesses against Postgres, Kafka, RabbitMQ."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import uuid
from typing import Any

import aio_pika
import asyncpg
import pytest
from aiokafka import AIOKafkaProducer

from consumer_idem import PostgresStore
from consumer_idem.cli.settings import Settings
from tests._cli import PIPE, TERMINAL, cli
from tests._cli_handlers import buggy_consumer
from tests._payments import read_topic, wait_until

HANDLER = "tests._cli_handlers:buggy_consumer"


@pytest.fixture
def cli_scope(monkeypatch: pytest.MonkeyPatch) -> str:
    """A scope for the handler the CLI loads (and for this process's copy of it)."""
    scope = f"cli-ops-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("CLI_TEST_SCOPE", scope)
    return scope


async def send(producer: AIOKafkaProducer, topic: str, items: list[tuple[str | None, Any]]) -> None:
    for key, body in items:
        headers = [] if key is None else [("idempotency-key", key.encode())]
        value = body if isinstance(body, bytes) else json.dumps(body).encode()
        await producer.send_and_wait(topic, value=value, headers=headers)


async def test_a_replay_failure_is_dead_lettered_again_and_runs_after_the_fix(
    pg_dsn: str,
    store: PostgresStore,
    settings: Settings,
    kafka_topic_factory: Any,
    kafka_producer: AIOKafkaProducer,
    cli_scope: str,
) -> None:
    consumer = buggy_consumer(store)
    from consumer_idem import ConsumerMessage

    done = ConsumerMessage(b'{"id": 2}', {"idempotency-key": b"k-done"})
    assert (await consumer.process(done)).action.value == "ack"
    dlq = await kafka_topic_factory("cli.replay")
    await send(
        kafka_producer,
        dlq,
        [("k-new", {"id": 1}), ("k-done", {"id": 2}), ("k-fail", {"id": 3, "fail": True})],
    )
    args: tuple[str, ...] = ("replay", "--transport", "kafka", "--source", dlq)
    args += ("--handler", HANDLER, "--group", f"{dlq}-g", "--json")

    code, out, err = await cli(*args, dsn=pg_dsn)
    assert code == 1, err  # partial failure
    data = json.loads(out)
    assert (data["read"], data["total"], data["execute"], data["skip"]) == (3, 3, 1, 1)
    assert (data["failed"], data["redead_lettered"], data["interrupted"]) == (1, 1, False)
    [problem] = data["problems"]
    assert (problem["key"], problem["reason"]) == ("k-fail", "failed_retryable")
    assert "handler bug" in problem["error"] and problem["position"].startswith(dlq)
    # one line per state change, naming scope and key: the record failed, the copy went back
    lines = [x for x in err.splitlines() if f"scope={cli_scope} key=k-fail" in x]
    assert len(lines) == 2 and all(" WARNING " in x for x in lines), lines
    assert "recorded as failed_retryable" in lines[0]
    assert "replay did not settle it" in lines[1] and "dead-lettered again" in lines[1]

    # the copy waits at the end of the topic, with the reason and its original coordinates
    records = await read_topic(settings.kafka_bootstrap, dlq, 4)
    copy = dict(records[3].headers)
    assert copy["idempotency-key"] == b"k-fail"
    assert copy["x-dead-letter-reason"] == b"failed_retryable"
    assert b"handler bug" in copy["x-dead-letter-error"]
    assert copy["x-original-topic"] == dlq.encode() and copy["x-original-offset"] == b"2"

    code, out, _ = await cli(*args, dsn=pg_dsn)  # the same group meets only the copy
    assert code == 1 and json.loads(out)["read"] == 1 and json.loads(out)["failed"] == 1

    code, out, err = await cli(*args, dsn=pg_dsn, CLI_TEST_FIXED="1")  # the fix is deployed
    assert code == 0, err
    data = json.loads(out)
    assert (data["read"], data["execute"], data["failed"]) == (1, 1, 0)
    record = await store.get(cli_scope, "k-fail")
    assert record is not None and record.status.value == "completed"

    code, out, _ = await cli(*args, dsn=pg_dsn)
    assert code == 0 and json.loads(out)["read"] == 0


async def test_a_rabbit_replay_failure_goes_back_to_the_queue_with_its_reason(
    pg_dsn: str,
    store: PostgresStore,
    amqp_connection: aio_pika.abc.AbstractConnection,
    queue_name: str,
    cli_scope: str,
) -> None:
    channel = await amqp_connection.channel(publisher_confirms=True)
    queue = await channel.declare_queue(
        queue_name, durable=True, arguments={"x-queue-type": "quorum"}
    )
    for key, body in [("r-ok", {"id": 1}), ("r-fail", {"id": 2, "fail": True})]:
        await channel.default_exchange.publish(
            aio_pika.Message(
                json.dumps(body).encode(), headers={"idempotency-key": key}, message_id=key
            ),
            routing_key=queue_name,
        )
    args = ("replay", "--transport", "rabbit", "--source", queue_name, "--handler", HANDLER)
    try:
        code, out, err = await cli(*args, "--json", dsn=pg_dsn)
        assert code == 1, err
        data = json.loads(out)
        assert (data["read"], data["execute"], data["failed"], data["redead_lettered"]) == (
            2,
            1,
            1,
            1,
        )
        left = await queue.get(no_ack=False)
        assert left is not None and left.headers["idempotency-key"] == "r-fail"
        assert left.headers["x-dead-letter-reason"] == "failed_retryable"
        assert "handler bug" in str(left.headers["x-dead-letter-error"])
        assert left.message_id == "r-fail"  # its properties came along
        await left.nack(requeue=True)

        code, out, err = await cli(*args, "--json", dsn=pg_dsn, CLI_TEST_FIXED="1")
        assert code == 0, err
        assert (json.loads(out)["read"], json.loads(out)["execute"]) == (1, 1)
        assert (
            await channel.declare_queue(queue_name, passive=True)
        ).declaration_result.message_count == 0
    finally:
        await queue.delete(if_unused=False, if_empty=False)
        await channel.close()


async def test_a_dry_run_changes_nothing_and_logs_nothing(
    pg_dsn: str,
    store: PostgresStore,
    kafka_topic_factory: Any,
    kafka_producer: AIOKafkaProducer,
    cli_scope: str,
) -> None:
    consumer = buggy_consumer(store)
    from consumer_idem import ConsumerMessage

    await consumer.process(ConsumerMessage(b'{"id": 2}', {"idempotency-key": b"k-done"}))
    dlq = await kafka_topic_factory("cli.dry")
    await send(
        kafka_producer,
        dlq,
        [
            (None, {"id": 1}),  # no key: a real run dead-letters it
            ("k-text", b"not json"),  # not JSON: likewise
            ("k-done", {"id": 99}),  # the key of another payload: misuse
            ("k-fail", {"id": 3, "fail": True}),  # would execute (and fail)
        ],
    )
    args = ("-v", "replay", "--transport", "kafka", "--source", dlq, "--handler", HANDLER)
    for _ in range(2):  # and again: nothing was committed, the same four are read
        code, out, err = await cli(*args, "--dry-run", "--json", dsn=pg_dsn)
        assert code == 0, err
        data = json.loads(out)
        assert (data["read"], data["invalid"], data["misuse"], data["execute"]) == (4, 2, 1, 1)
        assert data["redead_lettered"] == 0 and len(data["problems"]) == 3
        # even at INFO (-v), a dry run logs no action: nothing dead-lettered, nothing parked
        assert "dead-letter" not in err.lower() and "WARNING" not in err and "INFO" not in err
    assert await store.get(cli_scope, "k-fail") is None


async def test_progress_is_a_bar_on_a_terminal_and_lines_in_a_pipe(
    pg_dsn: str,
    store: PostgresStore,
    pg_pool: asyncpg.Pool,
    kafka_topic_factory: Any,
    kafka_producer: AIOKafkaProducer,
    cli_scope: str,
) -> None:
    dlq = await kafka_topic_factory("cli.progress")
    await send(kafka_producer, dlq, [(f"p-{i}", {"id": i}) for i in range(6)])
    args = ("replay", "--transport", "kafka", "--source", dlq, "--handler", HANDLER)

    code, out, err = await cli(
        "--progress-interval", "0", *args, "--dry-run", "--rate", "20", dsn=pg_dsn, **PIPE
    )
    assert code == 0, err
    lines = [x for x in err.splitlines() if x.startswith("dry run: ")]
    assert lines[0].startswith("dry run: 1/6 read=1") and lines[-1].startswith("dry run: 6/6")
    assert "━" not in err  # no bar, no escape codes in a pipe
    assert out.startswith("dry run, nothing changed: read 6 of 6 messages")

    code, out, err = await cli(*args, "--rate", "20", dsn=pg_dsn, **TERMINAL)
    assert code == 0, err
    assert "━" in err and "6/6" in err and "\x1b[" in err  # rich's live bar
    assert "replayed 6 of 6 messages" in out and "6 executed" in out

    scope = f"cli-prune-{uuid.uuid4().hex[:8]}"
    await pg_pool.execute(
        f"INSERT INTO {store.table} (scope, key, fingerprint, status, completed_at, expires_at)"
        " SELECT $1, 'k' || g, 'v1:jcs:x', 'completed', now(), now() - interval '1 s'"
        " FROM generate_series(1, 30) g",
        scope,
    )
    code, out, err = await cli(
        "--progress-interval", "0", "prune", "--batch-size", "10", dsn=pg_dsn, **PIPE
    )
    assert code == 0 and "prune (delete): " in err and "batches" in err
    assert out.startswith("deleted ") and "rows past retention in" in out
    code, out, err = await cli("prune", "--json", dsn=pg_dsn, **TERMINAL)
    assert code == 0 and "━" in err and json.loads(out)["finished"] is True


async def test_an_interrupted_replay_exits_130_and_resumes(
    pg_dsn: str,
    store: PostgresStore,
    kafka_topic_factory: Any,
    kafka_producer: AIOKafkaProducer,
    cli_scope: str,
) -> None:
    dlq = await kafka_topic_factory("cli.interrupt")
    await send(kafka_producer, dlq, [(f"i-{i}", {"id": i}) for i in range(10)])
    args = ["replay", "--transport", "kafka", "--source", dlq, "--handler", HANDLER, "--json"]
    env = dict(os.environ, CONSUMER_IDEM_PG_DSN=pg_dsn, **PIPE)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "consumer_idem.cli",
        *args,
        "--rate",
        "4",
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )

    async def started() -> bool:
        return await store.get(cli_scope, "i-1") is not None

    await wait_until(started, 30, "the replay to start")
    proc.send_signal(signal.SIGINT)
    out, err = await asyncio.wait_for(proc.communicate(), timeout=60)
    assert proc.returncode == 130, err.decode()
    first = json.loads(out)
    assert first["interrupted"] is True and 2 <= first["read"] < 10

    code, rest, problems = await cli(*args, dsn=pg_dsn)  # resumes where it stopped
    assert code == 0, problems
    assert json.loads(rest)["read"] == 10 - first["read"]
    assert json.loads(rest)["execute"] == 10 - first["read"]


async def test_reconcile_ends_with_a_summary_in_the_store_terms(
    pg_dsn: str,
    store: PostgresStore,
    kafka_topic_factory: Any,
    cli_scope: str,
) -> None:
    source = await kafka_topic_factory("cli.rec")
    operator = await kafka_topic_factory("cli.rec.operator")
    for key in ("exec-1", "not-1", "still-1"):  # parked and never announced: the sweeper does
        d = await store.reserve(cli_scope, key, "v1:jcs:x")
        await store.mark_unknown(cli_scope, key, d.token, "gateway timeout")
    env = dict(os.environ, CONSUMER_IDEM_PG_DSN=pg_dsn, **PIPE)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "consumer_idem.cli",
        "--progress-interval",
        "0",
        "reconcile",
        "--transport",
        "kafka",
        "--source",
        source,
        "--operator",
        operator,
        "--group",
        f"{source}-g",
        "--scope",
        cli_scope,
        "--resolver",
        "tests._cli_handlers:by_key_prefix",
        "--max-attempts",
        "1",  # "still unknown" goes to the operator at once
        "--sweep-interval",
        "0.3",
        "--json",
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )

    async def settled() -> bool:
        records = [await store.get(cli_scope, k) for k in ("exec-1", "not-1", "still-1")]
        return (
            [r.status.value for r in records if r is not None]
            == ["completed", "failed_retryable", "unknown"]
            and records[2] is not None
            and records[2].reconcile_after is None  # with the operator
        )

    try:
        await wait_until(settled, 60, "the reconciler to settle the three keys")
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = await asyncio.wait_for(proc.communicate(), timeout=60)
    text = err.decode()
    assert proc.returncode == 1, text[-2000:]  # a case went to the operator
    data = json.loads(out)
    assert {k: v for k, v in data["outcomes"].items() if v} == {
        "executed": 1,
        "not_executed": 1,
        "reconcile_exhausted": 1,
    }
    assert data["sweeps"]["published"] == 3 and data["unknown_left"] == 1
    assert data["with_operator"] == 1 and data["needs_operator"] == 1
    # every state change is one line naming scope and key, with the reason
    assert f"INFO scope={cli_scope} key=exec-1: reconciled: executed -> completed" in text
    assert f"INFO scope={cli_scope} key=not-1: reconciled: not executed -> failed_retryable" in text
    assert f"scope={cli_scope} key=still-1: reconciliation gave up, handed to an operator" in text
    assert "reconcile: " in text and "executed 1, not executed 1" in text  # progress lines


async def test_a_missing_or_old_schema_names_the_command_that_fixes_it(pg_dsn: str) -> None:
    schema = f"cli_nomig_{uuid.uuid4().hex[:8]}"
    for args in (
        ("stats", "--schema", schema),
        ("list", "--schema", schema, "--json"),
        ("replay", "--transport", "kafka", "--source", "x", "--handler", HANDLER),
        (
            "replay",
            "--schema",
            schema,
            "--transport",
            "kafka",
            "--source",
            "x",
            "--handler",
            HANDLER,
        ),
    ):
        env = {"CONSUMER_IDEM_SCHEMA": schema, "CLI_TEST_SCOPE": "s"}
        code, out, err = await cli(*args, dsn=pg_dsn, **env)
        assert code == 2 and out == "", (args, err)
        assert err.count("\n") == 1 and err.startswith("error: "), err  # one line, once
        assert "is missing or outdated" in err and "Traceback" not in err
        assert "run `consumer-idem migrate" in err
    assert f"consumer-idem migrate --schema {schema}`" in err

    old = f"cli_old_{uuid.uuid4().hex[:8]}"
    code, _, _ = await cli("migrate", "--schema", old, dsn=pg_dsn)
    assert code == 0
    conn = await asyncpg.connect(pg_dsn)
    try:
        newest = await conn.fetchval(f'SELECT max(version) FROM "{old}".schema_migrations')
        await conn.execute(f'DELETE FROM "{old}".schema_migrations WHERE version = $1', newest)
        # (version numbers may have gaps: the one before is what the schema holds now)
        previous = await conn.fetchval(f'SELECT max(version) FROM "{old}".schema_migrations')
    finally:
        await conn.close()
    code, _, err = await cli("list", "--schema", old, dsn=pg_dsn)
    assert code == 2 and err.count("\n") == 1
    assert f"is at version {previous}, this library needs {newest}" in err
    assert f"run `consumer-idem migrate --schema {old}`" in err
