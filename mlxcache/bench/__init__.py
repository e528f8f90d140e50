"""Benchmarks: each prints one machine-readable JSON line and compares with its baseline."""
