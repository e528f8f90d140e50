"""The prompt cache: a pure-Python prompt index over a KV store of MLX arrays."""
