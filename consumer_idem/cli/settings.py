"""Connection settings read from the environment (``CONSUMER_IDEM_*``), localhost defaults.

For the CLI, the examples, the tests and ``scripts/services`` (it needs the ``cli`` extra:
pydantic-settings). The library itself takes its connections as arguments; only the runners
fall back to ``CONSUMER_IDEM_KAFKA_BOOTSTRAP`` / ``CONSUMER_IDEM_AMQP_URL`` when none is given.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    """Connection settings. Every field reads ``CONSUMER_IDEM_<FIELD>`` from the environment."""

    model_config = SettingsConfigDict(env_prefix="CONSUMER_IDEM_", extra="ignore")

    pg_dsn: str = Field(
        default="postgresql://postgres:postgres@127.0.0.1:5432/postgres",
        description="PostgreSQL DSN of the idempotency store (and, usually, the handlers' data).",
    )
    pg_pooler: Literal["transaction"] | None = Field(
        default=None,
        description=(
            "'transaction' when pg_dsn reaches PostgreSQL through a transaction pooler"
            " (PgBouncer pool_mode=transaction, a provider's pooled port); unset for a direct"
            " connection or a session pooler."
        ),
    )
    kafka_bootstrap: str = Field(default="127.0.0.1:9092", description="Kafka bootstrap servers.")
    amqp_url: str = Field(default="amqp://guest:guest@127.0.0.1:5672/", description="RabbitMQ URL.")
    redis_url: str = Field(default="redis://127.0.0.1:6379/0", description="Redis URL.")
    nats_url: str = Field(default="nats://127.0.0.1:4222", description="NATS server URL.")
    schema_name: str = Field(
        default="consumer_idem",
        validation_alias="CONSUMER_IDEM_SCHEMA",
        description="Postgres schema holding the store's tables.",
    )


def load_settings() -> Settings:
    """Read the settings from the environment now (not cached: tests change the environment)."""
    return Settings()
