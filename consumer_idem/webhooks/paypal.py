"""PayPal, verified offline: ``PAYPAL-TRANSMISSION-SIG`` is an RSA-SHA256 (PKCS#1 v1.5)
signature, base64, over ``transmission_id|transmission_time|webhook_id|crc32(raw body)`` (the
CRC as an unsigned decimal), made with the key of the certificate at ``PAYPAL-CERT-URL``.

The library never fetches anything itself: the caller supplies ``fetch_certificate(url) -> PEM
bytes`` (an HTTPS GET, with TLS verification, is what PayPal intends). The URL must be
``https`` on an allowed PayPal host before it is fetched, each certificate is fetched once
and cached, and one outside its validity period does not verify. The transmission time is
signed, so it must be within the tolerance. Several webhook ids may be given (a webhook being
replaced). The identity is the event's ``id`` (``WH-...``): each retry is a new transmission,
the event is the same.
"""

from __future__ import annotations

from consumer_idem.extras import missing

try:
    import cryptography  # noqa: F401 - the webhooks extra
except ImportError as exc:
    raise missing("webhooks", exc, __name__) from exc

import base64
import binascii
import time
import zlib
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import UTC, datetime
from urllib.parse import urlsplit

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import padding, rsa

from consumer_idem.errors import WebhookSecretError, WebhookVerificationError
from consumer_idem.fingerprint import fingerprint_payload
from consumer_idem.webhooks._verify import (
    DEFAULT_TOLERANCE,
    check_iso_time,
    checked_tolerance,
    json_object,
    one_header,
    string_field,
)
from consumer_idem.webhooks.receiver import Delivery

CertificateFetcher = Callable[[str], Awaitable[bytes]]
#: the hosts PayPal serves its signing certificates from
PAYPAL_CERT_HOSTS = ("api.paypal.com", "api-m.paypal.com", "api.sandbox.paypal.com",
                     "api-m.sandbox.paypal.com")  # fmt: skip
AUTH_ALGO = "SHA256withRSA"
_CACHE_SIZE = 32


def signed_string(
    transmission_id: str, transmission_time: str, webhook_id: str, body: bytes
) -> bytes:
    """The bytes PayPal signs for one transmission."""
    crc = zlib.crc32(body) & 0xFFFFFFFF
    return f"{transmission_id}|{transmission_time}|{webhook_id}|{crc}".encode()


