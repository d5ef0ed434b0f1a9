"""`fedkey-bench paper` (and `merge`): the seed papers' experiments and the ranking of the aggregation methods, with its report."""
