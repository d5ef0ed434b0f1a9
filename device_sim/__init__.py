"""Simulated phones: corpora, partitioning into private shards, local training, the HTTP client."""
