"""`python -m fedkey ...`: the same as `fedkey ...` (how `fedkey demo` starts its processes)."""

from fedkey.cli import main

main()
