"""``on_execute`` / ``on_replay`` of HTTP routes (per route, or the middleware's for every
route), through FastAPI on the real store: a hook counts real executions and sets a header on
a replayed response; a failing hook changes no response."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from pydantic import BaseModel

from consumer_idem import PostgresStore
from consumer_idem.http import IdempotencyMiddleware, RequestOutcome, idempotent


class Order(BaseModel):
    amount: int


def client(app: FastAPI, store: PostgresStore, **options: Any) -> httpx.AsyncClient:
    app.add_middleware(IdempotencyMiddleware, store=store, shared_keys=True, **options)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    return httpx.AsyncClient(transport=transport, base_url="http://test")


@pytest.mark.parametrize("mode", ["transactional", "two_phase"])
async def test_route_hooks_count_real_executions_and_mark_a_replay_with_a_header(
    store: PostgresStore, scope: str, mode: str
) -> None:
    executed: list[RequestOutcome] = []
    replayed: list[RequestOutcome] = []

    def on_replay(outcome: RequestOutcome) -> None:
        replayed.append(outcome)
        outcome.set_header("x-replay-count", str(len(replayed)))

    app = FastAPI()

    @app.post(f"/{scope}", status_code=201)
    @idempotent(mode=mode, on_execute=executed.append, on_replay=on_replay)  # type: ignore[arg-type]
    async def create(order: Order) -> dict[str, int]:
        return {"amount": order.amount}

    @app.post(f"/{scope}/plain", status_code=201)
    async def plain(order: Order) -> dict[str, int]:  # no hooks of its own, none global
        return {"amount": order.amount}

    async with client(app, store) as http:
        key = {"Idempotency-Key": f"{scope}-1"}
        first = await http.post(f"/{scope}", json={"amount": 5}, headers=key)
        again = await http.post(f"/{scope}", json={"amount": 5}, headers=key)
        third = await http.post(f"/{scope}", json={"amount": 5}, headers=key)
        await http.post(f"/{scope}/plain", json={"amount": 5}, headers={"Idempotency-Key": "p"})
    assert first.status_code == again.status_code == third.status_code == 201
    assert "x-replay-count" not in first.headers
    assert again.headers["x-replay-count"] == "1" and third.headers["x-replay-count"] == "2"
    assert again.json() == first.json() == {"amount": 5}
    assert [(o.key, o.replayed, o.status, o.route) for o in executed] == [
        (f"{scope}-1", False, 201, f"/{scope}")
    ]
    assert [o.replayed for o in replayed] == [True, True]
    assert executed[0].scope == replayed[0].scope and executed[0].method == "POST"


async def test_the_middlewares_hooks_apply_to_every_route_and_a_route_overrides_them(
    store: PostgresStore, scope: str
) -> None:
    seen: list[tuple[str, str, bool]] = []
    app = FastAPI()

    @app.post(f"/{scope}/a")
    async def a() -> int:
        return 1

    @app.post(f"/{scope}/b")
    @idempotent(on_replay=lambda o: seen.append(("route", o.route, o.replayed)))
    async def b() -> int:
        return 2

    async with client(
        app,
        store,
        on_execute=lambda o: seen.append(("all", o.route, o.replayed)),
        on_replay=lambda o: seen.append(("all", o.route, o.replayed)),
    ) as http:
        for path in ("a", "a", "b", "b"):
            await http.post(f"/{scope}/{path}", headers={"Idempotency-Key": f"{scope}-{path}"})
    assert seen == [
        ("all", f"/{scope}/a", False),
        ("all", f"/{scope}/a", True),
        ("all", f"/{scope}/b", False),
        ("route", f"/{scope}/b", True),
    ]


async def test_a_failing_hook_changes_no_response(
    store: PostgresStore, scope: str, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(outcome: RequestOutcome) -> None:
        raise RuntimeError("metrics backend down")

    app = FastAPI()

    @app.post(f"/{scope}", status_code=201)
    async def create() -> int:
        return 7

    async with client(app, store, on_execute=broken, on_replay=broken) as http:
        key = {"Idempotency-Key": f"{scope}-1"}
        first = await http.post(f"/{scope}", headers=key)
        again = await http.post(f"/{scope}", headers=key)
    assert first.status_code == again.status_code == 201 and again.json() == 7
    assert again.headers["idempotent-replayed"] == "true"
    assert "a request hook failed" in caplog.text
