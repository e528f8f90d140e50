"""MkDocs hooks: the site's home page is README.md, and its CLI reference is rendered from the
Typer app when the site is built (so neither is a copy that could drift)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent


def home(readme: str) -> str:
    """README.md as the site's index: its links into docs/ made relative to the site."""
    return re.sub(r"\]\(docs/", "](", readme)


def on_files(files: Files, config: Any) -> Files:
    from mlxcache_cli.reference import render  # imported here: the app loads only to build

    files.append(File.generated(config, "index.md", content=home((ROOT / "README.md").read_text())))
    files.append(File.generated(config, "cli.md", content=render()))
    return files
