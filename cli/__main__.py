"""`python -m cli ...`: the same as `fedkey ...` (how `fedkey demo` starts its processes)."""

from cli import main

main()
