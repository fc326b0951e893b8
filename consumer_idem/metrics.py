"""Counters and latency histograms. Exported to Prometheus when ``prometheus-client`` is
installed (on the registry you pass, or its default one); always kept in-process too, so tests
and the CLI can read them.

Labels are bounded: a consumer scope names a consumer (a handful per service), but an HTTP
record scope embeds its caller (``http:<caller>:<METHOD> <route>``), and one series per user
would grow without end. Every scope therefore goes through ``label`` (by default
`bounded_scope`, which drops the caller) before it becomes a label or an in-process key.
HTTP requests are counted by route template, method and outcome
([`Metrics.http_request`][consumer_idem.metrics.Metrics.http_request]).
"""

from __future__ import annotations

import threading
import weakref
from collections import Counter
from collections.abc import Callable
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
    "stored_offset_discarded",
)

#: gauges (set, not counted), with their help text; labelled by scope label
GAUGES = {
    "outbox_pending": "Outgoing messages committed and not yet confirmed by the broker.",
    "outbox_parked": "Outgoing messages the broker refused for good (an operator's).",
    "outbox_oldest_pending_seconds": "Age of the oldest pending outgoing message.",
    "outbox_stranded": "Outgoing messages pending for a route no relay of their scope sends.",
}

HTTP_SCOPE_PREFIX = "http:"

try:  # optional dependency: the `metrics` extra
    import prometheus_client as _prom
except ImportError:  # pragma: no cover - exercised only without the extra
    _prom = None  # type: ignore[assignment]

_lock = threading.Lock()
#: collectors per registry: prometheus_client refuses a name registered twice on one registry
_registered: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()


def bounded_scope(scope: str) -> str:
    """The label of a scope: HTTP record scopes lose their caller (``http:POST /orders/{id}``);
    any other scope (a consumer's, ``webhook:<provider>``) is already bounded and kept."""
    if scope.startswith(HTTP_SCOPE_PREFIX):
        _caller, sep, rest = scope[len(HTTP_SCOPE_PREFIX) :].partition(":")
        if sep:
            return HTTP_SCOPE_PREFIX + rest
    return scope


def _collector(registry: Any, name: str, factory: str, doc: str, labels: tuple[str, ...]) -> Any:
    with _lock:
        known = _registered.setdefault(registry, {})
        if name not in known:
            known[name] = getattr(_prom, factory)(name, doc, labels, registry=registry)
        return known[name]


class Metrics:
    """Counts events per (name, scope label), HTTP requests per (method, route, outcome), and
    observes latencies per operation.

    ``registry`` is the ``prometheus_client.CollectorRegistry`` to export to (default: the
    library's global one). ``label`` maps a scope to its label (default `bounded_scope`).
    """

    def __init__(
        self, registry: Any = None, *, label: Callable[[str], str] = bounded_scope
    ) -> None:
        self.registry = registry if registry is not None or _prom is None else _prom.REGISTRY
        self.label = label
        self._counts: Counter[tuple[str, str]] = Counter()
        self._http: Counter[tuple[str, str, str]] = Counter()
        self._gauges: dict[tuple[str, str], float] = {}
        # labelled Prometheus children, cached: .labels() takes a lock and validates each time
        self._children: dict[tuple[str, ...], Any] = {}

    def _child(self, kind: str, *values: str) -> Any:
        child = self._children.get((kind, *values))
        if child is None and _prom is not None:
            if kind == "counter":
                parent = _collector(
                    self.registry,
                    "consumer_idem_events_total",
                    "Counter",
                    "Idempotency events by kind.",
                    ("event", "scope"),
                )
            elif kind == "http":
                parent = _collector(
                    self.registry,
                    "consumer_idem_http_requests_total",
                    "Counter",
                    "Requests through the Idempotency-Key middleware by outcome.",
                    ("method", "route", "outcome"),
                )
            else:
                parent = _collector(
                    self.registry,
                    "consumer_idem_operation_seconds",
                    "Histogram",
                    "Store operation latency.",
                    ("operation",),
                )
            child = parent.labels(*values)
            self._children[(kind, *values)] = child
        return child

    def inc(self, name: str, scope: str, amount: int = 1) -> None:
        label = self.label(scope)
        self._counts[(name, label)] += amount
        child = self._child("counter", name, label)
        if child is not None:
            child.inc(amount)

    def http_request(self, method: str, route: str, outcome: str) -> None:
        """One request through the Idempotency-Key middleware: ``route`` is the template."""
        self._http[(method, route, outcome)] += 1
        child = self._child("http", method, route, outcome)
        if child is not None:
            child.inc()

    def gauge(self, name: str, label: str, value: float) -> None:
        """Set gauge ``consumer_idem_<name>`` for a scope label (already bounded: a caller that
        sums several scopes into one label sets the sum), e.g. ``outbox_pending``."""
        self._gauges[(name, label)] = value
        if _prom is None:
            return
        child = self._children.get(("gauge", name, label))
        if child is None:
            parent = _collector(
                self.registry,
                f"consumer_idem_{name}",
                "Gauge",
                GAUGES.get(name, name.replace("_", " ")),
                ("scope",),
            )
            child = self._children[("gauge", name, label)] = parent.labels(label)
        child.set(value)

    def gauge_value(self, name: str, label: str) -> float | None:
        """The last value set for gauge ``name`` and a scope label (None: never set)."""
        return self._gauges.get((name, label))

    def observe(self, operation: str, seconds: float) -> None:
        child = self._child("histogram", operation)
        if child is not None:
            child.observe(seconds)

    def count(self, name: str, scope: str | None = None) -> int:
        """How many ``name`` events this instance saw (for one scope's label, or in all)."""
        label = None if scope is None else self.label(scope)
        return sum(v for (n, s), v in self._counts.items() if n == name and label in (None, s))

    def http_count(self, outcome: str | None = None, route: str | None = None) -> int:
        """How many middleware requests ended with ``outcome`` (on ``route``), or in all."""
        return sum(
            v for (_m, r, o), v in self._http.items() if outcome in (None, o) and route in (None, r)
        )

    def snapshot(self) -> dict[str, int]:
        out: Counter[str] = Counter()
        for (name, _scope), value in self._counts.items():
            out[name] += value
        return dict(out)
