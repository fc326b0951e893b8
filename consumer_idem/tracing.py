"""OpenTelemetry tracing: a span per delivery and per request, nothing without OpenTelemetry.

The library depends on ``opentelemetry-api`` only, and only when it is installed (the ``otel``
extra). Without it every hook below is the undecorated function or an empty context manager: no
import fails and nothing runs. With it, spans are made once a tracer provider is set (the SDK's,
by ``opentelemetry.trace.set_tracer_provider`` or [`configure`][consumer_idem.tracing.configure]);
until then each hook costs
one check. [`configure`][consumer_idem.tracing.configure] turns tracing off, passes a provider, and
chooses how keys appear.

What a delivery looks like (span names; attributes in the README's "Tracing" section)::

    process <topic | routing key>        CONSUMER, continuing the producer's ``traceparent``
      consumer_idem.reserve              the claim (decision: execute, replay, in_progress...)
      consumer_idem.handler              your handler
      consumer_idem.commit               the result and COMMIT (or the failure recorded)
      consumer_idem.settle               carrying out the verdict: ack, publish, retry
        send <destination>               PRODUCER: a dead letter or a reconciliation notice

The settle span is a child of the delivery span that starts when that one has ended: a runner
processes, then settles (Kafka a chunk of records at a time), so the verdict carries the span's
context (``Verdict.trace_context``) to the settle path.

A request through [`IdempotencyMiddleware`][consumer_idem.http.IdempotencyMiddleware] gets one span
with the same
children: an INTERNAL child of the request's span when an instrumentation (ASGI, FastAPI) made
one, else a SERVER span of its own continuing the caller's ``traceparent``.

The hooks are context managers around the work, each one ``with`` where it happens:
[`delivery`][consumer_idem.tracing.delivery] (consumer ``process`` / ``execute``),
[`batch`][consumer_idem.tracing.batch] (a batch transaction),
[`step`][consumer_idem.tracing.step] (a step of the claim engine or the handler call),
[`settling`][consumer_idem.tracing.settling] (the settle
path), [`publishing`][consumer_idem.tracing.publishing] (a publish on it),
[`request`][consumer_idem.tracing.request], [`outcome`][consumer_idem.tracing.outcome] and
[`http_status`][consumer_idem.tracing.http_status] (the HTTP middleware). Without a span to make,
each gives one shared
object that does nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import time
from collections.abc import Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from consumer_idem.message import ConsumerMessage
from consumer_idem.metrics import bounded_scope
from consumer_idem.types import Decision, DecisionKind, Outcome, OutcomeKind

try:  # optional dependency: the `otel` extra
    from opentelemetry import propagate as _propagate
    from opentelemetry import trace as _trace
    from opentelemetry.context import Context as _Context
    from opentelemetry.propagators.textmap import Getter as _Getter
except ImportError:  # pragma: no cover - exercised in a subprocess without the package
    _trace = None  # type: ignore[assignment]

T = TypeVar("T")

#: how a key appears in span attributes (see :func:`configure`)
KeyMode = Literal["hash", "truncate", "plain", "omit"]

#: keys are hashed unless :func:`configure` says otherwise
DEFAULT_KEY_MODE: KeyMode = "hash"
DEFAULT_KEY_LENGTH = 16

#: the OpenTelemetry API is importable
AVAILABLE = _trace is not None

SCOPE = "consumer_idem.scope"
KEY = "consumer_idem.key"
DECISION = "consumer_idem.decision"
OUTCOME = "consumer_idem.outcome"
ACTION = "consumer_idem.action"
REASON = "consumer_idem.reason"
ATTEMPT = "consumer_idem.attempt"
MODE = "consumer_idem.mode"
SETTLED = "consumer_idem.settled"
PUBLISH = "consumer_idem.publish"


@dataclass(slots=True)
class _Config:
    enabled: bool = True
    key: KeyMode = DEFAULT_KEY_MODE
    key_length: int = DEFAULT_KEY_LENGTH
    provider: Any = None
    tracer: Any = None
    #: a global provider has been seen: OpenTelemetry sets it once and never replaces it
    global_set: bool = False
    #: until when (``time.monotonic()``) a missing global provider is not asked for again
    unset_until: float = 0.0


_config = _Config()


def configure(
    *,
    enabled: bool = True,
    key: KeyMode = DEFAULT_KEY_MODE,
    key_length: int = DEFAULT_KEY_LENGTH,
    tracer_provider: Any = None,
) -> None:
    """Set how the library traces (process-wide; call it at start-up).

    ``enabled=False``: no span at all, even with a provider set. ``key``: how the idempotency
    key appears in the ``consumer_idem.key`` attribute: ``"hash"`` (default:
    ``sha256:`` and the first ``key_length`` hex digits of the key's SHA-256, see
    [`key_attribute`][consumer_idem.tracing.key_attribute]), ``"truncate"`` (its first
    ``key_length`` characters), ``"plain"``
    (the whole key) or ``"omit"``. ``tracer_provider``: the provider to use instead of the
    global one (``opentelemetry.trace.get_tracer_provider()``)."""
    if key not in ("hash", "truncate", "plain", "omit"):
        raise ValueError(f"key is 'hash', 'truncate', 'plain' or 'omit', not {key!r}")
    if key_length < 1:
        raise ValueError("key_length is at least 1")
    _config.enabled = enabled
    _config.key = key
    _config.key_length = key_length
    _config.provider = tracer_provider
    _config.tracer = None
    _config.unset_until = 0.0


def key_attribute(key: str) -> str | None:
    """The ``consumer_idem.key`` attribute of ``key`` under the configured mode. Hashed (the
    default), an operator finds the traces of a key by computing the same value::

        python -c "from consumer_idem.tracing import key_attribute; print(key_attribute('k'))"

    A hash keeps raw keys (order numbers, e-mail-derived ids) out of the trace backend; it does
    not make a guessable key secret."""
    mode, n = _config.key, _config.key_length
    if mode == "hash":
        return "sha256:" + hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()[:n]
    if mode == "truncate":
        return key if len(key) <= n else key[:n] + "…"
    if mode == "plain":
        return key
    return None


def active() -> bool:
    """Spans are being made: the API is installed, tracing is on and a provider is set."""
    if _trace is None or not _config.enabled:
        return False
    if _config.provider is not None or _config.global_set:
        return True
    # Asking the API reads the environment each time (a few µs, several times a delivery):
    # a missing provider is asked for again once a second, so one set later is seen then.
    now = time.monotonic()
    if now < _config.unset_until:
        return False
    # the API's default provider (a proxy until one is set) makes only non-recording spans
    provider = _trace.get_tracer_provider()
    if isinstance(provider, _trace.ProxyTracerProvider | _trace.NoOpTracerProvider):
        _config.unset_until = now + 1.0
        return False
    _config.global_set = True  # asked several times per delivery: remember the answer
    return True


def _tracer() -> Any:
    tracer = _config.tracer
    if tracer is None:
        assert _trace is not None
        provider = _config.provider or _trace.get_tracer_provider()
        tracer = _config.tracer = provider.get_tracer("consumer_idem")
    return tracer


# --- the delivery or request span this task is in ------------------------------------------


@dataclass(slots=True)
class _Root:
    span: Any
    message: ConsumerMessage | None = None
    #: a SERVER span of our own (no instrumentation made one): it carries the HTTP attributes
    server: bool = False
    #: a reservation decided, and said so on the span
    decided: bool = False
    #: the span of a batch transaction
    batch: bool = False


_root: ContextVar[_Root | None] = ContextVar("consumer_idem_trace_root", default=None)
_step: ContextVar[str | None] = ContextVar("consumer_idem_trace_step", default=None)


def _set(span: Any, name: str, value: Any) -> None:
    if value is not None:
        span.set_attribute(name, value)


def _current_context() -> Any:
    assert _trace is not None
    return _trace.get_current_span().get_span_context()


if _trace is not None:

    class _HeaderGetter(_Getter[Mapping[str, bytes]]):
        """Reads ``traceparent`` / ``tracestate`` from a delivery's headers (bytes, any case)."""

        def get(self, carrier: Mapping[str, bytes], key: str) -> list[str] | None:
            value = carrier.get(key)
            if value is None:
                lowered = key.lower()
                value = next((v for k, v in carrier.items() if k.lower() == lowered), None)
            return None if value is None else [value.decode("latin-1")]

        def keys(self, carrier: Mapping[str, bytes]) -> list[str]:
            return list(carrier)

    _HEADERS = _HeaderGetter()


