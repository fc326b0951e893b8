"""Reading a request: its whole body (never a part of it), and the fingerprint of what it is."""

from __future__ import annotations

from urllib.parse import parse_qsl, quote, urlencode

from consumer_idem.fingerprint import fingerprint_bytes, fingerprint_json, parse_json
from consumer_idem.http.asgi import Message, Receive


class ClientGone(Exception):
    """The client disconnected before the request body was complete."""


class TooLarge(Exception):
    """The request body is longer than the middleware's ``max_body``."""


async def read_body(receive: Receive, limit: int) -> bytes:
    """The whole request body. A disconnect before its last chunk is no end of body: the
    request is incomplete (raises `ClientGone`), and nothing may run on a part of it."""
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        body += message.get("body", b"")
        if len(body) > limit:
            raise TooLarge
        if not message.get("more_body", False):
            break
    return bytes(body)


def replay_body(body: bytes, receive: Receive) -> Receive:
    """``receive`` for the app: the body already read, then the real ``receive``."""
    delivered = False

    async def again() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return again


def _canonical_target(method: str, path: str, query_string: bytes) -> str:
    """``METHOD /path?query``, ASCII: the path percent-encoded, the query parameters decoded,
    sorted by name (repeated names keep their order) and encoded again."""
    target = quote(path, safe="/:@!$&'()*+,;=~", errors="surrogatepass")
    if query_string:
        pairs = parse_qsl(
            query_string.decode("latin-1"),
            keep_blank_values=True,
            encoding="utf-8",
            errors="surrogateescape",
        )
        pairs.sort(key=lambda pair: pair[0])
        query = urlencode(pairs, quote_via=quote, encoding="utf-8", errors="surrogateescape")
        target += "?" + query
    return f"{method} {target}"


def request_fingerprint(
    method: str, path: str, query_string: bytes, body: bytes, *, host: str | None = None
) -> str:
    """What the record's fingerprint covers: the concrete request. Method, path with its
    parameters, canonical query string, the host when routing depended on it (a ``Host``
    route), and the body (RFC 8785 canonical JSON when it is JSON, else its raw bytes)."""
    target = _canonical_target(method, path, query_string)
    if host:  # the target has no raw space after the method: this cannot be forged by a path
        target += " host=" + quote(host, safe="", errors="surrogatepass")
    try:
        value = parse_json(body) if body else None
        return fingerprint_json({"request": target, "body": value})
    except ValueError:  # not JSON (or UTF-8), too deep, or JSON RFC 8785 cannot canonicalise
        return fingerprint_bytes(target.encode() + b"\n" + body)
