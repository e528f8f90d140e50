"""Package discovery (the rest of the metadata is in pyproject.toml).

Every package under `mlxcache/` is found, and `cli/` is installed as `mlxcache_cli`:
static configuration cannot both discover packages and rename a directory.
"""

from setuptools import find_packages, setup

setup(
    package_dir={"mlxcache": "mlxcache", "mlxcache_cli": "cli"},
    packages=[
        *find_packages(include=["mlxcache", "mlxcache.*"]),
        *(f"mlxcache_cli{name[len('cli') :]}" for name in find_packages(include=["cli", "cli.*"])),
    ],
)
