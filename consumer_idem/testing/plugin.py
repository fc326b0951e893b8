"""The pytest plugin (registered as ``consumer_idem`` under the ``pytest11`` entry point, so it
loads wherever consumer-idem is installed): two fixtures.

* ``idem_dsn`` (session): the DSN of a PostgreSQL for the tests (see
  :func:`consumer_idem.testing.postgres.postgres_dsn`): ``CONSUMER_IDEM_PG_DSN``, else a
  container started with testcontainers when a Docker engine answers, else the test fails with
  a message saying how to provide one. Override it in a ``conftest.py`` to use another.
* ``idem_store`` (per test, async: needs pytest-asyncio): a :class:`PostgresStore` migrated
  into a fresh schema of its own on that database, dropped with everything in it afterwards.
  Its pool is ``idem_store.pool``; tables the test creates on it live in that schema.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from consumer_idem.stores.postgres.store import PostgresStore
from consumer_idem.testing.postgres import NoPostgres, fresh_store, postgres_dsn


@pytest.fixture(scope="session")
def idem_dsn() -> Iterator[str]:
    """The DSN of the tests' PostgreSQL (``CONSUMER_IDEM_PG_DSN``, or a container)."""
    with contextlib.ExitStack() as stack:
        try:
            dsn = stack.enter_context(postgres_dsn())
        except NoPostgres as exc:
            missing = str(exc)
        else:
            yield dsn
            return
    pytest.fail(missing, pytrace=False)  # outside the handler: no chained traceback


def _store_fixture() -> Any:
    try:
        import pytest_asyncio
    except ImportError:  # the plugin loads in every pytest run: it must not break one without it

        def missing() -> None:
            pytest.fail(
                "the idem_store fixture is async: install pytest-asyncio "
                "(`pip install 'consumer-idem[testing]'`)",
                pytrace=False,
            )

        return pytest.fixture(missing, name="idem_store")

    async def idem_store(idem_dsn: str) -> AsyncIterator[PostgresStore]:
        """A migrated :class:`PostgresStore` in a fresh schema, dropped after the test."""
        missing = None
        try:
            async with fresh_store(idem_dsn) as store:
                yield store
        except NoPostgres as exc:
            missing = str(exc)
        if missing is not None:
            pytest.fail(missing, pytrace=False)

    return pytest_asyncio.fixture(idem_store, name="idem_store")


idem_store = _store_fixture()
