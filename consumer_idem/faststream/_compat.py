"""What FastStream keeps only in private or internal attributes, read in this module alone.

FastStream 0.7 documents brokers, routers, subscribers' decorators, middlewares and the context
(``ContextRepo``), but not its subscribers' handler list, their parse-and-filter step, nor the
options a broker was created with: those live on classes of ``faststream._internal``. Each
reader below names what it stands in for and the FastStream versions it was checked against
(0.7.8, the version installed with the ``faststream`` extra), so an upgrade that moves one
breaks here, in one small function, and the tests of the FastStream integration say so.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

#: the FastStream versions these readers were checked against
CHECKED_WITH = ("0.7.8",)


def subscriber_middlewares(subscriber: Any) -> Sequence[Any]:
    """The broker and router middlewares FastStream runs around ``subscriber``'s handler.

    No public API lists them. FastStream 0.7 keeps them (broker's, then routers') in the
    subscriber's private ``_broker_middlewares``; subscribers themselves take none there.
    Checked: 0.7.8.
    """
    middlewares = getattr(subscriber, "_broker_middlewares", None)
    if middlewares is None:
        raise RuntimeError(
            "this FastStream version no longer keeps a subscriber's middlewares in "
            "_broker_middlewares (checked with 0.7.8): consumer_idem cannot check its ack policy"
        )
    return tuple(middlewares)


def current_subscriber(context: Any) -> Any:
    """The subscriber running the current delivery. FastStream puts it in its context under
    ``handler_``, a name it does not document (there is no public accessor). Checked: 0.7.8."""
    return context.get("handler_")


def producer_options(broker: Any) -> Mapping[str, Any]:
    """The options a broker was created with (``acks``, ``enable_idempotence``...). No public
    API returns them; FastStream 0.7 keeps them in the broker's private ``_connection_kwargs``
    (empty when absent, so a missing attribute only means the acks warning is not shown).
    Checked: 0.7.8."""
    options = getattr(broker, "_connection_kwargs", None)
    return options if isinstance(options, Mapping) else {}


def handler_calls(subscriber: Any) -> Sequence[Any]:
    """The handler items of ``subscriber`` (one per decorated function, with its filter):
    ``subscriber.calls``, an internal ``CallsCollection`` of ``HandlerItem``; no public API
    lists a subscriber's handlers. Checked: 0.7.8."""
    return tuple(getattr(subscriber, "calls", ()))


def has_publishers(call: Any) -> bool:
    """Does the handler of ``call`` carry ``@publisher`` decorators? The handler's private
    ``_publishers``; no public API says whether a handler publishes its result.
    Checked: 0.7.8."""
    return bool(getattr(call.handler, "_publishers", None))


def is_handler_call(subscriber: Any, call_next: Any) -> bool:
    """Is ``call_next`` the handler's own call (no middleware between)? Compared with each
    handler's ``handler.call_wrapped``, internal; no public API tells a middleware what it
    wraps. Checked: 0.7.8."""
    return any(call_next == item.handler.call_wrapped for item in handler_calls(subscriber))


async def parse_for(call: Any, raw: Any) -> Any:
    """``raw`` parsed by the handler item ``call`` if its filter accepts it, else None; raises
    the parser's error. ``HandlerItem.is_suitable``, internal (FastStream runs it when it routes
    a delivery; no public API routes one message). Checked: 0.7.8."""
    return await call.is_suitable(raw, {})


async def call_with_middleware(
    call: Any, parsed: Any, middleware: Callable[..., Awaitable[Any]]
) -> Any:
    """Run the handler item ``call`` on ``parsed`` with ``middleware`` (a ``consume_scope``)
    innermost: ``HandlerItem.call`` and its private ``_extra_middlewares`` argument, as
    FastStream's own subscriber calls it; no public API runs a handler on a message of one's
    choosing. Checked: 0.7.8."""
    return await call.call(message=parsed, _extra_middlewares=[middleware])


