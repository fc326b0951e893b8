"""The store's own API, under the decorators: reserve, then complete in your
transaction."""

import asyncio
import os
import uuid

from consumer_idem import DecisionKind, PostgresStore, fingerprint_bytes

DSN = os.environ.get(
    "CONSUMER_IDEM_PG_DSN", "postgresql://postgres:postgres@127.0.0.1/postgres"
)


async def main() -> None:
    async with PostgresStore.from_dsn(DSN) as store:  # closed at the end
        await store.migrate()
        key = f"k-{uuid.uuid4().hex[:8]}"
        fp = fingerprint_bytes(b"the work")

        decision = await store.reserve("docs.lowlevel", key, fp, lease=30)
        assert (
            decision.kind is DecisionKind.EXECUTE
        )  # yours, with an owner token
        async with store.pool.acquire() as conn, conn.transaction():
            await conn.execute("SELECT 1")  # your writes...
            await store.complete(
                "docs.lowlevel", key, decision.token, {"ok": True}, conn=conn
            )

        again = await store.reserve("docs.lowlevel", key, fp)
        print(again.kind, again.record.result)  # replay {'ok': True}
        other_fp = fingerprint_bytes(b"other work")
        other = await store.reserve("docs.lowlevel", key, other_fp)
        print(other.kind)  # misuse: the same key for other work


asyncio.run(main())
