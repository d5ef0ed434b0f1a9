"""`fedkey-bench aggregation`: the server's aggregation of a round against reading its uploads once."""
