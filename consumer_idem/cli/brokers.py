"""The broker addresses of the commands that reach a broker: ``--bootstrap-servers`` and
``--amqp-url`` on the command line, else the ``CONSUMER_IDEM_*`` settings."""

from __future__ import annotations

from typing import Annotated

import typer

from consumer_idem.cli.settings import Settings, load_settings

BootstrapOpt = Annotated[
    str | None,
    typer.Option(
        "--bootstrap-servers",
        help="Kafka bootstrap servers (default: CONSUMER_IDEM_KAFKA_BOOTSTRAP)",
    ),
]
AmqpUrlOpt = Annotated[
    str | None,
    typer.Option("--amqp-url", help="RabbitMQ URL (default: CONSUMER_IDEM_AMQP_URL)"),
]


def broker_settings(bootstrap_servers: str | None, amqp_url: str | None) -> Settings:
    """The settings, with the broker addresses given as flags in place of theirs."""
    settings = load_settings()
    given = {"kafka_bootstrap": bootstrap_servers, "amqp_url": amqp_url}
    return settings.model_copy(update={k: v for k, v in given.items() if v})
