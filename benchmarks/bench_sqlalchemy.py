"""Transactional executions whose effect is written through a bound SQLAlchemy ``AsyncSession``
(an ORM object added and flushed, the store on the application's engine: one pool) against
the same effect written with raw asyncpg on the handler's connection (the store on an asyncpg
pool), same run, same database. ``sqlalchemy.session_alone.c1``, a reference: the same ORM write
in a plain session of its own (its own BEGIN and COMMIT, no idempotency) against the same raw
idempotent unit, which shows how much of the gap is SQLAlchemy's own cost."""

from __future__ import annotations

import uuid
from typing import Any

import asyncpg
from sqlalchemy import BigInteger, String
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from benchmarks.common import entry, interleaved, rate, scratch_database
from consumer_idem import PostgresStore, run_transactional
from consumer_idem.sqlalchemy import engine_store, with_session

EFFECT = "INSERT INTO bench_effects (id, customer_id, amount_cents) VALUES ($1, $2, $3)"


class Base(DeclarativeBase):
    pass


class Effect(Base):
    __tablename__ = "bench_effects"

    id: Mapped[str] = mapped_column(String, primary_key=True)
    customer_id: Mapped[str] = mapped_column(String)
    amount_cents: Mapped[int] = mapped_column(BigInteger)


async def run(per_chunk: int = 300, chunks: int = 20) -> list[dict[str, Any]]:
    async with scratch_database() as dsn:
        pool = await asyncpg.create_pool(dsn, min_size=4, max_size=4)
        assert pool is not None
        engine = create_async_engine(
            dsn.replace("postgresql://", "postgresql+asyncpg://", 1), pool_size=4
        )
        async with engine.begin() as conn:
            await conn.run_sync(Base.metadata.create_all)
        raw_store = PostgresStore(pool)
        await raw_store.migrate()
        session_store = engine_store(engine)

        async def raw(r: int) -> float:
            scope = f"bench-raw-{uuid.uuid4().hex[:6]}"

            async def op(i: int) -> None:
                async def handler(conn: asyncpg.Connection) -> None:
                    await conn.execute(EFFECT, f"{scope}-{i}", "c1", 100)

                await run_transactional(raw_store, scope, f"key-{i}", "v1:jcs:x", handler)

            return await rate(op, per_chunk, 1)

        async def orm(r: int) -> float:
            scope = f"bench-orm-{uuid.uuid4().hex[:6]}"

            async def op(i: int) -> None:
                async def handler(session: AsyncSession) -> None:
                    session.add(Effect(id=f"{scope}-{i}", customer_id="c1", amount_cents=100))

                await run_transactional(
                    session_store, scope, f"key-{i}", "v1:jcs:x", with_session(handler)
                )

            return await rate(op, per_chunk, 1)

        async def alone(r: int) -> float:
            """The same ORM write in a session of its own, with no idempotency at all: what
            SQLAlchemy itself costs against the raw idempotent unit (a reference)."""
            prefix = f"bench-alone-{uuid.uuid4().hex[:6]}"

            async def op(i: int) -> None:
                async with AsyncSession(engine, expire_on_commit=False) as session:
                    session.add(Effect(id=f"{prefix}-{i}", customer_id="c1", amount_cents=100))
                    await session.commit()

            return await rate(op, per_chunk, 1)

        await raw(-1)  # warm-up: connections, prepared statements, compiled SQL, table pages
        await orm(-1)
        await alone(-1)
        base, subject = await interleaved(chunks, raw, orm)
        reference, session_alone = await interleaved(chunks // 2, raw, alone)
        await engine.dispose()
        await pool.close()
    return [
        entry("store.transactional.sqlalchemy.c1", subject, "ops/s", base),
        entry("sqlalchemy.session_alone.c1", session_alone, "ops/s", reference),
    ]
