"""The PostgreSQL store: the state machine's SQL (``migrations/``), its Python side, its errors."""
