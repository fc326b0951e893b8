"""Runner scaffolding shared by the transport tests: runners started in the background for one
test and stopped (gracefully, bounded in time) at its end. The ``running`` fixture
(``tests/conftest.py``) hands a test a :class:`Running`."""

from __future__ import annotations

import asyncio
from typing import Any, Generic, TypeVar

R = TypeVar("R")

#: how long a runner may take to stop gracefully (drain, final commits) before the test fails
STOP_WITHIN = 60


class Running:
    """Runners (anything with ``run(stop_event)``) started by :meth:`start`, stopped by
    :meth:`stop_all`."""

    def __init__(self) -> None:
        self.tasks: list[tuple[asyncio.Event, asyncio.Task[None]]] = []

    def start(self, runner: R) -> R:
        stop = asyncio.Event()
        run: Any = runner
        self.tasks.append((stop, asyncio.create_task(run.run(stop))))
        return runner

    def died(self) -> None:
        """Raise what a runner that ended on its own raised (a test waiting on it says why)."""
        for _, task in self.tasks:
            if task.done():
                task.result()

    async def stop_all(self) -> None:
        for stop, _ in self.tasks:
            stop.set()
        for _, task in self.tasks:
            await asyncio.wait_for(task, STOP_WITHIN)
        self.tasks.clear()


class Started(Generic[R]):
    """One runner, started in the background at once, until :meth:`finish`."""

    def __init__(self, runner: R) -> None:
        self.runner = runner
        self.stop = asyncio.Event()
        run: Any = runner
        self.task: asyncio.Task[None] = asyncio.create_task(run.run(self.stop))

    async def finish(self) -> None:
        self.stop.set()
        await asyncio.wait_for(self.task, STOP_WITHIN)
