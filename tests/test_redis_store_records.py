"""``RedisStore``'s first-execution path builds records from what it sent (no read back) and
packs its commands with hiredis: the records must equal what the store reads, records written
by earlier versions (more fields) must still work, and packing must not change a byte."""

from __future__ import annotations

import uuid

import pytest
import redis.asyncio as aioredis

from consumer_idem import Attempt, OutcomeKind, RedisStore, Retryable, run_two_phase
from consumer_idem.cli.settings import Settings
from consumer_idem.stores import redis_compat
from consumer_idem.stores.redis_compat import Commands
from consumer_idem.types import DecisionKind, ResultKind, Status, StoredResponse

FP = "v1:jcs:records"


async def test_records_built_from_the_replies_equal_the_stored_ones(
    redis_client: aioredis.Redis, redis_prefix: str
) -> None:
    store = RedisStore(redis_client, prefix=redis_prefix, lease=12.5, retention=3600)
    decision = await store.reserve("s", "k-é", FP)
    assert decision.kind is DecisionKind.EXECUTE
    assert await store.get("s", "k-é") == decision.record

    done = await store.complete("s", "k-é", decision.token, {"total": 7, "name": "ü"})
    assert done.status is Status.COMPLETED and done.result == {"total": 7, "name": "ü"}
    assert await store.get("s", "k-é") == done

    # a stored response, and no result
    second = await store.reserve("s", "k2", FP)
    response = StoredResponse(201, {"content-type": "application/json"}, b'{"id":1}')
    done = await store.complete(
        "s", "k2", second.token, None, result_kind=ResultKind.DOMAIN_ERROR, response=response
    )
    assert done.result_json is None and done.response == response
    assert await store.get("s", "k2") == done


async def test_records_written_by_earlier_versions_are_completed_and_replayed(
    redis_client: aioredis.Redis, redis_prefix: str
) -> None:
    """Earlier versions wrote ``ua`` and ``rat`` on every claim; this one leaves them to their
    defaults. Both shapes are read, completed and re-claimed alike."""
    store = RedisStore(redis_client, prefix=redis_prefix)
    token = uuid.uuid4()
    now = int((await redis_client.time())[0]) * 1000
    await redis_client.hset(
        f"{redis_prefix}s\x1fold",
        mapping={
            "fp": FP,
            "st": "in_progress",
            "tok": str(token),
            "lu": now + 30_000,
            "att": 1,
            "ca": now,
            "ua": now,
            "rat": 0,
            "ret": 60_000,
        },
    )
    done = await store.complete("s", "old", token, "charged")
    assert (done.attempts, done.reconcile_attempts, done.result) == (1, 0, "charged")
    again = await run_two_phase(store, "s", "old", FP, charge)
    assert again.kind is OutcomeKind.REPLAYED and again.result == "charged"


async def test_a_retry_after_failed_retryable_counts_attempts(
    redis_client: aioredis.Redis, redis_prefix: str
) -> None:
    store = RedisStore(redis_client, prefix=redis_prefix)
    first = await run_two_phase(store, "s", "k", FP, refuse)
    assert first.kind is OutcomeKind.FAILED_RETRYABLE
    second = await run_two_phase(store, "s", "k", FP, charge)
    assert (second.kind, second.attempts) == (OutcomeKind.EXECUTED, 2)
    record = await store.get("s", "k")
    assert record is not None and record.last_error is None and record.attempts == 2


@pytest.mark.parametrize(
    "args",
    [
        ("s\x1fk", "v1:jcs:" + "a" * 64, str(uuid.uuid4()), 30_000, 604_800_000),
        ("http:c:POST /é\x1f€😀", '{"ok":"ü\\n"}', "", "success", 1, "201", "{}", "ab" * 600),
    ],
)
def test_hiredis_packs_as_the_connection_would(args: tuple[object, ...]) -> None:
    assert redis_compat._hiredis_pack is not None, "hiredis comes with the redis extra"
    conn = aioredis.Connection()
    command = (b"EVALSHA", "f" * 40, 1, *args)
    assert redis_compat._hiredis_pack(command) == b"".join(conn.pack_command(*command))


async def test_a_client_with_another_encoding_packs_with_redis_py(settings: Settings) -> None:
    assert redis_compat._hiredis_pack is not None, "hiredis comes with the redis extra"
    client = aioredis.from_url(settings.redis_url, encoding="latin-1")
    try:
        assert Commands(client)._pack is None
        assert Commands(aioredis.from_url(settings.redis_url))._pack is not None
    finally:
        await client.aclose()


async def charge(attempt: Attempt) -> str:
    return "charged"


async def refuse(attempt: Attempt) -> str:
    raise Retryable("gateway said no, nothing charged")
