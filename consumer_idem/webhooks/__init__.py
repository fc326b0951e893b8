"""Incoming payment-gateway webhooks: verify the signature on the raw body, then run each
event's effect once, and keep its record longer than the sender retries.

One verification mechanism (``_verify``: raw body, constant-time comparison of bytes, secrets
checked when the verifier is built, several secrets for rotation, a timestamp tolerance only
where the timestamp is signed) and a module per sender:

* ``stripe``: [`stripe_verifier`][consumer_idem.webhooks.stripe_verifier]; deduplicated by the event
``id``
* ``standard`` (Svix): [`standard_verifier`][consumer_idem.webhooks.standard_verifier]; by
``webhook-id``
* ``razorpay``: [`razorpay_verifier`][consumer_idem.webhooks.razorpay_verifier]; by
``x-razorpay-event-id``
* ``checkout``: [`checkout_verifier`][consumer_idem.webhooks.checkout_verifier]; by the event ``id``
* ``shopify``: [`shopify_verifier`][consumer_idem.webhooks.shopify_verifier]; by
``X-Shopify-Webhook-Id``
* ``github``: [`github_verifier`][consumer_idem.webhooks.github_verifier]; by ``X-GitHub-Delivery``
* ``paddle``: [`paddle_verifier`][consumer_idem.webhooks.paddle_verifier]; by ``event_id``
* ``adyen``: [`adyen_verifier`][consumer_idem.webhooks.adyen_verifier]; each item, by pspReference +
eventCode + success
* ``paypal``: `paypal_verifier` (the ``webhooks`` extra: cryptography); by the event ``id``
* ``toss``: [`toss_verifier`][consumer_idem.webhooks.toss_verifier]; signed events by type +
createdAt + data, unsigned payment
  events re-read from Toss, by paymentKey + status

A malformed request is a 400 naming what is wrong, a wrong or stale signature a 401, and
nothing is recorded for either. [`WebhookReceiver`][consumer_idem.webhooks.WebhookReceiver] runs the
handler once per (provider,
event id) in the transaction that records it, answers as the sender expects (Adyen:
``[accepted]``), and refuses a retention shorter than the sender's retry horizon
(`RETRY_HORIZONS`) plus a margin.
"""

from __future__ import annotations

from consumer_idem.extras import missing

try:
    import starlette  # noqa: F401 - the http extra
except ImportError as exc:
    raise missing("http", exc, __name__) from exc

import hmac  # noqa: F401 - tests watch hmac.compare_digest through this module
from typing import Any

from consumer_idem.errors import WebhookSecretError, WebhookVerificationError
from consumer_idem.webhooks._verify import DEFAULT_TOLERANCE, HmacVerifier, Scheme
from consumer_idem.webhooks.adyen import AdyenVerifier, adyen_batch, adyen_verifier, sign_adyen_item
from consumer_idem.webhooks.checkout import checkout_verifier, sign_checkout
from consumer_idem.webhooks.github import github_verifier, sign_github
from consumer_idem.webhooks.horizons import MARGIN, RETRY_HORIZONS, retention_floor
from consumer_idem.webhooks.paddle import paddle_verifier, sign_paddle
from consumer_idem.webhooks.razorpay import razorpay_verifier, sign_razorpay
from consumer_idem.webhooks.receiver import (
    Delivery,
    DeliveryHandler,
    DeliveryVerifier,
    EventHandler,
    Verifier,
    WebhookReceiver,
    resolve_unknown,
)
from consumer_idem.webhooks.shopify import shopify_verifier, sign_shopify
from consumer_idem.webhooks.standard import sign_standard, standard_verifier, verify_standard
from consumer_idem.webhooks.stripe import sign_stripe, stripe_verifier, verify_stripe
from consumer_idem.webhooks.toss import TossVerifier, sign_toss, toss_verifier

#: the PayPal names need the ``webhooks`` extra (cryptography): imported when first used
_PAYPAL = {"PayPalVerifier", "paypal_verifier", "sign_paypal", "PAYPAL_CERT_HOSTS"}


def __getattr__(name: str) -> Any:
    if name in _PAYPAL:
        from consumer_idem.webhooks import paypal

        return getattr(paypal, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DEFAULT_TOLERANCE",
    "MARGIN",
    "PAYPAL_CERT_HOSTS",
    "RETRY_HORIZONS",
    "AdyenVerifier",
    "Delivery",
    "DeliveryHandler",
    "DeliveryVerifier",
    "EventHandler",
    "HmacVerifier",
    "PayPalVerifier",
    "Scheme",
    "TossVerifier",
    "Verifier",
    "WebhookReceiver",
    "WebhookSecretError",
    "WebhookVerificationError",
    "adyen_batch",
    "adyen_verifier",
    "checkout_verifier",
    "github_verifier",
    "paddle_verifier",
    "paypal_verifier",
    "razorpay_verifier",
    "resolve_unknown",
    "retention_floor",
    "shopify_verifier",
    "sign_adyen_item",
    "sign_checkout",
    "sign_github",
    "sign_paddle",
    "sign_paypal",
    "sign_razorpay",
    "sign_shopify",
    "sign_standard",
    "sign_stripe",
    "sign_toss",
    "standard_verifier",
    "stripe_verifier",
    "toss_verifier",
    "verify_standard",
    "verify_stripe",
]
