"""fedkey's research harness: one sub-package per benchmark (its runner, its report, its configs), the shared pieces in common/, the `fedkey-bench` command in cli.py."""
