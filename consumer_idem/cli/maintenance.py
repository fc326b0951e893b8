"""Keeping the store in shape: ``sweep`` (due notices, expired leases) and ``prune``."""

from __future__ import annotations

import asyncio
import math
from dataclasses import asdict
from typing import Annotated, Any

import typer

from consumer_idem.cli.brokers import AmqpUrlOpt, BootstrapOpt, broker_settings
from consumer_idem.cli.common import (
    DsnOpt,
    JsonOpt,
    SchemaOpt,
    ScopesOpt,
    TransportName,
    emit,
    finish,
    on_signals,
    open_store,
    options,
    plural,
    run,
    transport_runner,
)
from consumer_idem.cli.output import (
    ExitCode,
    Reporter,
    console,
)
from consumer_idem.stores.postgres.maintenance import (
    DEFAULT_PRUNE_RATE,
    PrunePolicy,
    PruneReport,
)


def sweep(
    transport: Annotated[
        TransportName | None,
        typer.Option("--transport", help="publish due notices through kafka or rabbit"),
    ] = None,
    source: Annotated[
        str, typer.Option(help="reconciliation topic/queue")
    ] = "consumer_idem.reconcile",
    scope: ScopesOpt = None,
    bootstrap_servers: BootstrapOpt = None,
    amqp_url: AmqpUrlOpt = None,
    dsn: DsnOpt = None,
    schema: SchemaOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Once: park expired leases as unknown (every scope); with --transport, also publish
    due notices and send due re-dispatches (of --scope, default all). Exit 1 when a notice
    or re-dispatch could not be sent (they stay due)."""
    from consumer_idem.operations.reconcile import Reconciler, StillUnknown, Sweeper

    reporter = Reporter("sweep", interval=options.progress_interval)

    async def main() -> dict[str, int]:
        async with open_store(dsn, schema) as store:
            stop = asyncio.Event()
            on_signals(stop)
            if transport is None:
                total = await store.maintenance.count_expired_leases()
                with reporter.running():
                    reporter.update(0, total, "")
                    swept = await store.maintenance.sweep(
                        on_batch=lambda r: reporter.update(
                            r.parked, max(total, r.parked), f"parked {r.parked}"
                        ),
                        stop=stop,
                    )
                due = len(await store.reconciliation.due_notices(10_000, scope))
                return {"zombies": swept.parked, "due_unpublished": due}

            async def never(record: Any) -> StillUnknown:
                return StillUnknown()

            runner = transport_runner(
                transport,
                Reconciler(store, never),
                broker_settings(bootstrap_servers, amqp_url),
                source=source,
                operator=f"{source}.operator",
                group="consumer-idem-sweep",
            )
            await runner.open_publisher()
            try:
                with reporter.running():
                    reporter.update(0, None, "parking, publishing, re-dispatching")
                    report = await Sweeper(store, runner, scopes=scope).run_once()
            finally:
                await runner.close_publisher()
            return asdict(report)

    data = run(main(), one_shot=transport is None)
    failures = data.get("refused", 0) + data.get("redispatch_failed", 0)

    def human() -> None:
        line = f"parked {plural(data['zombies'], 'expired lease')} as unknown"
        if transport is None:
            due = data["due_unpublished"]
            line += f"; {plural(due, 'reconciliation notice')} due and unpublished" + (
                " (a reconciler publishes them, or sweep --transport)" if due else ""
            )
        else:
            line += (
                f"; published {plural(data['published'], 'due notice')}"
                f" ({data['refused']} refused, still due);"
                f" re-dispatched {plural(data['redispatched'], 'original')}"
                f" ({data['redispatch_failed']} failed, retried later)"
            )
        console.print(line)

    emit(data, as_json, human)
    finish(ExitCode.PARTIAL if failures else ExitCode.OK)


def prune(
    policy: Annotated[
        PrunePolicy, typer.Option(help="delete, or soft-expire first")
    ] = PrunePolicy.DELETE,
    batch_size: Annotated[int, typer.Option(min=1, help="rows per statement")] = 200,
    max_batches: Annotated[int | None, typer.Option(min=1, help="stop after this many")] = None,
    max_rows_per_s: Annotated[
        float,
        typer.Option(min=0, help="pace: rows a second at most (0: as fast as it goes)"),
    ] = DEFAULT_PRUNE_RATE,
    dsn: DsnOpt = None,
    schema: SchemaOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Delete (or soft-expire) records past retention, in small batches, paced so that
    live traffic beside it keeps its speed."""
    if not math.isfinite(max_rows_per_s):  # inf would be no pace at all: 0 says so
        raise typer.BadParameter(
            "a finite number of rows a second, or 0 for no pace",
            param_hint="'--max-rows-per-s'",
        )
    reporter = Reporter(f"prune ({policy.value})", interval=options.progress_interval)
    interrupted = False

    async def main() -> PruneReport:
        nonlocal interrupted
        async with open_store(dsn, schema) as store:
            stop = asyncio.Event()
            on_signals(stop)
            total = await store.maintenance.count_prunable()
            with reporter.running():
                reporter.update(0, total, "")
                report = await store.maintenance.prune(
                    policy=policy,
                    batch_size=batch_size,
                    max_batches=max_batches,
                    on_batch=lambda r: reporter.update(
                        r.rows, max(total, r.rows), f"{r.batches} batches"
                    ),
                    stop=stop,
                    max_rows_per_s=max_rows_per_s,
                )
            interrupted = stop.is_set() and not report.finished
            return report

    report = run(main())
    data = {
        **asdict(report),
        "longest_statement_ms": round(report.longest_statement_s * 1000, 1),
        "interrupted": interrupted,
    }
    done = "deleted" if policy is PrunePolicy.DELETE else "soft-expired or deleted"

    def human() -> None:
        console.print(
            f"{done} {report.rows} rows past retention in {report.batches} batches "
            f"(longest statement {data['longest_statement_ms']} ms)"
            + ("" if report.finished else "; stopped early, more rows may be due")
        )

    emit(data, as_json, human)
    finish(ExitCode.INTERRUPTED if interrupted else ExitCode.OK)
