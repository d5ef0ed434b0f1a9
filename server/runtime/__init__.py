"""The service's plumbing: threads, slots, limits, admission, metrics, the collector."""
