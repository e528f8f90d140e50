"""`python -m mlxcache_cli`: the same as the `mlxcache` command."""

from mlxcache_cli.main import app

app()
