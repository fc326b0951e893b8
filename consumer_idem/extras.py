"""What to install when an integration's library is missing.

Each integration module starts by importing the library its extra brings; without it the
import fails with [`MissingExtra`][consumer_idem.extras.MissingExtra], which names the ``pip
install`` that fixes it
instead of a bare ``ModuleNotFoundError``::

    try:
        import aiokafka  # noqa: F401 - the kafka extra
    except ImportError as exc:
        raise missing("kafka", exc, __name__) from exc
"""

from __future__ import annotations

#: the import name of each extra's library, as pyproject.toml's optional dependencies give it
LIBRARIES = {
    "kafka": "aiokafka",
    "rabbit": "aio_pika",
    "faststream": "faststream",
    "http": "starlette",
    "sqlalchemy": "sqlalchemy",
    "cli": "typer",
    "webhooks": "cryptography",
}


class MissingExtra(ImportError):
    """An integration was imported without the extra that brings its library."""


def missing(extra: str, exc: ImportError, module: str) -> ImportError:
    """The error to raise for ``exc``: [`MissingExtra`][consumer_idem.extras.MissingExtra] naming
    ``extra`` when the missing
    module is that extra's library (or part of it); ``exc`` itself otherwise (another library
    missing is not fixed by this extra)."""
    library = LIBRARIES[extra]
    name = exc.name or ""
    if name != library and not name.startswith(library + "."):
        return exc
    return MissingExtra(
        f"{module} needs the {extra!r} extra ({name} is not installed): "
        f"pip install 'consumer-idem[{extra}]'",
        name=name,
    )
