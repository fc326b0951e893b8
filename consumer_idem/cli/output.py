"""How the CLI talks to people and scripts: results on stdout, everything else on stderr.

* Results: rich tables on stdout (columns fold, never truncate; when stdout is not a terminal the
  table is as wide as its content, so a pipe gets whole lines), or JSON with ``--json``.
* Errors: one plain line on stderr, ``error: ...``, printed once (never wrapped by rich).
* Logs: the library's log records, one plain line each on stderr.
* Progress: a rich progress bar on stderr when stderr is a terminal, else a plain line every
  ``--progress-interval`` seconds.
"""

from __future__ import annotations

import logging
import re
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from enum import IntEnum
from typing import Any, NoReturn

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from consumer_idem.types import Eviction, Status


class ExitCode(IntEnum):
    """What ``consumer-idem`` exits with (documented in the README's CLI section)."""

    OK = 0  #: everything asked was done
    PARTIAL = 1  #: it ran, but something was not settled (a replay's failures, an operator case)
    BAD_INPUT = 2  #: bad arguments, unknown scope/key, missing schema, unreachable service
    INTERRUPTED = 130  #: stopped by Ctrl-C / SIGTERM; what was done is kept (re-run resumes)


class CliError(Exception):
    """One line for the operator, exit code 2."""


def stdout_console() -> Console:
    """Tables for a terminal fold to its width; for a pipe or file they keep their full width."""
    probe = Console(highlight=False)  # results are read, not decorated: no number colours
    return probe if probe.is_terminal else Console(width=100_000, highlight=False)


console = stdout_console()
err = Console(stderr=True)


def one_line(text: str) -> str:
    return re.sub(r"\s*\n\s*", " ", text).strip()


def fail(message: str, code: ExitCode = ExitCode.BAD_INPUT) -> NoReturn:
    """Print ``error: message`` as one plain line on stderr and exit."""
    sys.stderr.write(f"error: {one_line(message)}\n")
    sys.stderr.flush()
    raise typer.Exit(code=int(code))


def note(message: str) -> None:
    """A plain line on stderr that is not a result (a hint, the next page's cursor)."""
    sys.stderr.write(one_line(message) + "\n")
    sys.stderr.flush()


# --- logging ------------------------------------------------------------------------------------


class _OneLine(logging.Formatter):
    """``2024-05-01T10:00:00 WARNING message``; an exception as its type and text, not a
    traceback (unless tracebacks are asked for)."""

    def __init__(self, tracebacks: bool) -> None:
        super().__init__("%(asctime)s %(levelname)s %(message)s", "%Y-%m-%dT%H:%M:%S")
        self.tracebacks = tracebacks

    def format(self, record: logging.LogRecord) -> str:
        if self.tracebacks:
            return super().format(record)
        exc = record.exc_info[1] if record.exc_info else None
        record = logging.makeLogRecord(record.__dict__)
        record.exc_info = record.exc_text = None
        line = one_line(super().format(record))
        return f"{line}: {type(exc).__name__}: {one_line(str(exc))}" if exc else line


