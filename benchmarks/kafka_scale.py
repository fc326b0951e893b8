"""Horizontal scale: 1, 2 and 4 consumer processes of one group over eight partitions
(``kafka.scale.procs_N``), batch mode, the demo effect, and where the CPU went.

Each process joins the group and waits; once the group is stable with all of them, they are
told to go together, so joining and rebalancing are not measured. The rate runs from the first
record settled in any process to the last one in any. Over the same window the CPU time of the
consumer processes, of PostgreSQL (the backends of the benchmark database and the WAL writer,
checkpointer and background writer) and of the Kafka broker is read from ``/proc``, so the
entry's log line says which of them ran out of the machine's cores.

    python -m benchmarks.kafka_scale child <topic> <group> <scope>   (one consumer process)
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import asyncpg
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from benchmarks.common import entry
from consumer_idem.cli.settings import load_settings
from examples.payments_producer import plan, send_kafka

#: messages per run (eight partitions), and the process counts measured
COUNT = 40_000
PROCESSES = (1, 2, 4)
ROOT = Path(__file__).resolve().parent.parent
TICKS = os.sysconf("SC_CLK_TCK")


# --- one consumer process --------------------------------------------------------------------


async def child(topic: str, group: str, scope: str) -> None:
    from consumer_idem import PostgresStore, header, idempotent_consumer
    from consumer_idem.transports.kafka import KafkaRunner
    from handlers.payments import record_payments

    pool = await asyncpg.create_pool(load_settings().pg_dsn, min_size=2, max_size=10)
    assert pool is not None
    consumer = idempotent_consumer(
        PostgresStore(pool), scope=scope, key=header("idempotency-key"), batch=True
    )(record_payments)
    runner = KafkaRunner(consumer, topics=[topic], group_id=group, outbox_relay=None)
    await runner.start()  # joins the group; nothing is consumed before run()
    print(json.dumps({"event": "joined"}), flush=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.readline)  # "go"
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    task = asyncio.create_task(runner.run(stop))
    first: float | None = None
    last = 0.0
    seen = 0
    while not stop.is_set():
        if runner.stats.processed > seen:
            seen = runner.stats.processed
            last = time.time()
            first = first or last
        await asyncio.sleep(0.002)
    await task
    await pool.close()
    print(json.dumps({"event": "stopped", "first": first, "last": last, "n": seen}), flush=True)


# --- CPU accounting --------------------------------------------------------------------------


def _cpu(pid: int) -> float:
    """User + system CPU seconds of a process (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICKS


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _groups(database: str) -> dict[str, list[int]]:
    """The PostgreSQL processes working for the benchmark database, and the broker's."""
    found: dict[str, list[int]] = {"postgres": [], "broker": []}
    shared = ("walwriter", "checkpointer", "background writer", "wal writer")
    for entry_ in os.listdir("/proc"):
        if not entry_.isdigit():
            continue
        pid = int(entry_)
        line = _cmdline(pid)
        if line.startswith("postgres:") and (database in line or any(s in line for s in shared)):
            found["postgres"].append(pid)
        elif "kafka.Kafka" in line:
            found["broker"].append(pid)
    return found


def _machine() -> tuple[float, float, float]:
    """(busy, iowait, idle) CPU seconds of the whole machine since boot (``/proc/stat``)."""
    values = [int(v) / TICKS for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    user, nice, system, idle, iowait, irq, softirq, steal = (values + [0.0] * 8)[:8]
    return user + nice + system + irq + softirq + steal, iowait, idle


class CpuWindow:
    """CPU seconds of each group of processes between :meth:`start` and :meth:`stop`, and of
    the whole machine (other work on it included: these machines are shared)."""

    def __init__(self, database: str, consumers: list[int]) -> None:
        self.database = database
        self.consumers = consumers
        self.before: dict[int, float] = {}
        self.spent: dict[str, float] = {}
        self.wall = 0.0

    def _snapshot(self) -> dict[str, dict[int, float]]:
        groups = _groups(self.database)
        groups["consumers"] = self.consumers
        return {name: {pid: _cpu(pid) for pid in pids} for name, pids in groups.items()}

    def start(self) -> None:
        self.started = time.monotonic()
        self.first = self._snapshot()
        self.machine = _machine()

    def stop(self) -> None:
        self.wall = time.monotonic() - self.started
        busy, iowait, idle = (b - a for a, b in zip(self.machine, _machine(), strict=True))
        self.machine = (busy, iowait, idle)
        last = self._snapshot()
        for name, now in last.items():
            before = self.first.get(name, {})
            self.spent[name] = sum(cpu - before.get(pid, 0.0) for pid, cpu in now.items())

    def describe(self, messages: int) -> str:
        cores = os.cpu_count() or 1
        parts = [
            f"{name} {cpu:.1f} s ({cpu / messages * 1e6:.0f} us/msg)"
            for name, cpu in sorted(self.spent.items())
        ]
        used = sum(self.spent.values())
        busy, iowait, idle = self.machine
        total = max(busy + iowait + idle, 1e-9)
        return (
            f"CPU over {self.wall:.1f} s x {cores} cores = {self.wall * cores:.1f} s: "
            + ", ".join(parts)
            + f"; these together {used / (self.wall * cores):.0%} of the machine, which was"
            f" {busy / total:.0%} busy (everything on it), {iowait / total:.0%} waiting for the"
            f" disk, {idle / total:.0%} idle"
        )


# --- the measurement -------------------------------------------------------------------------


async def _spawn(dsn: str, topic: str, group: str, scope: str) -> asyncio.subprocess.Process:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "benchmarks.kafka_scale",
        "child",
        topic,
        group,
        scope,
        cwd=ROOT,
        env=dict(os.environ, CONSUMER_IDEM_PG_DSN=dsn),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), 60)
    assert json.loads(line)["event"] == "joined", line
    return proc


