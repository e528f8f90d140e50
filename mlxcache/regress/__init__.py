"""Byte-identical regression runs: suites, execution variants, golden files."""

VARIANTS = ("cold", "warm", "disk", "lanes", "drafted")
"""Execution variants (`runner`); here so that the CLI lists them without importing a model."""