class _Stderr(logging.Handler):
    """Writes to ``sys.stderr`` as it is at emit time, so rich's progress display (which
    redirects stderr while it runs) prints the line above its bar."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(self.format(record) + "\n")
        except Exception:  # pragma: no cover - logging must never break the command
            self.handleError(record)


class _FatalStoreErrors(logging.Filter):
    """While a store failure ends the command (with its own ``error:`` line), the store's
    warning about the same failure (a record with an ``operation``) would print it twice."""

    active = False

    def filter(self, record: logging.LogRecord) -> bool:
        return not (self.active and hasattr(record, "operation"))


_fatal = _FatalStoreErrors()
_handler = _Stderr()
_handler.addFilter(_fatal)


@contextmanager
def store_errors_fatal() -> Iterator[None]:
    """Inside: a failed store call ends the command; its log warning is not printed."""
    before, _fatal.active = _fatal.active, True
    try:
        yield
    finally:
        _fatal.active = before


def setup_logging(verbose: int, *, default: int = logging.WARNING) -> None:
    """Log records on stderr, one line each. The library's: WARNING and up by default
    (``default`` for long-running commands), INFO with ``-v``, DEBUG (and tracebacks) with
    ``-vv``. The broker clients': none by default (a failure of theirs ends the command with
    its own error line, which their log would only repeat), WARNING and up where the library
    logs INFO (``reconcile``, ``-v``), INFO with ``-vv``."""
    level = {0: default, 1: logging.INFO}.get(verbose, logging.DEBUG)
    _handler.setFormatter(_OneLine(tracebacks=verbose >= 2))
    library = logging.getLogger("consumer_idem")
    library.setLevel(level)
    if _handler not in library.handlers:
        library.addHandler(_handler)
    library.propagate = False
    others = logging.getLogger()
    others.setLevel({logging.DEBUG: logging.INFO, logging.INFO: logging.WARNING}.get(level, 100))
    if _handler not in others.handlers:
        others.addHandler(_handler)


# --- durations ----------------------------------------------------------------------------------

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")


def parse_duration(text: str) -> timedelta:
    """``90s``, ``15m``, ``1h30m``, ``2d``, ``1w`` or plain seconds."""
    text = text.strip().lower()
    try:
        return timedelta(seconds=float(text))
    except ValueError:
        pass
    parts = _DURATION.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise typer.BadParameter(f"{text!r} is not a duration (e.g. 90s, 15m, 1h30m, 2d)")
    return timedelta(seconds=sum(float(n) * _UNITS[u] for n, u in parts))


def age(seconds: float | None) -> str:
    """A compact age: ``45s``, ``12m``, ``3h05m``, ``2d04h``."""
    if seconds is None:
        return "-"
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


# --- progress -----------------------------------------------------------------------------------


class Reporter:
    """Progress of a long command on stderr: a rich bar on a terminal, else a plain line every
    ``interval`` seconds, from the first interval on, when something changed."""

    def __init__(self, label: str, *, interval: float, enabled: bool = True) -> None:
        self.label = label
        self.interval = interval
        self.enabled = enabled
        self.terminal = enabled and err.is_terminal
        self._progress: Progress | None = None
        self._task: Any = None
        self._started = time.monotonic()
        # the first plain line after one interval: a command that ends sooner prints none
        self._last_line = self._started
        self._last_text = ""

    @contextmanager
    def running(self) -> Iterator[Reporter]:
        if not self.terminal:
            yield self
            return
        self._progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[counts]}"),
            TimeElapsedColumn(),
            console=err,
            transient=False,
        )
        with self._progress:
            self._task = self._progress.add_task(self.label, total=None, counts="")
            yield self
        self._progress = None

    def update(self, done: int, total: int | None, counts: str) -> None:
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.update(self._task, completed=done, total=total, counts=counts)
            return
        now = time.monotonic()
        text = (f"{done}" + (f"/{total}" if total is not None else "") + f" {counts}").strip()
        if text == self._last_text or now - self._last_line < self.interval:
            return
        self._last_line, self._last_text = now, text
        rate = done / max(now - self._started, 1e-9)
        note(f"{self.label}: {text} ({rate:.1f}/s, {age(now - self._started)})")


def evict_consequence(status: Status) -> str:
    """What evicting a record of ``status`` does, for the confirmation prompt."""
    if status is Status.UNKNOWN:
        return (
            "It is unknown: its effect may already have happened. Evicting says it did not: "
            "the key runs again (its kept original is re-sent by the sweeper). If it may have "
            "taken effect, reconcile it instead."
        )
    if status is Status.IN_PROGRESS:
        return (
            "Its worker's lease has run out: its call may have taken effect (`consumer-idem "
            "sweep` parks it as unknown for reconciliation). Evicting runs it again."
        )
    return "The key becomes new work: it runs again (a kept original is re-sent)."


def held_line(eviction: Eviction) -> str:
    """Why an evict left a record as it is."""
    until = eviction.held_until.isoformat(timespec="seconds") if eviction.held_until else "?"
    return (
        f"({eviction.scope}, {eviction.key}) is held by a worker until {until}: nothing "
        "evicted (deleted under a running call, a duplicate delivered before the call ends "
        "would run it again). Wait for the worker to finish, or for its lease to run out "
        "(`consumer-idem sweep` then parks it as unknown), and decide then"
    )


def evicted_line(eviction: Eviction) -> str:
    """What an evict did, and what runs the key again."""
    line = f"evicted ({escape(eviction.scope)}, {escape(eviction.key)}), was {eviction.status}"
    if eviction.redispatch_to is not None:
        return (
            f"{line}; its original message is armed: the sweeper (consumer-idem sweep "
            f"--transport T --scope {escape(eviction.scope)}, or a running reconciler's) sends "
            f"it again to {escape(eviction.redispatch_to)}, and it runs once"
        )
    return f"{line}; a later delivery with this key runs it again"
