"""Where records live: the PostgreSQL store (the reference), the Redis store, the Redis cache.

Importing this package imports no optional client: ``RedisStore`` and ``CompletedCache`` need the
``redis`` extra and are imported from their own modules (or from ``consumer_idem``).
"""
