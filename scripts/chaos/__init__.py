"""Chaos harness: sustained load, seeded faults, a ledger, and a verdict.

Run with ``make chaos ARGS='--profile smoke'``; see docs/RELIABILITY.md.
"""
