"""``RedisStore``'s own connections (reserve and complete send their one command on connections
of the client's pool that the store keeps): a server that lost its scripts, a connection killed
under the store, many calls at once, all against the real Redis."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from consumer_idem import Attempt, OutcomeKind, RedisStore, StoreUnavailable, run_two_phase
from consumer_idem.cli.settings import Settings

FP = "v1:jcs:connections"


@pytest.fixture
async def named_client(settings: Settings) -> AsyncIterator[tuple[aioredis.Redis, str]]:
    """A client whose connections carry a name of their own (so a test can kill just them)."""
    name = f"ci-test-{uuid.uuid4().hex[:8]}"
    client = aioredis.from_url(settings.redis_url, client_name=name)
    yield client, name
    await client.aclose()


async def charge(attempt: Attempt) -> str:
    return "charged"


async def test_scripts_the_server_lost_are_sent_again(
    named_client: tuple[aioredis.Redis, str], redis_prefix: str
) -> None:
    client, _ = named_client
    store = RedisStore(client, prefix=redis_prefix)
    first = await run_two_phase(store, "s", "k1", FP, charge)
    await client.script_flush()  # a restart without persistence, or an operator
    second = await run_two_phase(store, "s", "k2", FP, charge)
    again = await run_two_phase(store, "s", "k1", FP, charge)
    assert [first.kind, second.kind, again.kind] == [
        OutcomeKind.EXECUTED,
        OutcomeKind.EXECUTED,
        OutcomeKind.REPLAYED,
    ]


async def test_a_connection_killed_under_the_store_fails_that_call_only(
    named_client: tuple[aioredis.Redis, str], redis_client: aioredis.Redis, redis_prefix: str
) -> None:
    client, name = named_client
    store = RedisStore(client, prefix=redis_prefix)
    await run_two_phase(store, "s", "before", FP, charge)  # the store now keeps a connection
    clients = await redis_client.client_list()
    ours = [c["id"] for c in clients if c.get("name") == name]
    assert ours
    for client_id in ours:
        await redis_client.client_kill_filter(_id=client_id)
    outcomes = []
    for i in range(3):
        try:
            outcomes.append((await store.reserve("s", f"after-{i}", FP)).kind.value)
        except StoreUnavailable:
            outcomes.append("unavailable")
    # the killed connection fails the call that meets it (a reply may have been lost with it:
    # never sent again blindly); it is given back, and the next call gets a new one
    assert outcomes == ["unavailable", "execute", "execute"]


async def test_many_calls_at_once_each_get_a_connection_and_give_it_back(
    named_client: tuple[aioredis.Redis, str], redis_prefix: str
) -> None:
    client, _ = named_client
    store = RedisStore(client, prefix=redis_prefix)
    outcomes = await asyncio.gather(
        *(run_two_phase(store, "s", f"k{i}", FP, charge) for i in range(100))
    )
    assert {o.kind for o in outcomes} == {OutcomeKind.EXECUTED}
    replays = await asyncio.gather(
        *(run_two_phase(store, "s", f"k{i}", FP, charge) for i in range(100))
    )
    assert {o.kind for o in replays} == {OutcomeKind.REPLAYED}
