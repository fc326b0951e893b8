"""Throughput at scale (issue 18): RabbitMQ batch mode, and the store's cost as it grows.

``rabbit.*.batch_mode``: a quorum queue pre-filled with 20,000 payments (the demo effect: a
ledger row and the account balance), consumed in batches of 100 (closed after 50 ms at the
latest), prefetch 400, one transaction per batch, acks after the commit as multiple acks. The
baseline is plain aio-pika doing exactly that (same batching, the same set-based effect in one
transaction, ``basic.ack(multiple=True)`` of the contiguous prefix), without idempotency. The
two alternate, three runs each, medians.

``store.reserve_complete.c8.at_5m_rows``: ``reserve`` + ``complete`` of new random keys (UUIDs)
by 8 concurrent tasks, against a store holding 5 million rows (10 scopes, loaded with COPY from
a generated stream, the indexes in place, then VACUUM ANALYZE), over the same against an empty
store, interleaved in one run.

The prune entries run on that store (5 million live rows) twice, each time over 1 million expired
rows loaded for it, while a paced live load (reserve + complete of new keys, 400/s by 4 tasks)
runs all along and the prune runs in one-second phases that alternate with one-second quiet
ones (so both see the same minutes of a machine whose disk and CPU speed drift):
``store.prune.rows_per_s`` and ``store.prune.unpaced.live_p99_ratio`` with the prune unpaced
(``max_rows_per_s=0``: what it can do), ``store.prune.live_p99_ratio`` and
``store.prune.paced.rows_per_s`` with its default pace (20,000 rows/s). A p99 ratio's value is the
live p99 (ms) in the pruning phases, its baseline the p99 in the quiet ones. The scratch database
is dropped afterwards.
"""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid
from typing import Any

import aio_pika
import asyncpg
from aio_pika.abc import AbstractIncomingMessage

from benchmarks.common import Clock, entry, interleaved, rate, scratch_database, until
from consumer_idem import PostgresStore, header, idempotent_consumer
from consumer_idem.cli.settings import load_settings
from consumer_idem.stores.postgres.maintenance import DEFAULT_PRUNE_RATE
from consumer_idem.transports.rabbit import RabbitRunner
from consumer_idem.transports.rabbit import to_message as amqp_message
from examples.payments_producer import plan, send_rabbit
from handlers.payments import ensure_tables, record_payments

N = 20_000
BATCH = 100
WAIT = 0.05
PREFETCH = 4 * BATCH


# --- RabbitMQ batch mode -------------------------------------------------------------------------


async def plain_rabbit_batches(pool: asyncpg.Pool, queue: str) -> float:
    """Plain aio-pika with the runner's batching: gather up to BATCH deliveries (or what came
    within WAIT), one transaction for the set-based effect, then one multiple ack for the
    contiguous prefix of settled delivery tags."""
    connection = await aio_pika.connect(load_settings().amqp_url)
    clock = Clock()
    gathered: list[AbstractIncomingMessage] = []
    closer: asyncio.TimerHandle | None = None
    tasks: set[asyncio.Task[None]] = set()
    done: dict[int, AbstractIncomingMessage] = {}
    floor = 0
    try:
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=PREFETCH)
        q = await channel.get_queue(queue)

        async def handle(batch: list[AbstractIncomingMessage]) -> None:
            nonlocal floor
            async with pool.acquire() as conn, conn.transaction():
                await record_payments([amqp_message(m) for m in batch], conn)
            for m in batch:
                assert m.delivery_tag is not None
                done[m.delivery_tag] = m
            top = floor
            while top + 1 in done:
                top += 1
            if top > floor:
                last = done[top]
                for tag in range(floor + 1, top + 1):
                    del done[tag]
                floor = top
                await last.ack(multiple=True)
            clock.tick(len(batch))

        def close() -> None:
            nonlocal closer, gathered
            if closer is not None:
                closer.cancel()
                closer = None
            if gathered:
                batch, gathered = gathered, []
                task = asyncio.create_task(handle(batch))
                tasks.add(task)
                task.add_done_callback(tasks.discard)

        async def on_message(message: AbstractIncomingMessage) -> None:
            nonlocal closer
            gathered.append(message)
            if len(gathered) >= BATCH:
                close()
            elif closer is None:
                closer = asyncio.get_running_loop().call_later(WAIT, close)

        tag = await q.consume(on_message)
        await until(lambda: clock.count >= N)
        await q.cancel(tag)
    finally:
        await connection.close()
    return clock.rate()


