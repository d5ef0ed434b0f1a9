"""The federation's algorithm: rounds, strategies, privacy, bounded influence, updates."""