def runs_partitions_apart(subscriber: Any) -> tuple[int, bool]:
    """``(max_workers, one consumer per worker)`` of a Kafka subscriber: the attributes
    ``max_workers`` and ``consumer_subgroup`` of FastStream's internal concurrent subscriber
    classes (a subscriber with a subgroup keeps each partition on one worker); the public
    side is only the ``max_workers`` argument. Checked: 0.7.8."""
    workers = getattr(subscriber, "max_workers", 1) or 1
    return workers, hasattr(subscriber, "consumer_subgroup")


def handler_function(call: Any) -> Any:
    """The function a user decorated as the handler item ``call``, whose return annotation
    says what a replay is read back as: the wrapper's private ``_declared_call`` (its
    ``_original_call`` before 0.7). No public API hands it back. Checked: 0.7.8."""
    wrapper = call.handler
    return getattr(wrapper, "_declared_call", None) or getattr(wrapper, "_original_call", None)


def nats_acks_on_delivery(subscriber: Any) -> bool:
    """Does the NATS JetStream push ``subscriber`` have nats-py ack each message as it arrives?
    FastStream turns ``ack_policy=AckPolicy.ACK_FIRST`` into ``AckPolicy.MANUAL`` plus
    ``manual_ack=False`` in the subscriber's ``extra_options`` (the options of nats-py's
    ``subscribe``, an internal attribute); the public ``ack_policy`` then reads MANUAL.
    Checked: 0.7.8."""
    options = getattr(subscriber, "extra_options", None) or {}
    return options.get("manual_ack") is False


def confluent_connection(broker: Any) -> Any:
    """The options a ``faststream.confluent.KafkaBroker`` was created with (its
    ``ConfluentFastConfig``: ``consumer_config`` and ``producer_config`` as librdkafka reads
    them, the broker's ``config=`` overriding the named arguments): ``broker.config``'s
    ``broker_config.connection_config``, internal classes; no public API returns them.
    Checked: 0.7.8."""
    return broker.config.broker_config.connection_config


async def confluent_commit(consumer: Any, offsets: list[Any], wait: bool = True) -> None:
    """Commit exactly ``offsets`` (confluent_kafka ``TopicPartition``s) for the
    ``AsyncConfluentConsumer`` ``consumer``; ``wait``: for the broker's answer (else librdkafka
    sends it in the background, in order, and logs a failure). Its public
    ``commit()`` commits every partition's position, which may be ahead of what is settled, so
    the wrapped confluent ``Consumer`` (its ``consumer`` attribute) commits instead, on the
    wrapper's private single-thread ``_thread_pool``: FastStream runs every call of that
    consumer there, so a commit never runs beside its poll or close. Checked: 0.7.8."""
    pool = consumer._thread_pool
    client = consumer.consumer
    await asyncio.get_running_loop().run_in_executor(
        pool, functools.partial(client.commit, offsets=offsets, asynchronous=not wait)
    )


def nats_ordered_consumer(subscriber: Any) -> bool:
    """Is the NATS JetStream push ``subscriber`` an ordered consumer (``ordered_consumer=True``:
    nats-py creates it with ``AckPolicy.NONE``, so nothing is ever redelivered)? FastStream
    keeps the flag in the subscriber's internal ``extra_options``. Checked: 0.7.8."""
    options = getattr(subscriber, "extra_options", None) or {}
    return bool(options.get("ordered_consumer"))


#: the hooks run before each FastStream subscriber starts (see `on_subscriber_start`)
_START_HOOKS: list[Callable[[Any], Awaitable[None]]] = []


def on_subscriber_start(hook: Callable[[Any], Awaitable[None]]) -> None:
    """Run ``hook(subscriber)`` before each FastStream subscriber starts consuming, whether the
    broker starts it or the application starts it later (a runtime subscriber); an exception
    from the hook stops that start. FastStream has no public per-subscriber start hook: every
    subscriber's ``start`` (Kafka, Confluent, RabbitMQ, NATS, Redis) awaits the base
    ``SubscriberUsecase.start`` before it subscribes or fetches, so the hook wraps that one
    method, once per process (a subscriber with no hook's concern returns at once). Checked:
    0.7.8."""
    from faststream._internal.endpoint.subscriber.usecase import SubscriberUsecase

    if hook not in _START_HOOKS:
        _START_HOOKS.append(hook)
    if getattr(SubscriberUsecase.start, _HOOKED, False):
        return
    original = SubscriberUsecase.start

    @functools.wraps(original)
    async def start(self: Any) -> None:
        for each in tuple(_START_HOOKS):
            await each(self)
        await original(self)

    setattr(start, _HOOKED, True)
    SubscriberUsecase.start = start  # type: ignore[method-assign]


