"""Whether the user's handler started in the delivery being run: the delivery budget counts
handler starts, not tries. A try that only waited (for the store, a lock or another owner of
the key) spends nothing, but one whose handler started does, however it ended: a handler whose
own statement always times out is a poison message, not an outage to wait out for ever."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

#: the cell of the delivery being watched (a list, so a child task's note is seen too)
_STARTED: ContextVar[list[bool] | None] = ContextVar("consumer_idem_handler_started", default=None)


@contextmanager
def watching() -> Iterator[list[bool]]:
    """Watch the runs inside the block: ``cell[0]`` is True once a handler started."""
    cell = [False]
    token = _STARTED.set(cell)
    try:
        yield cell
    finally:
        _STARTED.reset(token)


def note_started() -> None:
    """Called right before a handler is called (single or batch)."""
    cell = _STARTED.get()
    if cell is not None:
        cell[0] = True