async def idempotent_rabbit_batches(store: PostgresStore, queue: str) -> float:
    consumer = idempotent_consumer(
        store, scope=f"bench-{uuid.uuid4().hex[:6]}", key=header("idempotency-key"), batch=True
    )(record_payments)
    runner = RabbitRunner(
        consumer, queue=queue, batch_size=BATCH, batch_wait=WAIT, prefetch=PREFETCH
    )
    clock = Clock()
    stop = asyncio.Event()
    task = asyncio.create_task(runner.run(stop))
    seen = 0

    def done() -> bool:
        nonlocal seen
        if task.done():
            task.result()
        if runner.stats.processed > seen:
            clock.tick(runner.stats.processed - seen)
            seen = runner.stats.processed
        return seen >= N

    try:
        await until(done)
    finally:
        stop.set()
        await task
    return clock.rate()


async def rabbit_batch_mode(runs: int = 3) -> list[dict[str, Any]]:
    async with scratch_database() as dsn:
        pool = await asyncpg.create_pool(dsn, min_size=4, max_size=16)
        assert pool is not None
        await ensure_tables(pool)
        store = PostgresStore(pool)
        await store.migrate()
        run_id = uuid.uuid4().hex[:8]
        plains: list[float] = []
        idems: list[float] = []
        for r in range(runs):
            # alternate which goes first: both see the same machine, warm or not
            order = ("plain", "idempotent") if r % 2 == 0 else ("idempotent", "plain")
            for which in order:
                queue = f"bench-batch-{which}-{run_id}-{r}"
                await send_rabbit(plan(N, 0.0, 3, f"{run_id}{which}{r}"), queue)
                if which == "plain":
                    plains.append(await plain_rabbit_batches(pool, queue))
                else:
                    idems.append(await idempotent_rabbit_batches(store, queue))
                await _delete_queues(queue)
        await pool.close()
    plain, idem = statistics.median(plains), statistics.median(idems)
    return [
        entry("rabbit.plain.batch_mode", plain, "msg/s", None),
        entry("rabbit.idempotent.batch_mode", idem, "msg/s", plain),
    ]


async def _delete_queues(queue: str) -> None:
    connection = await aio_pika.connect(load_settings().amqp_url)
    try:
        channel = await connection.channel()
        for name in (queue, f"{queue}.dlq"):
            await channel.queue_delete(name)
    finally:
        await connection.close()


# --- the store as it grows -----------------------------------------------------------------------

ROWS = 5_000_000
SCOPES = 10
CONCURRENCY = 8
FP = "v1:jcs:" + "0" * 64
COLUMNS = ["scope", "key", "fingerprint", "status", "result", "result_kind", "completed_at"]
COLUMNS.append("expires_at")


def _stamp(year: int, i: int, us: int) -> str:
    """A distinct ``expires_at`` for row ``i``: two rows a second from January 1st of
    ``year`` (at most 5,356,800 rows: the month has 31 days)."""
    s = i // 2
    day, hour, minute, second = 1 + s // 86400, s // 3600 % 24, s // 60 % 60, s % 60
    return f"{year}-01-{day:02d} {hour:02d}:{minute:02d}:{second:02d}.{us:06d}+00"


