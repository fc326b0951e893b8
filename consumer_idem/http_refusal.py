"""An ASGI middleware that was set up wrong refuses to start, through the ASGI lifespan.

Starlette builds its middleware stack on the first ASGI call, the lifespan startup. An
exception raised there is taken by uvicorn's default lifespan mode (``auto``) as "this app has
no lifespan": it logs that, skips the app's own lifespan and serves every request as a 500.
A middleware that cannot keep its promise therefore keeps the error it found when it was built
and answers the lifespan startup with ``lifespan.startup.failed`` and the error's message:
every ASGI server then stops at start-up (uvicorn exits non-zero and logs the message).
A server run without a lifespan (``--lifespan off``) gets the error raised on every request.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from consumer_idem.errors import ConfigurationError

Message = dict[str, Any]


async def refuse(
    error: ConfigurationError,
    scope: Message,
    receive: Callable[[], Awaitable[Message]],
    send: Callable[[Message], Awaitable[None]],
) -> None:
    """Answer the lifespan startup with ``error``; raise it on any other call."""
    if scope["type"] != "lifespan":
        raise error
    message = await receive()
    if message["type"] == "lifespan.startup":
        await send({"type": "lifespan.startup.failed", "message": str(error)})
