"""How long each sender keeps retrying an event: the one table of retry horizons.

A webhook record must outlive the sender's last retry of its event: pruned earlier, that retry
finds no record and runs the effect a second time.
[`WebhookReceiver`][consumer_idem.webhooks.WebhookReceiver]
for a named sender refuses, when it is built, a retention shorter than the horizon plus
`MARGIN`, and every record it writes expires that long after its completion (``prune``
removes only records past their ``expires_at``).
"""

from __future__ import annotations

from datetime import timedelta

from consumer_idem.errors import ConfigurationError

#: sender -> (how long it retries an event after the first delivery, where that figure is from)
RETRY_HORIZONS: dict[str, tuple[timedelta, str]] = {
    "stripe": (timedelta(days=3), "retries for up to 3 days (live mode)"),
    "standard": (timedelta(hours=28), "Svix's schedule ends about 28 hours after the first try"),
    "razorpay": (timedelta(hours=24), "retries for 24 hours"),
    "checkout": (timedelta(hours=31), "retries for about 31 hours"),
    "shopify": (timedelta(hours=4), "8 retries over 4 hours"),
    "github": (timedelta(days=3), "no automatic retry; manual redelivery of the last 3 days"),
    "paddle": (timedelta(days=3), "retries for 3 days (live)"),
    "adyen": (timedelta(days=30), "retries for up to 30 days"),
    "paypal": (timedelta(days=3), "25 retries over 3 days"),
    "toss": (timedelta(days=4), "7 retries over about 3.8 days"),
}
#: kept beyond the horizon: clock skew, a sender's late retry, an operator's manual resend
MARGIN = timedelta(days=1)
#: the retention of a receiver that names none (at least each sender's floor)
DEFAULT_RETENTION = timedelta(days=30)


def spoken(duration: timedelta) -> str:
    """``7 days``, ``28 hours``, ``1 day, 4 hours``: a duration as the message says it."""
    days, seconds = duration.days, duration.seconds
    parts = [f"{days} day{'s' * (days != 1)}"] if days else []
    hours, rest = divmod(seconds, 3600)
    if hours:
        parts.append(f"{hours} hour{'s' * (hours != 1)}")
    if rest or duration.microseconds or not parts:
        amount = rest + duration.microseconds / 1e6
        parts.append(f"{amount:g} second{'s' * (amount != 1)}")
    return ", ".join(parts)


def retention_floor(sender: str) -> timedelta | None:
    """The shortest retention for ``sender``'s records (None: a sender not in the table)."""
    horizon = RETRY_HORIZONS.get(sender)
    return None if horizon is None else horizon[0] + MARGIN


def checked_retention(sender: str | None, retention: timedelta | None) -> timedelta:
    """The retention to write ``sender``'s records with: ``retention``, refused when shorter
    than the sender's floor, or by default the longer of 30 days and that floor."""
    floor = retention_floor(sender) if sender is not None else None
    if retention is None:
        return max(DEFAULT_RETENTION, floor) if floor is not None else DEFAULT_RETENTION
    if floor is not None and retention < floor:
        horizon, source = RETRY_HORIZONS[sender]  # type: ignore[index]
        raise ConfigurationError(
            f"a retention of {spoken(retention)} is shorter than {sender}'s retry horizon "
            f"({spoken(horizon)}: {source}) plus a margin of {spoken(MARGIN)}: a late retry "
            f"would run the effect again. Keep its records at least {spoken(floor)}."
        )
    return retention
