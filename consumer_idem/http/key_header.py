"""The ``Idempotency-Key`` header: what a valid one looks like, and the key it carries."""

from __future__ import annotations

import re

from consumer_idem.errors import KeyHeaderError

HEADER = b"idempotency-key"
#: a bare token, of any length: a long one is told its length, not that it is malformed
_TOKEN = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~:/=-]+")
MAX_KEY = 255
#: one RFC 8941 parameter: ``;key`` or ``;key=bare-item``
_PARAMETER = re.compile(
    r";[ ]*[a-z*][a-z0-9_.*-]*(?:=(?:"
    r'"(?:[^"\\\x00-\x1f\x7f-\uffff]|\\["\\])*"'  # string
    r"|\?[01]"  # boolean
    r"|-?[0-9]{1,15}(?:\.[0-9]{1,3})?"  # integer or decimal
    r"|[A-Za-z*][A-Za-z0-9!#$%&'*+.^_`|~:/-]*"  # token
    r"|:[A-Za-z0-9+/]*={0,2}:"  # byte sequence
    r"))?"
)


def parse_key_header(value: str) -> str:
    """The key from an ``Idempotency-Key`` header: an RFC 8941 string item (``"abc"``, with
    ``\\"`` and ``\\\\`` escapes, printable ASCII; parameters such as ``;v=1`` are allowed and do
    not change the key) or a bare token. 1 to 255 characters."""
    value = value.strip(" \t")
    if value.startswith('"'):
        key = _string_item(value)
    elif _TOKEN.fullmatch(value):
        key = value
    else:
        raise KeyHeaderError("the key must be a quoted string or a token of [A-Za-z0-9._~:/=-]")
    if not 1 <= len(key) <= MAX_KEY:
        raise KeyHeaderError(f"the key must be 1 to {MAX_KEY} characters long, not {len(key)}")
    return key


def _string_item(value: str) -> str:
    """The string of an RFC 8941 string item (``value`` starts with its opening quote),
    followed by nothing but parameters."""
    out: list[str] = []
    i = 1
    while True:
        if i >= len(value):
            raise KeyHeaderError("unterminated structured-field string")
        ch = value[i]
        if ch == "\\":
            i += 1
            if i >= len(value) or value[i] not in '"\\':
                raise KeyHeaderError("bad escape in structured-field string")
            out.append(value[i])
        elif ch == '"':
            break
        elif not 0x20 <= ord(ch) <= 0x7E:
            raise KeyHeaderError("structured-field strings hold printable ASCII only")
        else:
            out.append(ch)
        i += 1
    rest = value[i + 1 :]
    while rest:
        parameter = _PARAMETER.match(rest)
        if parameter is None:
            raise KeyHeaderError("one structured-field string, optionally with parameters")
        rest = rest[parameter.end() :]
    return "".join(out)
