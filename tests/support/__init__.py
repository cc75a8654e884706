"""Shared test code: the one place test modules import from (no test imports another)."""