class PayPalVerifier:
    """Verifies PayPal transmissions with the certificate ``fetch_certificate`` returns."""

    sender = "paypal"

    def __init__(
        self,
        webhook_ids: Sequence[str],
        fetch_certificate: CertificateFetcher,
        *,
        allowed_hosts: Sequence[str] = PAYPAL_CERT_HOSTS,
        tolerance: float = DEFAULT_TOLERANCE,
    ) -> None:
        if (
            isinstance(webhook_ids, str)
            or not webhook_ids
            or not all(isinstance(w, str) and w.strip() for w in webhook_ids)
        ):
            raise WebhookSecretError("pass a list of one or more non-empty PayPal webhook ids")
        if not allowed_hosts or isinstance(allowed_hosts, str):
            raise WebhookSecretError("pass a list of the hosts certificates may come from")
        self.webhook_ids = [w.strip() for w in webhook_ids]
        self.fetch_certificate = fetch_certificate
        self.allowed_hosts = frozenset(h.lower() for h in allowed_hosts)
        self.tolerance = checked_tolerance(tolerance)
        self._certificates: dict[str, x509.Certificate] = {}

    async def certificate(self, url: str) -> x509.Certificate:
        """The certificate at ``url``: its host checked first, fetched once, then cached."""
        if not self._allowed(url):
            raise WebhookVerificationError(401, "PAYPAL-CERT-URL is not on an allowed host")
        cached = self._certificates.get(url)
        if cached is not None:
            return cached
        try:
            pem = await self.fetch_certificate(url)
        except Exception as exc:  # the fetch is I/O: an outage to wait out, never a refusal
            raise WebhookVerificationError(503, "the PayPal certificate cannot be fetched") from exc
        try:
            cert = x509.load_pem_x509_certificate(pem)
        except ValueError as exc:
            raise WebhookVerificationError(401, "PAYPAL-CERT-URL is no PEM certificate") from exc
        if len(self._certificates) >= _CACHE_SIZE:
            self._certificates.pop(next(iter(self._certificates)))
        self._certificates[url] = cert
        return cert

    def _allowed(self, url: str) -> bool:
        """``https`` on an allowed host, default port, no user info. A URL ``urlsplit`` cannot
        read (a port that is no number, an unclosed ``[``) raises ValueError: not allowed."""
        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError:
            return False
        return (
            parts.scheme == "https"
            and parts.username is None
            and port in (None, 443)
            and (parts.hostname or "").lower() in self.allowed_hosts
        )

    async def verify(
        self, body: bytes, headers: Mapping[str, str], now: float | None = None
    ) -> None:
        transmission_id = one_header(headers, "paypal-transmission-id")
        transmission_time = one_header(headers, "paypal-transmission-time")
        signature = one_header(headers, "paypal-transmission-sig")
        url = one_header(headers, "paypal-cert-url")
        if one_header(headers, "paypal-auth-algo") != AUTH_ALGO:
            raise WebhookVerificationError(400, f"PAYPAL-AUTH-ALGO is not {AUTH_ALGO}")
        check_iso_time(transmission_time, self.tolerance, now)
        try:
            raw = base64.b64decode(signature.encode("ascii"), validate=True)
        except (UnicodeEncodeError, binascii.Error):
            raise WebhookVerificationError(401, "no signature matches") from None
        cert = await self.certificate(url)
        moment = datetime.fromtimestamp(time.time() if now is None else now, UTC)
        if not cert.not_valid_before_utc <= moment <= cert.not_valid_after_utc:
            raise WebhookVerificationError(401, "the PayPal certificate is not valid now")
        key = cert.public_key()
        if not isinstance(key, rsa.RSAPublicKey):
            raise WebhookVerificationError(401, "the PayPal certificate's key is not RSA")
        for webhook_id in self.webhook_ids:
            signed = signed_string(transmission_id, transmission_time, webhook_id, body)
            try:
                key.verify(raw, signed, padding.PKCS1v15(), hashes.SHA256())
            except InvalidSignature:
                continue
            return
        raise WebhookVerificationError(401, "no signature matches")

    async def deliveries(self, body: bytes, headers: Mapping[str, str]) -> list[Delivery]:
        await self.verify(body, headers)
        event = json_object(body)
        event_id = string_field(event, "id", "PayPal event")
        # the signature covers only the body's CRC32: the transmission is sealed to this body
        seal = one_header(headers, "paypal-transmission-id")
        return [Delivery(event_id, event, fingerprint_payload(body), seal)]


def paypal_verifier(
    webhook_ids: Sequence[str],
    fetch_certificate: CertificateFetcher,
    *,
    allowed_hosts: Sequence[str] = PAYPAL_CERT_HOSTS,
    tolerance: float = DEFAULT_TOLERANCE,
) -> PayPalVerifier:
    """A PayPal verifier for one or more webhook ids (rotation), offline with the certificate."""
    return PayPalVerifier(
        webhook_ids, fetch_certificate, allowed_hosts=allowed_hosts, tolerance=tolerance
    )


def sign_paypal(
    body: bytes,
    private_key: rsa.RSAPrivateKey,
    *,
    webhook_id: str,
    transmission_id: str,
    transmission_time: str,
    cert_url: str,
) -> dict[str, str]:
    """The headers PayPal would send (for tests, with a key and certificate of your own)."""
    signed = signed_string(transmission_id, transmission_time, webhook_id, body)
    signature = private_key.sign(signed, padding.PKCS1v15(), hashes.SHA256())
    return {
        "paypal-transmission-id": transmission_id,
        "paypal-transmission-time": transmission_time,
        "paypal-transmission-sig": base64.b64encode(signature).decode(),
        "paypal-cert-url": cert_url,
        "paypal-auth-algo": AUTH_ALGO,
    }
