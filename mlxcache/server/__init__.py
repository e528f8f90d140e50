"""`mlxcache serve`: an OpenAI-compatible HTTP API over one engine worker."""
