"""consumer-idem: idempotent message consumers and HTTP endpoints on PostgreSQL."""

from consumer_idem.settings import Settings, load_settings

__all__ = ["Settings", "load_settings"]
__version__ = "0.1.0"
