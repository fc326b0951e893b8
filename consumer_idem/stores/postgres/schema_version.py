"""The store's schema version: apply the migrations, and check at start-up that they are applied."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from consumer_idem.errors import SchemaMissing
from consumer_idem.stores.postgres import errors as pg_errors
from consumer_idem.stores.postgres import migrate
from consumer_idem.stores.postgres.pooler import check_pool

if TYPE_CHECKING:
    from consumer_idem.stores.postgres.store import PostgresStore


class SchemaVersion:
    """Migrating one store's schema, and probing that it is at this library's version."""

    def __init__(self, store: PostgresStore) -> None:
        self.store = store

    async def migrate(self) -> list[int]:
        """Create or upgrade the schema (see
        [`PostgresStore.migrate`][consumer_idem.PostgresStore.migrate])."""
        schema = self.store.schema

        async def apply(c: Any) -> list[int]:
            await self.check_pool(c)
            return await migrate.apply(c, schema)

        return await self.store.run("migrate", "", None, apply)

    async def check_pool(self, conn: Any) -> None:
        """Behind a transaction pooler, check that the pool was made for one."""
        if self.store.pooler == "transaction":
            await check_pool(conn)

    async def check(self) -> None:
        """Raise [`SchemaMissing`][consumer_idem.SchemaMissing] when the schema is missing or older
        than this library
        (see [`PostgresStore.check_schema`][consumer_idem.PostgresStore.check_schema])."""
        schema = self.store.schema
        wanted = max(m.version for m in migrate.available())
        sql = f'SELECT coalesce(max(version), 0) FROM "{schema}".schema_migrations'

        async def check(c: Any) -> int:
            await self.check_pool(c)
            found: int = await c.fetchval(sql)
            return found

        version = await self.store.run("check_schema", "", None, check)
        if version < wanted:
            raise SchemaMissing(
                f"the idempotency schema {schema!r} is at version {version}, this library "
                f"needs {wanted}: {pg_errors.MIGRATE_HINT}"
            )
