"""One backoff policy for every retry loop: exponential, capped, with full jitter.

Full jitter (a uniform draw between 0 and the exponential ceiling) spreads out the consumers
that all met the same outage at the same moment, so they do not come back in lockstep.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Backoff:
    """``delay(attempt)``: seconds to wait before attempt ``attempt + 1`` (attempt counts from 1).

    The ceiling doubles per attempt from ``base`` up to ``cap``; with ``jitter`` (default) the
    delay is drawn uniformly from ``[0, ceiling]``, without it the delay is the ceiling."""

    base: float = 0.2
    cap: float = 30.0
    jitter: bool = True
    rng: random.Random = field(default_factory=random.Random, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.base < 0 or self.cap < self.base:
            raise ValueError(f"backoff needs 0 <= base <= cap, not base={self.base} cap={self.cap}")

    def ceiling(self, attempt: int) -> float:
        # min() before the power would overflow for a large attempt count
        exponent = min(max(0, attempt - 1), 64)
        return float(min(self.cap, self.base * 2**exponent))

    def delay(self, attempt: int) -> float:
        ceiling = self.ceiling(attempt)
        return self.rng.uniform(0.0, ceiling) if self.jitter else ceiling
