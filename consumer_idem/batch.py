"""Batch mode: a run of messages claimed, handled and completed in one transaction.

A `BatchUnit` carries one such run through its named steps: `claim`
every key at once, `run` the handler over the members claimed and commit,
`park` them when the handler ended the transaction itself, and
`settle_prefix`: the verdicts of the run, in order, up to the first that must
wait. Each message with a valid key is a `Member`. The consumer
(:meth:`IdempotentConsumer.process_batch <consumer_idem.consumer.IdempotentConsumer.process_batch>`)
falls back to one message per transaction when any step raises.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import asyncpg

from consumer_idem import handler_runs
from consumer_idem.commit import (
    check_sql,
    commit,
    execute_and_commit,
    mark_sql,
    new_mark,
    rollback,
)
from consumer_idem.execution import outcome_of
from consumer_idem.message import ConsumerMessage
from consumer_idem.outbox import close_units, committed, open_batch, pending
from consumer_idem.stores.results import encode_result
from consumer_idem.types import DecisionKind, Outcome, OutcomeKind, ResultKind
from consumer_idem.verdict import Action, CommitHook, Verdict, settled_by_commit

if TYPE_CHECKING:
    from consumer_idem.consumer import IdempotentConsumer

log = logging.getLogger("consumer_idem.consumer")


class Member(NamedTuple):
    """A message of the batch with a valid key. Immutable, like a frozen dataclass, but made
    in a quarter of the time (one is made per message: a frozen dataclass's ``__init__`` sets
    each field through ``object.__setattr__``, a measurable share of a batch's CPU)."""

    #: its place in the batch
    place: int
    message: ConsumerMessage
    key: str
    fingerprint: str
    #: the earlier member with the same key (judged after it); None for a key's first member
    first: Member | None = None


class EndedByHandler(Exception):
    """The batch handler sent COMMIT or ROLLBACK on the batch's connection itself."""


class BatchUnit:
    """One batch transaction of ``consumer`` over ``messages``, from claim to verdicts.

    ``hook``: the runner's progress, committed with the members the COMMIT settles on its own.
    ``alongside``: the transport's preparation of the batch, run while the claim is in flight.
    Call the unit once: ``verdicts = await BatchUnit(...)()``."""

    def __init__(
        self,
        consumer: IdempotentConsumer,
        messages: Sequence[ConsumerMessage],
        hook: CommitHook | None = None,
        alongside: Callable[[], Awaitable[object]] | None = None,
    ) -> None:
        self.consumer = consumer
        self.store = consumer.store
        self.scope = consumer.scope
        self.messages = messages
        self.hook = hook
        self.alongside = alongside
        #: what each message gets, as far as decided
        self.verdicts: list[Verdict | None] = [None] * len(messages)
        #: each key's first member, in batch order; later members with the same key
        self.firsts: dict[str, Member] = {}
        self.repeats: list[Member] = []
        #: the members claimed here (the handler runs them), and the reservation tokens of
        #: those claimed by a reservation rather than the set-based claim
        self.running: list[Member] = []
        self.tokens: dict[int, Any] = {}
        #: a member that must wait: nothing after it may run first
        self.cut: int | None = None
        #: the last message the runner's hook covers
        self.upto: ConsumerMessage | None = None
        prepare, firsts, verdicts = consumer.prepare, self.firsts, self.verdicts  # per message
        for i, message in enumerate(messages):
            prepared = prepare(message)
            if isinstance(prepared, Verdict):
                verdicts[i] = prepared
                continue
            key, fingerprint = prepared
            first = firsts.get(key)
            member = Member(i, message, key, fingerprint, first)
            if first is None:
                firsts[key] = member
            else:  # the same key twice in one batch: judged after the first
                self.repeats.append(member)

    async def __call__(self) -> list[Verdict]:
        async with self.store.connection() as conn:
            mark = await self.claim(conn)
            if self.cut is None:
                try:
                    results = await self.run(conn, mark)
                except EndedByHandler:
                    return await self.park(conn)
        if self.cut is not None:
            return await self.before_cut()
        return self.settle_prefix(results)

    # --- the steps -----------------------------------------------------------------------------

    async def claim(self, conn: asyncpg.Connection) -> str:
        """BEGIN and claim every key at once; a key the set-based claim did not take is
        reserved one by one (its record decides). When a member must wait, every claim is
        rolled back (`cut`). Returns the mark the COMMIT checks."""
        try:
            mark = new_mark()  # checked by the COMMIT: the handler must not end this
            begin = f"BEGIN; {mark_sql(mark)}"
            await conn.execute(begin)
            # sorted: concurrent batches (RabbitMQ's prefetch window holds several) take the
            # unique-index locks of shared keys in one order, so they never deadlock
            keys = sorted(self.firsts)
            claim = self.store.fast_path.claim_many(
                conn,
                self.scope,
                keys,
                [self.firsts[k].fingerprint for k in keys],
                self.consumer.retention,
                restart=begin,
            )
            alongside = self.alongside
            claimed = await (claim if alongside is None else _overlapped(claim, alongside))
            for member in self.firsts.values():
                if member.key in claimed:
                    self.running.append(member)
                else:
                    await self._reserve(conn, member)
            if self.cut is not None:
                # Partition order: the members after a key held elsewhere must not commit
                # before it. Undo these claims; run only the members before it.
                await rollback(conn)
        except BaseException:
            await rollback(conn)
            raise
        return mark

    async def _reserve(self, conn: asyncpg.Connection, member: Member) -> None:
        decision = await self.store.reserve(
            self.scope,
            member.key,
            member.fingerprint,
            retention=self.consumer.retention,
            conn=conn,
        )
        if decision.kind is DecisionKind.EXECUTE:
            self.running.append(member)
            self.tokens[member.place] = decision.token
            return
        decided = self.verdicts[member.place] = self.consumer.verdict(
            outcome_of(decision), hooks=False
        )
        if decided.action is Action.RETRY and (self.cut is None or member.place < self.cut):
            self.cut = member.place

    async def run(self, conn: asyncpg.Connection, mark: str) -> list[Any]:
        """Inside the open transaction: the handler over the claimed members, their results,
        then a checked COMMIT (with the messages they published: each member is its own unit,
        ``outbox_for(conn, message)``, and with the runner's progress up to the members this
        COMMIT settles). Rolls back and raises on any failure."""
        hook = self.hook
        if hook is not None:
            settled = self._settled_by_commit()
            self.upto = self.messages[settled - 1] if settled else None
        rider = hook.statement(self.upto) if hook is not None and self.upto is not None else ""
        members = [member.message for member in self.running]
        keys = [member.key for member in self.running]
        units = open_batch(conn, self.scope, members, keys, self.store)
        try:
            if not members:  # every member was decided by its record: nothing to hand over
                await (execute_and_commit(conn, rider) if rider else commit(conn))
                return []
            handler_runs.note_started()
            results = list(await self.consumer.handler(members, conn) or [])
            if not conn.is_closed() and not conn.is_in_transaction():
                raise EndedByHandler  # COMMIT or ROLLBACK sent by the handler itself
            if results and len(results) != len(members):
                raise ValueError(
                    f"batch handler returned {len(results)} results for {len(members)}"
                )
            results += [None] * (len(members) - len(results))
            await self._complete(conn, results)
            # still our transaction (the handler did not end and restart it), then the
            # outgoing messages and COMMIT, whose answer is checked: an aborted transaction
            # answers ROLLBACK, not done
            outgoing = pending(units)
            insert = await self.store.outbox.stage(conn, outgoing)  # a COPY for many
            statements = (check_sql(mark), insert, rider)
            await execute_and_commit(conn, "; ".join(s for s in statements if s))
        except BaseException:
            await rollback(conn)
            raise
        finally:
            close_units(conn)
        committed(self.store, outgoing)  # sent now (or, failing that, by a relay)
        return results

    async def _complete(self, conn: asyncpg.Connection, results: list[Any]) -> None:
        """The results on the members' records: a reserved member through its token, the
        others (claimed by the set-based claim) in one statement."""
        store_keys: list[str] = []
        store_values: list[str] = []
        tokens = self.tokens
        for member, result in zip(self.running, results, strict=True):
            token = tokens.get(member.place) if tokens else None
            if token is not None:
                await self.store.complete(
                    self.scope,
                    member.key,
                    token,
                    result,
                    retention=self.consumer.retention,
                    conn=conn,
                )
                continue
            encoded = encode_result(result)
            if encoded is not None:
                store_keys.append(member.key)
                store_values.append(encoded)
        await self.store.fast_path.store_results(conn, self.scope, store_keys, store_values)

    async def park(self, conn: asyncpg.Connection) -> list[Verdict]:
        """The batch handler ended the transaction itself: whatever it wrote may be durable
        without the records that guard it, so no member of the run may run again. Each is
        parked as ``unknown`` (with a notice), unless its claim was committed by the handler's
        own COMMIT (then it is done). The other members are left to the next delivery."""
        log.error(
            "scope=%s: the batch handler ended the idempotency transaction itself (COMMIT or "
            "ROLLBACK): parking its %d members as unknown; never end it in a handler",
            self.scope,
            len(self.running),
            extra={"scope": self.scope},
        )
        parked: dict[int, Verdict] = {}
        for member in self.running:  # every member first: none of them may run again
            record = await self.store.fast_path.record_failure(
                self.scope,
                member.key,
                member.fingerprint,
                "unknown",
                "the batch handler ended the idempotency transaction itself",
                retention=self.consumer.retention,
                conn=conn,
            )
            if record is not None:
                outcome = Outcome(
                    OutcomeKind.UNKNOWN, self.scope, member.key, record=record, parked_now=True
                )
                parked[member.place] = self.consumer.verdict(outcome)
        running = {member.place for member in self.running}
        verdicts: list[Verdict] = []
        for i, message in enumerate(self.messages):  # the prefix that can be settled now
            if i in parked:
                verdicts.append(parked[i])
            elif i in running:  # committed by the handler's COMMIT, or held by someone else
                verdicts.append(await self.consumer.process(message.fresh(), conn))
            else:
                break  # not claimed here: its redelivery decides
            if verdicts[-1].action is Action.RETRY:
                break
        return verdicts

    async def before_cut(self) -> list[Verdict]:
        """A member must wait (its key is held elsewhere): the members before it run as a batch
        of their own, and the list ends with its RETRY."""
        cut = self.cut
        assert cut is not None
        head = await BatchUnit(self.consumer, self.messages[:cut], self.hook)() if cut else []
        waiting = self.verdicts[cut]
        assert waiting is not None
        return head if len(head) < cut else [*head, waiting]

    def settle_prefix(self, results: list[Any]) -> list[Verdict]:
        """After the COMMIT: the runner's progress is committed; every member's verdict, in
        order, up to the first that must wait."""
        self.consumer.store_up()
        if self.hook is not None and self.upto is not None:
            self.hook.committed(self.upto)
        scope, verdicts = self.scope, self.verdicts  # read once, not per member
        for member, result in zip(self.running, results, strict=True):
            key = member.key
            outcome = Outcome(
                OutcomeKind.EXECUTED,
                scope,
                key,
                result=result,
                result_kind=ResultKind.SUCCESS,
                attempts=1,
            )
            verdicts[member.place] = Verdict(Action.ACK, scope, key, outcome)
        for member in self.repeats:
            self._judge_repeat(member)
        done: list[Verdict] = []
        for verdict in verdicts:
            assert verdict is not None
            done.append(verdict)
            if verdict.action is Action.RETRY:
                break
        consumer = self.consumer
        if consumer.on_execute is not None or consumer.on_replay is not None:
            consumer.settled(done)  # committed: each member's hook, once
        return done

    def _judge_repeat(self, member: Member) -> None:
        """A key seen earlier in the batch: a replay of the first's verdict, or a misuse when
        the payload differs."""
        first = member.first
        assert first is not None
        original = self.verdicts[first.place]
        metrics = self.consumer.metrics
        if member.fingerprint != first.fingerprint:
            metrics.inc("key_misuse", self.scope)
            self.verdicts[member.place] = Verdict(
                Action.DEAD_LETTER, self.scope, member.key, reason="key_misuse"
            )
        elif original is not None:
            metrics.inc("replay", self.scope)
            self.verdicts[member.place] = Verdict(
                original.action,
                self.scope,
                member.key,
                original.outcome,
                original.reason,
                original.retry_after,
                duplicate=True,
            )

    def _settled_by_commit(self) -> int:
        """Before the COMMIT: how many leading members it settles on its own (run members,
        plain duplicates), stopping at the first with something left to publish or keep (a
        dead letter, a notice, an ``unknown`` outcome) or to wait for."""
        running = {member.place for member in self.running}
        repeat_of = {member.place: member for member in self.repeats}

        def settled(i: int) -> bool:
            if i in running:
                return True
            repeat = repeat_of.get(i)
            if repeat is not None:
                first = repeat.first
                assert first is not None
                return repeat.fingerprint == first.fingerprint and settled(first.place)
            verdict = self.verdicts[i]
            return verdict is not None and settled_by_commit(verdict)

        for i in range(len(self.messages)):
            if not settled(i):
                return i
        return len(self.messages)


_T = TypeVar("_T")


async def _overlapped(main: Awaitable[_T], side: Callable[[], Awaitable[object]]) -> _T:
    """``main``'s answer, with ``side`` run while ``main`` waits for Postgres (a batch's claim
    takes milliseconds of the server's time, in which this process would sit idle). ``side``
    failing is only logged; ``main`` never outlives this call."""
    task = asyncio.ensure_future(main)
    try:
        await asyncio.sleep(0)  # main's query goes out before side takes the loop
        try:
            await side()
        except Exception:
            log.debug("work alongside a claim failed (the handler's call redoes it)", exc_info=True)
        return await task
    finally:
        if not task.done():  # cancelled while side ran: the connection must be free after
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
