"""Reference domain handlers for the payments examples (ledger write, gateway charge, webhook
resolution). Delivered with the consumer, HTTP and reconciliation work."""
