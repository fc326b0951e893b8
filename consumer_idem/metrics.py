"""Counters and latency histograms. Exported to Prometheus when ``prometheus-client`` is
installed; always kept in-process too, so tests and the CLI can read them."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

COUNTERS = (
    "created",
    "replay",
    "in_progress",
    "key_misuse",
    "failed_retry",
    "unknown",
    "store_error",
    "zombie",
    "pruned",
    "reconcile_scheduled",
    "reconcile_resolved",
    "reconcile_failed",
    "invalid_key",
    "lease_lost",
)

try:  # optional dependency: the `metrics` extra
    import prometheus_client as _prom
except ImportError:  # pragma: no cover - exercised only without the extra
    _prom = None  # type: ignore[assignment]

_lock = threading.Lock()
_prom_objects: dict[str, Any] = {}


def _prometheus(name: str, factory: str, doc: str, labels: tuple[str, ...]) -> Any:
    # Registered once per process: prometheus_client refuses duplicate names.
    with _lock:
        if name not in _prom_objects and _prom is not None:
            _prom_objects[name] = getattr(_prom, factory)(name, doc, labels)
        return _prom_objects.get(name)


class Metrics:
    """Counts events per (name, scope) and observes latencies per operation."""

    def __init__(self) -> None:
        self._counts: Counter[tuple[str, str]] = Counter()
        # labelled Prometheus children, cached: .labels() takes a lock and validates each time
        self._children: dict[tuple[str, str], Any] = {}

    def _child(self, kind: str, name: str, label: str) -> Any:
        child = self._children.get((name, label))
        if child is None and _prom is not None:
            if kind == "counter":
                parent = _prometheus(
                    "consumer_idem_events_total",
                    "Counter",
                    "Idempotency events by kind.",
                    ("event", "scope"),
                )
                child = parent.labels(event=name, scope=label)
            else:
                parent = _prometheus(
                    "consumer_idem_operation_seconds",
                    "Histogram",
                    "Store operation latency.",
                    ("operation",),
                )
                child = parent.labels(operation=name)
            self._children[(name, label)] = child
        return child

    def inc(self, name: str, scope: str, amount: int = 1) -> None:
        self._counts[(name, scope)] += amount
        child = self._child("counter", name, scope)
        if child is not None:
            child.inc(amount)

    def observe(self, operation: str, seconds: float) -> None:
        child = self._child("histogram", operation, "")
        if child is not None:
            child.observe(seconds)

    def count(self, name: str, scope: str | None = None) -> int:
        """How many ``name`` events this instance saw (for one scope, or in all)."""
        return sum(v for (n, s), v in self._counts.items() if n == name and scope in (None, s))

    def snapshot(self) -> dict[str, int]:
        out: Counter[str] = Counter()
        for (name, _scope), value in self._counts.items():
            out[name] += value
        return dict(out)