def _extract(headers: Mapping[str, bytes]) -> Any:
    """The trace context the producer put in ``headers`` (W3C ``traceparent`` through the
    global propagator), on an empty context: never the current span."""
    assert _trace is not None
    return _propagate.extract(headers, context=_Context(), getter=_HEADERS)


def _parent(headers: Mapping[str, bytes]) -> tuple[Any, Any, list[Any]]:
    """Parent context, span kind and links of a delivery span. The producer's trace goes on;
    when an instrumentation (FastStream's telemetry middleware) already continued it, the
    delivery span nests under that one. A span current for another reason (the runner started
    inside a span: its tasks inherit it) is not the delivery's parent."""
    assert _trace is not None
    current = _current_context()
    extracted = _extract(headers)
    producer = _trace.get_current_span(extracted).get_span_context()
    if producer.is_valid:
        if current.is_valid and current.trace_id == producer.trace_id:
            return None, _trace.SpanKind.INTERNAL, []
        return extracted, _trace.SpanKind.CONSUMER, []
    links = [_trace.Link(current)] if current.is_valid else []
    return _Context(), _trace.SpanKind.CONSUMER, links


def _messaging(message: ConsumerMessage) -> tuple[str, dict[str, Any]]:
    """Span name and messaging attributes (OpenTelemetry messaging conventions)."""
    attributes: dict[str, Any] = {
        "messaging.operation.type": "process",
        "messaging.operation.name": "process",
    }
    raw = message.raw
    if message.topic is not None:  # Kafka
        attributes["messaging.system"] = "kafka"
        attributes["messaging.destination.name"] = message.topic
        if message.partition is not None:
            attributes["messaging.destination.partition.id"] = str(message.partition)
        if message.offset is not None:
            attributes["messaging.kafka.offset"] = message.offset
        return f"process {message.topic}", attributes
    if raw is not None and hasattr(raw, "delivery_tag"):  # AMQP (aio-pika)
        attributes["messaging.system"] = "rabbitmq"
        exchange = getattr(raw, "exchange", None) or ""
        routing_key = getattr(raw, "routing_key", None) or ""
        attributes["messaging.destination.name"] = exchange  # "" is the default exchange
        if routing_key:
            attributes["messaging.rabbitmq.destination.routing_key"] = routing_key
        tag = getattr(raw, "delivery_tag", None)
        if isinstance(tag, int):
            attributes["messaging.rabbitmq.message.delivery_tag"] = tag
        if message.message_id:
            attributes["messaging.message.id"] = message.message_id
        return f"process {routing_key or exchange or '(default)'}", attributes
    if message.message_id:
        attributes["messaging.message.id"] = message.message_id
    return "process", attributes


