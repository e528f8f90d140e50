"""Byte-identical regression runs: suites, execution variants, golden files."""
