"""The scenarios [`assert_idempotent`][consumer_idem.testing.assert_idempotent] plays, per mode.

Each scenario names a fault at a step boundary (armed on the connection, or played by the kit
around the handler), or a way of delivering again (duplicates, concurrent copies, a crash before
the ack), and what the attempt it hit must leave behind.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from consumer_idem.consumer import IdempotentConsumer
from consumer_idem.testing.faults import LIBRARY_COMMIT, Fault, Kind, Point


@dataclass(frozen=True)
class Scenario:
    name: str
    fault: Fault | None = None
    #: a fault the kit plays around the handler (see ``HandlerFaults.wrap``)
    inject: str | None = None
    crash_before_ack: int = 0
    #: the attempt the fault hit was rolled back: it must have left no effect at all
    rolled_back: bool = False
    concurrent: bool = False
    #: deliver the same message this many times more, one after the other
    duplicates: int = 0
    #: the messages travel together in one batch (batch mode)
    together: int = 1


def _library_commit(kind: Kind) -> Fault:
    return Fault(Point.COMMIT, kind, match=LIBRARY_COMMIT)


#: Transactional mode: everything before the COMMIT must vanish with it.
TRANSACTIONAL = (
    Scenario("duplicate delivery", duplicates=2),
    Scenario("concurrent duplicates", concurrent=True),
    Scenario("crash before commit", _library_commit(Kind.DROP_BEFORE), rolled_back=True),
    Scenario("shutdown before commit", _library_commit(Kind.CANCEL), rolled_back=True),
    Scenario("commit rolled back", _library_commit(Kind.ROLLED_BACK), rolled_back=True),
    Scenario(
        "server refuses a handler statement",
        Fault(Point.HANDLER, Kind.SERVER_ERROR),
        rolled_back=True,
    ),
    Scenario("commit landed, answer lost", _library_commit(Kind.DROP_AFTER)),
    Scenario("crash after commit before ack", crash_before_ack=1),
    Scenario("lease lost", inject="session_killed", rolled_back=True),
)
#: Batch mode adds what only a batch has.
BATCH = (
    *TRANSACTIONAL,
    Scenario("duplicate in one batch", together=2),
    Scenario(
        "crash before a batch's commit",
        _library_commit(Kind.DROP_BEFORE),
        rolled_back=True,
        together=2,
    ),
)
#: Two-phase mode: the external call is not rolled back; a lost or ambiguous outcome is
#: parked ``unknown`` and settled by reconciliation, after which it must have happened once.
TWO_PHASE = (
    Scenario("duplicate delivery", duplicates=2),
    Scenario("concurrent duplicates", concurrent=True),
    Scenario("crash after claim, before the call", Fault(Point.CLAIM, Kind.DROP_AFTER)),
    Scenario("crash before commit", Fault(Point.COMPLETE, Kind.DROP_BEFORE)),
    Scenario("commit rolled back", Fault(Point.COMMIT, Kind.ROLLED_BACK)),
    Scenario("crash after commit before ack", crash_before_ack=1),
    Scenario("lease lost", inject="lease_lost"),
    Scenario("ambiguous failure before the call", inject="ambiguous_before"),
    Scenario("ambiguous failure after the call", inject="ambiguous_after"),
)

#: The handler's own call took effect on the far side, then failed on ours (a read timeout):
#: run for every consumer given ``external=``, and always listed for a two-phase one (not
#: applicable without ``external=``: its call is the one thing the kit cannot reach otherwise).
TOOK_EFFECT_THEN_FAILED = Scenario("the call took effect, then failed", inject="took_effect")

CLEAN = "clean delivery"


def scenario_names(consumer: IdempotentConsumer, *, external: bool = False) -> list[str]:
    """The scenarios `assert_idempotent` runs for ``consumer`` (given ``external=``
    calls, or not), in order."""
    return [CLEAN, *(s.name for s in scenarios_of(consumer, external))]


def scenarios_of(consumer: IdempotentConsumer, external: bool) -> Sequence[Scenario]:
    if consumer.mode == "two_phase":
        return (*TWO_PHASE, TOOK_EFFECT_THEN_FAILED)
    chosen = BATCH if consumer.batch else TRANSACTIONAL
    return (*chosen, TOOK_EFFECT_THEN_FAILED) if external else chosen


def chosen_scenarios(
    consumer: IdempotentConsumer, external: bool, names: Collection[str] | None
) -> list[Scenario]:
    """The scenarios of ``consumer`` named in ``names`` (all without), in order; an unknown
    name is refused with the known ones."""
    chosen = list(scenarios_of(consumer, external))
    if names is not None:
        unknown = set(names) - {s.name for s in chosen} - {CLEAN}
        if unknown:
            known = scenario_names(consumer, external=external)
            raise ValueError(f"no such scenario {sorted(unknown)}: {known}")
        chosen = [s for s in chosen if s.name in names]
    return chosen
