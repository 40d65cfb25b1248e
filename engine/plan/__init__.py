"""`regen plan`: the projection (shard plan, token counts, GPU-time / wall-time / disk) and the pilot on live servers."""
