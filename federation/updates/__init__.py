"""Updates: stored on disk as they arrive, read back in slices, validated."""
