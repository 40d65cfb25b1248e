"""The run dir on disk: shard store (Parquet parts + state.sqlite), its schema, count cache, rejects, manifest, and its readers (stats)."""
