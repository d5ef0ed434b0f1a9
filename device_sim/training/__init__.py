"""Where phones train: the local trainer and its backends (processes, Ray, stacked)."""