_DECIDED = {
    OutcomeKind.EXECUTED: DecisionKind.EXECUTE,
    OutcomeKind.FAILED_RETRYABLE: DecisionKind.EXECUTE,
    OutcomeKind.REPLAYED: DecisionKind.REPLAY,
    OutcomeKind.IN_PROGRESS: DecisionKind.IN_PROGRESS,
    OutcomeKind.MISUSE: DecisionKind.MISUSE,
}


def _describe_verdict(root: _Root, verdict: Any) -> None:
    """The delivery span's result attributes, from the consumer's verdict."""
    span = root.span
    assert _trace is not None
    _set(span, SCOPE, verdict.scope)
    if verdict.key is not None:
        _set(span, KEY, key_attribute(verdict.key))
    _set(span, ACTION, str(verdict.action))
    _set(span, REASON, verdict.reason)
    outcome: Outcome | None = verdict.outcome
    if outcome is not None:
        _set(span, OUTCOME, str(outcome.kind))
        if outcome.attempts:
            _set(span, ATTEMPT, outcome.attempts)
        decided = _DECIDED.get(outcome.kind)
        if outcome.kind is OutcomeKind.UNKNOWN:
            decided = DecisionKind.EXECUTE if outcome.parked_now else DecisionKind.UNKNOWN
        if not root.decided and decided is not None:  # a cached replay: no reservation ran
            _set(span, DECISION, str(decided))
    failed = str(verdict.action) == "dead_letter" or (
        outcome is not None
        and (
            outcome.kind is OutcomeKind.FAILED_RETRYABLE
            or (outcome.kind is OutcomeKind.UNKNOWN and outcome.parked_now)
        )
    )
    if failed:
        span.set_status(_trace.Status(_trace.StatusCode.ERROR, verdict.reason or str(outcome)))


class _Off:
    """What a hook gives when it makes no span: enters, describes and carries nothing."""

    __slots__ = ()

    def __enter__(self) -> _Off:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def done(self, verdict: T) -> T:
        return verdict

    def done_all(self, verdicts: list[T]) -> list[T]:
        return verdicts

    def describe(self, result: object) -> None:
        return None


_OFF = _Off()