async def _rows(n: int, scopes: int, year: int, chunk: int = 50_000) -> Any:
    """COPY text for ``n`` completed records with random UUID keys spread over ``scopes``
    scopes, expiring in January of ``year``, in chunks (the table is never in memory)."""
    import random

    rng = random.Random(f"{n}:{year}")
    done = 0
    while done < n:
        m = min(chunk, n - done)
        lines = []
        for i in range(done, done + m):
            k = f"{rng.getrandbits(128):032x}"
            key = f"{k[:8]}-{k[8:12]}-{k[12:16]}-{k[16:20]}-{k[20:]}"
            lines.append(
                f'bench.scope{i % scopes}\t{key}\t{FP}\tcompleted\t{{"ok":1}}\tsuccess\t'
                f"{_stamp(year - 1, i, 0)}\t{_stamp(year, i, rng.getrandbits(19) % 1_000_000)}\n"
            )
        yield "".join(lines).encode()
        done += m


async def load(pool: asyncpg.Pool, store: PostgresStore, n: int, year: int) -> float:
    """COPY ``n`` rows into the store's table (its indexes in place, as in a store that grew),
    VACUUM ANALYZE it, as autovacuum would have, and CHECKPOINT: a store that grew over weeks
    has its pages on disk, and otherwise the checkpoint that the load's WAL brings on would
    write them out in the middle of the measurement. Returns the seconds it took."""
    started = time.perf_counter()
    async with pool.acquire() as conn:
        await conn.copy_to_table(
            "idempotency_records",
            schema_name=store.schema,
            source=_rows(n, SCOPES, year),
            columns=COLUMNS,
            format="text",
        )
        await conn.execute(f"VACUUM (ANALYZE) {store.table}")
        try:
            await conn.execute("CHECKPOINT")
        except asyncpg.InsufficientPrivilegeError:  # neither superuser nor pg_checkpoint
            print("   (no CHECKPOINT: the role may not; a checkpoint may land in a chunk)")
    return time.perf_counter() - started


def reserve_complete(store: PostgresStore, scope: str) -> Any:
    """One live reservation of a new key: ``reserve`` then ``complete`` (two transactions)."""

    async def op(i: int) -> None:
        decision = await store.reserve(scope, str(uuid.uuid4()), FP)
        assert decision.token is not None
        await store.complete(scope, decision.record.key, decision.token, {"ok": 1})

    return op


async def growth(
    pool: asyncpg.Pool, empty: PostgresStore, big: PostgresStore, chunks: int, per_chunk: int
) -> list[dict[str, Any]]:
    """reserve + complete at c8 on ``big`` (loaded with ROWS rows) over ``empty``,
    interleaved."""
    loaded = await load(pool, big, ROWS, 2099)
    print(f"   loaded {ROWS:,} rows in {loaded:.0f} s", flush=True)
    scope = "bench.scope3"  # one of the loaded scopes: its part of the index is full

    async def on_empty(r: int) -> float:
        return await rate(reserve_complete(empty, scope), per_chunk, CONCURRENCY)

    async def on_big(r: int) -> float:
        return await rate(reserve_complete(big, scope), per_chunk, CONCURRENCY)

    await on_empty(-1)  # warm-up: connections, plans, the pages the workload touches
    await on_big(-1)
    base, subject = await interleaved(chunks, on_empty, on_big)
    name = f"store.reserve_complete.c{CONCURRENCY}.at_{ROWS // 1_000_000}m_rows"
    return [entry(name, subject, "ops/s", base)]


async def store_scale(chunks: int = 8, per_chunk: int = 1500) -> list[dict[str, Any]]:
    """The growth entry, then the prune entries on the same big store (5 million live rows);
    the scratch database is dropped afterwards."""
    async with scratch_database() as dsn:
        pool = await asyncpg.create_pool(dsn, min_size=CONCURRENCY, max_size=CONCURRENCY + 2)
        assert pool is not None
        empty = PostgresStore(pool, schema="bench_empty")
        big = PostgresStore(pool, schema="bench_big")
        for store in (empty, big):
            await store.migrate()
        try:
            results = await growth(pool, empty, big, chunks, per_chunk)
            rows_s, ratio = await prune_under_load(pool, big, 0, 2020)
            results.append(entry("store.prune.rows_per_s", *rows_s))
            results.append(entry("store.prune.unpaced.live_p99_ratio", *ratio))
            rows_s, ratio = await prune_under_load(pool, big, DEFAULT_PRUNE_RATE, 2021)
            results.append(entry("store.prune.live_p99_ratio", *ratio))
            results.append(entry("store.prune.paced.rows_per_s", *rows_s))
        finally:
            await pool.close()
    return results


