"""fedkey's tests. A package, so that `fedkey.testing` is importable by its name (pytest puts the
checkout on sys.path: `pythonpath = ["."]` in pyproject.toml)."""
