"""Versioned SQL migrations shipped in ``consumer_idem/stores/postgres/migrations``.

Every file ``NNNN_name.sql`` is applied once, in order, inside one transaction per run that
holds an advisory lock, so several processes starting together migrate exactly once.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from importlib import resources

import asyncpg

_IDENT = re.compile(r"[a-z_][a-z0-9_]{0,62}")
_FILE = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")


def validate_schema(schema: str) -> str:
    """The schema name is put into SQL text, so only plain lower-case identifiers are allowed."""
    # fullmatch: "$" in a pattern also matches before a trailing newline, and a newline in an
    # unquoted identifier (a prepared statement's name) is whitespace to PostgreSQL
    if not _IDENT.fullmatch(schema):
        raise ValueError(f"invalid schema name {schema!r}: use [a-z_][a-z0-9_]*, at most 63 chars")
    return schema


def per_schema_name(prefix: str, schema: str) -> str:
    """An identifier of the library's own for one store (a prepared statement, a NOTIFY
    channel): ``<prefix>_<schema>``, unless that passes PostgreSQL's 63 bytes, which it would
    cut silently (two long schemas with a common start would then share one prepared statement
    on a connection: one store's claim written into the other's table). A longer one is
    ``<prefix>$<digest of the schema>``: no schema name holds a ``$``, so the two forms never
    meet. No prefix may be another's followed by ``_`` (``consumer_idem_check`` and
    ``consumer_idem_check_done`` would name the same statement for schemas ``done_x`` and
    ``x``)."""
    name = f"{prefix}_{schema}"
    if len(name) <= 63:
        return name
    return f"{prefix}${hashlib.sha256(schema.encode()).hexdigest()[: 62 - len(prefix)]}"


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str


def available() -> list[Migration]:
    found = []
    for entry in resources.files("consumer_idem.stores.postgres.migrations").iterdir():
        match = _FILE.match(entry.name)
        if match:
            found.append(Migration(int(match[1]), match[2], entry.read_text(encoding="utf-8")))
    return check_versions(sorted(found, key=lambda m: m.version))


def check_versions(migrations: list[Migration]) -> list[Migration]:
    """Refuse two files with one version number: the second would be skipped for ever."""
    versions = [m.version for m in migrations]
    twice = sorted({v for v in versions if versions.count(v) > 1})
    if twice:
        raise RuntimeError(f"two migration files share version(s) {twice}: renumber one")
    return migrations


async def apply(conn: asyncpg.Connection, schema: str) -> list[int]:
    """Apply pending migrations to ``schema``; returns the versions applied now."""
    schema = validate_schema(schema)
    applied_now: list[int] = []
    async with conn.transaction():
        # One lock per schema: concurrent starters queue here instead of racing CREATE SCHEMA.
        await conn.execute(
            "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))", f"consumer_idem:{schema}"
        )
        await conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{schema}"')
        await conn.execute(f'SET LOCAL search_path TO "{schema}"')
        await conn.execute(
            "CREATE TABLE IF NOT EXISTS schema_migrations ("
            " version integer PRIMARY KEY, name text NOT NULL,"
            " applied_at timestamptz NOT NULL DEFAULT now())"
        )
        done = {r["version"] for r in await conn.fetch("SELECT version FROM schema_migrations")}
        for migration in available():
            if migration.version in done:
                continue
            await conn.execute(migration.sql)
            await conn.execute(
                "INSERT INTO schema_migrations (version, name) VALUES ($1, $2)",
                migration.version,
                migration.name,
            )
            applied_now.append(migration.version)
    return applied_now
