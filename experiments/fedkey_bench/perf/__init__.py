"""`fedkey-bench perf`: the system against its performance targets, with its report."""