_HOOKED = "_consumer_idem_start_hooks"


def redis_client(broker: Any) -> Any:
    """The ``redis.asyncio.Redis`` client of a started ``RedisBroker``. FastStream publishes
    only its own message format (one ``__data__`` field), so an entry copied field for field
    needs the client, which it keeps in the private ``_connection`` (set on connect). Checked:
    0.7.8."""
    client = getattr(broker, "_connection", None)
    if client is None:
        raise RuntimeError("the RedisBroker is not connected (or keeps no _connection)")
    return client


# --- NATS pull subscribers: a fetch that never drops what it already holds -----------------
# A NATS pull subscriber's fetch that never drops the messages it already holds.
#
# FastStream's batch pull loop (checked with FastStream 0.7.8, nats-py 2.16.0) gathers a batch
# with several ``fetch`` calls and hands what it gathered to the handler when a fetch times out,
# catching nats-py's ``nats.errors.TimeoutError``. But nats-py's ``fetch`` of several messages
# sometimes raises the plain ``asyncio.TimeoutError`` instead: when the server's "request
# timeout" status for its no-wait probe reaches the client just before the client's own timer
# does. That error escapes the loop, FastStream restarts the loop, and the messages already
# gathered are dropped in hand, neither acked nor ``nak``-ed: JetStream delivers them again only
# after the consumer's ``ack_wait`` (30 s by default), however soon they could have run. After a
# Postgres outage that is a stall of the whole batch.
#
# So the middleware gives each pull subscriber's subscription a ``fetch`` that raises nats-py's
# own timeout for both: the loop then runs what it gathered at once. Only the one subscription
# object is wrapped (nats-py's and FastStream's classes are left alone), each time FastStream
# creates it (``_create_subscription``, internal: FastStream has no hook after a subscriber
# subscribes).

#: marks a subscriber (or subscription) already wrapped
_WRAPPED = "_consumer_idem_fetch_timeouts"


def catch_fetch_timeouts(subscriber: Any) -> None:
    """Make every subscription ``subscriber`` (a NATS pull subscriber) creates raise only
    nats-py's ``TimeoutError`` from ``fetch``; other subscribers are left alone."""
    if getattr(subscriber, "pull_sub", None) is None or getattr(subscriber, _WRAPPED, False):
        return
    create: Callable[[], Awaitable[None]] = subscriber._create_subscription

    @functools.wraps(create)
    async def create_subscription() -> None:
        await create()
        subscription = getattr(subscriber, "subscription", None)
        if subscription is not None and not getattr(subscription, _WRAPPED, False):
            subscription.fetch = _nats_timeouts(subscription.fetch)
            setattr(subscription, _WRAPPED, True)

    subscriber._create_subscription = create_subscription
    setattr(subscriber, _WRAPPED, True)


def _nats_timeouts(fetch: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    from nats.errors import TimeoutError as NatsTimeout  # type: ignore[import-not-found, unused-ignore]

    @functools.wraps(fetch)
    async def wrapped(*args: Any, **kwargs: Any) -> Any:
        try:
            return await fetch(*args, **kwargs)
        except NatsTimeout:
            raise
        except TimeoutError as exc:  # nats-py's other timeout: the same "nothing more"
            raise NatsTimeout from exc

    return wrapped


def redis_message_format(subscriber: Any) -> Any:
    """The message format (``BinaryMessageFormatV1``, ``JSONMessageFormat``...) a Redis stream
    ``subscriber`` parses its entries with: its own ``message_format=`` or the broker's. Read
    from the subscriber's stream parser, ``parser.config`` (the internal
    ``RedisSubscriberConfig``, whose ``message_format`` property resolves the two); no public
    API returns it. A batch subscriber's members are parsed with it one by one, as the
    single-entry subscriber parses them. Checked: 0.7.8."""
    return subscriber.parser.config.message_format
