"""An HTTP app whose IdempotencyMiddleware could not keep its promise does not start: plain
``uvicorn app:app`` (its default lifespan mode, ``auto``) exits non-zero with the reason,
instead of skipping the app's lifespan and answering every request with a 500."""

from __future__ import annotations

import asyncio
import os
import sys
import textwrap
from pathlib import Path

from tests.conftest import ROOT_DIR, free_port

APP = textwrap.dedent(
    """
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from consumer_idem.http import IdempotencyMiddleware


    async def create(request):
        return JSONResponse({"created": True}, status_code=201)


    app = Starlette(routes=[Route("/orders", create, methods=["POST"])])
    # neither caller= nor shared_keys=: callers could share keys
    app.add_middleware(IdempotencyMiddleware, store=lambda: None)
    """
)


async def test_uvicorn_with_default_options_refuses_to_start_a_middleware_without_caller(
    tmp_path: Path,
) -> None:
    (tmp_path / "app.py").write_text(APP)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT_DIR)])}
    server = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "uvicorn",
        "app:app",
        "--port",
        str(free_port()),
        cwd=tmp_path,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        output, _ = await asyncio.wait_for(server.communicate(), 30)
    except TimeoutError:
        server.kill()
        output, _ = await server.communicate()
        raise AssertionError(f"uvicorn started and kept serving:\n{output.decode()}") from None
    text = output.decode()
    assert server.returncode != 0, text
    assert "IdempotencyMiddleware cannot tell callers apart: pass caller=" in text
    assert "Application startup failed" in text
    assert "lifespan' protocol appears unsupported" not in text
