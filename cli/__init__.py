"""The mlxcache command line: a thin Typer + Rich layer over the `mlxcache` library."""
