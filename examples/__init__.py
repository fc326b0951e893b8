"""Runnable examples. `make demo` runs the payments demo."""
