"""Restarting the RabbitMQ broker from a test: the native node, or the compose service."""

from __future__ import annotations

import asyncio
import shutil

from tests.conftest import ROOT_DIR


async def _run(*cmd: str) -> None:
    proc = await asyncio.create_subprocess_exec(
        *cmd, cwd=ROOT_DIR, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
    )
    _, err = await asyncio.wait_for(proc.communicate(), timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {err.decode()[-500:]}")


async def rabbitmqctl(*args: str) -> None:
    if shutil.which("rabbitmqctl"):
        await _run("rabbitmqctl", *args)
    else:  # the Docker path: the broker runs in the compose service
        await _run("docker", "compose", "exec", "-T", "rabbitmq", "rabbitmqctl", *args)
