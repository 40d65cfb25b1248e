"""The host side of regen: supervisor, workers, shard store, stats, export, simulator."""

__version__ = "0.1.0"  # pyproject.toml reads it (tool.setuptools.dynamic); manifests record it
