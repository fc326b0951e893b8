"""Running ``consumer-idem`` as a real subprocess, the way an operator (or a script) does."""

from __future__ import annotations

import asyncio
import os
import sys

#: stderr/stdout as a terminal for rich (https://rich.readthedocs.io: TTY_COMPATIBLE), with a
#: live display, at a known width
TERMINAL = {"TTY_COMPATIBLE": "1", "TTY_INTERACTIVE": "1", "COLUMNS": "100"}
#: a pipe, whatever the environment of the test run says
PIPE = {"TTY_COMPATIBLE": "0", "TTY_INTERACTIVE": "0"}


async def cli(
    *args: str, dsn: str | None = None, stdin: bytes | None = None, **env_extra: str
) -> tuple[int, str, str]:
    """``python -m consumer_idem.cli ARGS``: (exit code, stdout, stderr); ``stdin``: what the
    operator types (none: stdin is closed)."""
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "NO_COLOR")}
    env.update(PIPE)
    env.update(env_extra)
    if dsn:
        env["CONSUMER_IDEM_PG_DSN"] = dsn
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "consumer_idem.cli",
        *args,
        env=env,
        stdin=asyncio.subprocess.DEVNULL if stdin is None else asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(stdin), timeout=120)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()
