"""The product modes built on the engine: chat sessions, JSON, tool calls."""
