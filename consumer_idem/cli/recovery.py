"""Recovering what went wrong: ``reconcile`` unknown outcomes, ``replay`` a dead-letter queue."""

from __future__ import annotations

import asyncio
import logging
from contextlib import suppress
from dataclasses import asdict
from datetime import timedelta
from typing import Annotated, Any

import typer
from rich.markup import escape

from consumer_idem.cli.brokers import AmqpUrlOpt, BootstrapOpt, broker_settings
from consumer_idem.cli.common import (
    DsnOpt,
    JsonOpt,
    SchemaOpt,
    ScopesOpt,
    TransportName,
    TransportOpt,
    emit,
    finish,
    folding_table,
    on_signals,
    open_store,
    options,
    run,
    transport_runner,
)
from consumer_idem.cli.output import (
    CliError,
    ExitCode,
    Reporter,
    console,
    note,
)
from consumer_idem.errors import ConsumerIdemError
from consumer_idem.stores.postgres.store import PostgresStore


def reconcile(
    transport: TransportOpt,
    resolver: Annotated[str, typer.Option(help="module:function, async (record) -> answer")],
    source: Annotated[
        str, typer.Option(help="reconciliation topic/queue")
    ] = "consumer_idem.reconcile",
    operator: Annotated[
        str | None,
        typer.Option(help="operator dead-letter topic/queue (default SOURCE.operator)"),
    ] = None,
    group: Annotated[str, typer.Option(help="Kafka consumer group")] = "consumer-idem-reconciler",
    scope: ScopesOpt = None,
    max_attempts: Annotated[int, typer.Option()] = 8,
    max_age_hours: Annotated[float, typer.Option()] = 48.0,
    sweep_interval: Annotated[float, typer.Option(help="seconds between sweeps")] = 5.0,
    local_writes: Annotated[
        list[str] | None,
        typer.Option(
            "--local-writes",
            help="SCOPE=module:function: the two-phase local_writes an 'executed' answer "
            "commits with the resolution (repeatable)",
        ),
    ] = None,
    bootstrap_servers: BootstrapOpt = None,
    amqp_url: AmqpUrlOpt = None,
    dsn: DsnOpt = None,
    schema: SchemaOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Run the reconciler and its sweeper until SIGTERM/SIGINT, then print what it did.
    Logs every state change (INFO). Exit 1 when a case went to the operator or a notice
    was invalid."""
    from consumer_idem.operations.reconcile import NEEDS_OPERATOR, OUTCOMES, Reconciler
    from consumer_idem.operations.reconcile import Sweeper as SweeperType
    from consumer_idem.operations.replay import load_target

    reporter = Reporter("reconcile", interval=options.progress_interval)

    async def main() -> dict[str, Any]:
        async with open_store(dsn, schema) as store:
            answer = load_target(resolver)
            writes = {}
            for spec in local_writes or []:
                name, sep, target = spec.partition("=")
                if not sep or not name:
                    raise ValueError(f"--local-writes wants SCOPE=module:function, not {spec!r}")
                writes[name] = load_target(target)
            reconciler = Reconciler(
                store,
                answer,
                max_attempts=max_attempts,
                max_age=timedelta(hours=max_age_hours),
                scopes=scope,
                local_writes=writes,
            )
            runner = transport_runner(
                transport,
                reconciler,
                broker_settings(bootstrap_servers, amqp_url),
                source=source,
                operator=operator or f"{source}.operator",
                group=group,
            )
            reconciler.attach(runner)
            stop = asyncio.Event()
            on_signals(stop)
            await runner.start()
            note(f"reconciling {source} via {transport.value}; Ctrl-C to stop")
            sweeper = SweeperType(store, runner, scopes=scope)
            sweeping = asyncio.create_task(sweeper.run(stop, sweep_interval))
            with reporter.running():
                showing = asyncio.create_task(
                    _show_reconcile(store, reconciler, sweeper, reporter, stop, scope)
                )
                try:
                    await runner.run(stop)
                    await sweeping
                finally:
                    stop.set()
                    await showing
            left = await store.maintenance.count_unknown(scope)
            scheduled = await store.maintenance.count_unknown(scope, scheduled_only=True)
            tally = {reason: reconciler.tally.get(reason, 0) for reason in OUTCOMES}
            return {
                "outcomes": tally,
                "sweeps": asdict(sweeper.total),
                "unknown_left": left,
                "with_operator": left - scheduled,
                "needs_operator": sum(tally[r] for r in NEEDS_OPERATOR),
            }

    data = run(main(), one_shot=False, default=logging.INFO)

    def human() -> None:
        done = [f"{n} {OUTCOMES[r]}" for r, n in data["outcomes"].items() if n]
        console.print(f"notices handled: {', '.join(done) if done else 'none'}")
        sweeps = data["sweeps"]
        console.print(
            f"sweeps: {sweeps['zombies']} expired leases parked as unknown, "
            f"{sweeps['published']} notices published ({sweeps['refused']} refused), "
            f"{sweeps['redispatched']} originals re-dispatched "
            f"({sweeps['redispatch_failed']} failed)"
        )
        console.print(
            f"unknown left: {data['unknown_left']} ({data['with_operator']} with an operator)"
        )

    emit(data, as_json, human)
    failures = data["needs_operator"] + data["sweeps"]["refused"]
    finish(ExitCode.PARTIAL if failures else ExitCode.OK)


def replay(
    transport: TransportOpt,
    source: Annotated[str, typer.Option(help="dead-letter topic/queue to replay")],
    handler: Annotated[
        str,
        typer.Option(help="module:function giving the IdempotentConsumer (or taking the store)"),
    ],
    group: Annotated[
        str | None,
        typer.Option(
            help="Kafka group of this replay (resumable); default consumer-idem-replay.SOURCE"
        ),
    ] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="only count: change and log nothing")
    ] = False,
    rate: Annotated[float | None, typer.Option(help="messages per second at most")] = None,
    bootstrap_servers: BootstrapOpt = None,
    amqp_url: AmqpUrlOpt = None,
    dsn: DsnOpt = None,
    schema: SchemaOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Run a dead-letter topic/queue through the idempotent handler: completed keys are
    skipped, unknown ones left to reconciliation, the rest run once. What it cannot settle
    is dead-lettered again to SOURCE with the reason (a re-run meets it again) and listed;
    exit 1 then, 130 if interrupted (a re-run resumes)."""
    from consumer_idem.operations import replay as replaying

    settings = broker_settings(bootstrap_servers, amqp_url)
    reporter = Reporter("dry run" if dry_run else "replay", interval=options.progress_interval)

    def show(report: replaying.ReplayReport) -> None:
        counts = " ".join(f"{k}={v}" for k, v in replaying.report_row(report).items())
        reporter.update(report.read, report.total, counts)

    async def main() -> replaying.ReplayReport:
        async with open_store(dsn, schema) as store:
            try:
                consumer = replaying.load_consumer(handler, store)
            except TypeError as exc:
                raise CliError(str(exc)) from exc
            messages: Any
            if transport is TransportName.kafka:
                messages = replaying.kafka_source(
                    source,
                    group_id=group or f"consumer-idem-replay.{source}",
                    bootstrap_servers=settings.kafka_bootstrap,
                    commit=not dry_run,
                )
            else:
                messages = replaying.rabbit_source(
                    source, url=settings.amqp_url, requeue_all=dry_run
                )
            stop = asyncio.Event()
            on_signals(stop)
            with reporter.running():
                return await replaying.replay(
                    consumer, messages, dry_run=dry_run, rate=rate, on_progress=show, stop=stop
                )

    report = run(main(), one_shot=False)
    data = {"dry_run": dry_run, "source": source, **report.as_dict()}
    emit(data, as_json, lambda: _replay_summary(report, dry_run, source))
    if report.interrupted:
        finish(ExitCode.INTERRUPTED)
    finish(ExitCode.PARTIAL if report.unsettled and not dry_run else ExitCode.OK)


async def _show_reconcile(
    store: PostgresStore,
    reconciler: Any,
    sweeper: Any,
    reporter: Reporter,
    stop: asyncio.Event,
    scopes: list[str] | None,
) -> None:
    """Keep the reconcile progress current: cases this run settled (or handed to the operator)
    against those plus the ones reconciliation still has, re-counted when the tally moves and
    every few seconds otherwise."""
    loop = asyncio.get_running_loop()
    left: int | None = None
    counted_at = -1e9
    counted_for = -1
    while True:
        tally = reconciler.tally
        operator = tally["reconcile_exhausted"] + tally["redispatch_exhausted"]
        done = tally["executed"] + tally["not_executed"] + operator
        if done != counted_for or loop.time() - counted_at >= 5.0:
            with suppress(ConsumerIdemError):  # a store blip: keep the last count
                left = await store.maintenance.count_unknown(scopes, scheduled_only=True)
            counted_at, counted_for = loop.time(), done
        counts = (
            f"executed {tally['executed']}, not executed {tally['not_executed']}, "
            f"still unknown {tally['rescheduled']}, to operator {operator}, "
            f"zombies {sweeper.total.zombies}"
        )
        reporter.update(done, None if left is None else done + left, counts)
        if stop.is_set():
            return
        with suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=0.5)


