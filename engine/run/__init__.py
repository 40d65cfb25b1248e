"""The run wing: the life of a sample in one supervisor, from a prompt row to a committed Parquet row."""
