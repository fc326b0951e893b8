"""Receiving GitHub: verified, each event run once, kept past the retries."""

import asyncio
import json
import os
import uuid
from typing import Any

import asyncpg
import httpx
from starlette.applications import Starlette
from starlette.routing import Route

from consumer_idem import PostgresStore
from consumer_idem.webhooks import WebhookReceiver, github_verifier, sign_github

DSN = os.environ.get(
    "CONSUMER_IDEM_PG_DSN", "postgresql://postgres:postgres@127.0.0.1/postgres"
)
# Repository > Settings > Webhooks > your hook > Secret
# (a random string you choose)
# Several, comma-separated, while you rotate: old and new are both accepted.
SECRETS = os.environ.get("GITHUB_WEBHOOK_SECRETS", "docs-github-secret").split(
    ","
)


async def on_event(event: dict[str, Any], conn: asyncpg.Connection) -> None:
    # runs once per X-GitHub-Delivery header;
    # the row commits with the dedupe record
    ref = str(event["issue"]["id"])
    await conn.execute("INSERT INTO docs_github_issues VALUES ($1)", ref)


async def main() -> None:
    pool = await asyncpg.create_pool(DSN)
    store = PostgresStore(pool)
    await store.migrate()
    await pool.execute(
        "CREATE TABLE IF NOT EXISTS docs_github_issues (ref text)"
    )
    receiver = WebhookReceiver(
        store, "github", github_verifier(SECRETS), on_event
    )
    app = Starlette(
        routes=[Route("/webhooks/github", receiver.handle, methods=["POST"])]
    )

    # what GitHub sends, signed with the first secret, delivered twice (a retry)
    ref = str(uuid.uuid4().int % 10**9)
    body = json.dumps({"action": "opened", "issue": {"id": int(ref)}}).encode()
    headers = sign_github(body, SECRETS[0], str(uuid.uuid4()))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(
        transport=transport, base_url="http://hooks"
    ) as client:
        for _ in range(2):
            response = await client.post(
                "/webhooks/github", content=body, headers=headers
            )
            assert response.status_code == 200, response.text
        forged = await client.post(
            "/webhooks/github", content=body + b" ", headers=headers
        )
        assert forged.status_code == 401, forged.text
    sql = "SELECT count(*) FROM docs_github_issues WHERE ref = $1"
    assert await pool.fetchval(sql, ref) == 1
    await pool.close()


asyncio.run(main())