#: how a replay's categories read in its summary (dry run, real run)
_REPLAY_WORDS = {
    "execute": ("would execute", "executed"),
    "skip": ("already completed (would be skipped)", "already completed (skipped)"),
    "unknown": ("parked unknown (left to reconciliation)",) * 2,
    "in_progress": ("held by a live worker",) * 2,
    "misuse": ("key reused with another payload",) * 2,
    "invalid": ("without a valid key or body",) * 2,
    "failed": ("-", "failed again"),
}


def _replay_summary(report: Any, dry_run: bool, source: str) -> None:
    from consumer_idem.operations.replay import CATEGORIES

    parts = [
        f"{getattr(report, c)} {_REPLAY_WORDS[c][0 if dry_run else 1]}"
        for c in CATEGORIES
        if getattr(report, c) or c in ("execute", "skip")
    ]
    of = f" of {report.total}" if report.total is not None else ""
    head = "dry run, nothing changed: read" if dry_run else "replayed"
    console.print(f"{head} {report.read}{of} messages from {escape(source)}: {', '.join(parts)}")
    if report.redead_lettered:
        console.print(
            f"{report.redead_lettered} not settled: dead-lettered again to {escape(source)} "
            "with the reason; a later replay with the same group meets them again"
        )
    if report.interrupted:
        console.print("interrupted: the rest is left in place; run the same command to resume")
    if report.problems and not dry_run:
        table = folding_table("category", "scope", "key", "reason", "error", "read at")
        for p in report.problems[:20]:
            table.add_row(
                *(escape(str(v or "")) for v in (p.category, p.scope, p.key, p.reason, p.error)),
                escape(p.position),
            )
        console.print(table)
        more = len(report.problems) - 20
        if more > 0:
            console.print(f"... and {more} more (all of them with --json, and in the log)")