class _Span:
    """A span made current for a ``with`` block; the delivery or batch span is also the task's
    root (``_root``) for its steps, and a step is marked (``_step``) so it never nests in
    itself."""

    __slots__ = ("_describes", "_make", "_root", "_root_token", "_step", "_step_token", "span")

    def __init__(
        self,
        make: Any,
        root: _Root | None = None,
        step: str | None = None,
        describes: bool = False,
    ) -> None:
        self._make = make
        self._root = root
        self._step = step
        self._describes = describes
        self.span: Any = None

    def __enter__(self) -> _Span:
        if self._step is not None:
            self._step_token = _step.set(self._step)
        try:
            self.span = self._make.__enter__()
        except BaseException:
            if self._step is not None:
                _step.reset(self._step_token)
            raise
        if self._root is not None:
            self._root.span = self.span
            self._root_token = _root.set(self._root)
        return self

    def __exit__(self, *exc: Any) -> Any:
        if self._root is not None:
            _root.reset(self._root_token)
        try:
            return self._make.__exit__(*exc)
        finally:
            if self._step is not None:
                _step.reset(self._step_token)

    def done(self, verdict: T) -> T:
        """The delivery's verdict, described on its span and carrying the span's context (the
        settle path continues it)."""
        assert self._root is not None
        _describe_verdict(self._root, verdict)
        result: T = dataclasses.replace(verdict, trace_context=self.span.get_span_context())  # type: ignore[type-var]
        return result

    def done_all(self, verdicts: list[T]) -> list[T]:
        """A batch's verdicts, each carrying the batch span's context."""
        context = self.span.get_span_context()
        return [dataclasses.replace(v, trace_context=context) for v in verdicts]  # type: ignore[type-var]

    def describe(self, result: object) -> None:
        """A step's result on its span (a decision or an outcome; a handler's is the user's)."""
        if self._describes:
            _describe_result(self.span, result)


def delivery(consumer: Any, message: ConsumerMessage) -> _Span | _Off:
    """``with tracing.delivery(consumer, message) as span: ... return span.done(verdict)``:
    one span per delivery, continuing the producer's trace from the message headers, with the
    verdict's attributes. Inside the span of the same message (``process`` calling
    ``execute``), no second one."""
    if _trace is None:
        return _OFF
    root = _root.get()
    if not active() or (root is not None and root.message is message):
        return _OFF
    parent, kind, links = _parent(message.headers)
    name, attributes = _messaging(message)
    attributes[SCOPE] = getattr(consumer, "scope", None)
    attributes[MODE] = getattr(consumer, "mode", None)
    make = _tracer().start_as_current_span(
        name, context=parent, kind=kind, attributes=_clean(attributes), links=links
    )
    return _Span(make, _Root(None, message))


def batch(scope: str, messages: Sequence[ConsumerMessage]) -> _Span | _Off:
    """``with tracing.batch(scope, messages) as span: ... return span.done_all(verdicts)``:
    one span for a batch transaction, linked to each message's producer context (messaging
    conventions: a batch continues many traces by links). Inside a batch span (the head of a
    batch run again), no second one."""
    if _trace is None:
        return _OFF
    root = _root.get()
    if not active() or not messages or (root is not None and root.batch):
        return _OFF
    links = []
    for message in messages:
        producer = _trace.get_current_span(_extract(message.headers)).get_span_context()
        if producer.is_valid:
            links.append(_trace.Link(producer))
    name, attributes = _messaging(messages[0])
    attributes.pop("messaging.kafka.offset", None)
    attributes["messaging.batch.message_count"] = len(messages)
    attributes[SCOPE] = scope
    make = _tracer().start_as_current_span(
        name,
        context=_Context(),
        kind=_trace.SpanKind.CONSUMER,
        attributes=_clean(attributes),
        links=links,
    )
    return _Span(make, _Root(None, batch=True))


def step(name: str) -> _Span | _Off:
    """``with tracing.step("commit") as span: ... span.describe(result)``: one step
    (``reserve``, ``handler``, ``commit``) as a child span ``consumer_idem.<name>`` of the
    current span, only when there is one (a step never starts a trace of its own). A step
    inside the same step (a completion that records a failure) is not a second span."""
    if _trace is None or not active() or _step.get() == name or not _current_context().is_valid:
        return _OFF
    make = _tracer().start_as_current_span(f"consumer_idem.{name}")
    # a handler's result is the user's: nothing of ours to describe
    return _Span(make, step=name, describes=name != "handler")


