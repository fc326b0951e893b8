"""What operators run: reconciliation of ``unknown`` keys and dead-letter replay."""