async def _stable(admin: AIOKafkaAdminClient, group: str, members: int) -> None:
    """Until the group is stable with ``members`` members that hold every partition."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        (described,) = await admin.describe_consumer_groups([group])
        info = described.groups[0] if hasattr(described, "groups") else described
        state, found = _state(info)
        if state == "Stable" and found == members:
            return
        await asyncio.sleep(0.2)
    raise TimeoutError(f"group {group} did not settle with {members} members")


def _state(info: Any) -> tuple[str, int]:
    """(state, members) of a DescribeGroups answer (a response object or a tuple)."""
    if isinstance(info, tuple):  # (error, group, state, protocol_type, protocol, members...)
        return str(info[2]), len(info[5])
    return str(info.state), len(info.members)


async def _run_once(
    dsn: str, admin: AIOKafkaAdminClient, topic: str, processes: int, database: str
) -> tuple[float, str]:
    group = f"scale-{processes}-{uuid.uuid4().hex[:6]}"
    scope = f"scale-{processes}-{uuid.uuid4().hex[:6]}"
    procs = [await _spawn(dsn, topic, group, scope) for _ in range(processes)]
    try:
        await _stable(admin, group, processes)
        window = CpuWindow(database, [p.pid for p in procs])
        conn = await asyncpg.connect(dsn)
        try:
            window.start()
            for p in procs:
                assert p.stdin is not None
                p.stdin.write(b"go\n")
                await p.stdin.drain()
            sql = 'SELECT count(*) FROM "consumer_idem".idempotency_records WHERE scope = $1'
            deadline = time.monotonic() + 300
            while await conn.fetchval(sql, scope) < COUNT:
                if time.monotonic() > deadline:
                    raise TimeoutError("the scale run did not finish")
                await asyncio.sleep(0.05)
            window.stop()
        finally:
            await conn.close()
    finally:
        reports = []
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            out, _ = await asyncio.wait_for(p.communicate(), 60)
            lines = out.decode().strip().splitlines()
            if lines:
                reports.append(json.loads(lines[-1]))
    started = min(r["first"] for r in reports if r.get("first"))
    ended = max(r["last"] for r in reports if r.get("last"))
    total = sum(r["n"] for r in reports)
    return (total - 1) / max(ended - started, 1e-9), window.describe(total)


async def run(dsn: str, run_id: str) -> list[dict[str, Any]]:
    """The ``kafka.scale.procs_N`` entries (the database at ``dsn`` is migrated, with the demo
    tables); each N's baseline is one process."""
    settings = load_settings()
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap)
    await admin.start()
    topic = f"bench-scale-{run_id}"
    database = dsn.rsplit("/", 1)[1]
    await admin.create_topics([NewTopic(topic, 8, 1)])
    results: list[dict[str, Any]] = []
    try:
        await send_kafka(plan(COUNT, 0.0, 5, run_id), topic)
        one: float | None = None
        for processes in PROCESSES:
            rate, cpu = await _run_once(dsn, admin, topic, processes, database)
            print(f"   procs_{processes}: {rate:,.0f} msg/s; {cpu}", flush=True)
            one = one or rate
            baseline = None if processes == 1 else one
            results.append(entry(f"kafka.scale.procs_{processes}", rate, "msg/s", baseline))
    finally:
        await admin.delete_topics([topic])
        await admin.close()
    return results


if __name__ == "__main__":
    if sys.argv[1:2] == ["child"]:
        asyncio.run(child(*sys.argv[2:5]))
