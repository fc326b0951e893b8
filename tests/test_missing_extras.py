"""Importing an integration without its extra names the ``pip install`` that fixes it, and
``downstream_key_for`` needs no web framework. Each case runs in a fresh interpreter where the
extra's library cannot be imported (its ``sys.modules`` entry is None, which is how Python
marks a module as unimportable)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT_DIR

CASES = [
    ("consumer_idem.transports.kafka", "aiokafka", "kafka"),
    ("consumer_idem.transports.rabbit", "aio_pika", "rabbit"),
    ("consumer_idem.faststream", "faststream", "faststream"),
    ("consumer_idem.http", "starlette", "http"),
    ("consumer_idem.webhooks", "starlette", "http"),
    ("consumer_idem.webhooks.paypal", "cryptography", "webhooks"),
    ("consumer_idem.sqlalchemy", "sqlalchemy", "sqlalchemy"),
]


def python_without(library: str, code: str) -> subprocess.CompletedProcess[str]:
    prelude = f"import sys\nsys.modules[{library!r}] = None\n"
    return subprocess.run(
        [sys.executable, "-c", prelude + code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT_DIR,
    )


@pytest.mark.parametrize(("module", "library", "extra"), CASES)
def test_an_integration_without_its_extra_names_the_install_that_fixes_it(
    module: str, library: str, extra: str
) -> None:
    ran = python_without(library, f"import {module}")
    assert ran.returncode != 0
    last = ran.stderr.strip().splitlines()[-1]
    assert last == (
        f"consumer_idem.extras.MissingExtra: {module} needs the {extra!r} extra "
        f"({library} is not installed): pip install 'consumer-idem[{extra}]'"
    )


def test_downstream_key_for_needs_no_starlette() -> None:
    ran = python_without(
        "starlette",
        "from consumer_idem import downstream_key_for\nprint(downstream_key_for('payments', 'k1'))",
    )
    assert ran.returncode == 0, ran.stderr
    from consumer_idem.http import downstream_key_for as old_path

    assert ran.stdout.strip() == old_path("payments", "k1")  # the old import path still works


def test_the_hmac_senders_need_no_cryptography() -> None:
    """Only PayPal's RSA needs the ``webhooks`` extra: the other nine work with ``http``, and
    the PayPal names say which extra they need when first used."""
    ran = python_without(
        "cryptography",
        "import consumer_idem.webhooks as w\n"
        "w.stripe_verifier(['s'])\nprint('ok')\n"
        "try:\n    w.paypal_verifier\nexcept ImportError as exc:\n    print(exc)",
    )
    assert ran.returncode == 0, ran.stderr
    lines = ran.stdout.strip().splitlines()
    assert lines[0] == "ok"
    assert lines[1].endswith("pip install 'consumer-idem[webhooks]'")
