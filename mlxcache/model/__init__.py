"""Model loading: the embedded default, GGUF files, mlx-lm folders and Hugging Face ids."""

from mlxcache.model.loader import DEFAULT_MODEL, LoadedModel, load

__all__ = ["DEFAULT_MODEL", "LoadedModel", "load"]
