"""`fedkey-bench cohorts`: phone-updates per second of the training backends by cohort size."""
