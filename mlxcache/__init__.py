"""mlxcache: an MLX model runner that resumes from cached prompt prefixes."""

__version__ = "0.1.0"
