"""``RedisStore``'s own connections (reserve and complete send their one command on connections
of the client's pool that the store keeps): a server that lost its scripts, a connection killed
under the store, many calls at once, all against the real Redis."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

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


# --- read deadlines: the client's socket_timeout, kept by one timer (redis_compat._Deadlines)


@pytest.fixture
async def paused(redis_client: aioredis.Redis) -> AsyncIterator[Callable[[int], Awaitable[None]]]:
    """``await pause(ms)``: the real server holds every client's commands for ``ms``
    (``CLIENT PAUSE ALL``; it cannot be lifted early, since UNPAUSE would wait too)."""
    until = 0.0

    async def pause(ms: int) -> None:
        nonlocal until
        await redis_client.execute_command("CLIENT", "PAUSE", str(ms), "ALL")
        until = time.monotonic() + ms / 1000

    yield pause
    await asyncio.sleep(max(0.0, until - time.monotonic()) + 0.05)


@pytest.fixture
async def timed_store(
    settings: Settings, redis_prefix: str
) -> AsyncIterator[Callable[[float], RedisStore]]:
    """``timed_store(seconds)``: a store on a client of its own with that socket timeout."""
    clients: list[aioredis.Redis] = []

    def make(seconds: float) -> RedisStore:
        clients.append(aioredis.from_url(settings.redis_url, socket_timeout=seconds))
        return RedisStore(clients[-1], prefix=redis_prefix)

    yield make
    for client in clients:
        await client.aclose()


async def test_a_reply_later_than_the_socket_timeout_fails_that_call_only(
    timed_store: Callable[[float], RedisStore], paused: Callable[[int], Awaitable[None]]
) -> None:
    store = timed_store(0.2)
    await run_two_phase(store, "s", "before", FP, charge)  # a kept connection
    await paused(700)
    started = time.monotonic()
    with pytest.raises(StoreUnavailable, match="Timeout reading"):
        await store.reserve("s", "during", FP)
    waited = time.monotonic() - started
    # the timeout is the client's, neither ignored nor cut short...
    assert 0.18 <= waited < 0.6
    # ...and it leaves nothing behind: the task is not still being cancelled
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0
    await asyncio.sleep(0.1)  # this task's own timers still run as they should
    await asyncio.sleep(0.6)  # the pause is over
    # the late connection was dropped (its reply could come in any time): a new one works
    outcome = await run_two_phase(store, "s", "after", FP, charge)
    assert outcome.kind is OutcomeKind.EXECUTED


async def test_a_caller_cancelled_while_waiting_for_a_reply_is_cancelled_not_timed_out(
    timed_store: Callable[[float], RedisStore], paused: Callable[[int], Awaitable[None]]
) -> None:
    store = timed_store(0.3)
    await run_two_phase(store, "s", "before", FP, charge)
    await paused(600)
    # the caller's own, shorter bound: its TimeoutError, through a cancellation of ours
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.1):
            await store.reserve("s", "bounded", FP)
    call = asyncio.create_task(store.reserve("s", "cancelled", FP))
    await asyncio.sleep(0.05)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    # a call the timer cancels while its caller is cancelled too stays cancelled
    both = asyncio.create_task(store.reserve("s", "both", FP))
    await asyncio.sleep(0.31)
    both.cancel()
    with pytest.raises((asyncio.CancelledError, StoreUnavailable)):
        await both
    await asyncio.sleep(0.4)
    outcome = await run_two_phase(store, "s", "after", FP, charge)
    assert outcome.kind is OutcomeKind.EXECUTED


async def test_reads_under_a_socket_timeout_share_one_timer(
    timed_store: Callable[[float], RedisStore],
) -> None:
    """redis-py bounds each read with a timer of its own, a tenth of a unit's CPU at c1 (the
    Powertools comparison): the store's calls keep the same bound with one timer for all."""
    store = timed_store(5)
    loop = asyncio.get_running_loop()
    timers = 0
    call_at = loop.call_at

    def counting(when: float, callback: Any, *args: Any, **kwargs: Any) -> asyncio.TimerHandle:
        nonlocal timers
        timers += 1
        return call_at(when, callback, *args, **kwargs)

    await run_two_phase(store, "s", "warm", FP, charge)
    loop.call_at = counting  # type: ignore[method-assign]
    try:
        for i in range(50):
            await run_two_phase(store, "s", f"k{i}", FP, charge)
    finally:
        del loop.call_at
    assert timers <= 1  # 100 commands


def test_read_deadlines_survive_a_closed_event_loop() -> None:
    """A store outlives an event loop (``asyncio.run`` twice, a test runner's loop per test):
    the timer of the closed loop never fires, so the next loop's calls get one of their own."""
    from consumer_idem.stores.redis_compat import _Deadlines

    deadlines = _Deadlines()

    async def waiting(seconds: float) -> bool:
        task = asyncio.current_task()
        assert task is not None
        deadlines.enter(task, seconds)
        try:
            await asyncio.sleep(2)
        except asyncio.CancelledError:
            task.uncancel()
            return deadlines.leave(task)
        return False

    async def abandoned() -> None:
        task = asyncio.create_task(waiting(0.05))
        await asyncio.sleep(0)  # entered; the loop then closes before the deadline
        task.cancel()

    asyncio.run(abandoned())
    time.sleep(0.1)
    started = time.monotonic()
    assert asyncio.run(waiting(0.2)) is True  # cut by the new loop's own timer
    assert time.monotonic() - started < 1
