"""`make demo`: the payments demo (producer + idempotent consumer on Kafka and RabbitMQ).

Not delivered yet: the consumer runners come with the `@idempotent_consumer` work. Until then
this says so plainly and exits non-zero instead of pretending to run.
"""

import sys

if __name__ == "__main__":
    print(
        "make demo: the payments demo arrives with @idempotent_consumer (not built yet).",
        file=sys.stderr,
    )
    sys.exit(1)
