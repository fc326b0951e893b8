"""Latency the Idempotency-Key middleware adds to the same endpoint (one INSERT), measured on
loopback over real Postgres in one run: p50 and p99 for a first execution and for a replay,
minus the same percentiles of the endpoint without the middleware. Requests alternate between
the three kinds, so all see the same machine. Targets: first <= 2 ms p50 added, replay <= 1 ms.

``http.wait_for_result``: a route with ``wait``; its first request takes 300 ms (longer than the
claim's 250 ms lock timeout, so the duplicate sent 50 ms later lets go of its connection and
waits for the NOTIFY). The figure is how long after the first request's response the
duplicate's replay arrives, p50 (target: under 20 ms); the baseline is the first's own time.
"""

from __future__ import annotations

import asyncio
import os
import socket
import statistics
import sys
import time
import uuid
from typing import Any

import httpx

from benchmarks.common import scratch_database

N = 600
WAITS = 40
SLOW_S = 0.3


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _serve(app: str, dsn: str) -> tuple[asyncio.subprocess.Process, str]:
    port = _port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "uvicorn",
        f"benchmarks.http_apps:{app}",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "warning",
        env={**os.environ, "CONSUMER_IDEM_PG_DSN": dsn},
    )
    url = f"http://127.0.0.1:{port}"
    async with httpx.AsyncClient() as c:
        for _ in range(150):
            try:
                await c.get(url + "/")
                return proc, url
            except httpx.TransportError:
                await asyncio.sleep(0.1)
    raise RuntimeError(f"{app} did not start")


def pct(values: list[float], p: float) -> float:
    return statistics.quantiles(values, n=100)[int(p) - 1] if len(values) > 2 else values[0]


async def run() -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    async with scratch_database() as dsn:
        plain_proc, plain_url = await _serve("without_middleware", dsn)
        idem_proc, idem_url = await _serve("with_middleware", dsn)
        try:
            times: dict[str, list[float]] = {"plain": [], "first": [], "replay": []}
            replay_key = f"bench-{uuid.uuid4().hex}"
            body = {"item": "book", "qty": 1}
            async with httpx.AsyncClient(timeout=10) as c:
                await c.post(
                    idem_url + "/orders", json=body, headers={"Idempotency-Key": replay_key}
                )
                for i in range(N + 50):  # the first 50 warm connections and caches
                    for kind in ("plain", "first", "replay"):
                        url = plain_url if kind == "plain" else idem_url
                        headers = {}
                        if kind == "first":
                            headers["Idempotency-Key"] = f"bench-{uuid.uuid4().hex}"
                        elif kind == "replay":
                            headers["Idempotency-Key"] = replay_key
                        started = time.perf_counter()
                        r = await c.post(url + "/orders", json=body, headers=headers)
                        elapsed = (time.perf_counter() - started) * 1000
                        assert r.status_code == 201, (kind, r.status_code, r.text)
                        if i >= 50:
                            times[kind].append(elapsed)
            waits, firsts = await _wait_for_result(idem_url)
        finally:
            for proc in (plain_proc, idem_proc):
                proc.terminate()
                await proc.wait()
    for p in (50, 99):
        base = pct(times["plain"], p)
        for kind in ("first", "replay"):
            added = pct(times[kind], p) - base
            results.append(
                {
                    "name": f"http.middleware.added_latency.{kind}.p{p}",
                    "value": round(added, 3),
                    "unit": "ms",
                    "baseline": round(base, 3),
                    "ratio": round(pct(times[kind], p) / base, 3),
                }
            )
    first = statistics.median(firsts)
    after = statistics.median(waits)
    results.append(
        {
            "name": "http.wait_for_result",
            "value": round(after, 3),
            "unit": "ms",
            "baseline": round(first, 3),
            "ratio": round((first + after) / first, 3),
        }
    )
    return results


async def _wait_for_result(url: str) -> tuple[list[float], list[float]]:
    """(ms from the first response to the waiting duplicate's replay, ms of each first)."""
    body = {"item": "book", "qty": 1, "sleep": SLOW_S}
    after: list[float] = []
    firsts: list[float] = []
    async with httpx.AsyncClient(timeout=10) as c:

        async def post(headers: dict[str, str]) -> tuple[httpx.Response, float]:
            r = await c.post(url + "/slow-orders", json=body, headers=headers)
            return r, time.perf_counter()

        for i in range(WAITS + 3):  # the first 3 warm up
            headers = {"Idempotency-Key": f"wait-{uuid.uuid4().hex}"}
            started = time.perf_counter()
            first = asyncio.create_task(post(headers))
            await asyncio.sleep(0.05)
            dup, dup_done = await post(headers)
            one, one_done = await first
            assert one.status_code == dup.status_code == 201, (one.text, dup.text)
            assert dup.headers.get("idempotent-replayed") == "true", dup.headers
            if i >= 3:
                after.append((dup_done - one_done) * 1000)
                firsts.append((one_done - started) * 1000)
    return after, firsts
