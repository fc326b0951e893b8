"""Whose request it is: the caller part of a record's scope.

A ``caller=`` value, an authenticated principal (``u.<identity>``) and no caller
(``anonymous``) are three namespaces: no label of one source is a label of another."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from urllib.parse import quote

from starlette.requests import HTTPConnection

from consumer_idem.http.asgi import Scope

#: names the caller of a request (a tenant, a user, an API key's id); ``None``: no caller
Caller = Callable[[HTTPConnection], str | None]

ANONYMOUS = "anonymous"


def principal(scope: Scope) -> str | None:
    """The authenticated user Starlette's ``AuthenticationMiddleware`` put in the scope, as
    ``user:<identity>``; ``None`` when there is none or it is not authenticated."""
    user = scope.get("user")
    if user is None or not getattr(user, "is_authenticated", False):
        return None
    try:
        identity = user.identity
    except NotImplementedError:  # a BaseUser that names itself only by display_name
        identity = user.display_name
    return f"user:{identity}" if identity else None


_HASHED = "sha256."


def _caller_label(value: str) -> str:
    """The caller (or a host) as it goes into the record scope: readable, no ``:`` (the
    scope's separator, so metrics can drop the caller) and no ``|`` (the host separator),
    bounded. A long one is replaced by ``sha256.<hash>``; a verbatim label never starts
    that way (its ``s`` is percent-encoded, which ``quote`` never does by itself), so a
    caller cannot pick a name that shares another caller's hashed key space."""
    label = quote(value, safe="@._-+~!$&'()*,;=/", errors="surrogatepass")
    if len(label) > 64:
        return _HASHED + hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:40]
    if label.startswith(_HASHED):
        return "%73" + label[1:]
    return label


#: a principal's label: ``u.<identity>``; a ``caller=`` value never starts so (nor is it
#: ``anonymous``): each source of a caller is its own namespace
_PRINCIPAL = "u."


def _callers_label(value: str) -> str:
    """A value of ``caller=``: `_caller_label`, except that its first character is
    percent-encoded (which ``quote`` never does to a letter) when the label would read
    ``anonymous`` (no caller) or ``u.`` (a principal): no caller value shares their keys."""
    label = _caller_label(value)
    if label == ANONYMOUS or label.startswith(_PRINCIPAL):
        return f"%{ord(label[0]):02X}{label[1:]}"
    return label


def _principal_label(identity: str) -> str:
    """An authenticated principal's label: ``u.`` and its identity's `_caller_label`."""
    return _PRINCIPAL + _caller_label(identity)


def caller_of(caller: Caller | None, scope: Scope, hosts: Iterable[str] = ()) -> str:
    """The caller part of a request's record scope; followed by the concrete host(s) when
    routing depends on the host (``acme|a.shop.example``): two hosts are two key spaces."""
    value = caller(HTTPConnection(scope)) if caller is not None else None
    if value:
        label = _callers_label(value)
    else:
        user = principal(scope)
        label = _principal_label(user.removeprefix("user:")) if user else ANONYMOUS
    return "|".join((label, *(_caller_label(host) for host in hosts)))
