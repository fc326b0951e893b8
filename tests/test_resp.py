"""The cache's own pipelined Redis connection, against the real Redis."""

from __future__ import annotations

import asyncio
import socket
import time
import uuid

import pytest
import redis.asyncio as aioredis

from consumer_idem.settings import Settings
from consumer_idem.stores.resp import Endpoint, RespConnection, RespError, endpoint_of


@pytest.fixture
def endpoint(redis_client: aioredis.Redis) -> Endpoint:
    found = endpoint_of(redis_client)
    assert found is not None
    return found


async def test_commands_round_trip_and_an_error_reply_leaves_the_connection_usable(
    endpoint: Endpoint, redis_client: aioredis.Redis, redis_prefix: str
) -> None:
    conn = RespConnection(endpoint, timeout=1.0)
    a, b, missing = (f"{redis_prefix}{n}" for n in ("a", "b", "missing"))
    assert await conn.execute("SET", a, b"\x00\xffbinary", "PX", 60_000) == b"OK"
    assert await conn.execute("SET", b, "text") == b"OK"
    assert await conn.execute("GET", a) == b"\x00\xffbinary"
    assert await conn.execute("MGET", a, missing, b) == [b"\x00\xffbinary", None, b"text"]
    assert 0 < await redis_client.pttl(a) <= 60_000
    with pytest.raises(RespError, match="WRONGTYPE"):
        await conn.execute("LPUSH", a, "x")
    assert await conn.execute("DEL", a, b, missing) == 2
    assert await conn.execute("GET", a) is None
    await conn.aclose()


async def test_concurrent_commands_share_one_connection_and_each_gets_its_own_reply(
    endpoint: Endpoint, redis_client: aioredis.Redis, redis_prefix: str
) -> None:
    await redis_client.mset({f"{redis_prefix}{i}": f"value-{i}" for i in range(300)})
    conn = RespConnection(endpoint, timeout=2.0)
    before = (await redis_client.info("stats"))["total_connections_received"]
    order = list(range(300))
    replies = await asyncio.gather(*(conn.execute("GET", f"{redis_prefix}{i}") for i in order))
    assert replies == [f"value-{i}".encode() for i in order]
    after = (await redis_client.info("stats"))["total_connections_received"]
    assert after - before == 1  # one connection, opened once, however many callers
    await conn.aclose()


async def test_a_cancelled_caller_does_not_shift_the_replies_of_the_others(
    endpoint: Endpoint, redis_client: aioredis.Redis, redis_prefix: str
) -> None:
    await redis_client.mset({f"{redis_prefix}{i}": str(i) for i in range(40)})
    conn = RespConnection(endpoint, timeout=2.0)
    await conn.execute("PING")  # connected, so the commands below are all in flight at once
    tasks = [asyncio.ensure_future(conn.execute("GET", f"{redis_prefix}{i}")) for i in range(40)]
    await asyncio.sleep(0)  # every command is written
    for task in tasks[::3]:
        task.cancel()
    for i, task in enumerate(tasks):
        if i % 3 == 0:
            with pytest.raises(asyncio.CancelledError):
                await task
        else:
            assert await task == str(i).encode()
    assert await conn.execute("GET", f"{redis_prefix}7") == b"7"
    await conn.aclose()


async def test_a_late_reply_is_never_read_as_the_answer_to_a_later_command(
    endpoint: Endpoint, redis_client: aioredis.Redis, redis_prefix: str
) -> None:
    await redis_client.set(f"{redis_prefix}first", "first")
    await redis_client.set(f"{redis_prefix}second", "second")
    conn = RespConnection(endpoint, timeout=0.3)
    await conn.execute("PING")
    await redis_client.execute_command("CLIENT", "PAUSE", "450", "ALL")
    started = time.monotonic()
    with pytest.raises(RespError, match="no reply within"):
        await conn.execute("GET", f"{redis_prefix}first")
    assert time.monotonic() - started < 0.42
    # sent while Redis is still paused: when it resumes, it answers the first GET (too late
    # for its caller) and this one; each reply must reach only its own caller
    assert await conn.execute("GET", f"{redis_prefix}second") == b"second"
    await conn.aclose()


async def test_a_connection_killed_by_redis_is_replaced_on_the_next_command(
    endpoint: Endpoint, redis_client: aioredis.Redis, redis_prefix: str
) -> None:
    conn = RespConnection(endpoint, timeout=1.0)
    first_id = await conn.execute("CLIENT", "ID")
    await redis_client.execute_command("CLIENT", "KILL", "ID", first_id)
    await asyncio.sleep(0.05)  # the close reaches this side
    await redis_client.set(f"{redis_prefix}k", "v")
    assert await conn.execute("GET", f"{redis_prefix}k") == b"v"
    assert await conn.execute("CLIENT", "ID") != first_id
    await conn.aclose()


async def test_auth_and_db_come_from_the_client_url(
    settings: Settings, redis_client: aioredis.Redis, redis_prefix: str
) -> None:
    user, password = f"ci-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    await redis_client.execute_command("ACL", "SETUSER", user, "on", f">{password}", "~*", "+@all")
    host = endpoint_of(redis_client)
    assert host is not None
    url = f"redis://{user}:{password}@{host.host}:{host.port}/3"
    client = aioredis.from_url(url, socket_timeout=1)
    other_db = aioredis.from_url(f"redis://{host.host}:{host.port}/3", socket_timeout=1)
    try:
        endpoint = endpoint_of(client)
        assert endpoint is not None
        assert (endpoint.username, endpoint.password, endpoint.db) == (user, password, 3)
        conn = RespConnection(endpoint, timeout=1.0)
        assert await conn.execute("SET", f"{redis_prefix}db3", "here") == b"OK"
        assert await other_db.get(f"{redis_prefix}db3") == b"here"
        assert await redis_client.get(f"{redis_prefix}db3") is None  # not in db 0
        assert await conn.execute("ACL", "WHOAMI") == user.encode()
        await conn.aclose()

        wrong = RespConnection(
            Endpoint(host=host.host, port=host.port, username=user, password="wrong"),
            timeout=1.0,
        )
        with pytest.raises(RespError, match="WRONGPASS"):
            await wrong.execute("PING")
        await wrong.aclose()
    finally:
        await other_db.delete(f"{redis_prefix}db3")
        await redis_client.execute_command("ACL", "DELUSER", user)
        await client.aclose()
        await other_db.aclose()


async def test_nothing_listening_is_a_quick_error() -> None:
    with socket.socket() as s:  # a port that was free a moment ago
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    conn = RespConnection(Endpoint(port=port, connect_timeout=0.5), timeout=0.5)
    started = time.monotonic()
    with pytest.raises(RespError, match="cannot connect"):
        await conn.execute("PING")
    assert time.monotonic() - started < 1.0


def test_clients_the_connection_cannot_stand_in_for_keep_redis_py() -> None:
    plain = endpoint_of(aioredis.from_url("redis://127.0.0.1:6390/2"))
    assert plain == Endpoint(host="127.0.0.1", port=6390, db=2)
    unix = endpoint_of(aioredis.from_url("unix:///run/redis.sock?db=1"))
    assert unix is not None and (unix.path, unix.db) == ("/run/redis.sock", 1)
    assert endpoint_of(aioredis.from_url("rediss://127.0.0.1:6390/0")) is None  # TLS
    assert endpoint_of(aioredis.from_url("redis://127.0.0.1:6390/0", protocol=3)) is None
    assert endpoint_of(object()) is None