EXPIRED = 1_000_000
LIVE_RATE = 400  # live reservations a second while latencies are measured
LIVE_TASKS = 4
QUIET_S = PRUNING_S = 1.0  # the phases that alternate until the prune is done

Figures = tuple[float, str, float | None]  # an entry's value, unit and baseline


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100)[98]


async def prune_under_load(
    pool: asyncpg.Pool, store: PostgresStore, pace: float, year: int
) -> tuple[Figures, Figures]:
    """Load EXPIRED rows expired in ``year`` into ``store`` (which holds live ones), then prune
    them with ``store.maintenance.prune(max_rows_per_s=pace)`` in phases of PRUNING_S seconds,
    each after QUIET_S seconds without, while a paced live load (reserve + complete of new keys,
    LIVE_RATE a second) runs all along: every live call is timed and counted in the phase it
    started in, so both p99s are taken over the same minutes of a machine whose speed drifts.
    Returns the prune's rate (rows/s) and the live p99s (ms: pruning, quiet)."""
    loaded = await load(pool, store, EXPIRED, year)
    print(f"   loaded {EXPIRED:,} expired rows in {loaded:.0f} s", flush=True)
    op = reserve_complete(store, "bench.scope5")
    phase = "warm-up"
    latencies: dict[str, list[float]] = {"quiet": [], "pruning": [], "warm-up": []}
    done = False

    async def live(t: int) -> None:
        interval = LIVE_TASKS / LIVE_RATE
        due = time.perf_counter() + t * interval / LIVE_TASKS
        while not done:
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            started, counted = time.perf_counter(), phase
            await op(0)
            latencies[counted].append(time.perf_counter() - started)
            due = max(due + interval, time.perf_counter() - interval)  # no catching up in bursts

    async def phases() -> tuple[int, float, float, int]:
        nonlocal phase, done
        rows, pruning_s, longest, batches = 0, 0.0, 0.0, 0
        await asyncio.sleep(2.0)  # warm-up
        try:
            while True:
                phase = "quiet"
                await asyncio.sleep(QUIET_S)
                phase = "pruning"
                stop = asyncio.Event()
                timer = asyncio.get_running_loop().call_later(PRUNING_S, stop.set)
                started = time.perf_counter()
                report = await store.maintenance.prune(stop=stop, max_rows_per_s=pace)
                pruning_s += time.perf_counter() - started
                timer.cancel()
                rows += report.rows
                batches += report.batches
                longest = max(longest, report.longest_statement_s)
                if report.finished:
                    return rows, pruning_s, longest, batches
        finally:
            done = True

    (rows, pruning_s, longest, batches), *_ = await asyncio.gather(
        phases(), *(live(t) for t in range(LIVE_TASKS))
    )
    quiet, pruning = latencies["quiet"], latencies["pruning"]
    print(
        f"   pruned {rows:,} rows (pace {pace or 'none'}) in {pruning_s:.1f} s ({batches} batches,"
        f" the longest {longest * 1000:.0f} ms); live calls {len(quiet)} quiet, {len(pruning)}"
        f" pruning, p99 {1000 * p99(quiet):.1f} / {1000 * p99(pruning):.1f} ms",
        flush=True,
    )
    return (rows / pruning_s, "rows/s", None), (1000 * p99(pruning), "ms", 1000 * p99(quiet))


async def run() -> list[dict[str, Any]]:
    results = await rabbit_batch_mode()
    results += await store_scale()
    return results