def settling(verdict: Any) -> _Span | _Off:
    """``with tracing.settling(verdict) as span: ... span.describe(settled)``: a
    ``consumer_idem.settle`` span around carrying out a verdict, a child of the delivery span
    the verdict came from (or of the current span; none when there is neither), with what was
    done (``acked``, ``retry``, ``unsettled``)."""
    if _trace is None or not active():
        return _OFF
    parent = getattr(verdict, "trace_context", None)
    if parent is not None:
        context = _trace.set_span_in_context(_trace.NonRecordingSpan(parent), _Context())
    elif _current_context().is_valid:
        context = None
    else:
        return _OFF
    attributes = {
        "messaging.operation.type": "settle",
        SCOPE: getattr(verdict, "scope", None),
        ACTION: str(verdict.action),
        REASON: getattr(verdict, "reason", None),
    }
    make = _tracer().start_as_current_span(
        "consumer_idem.settle", context=context, attributes=_clean(attributes)
    )
    return _Settling(make)


class _Settling(_Span):
    __slots__ = ()

    def describe(self, result: object) -> None:
        _set(self.span, SETTLED, str(result))


def _clean(attributes: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in attributes.items() if v is not None}


def _describe_result(span: Any, result: Any) -> None:
    """A step's result on its span: a decision (also on the delivery or request span) or an
    outcome."""
    decision: DecisionKind | None = None
    if isinstance(result, Decision):
        decision = result.kind
    elif isinstance(result, Outcome):
        _set(span, OUTCOME, str(result.kind))
    elif hasattr(result, "decision") and hasattr(result, "fingerprint"):  # TransactionalClaim
        claimed: Decision | None = result.decision
        decision = DecisionKind.EXECUTE if claimed is None else claimed.kind
    if decision is not None:
        _set(span, DECISION, str(decision))
        root = _root.get()
        if root is not None:
            root.span.set_attribute(DECISION, str(decision))
            root.decided = True


@contextlib.contextmanager
def publishing(what: str, destination: str | None) -> Iterator[None]:
    """A ``send <destination>`` PRODUCER span around a publish on the settle path (``what``:
    ``dead_letter``, ``notice``, ``redispatch``), under the current span only."""
    if _trace is None or not active() or not _current_context().is_valid:
        yield
        return
    attributes = {"messaging.operation.type": "send", PUBLISH: what}
    if destination is not None:
        attributes["messaging.destination.name"] = destination
    with _tracer().start_as_current_span(
        f"send {destination or what}", kind=_trace.SpanKind.PRODUCER, attributes=attributes
    ):
        yield


# --- HTTP ------------------------------------------------------------------------------------


def _asgi_headers(scope: Mapping[str, Any]) -> dict[str, bytes]:
    return {k.decode("latin-1"): v for k, v in scope.get("headers") or ()}


@contextlib.contextmanager
def request(
    asgi_scope: Mapping[str, Any], method: str, route: str, record_scope: str, key: str
) -> Iterator[None]:
    """The span of one request the middleware protects: an INTERNAL child of the request's
    span when an instrumentation made one (it has the HTTP attributes), else a SERVER span
    continuing the caller's ``traceparent``, with the HTTP attributes of its own."""
    if _trace is None or not active():
        yield
        return
    server = not _current_context().is_valid
    attributes: dict[str, Any] = {SCOPE: bounded_scope(record_scope), KEY: key_attribute(key)}
    if server:
        context = _extract(_asgi_headers(asgi_scope))
        kind = _trace.SpanKind.SERVER
        name = f"{method} {route}"
        attributes.update({"http.request.method": method, "http.route": route})
    else:
        context, kind, name = None, _trace.SpanKind.INTERNAL, f"idempotency {method} {route}"
    with _tracer().start_as_current_span(
        name, context=context, kind=kind, attributes=_clean(attributes)
    ) as span:
        token = _root.set(_Root(span, server=server))
        try:
            yield
        finally:
            _root.reset(token)


def outcome(name: str) -> None:
    """The request's outcome as the middleware counts it (``executed``, ``replayed``...)."""
    root = _root.get() if _trace is not None else None
    if root is not None:
        root.span.set_attribute(OUTCOME, name)


def http_status(status: int) -> None:
    """The response status, on a SERVER span of our own only (an instrumentation's span has
    it already)."""
    root = _root.get() if _trace is not None else None
    if root is not None and root.server:
        assert _trace is not None
        root.span.set_attribute("http.response.status_code", status)
        if status >= 500:
            root.span.set_status(_trace.Status(_trace.StatusCode.ERROR))
