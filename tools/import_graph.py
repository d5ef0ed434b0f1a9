"""Print which of fedkey's packages each package imports directly (`make imports`).

    python tools/import_graph.py [PACKAGE ...]

Run from the repository root. Without arguments the packages are the layers of import-linter's
layers contract in pyproject.toml (fedkey.cli, fedkey.runners, ...), in their order. A line reads
`server -> federation (12), common (8)`: there are 12 distinct (importing module, imported module)
pairs from fedkey.server to fedkey.federation. Every import counts, function-level ones and those
under `if TYPE_CHECKING` included, as import-linter counts them: the graph is grimp's, the library
import-linter checks its contracts with.
"""

from __future__ import annotations

import re
import sys
import tomllib
from collections import Counter
from pathlib import Path

import grimp

NAMESPACE = "fedkey"


def layer_packages(pyproject: Path = Path("pyproject.toml")) -> list[str]:
    """The packages of the layers contract, top layer first (`a | b` is two packages)."""
    with pyproject.open("rb") as f:
        contracts = tomllib.load(f)["tool"]["importlinter"]["contracts"]
    (layers,) = [c["layers"] for c in contracts if c["type"] == "layers"]
    return [p for layer in layers for p in re.split(r"\s*\|\s*", layer)]


def package_imports(packages: list[str]) -> dict[str, Counter[str]]:
    """package -> Counter of the other packages it imports, by (importer, imported) module pairs."""
    sys.path.insert(0, str(Path.cwd()))
    graph = grimp.build_graph(NAMESPACE)
    edges: dict[str, Counter[str]] = {p: Counter() for p in packages}
    for module in graph.modules:
        importer = _package(module)
        if importer not in edges:
            continue
        for imported in graph.find_modules_directly_imported_by(module):
            target = _package(imported)
            if target != importer and target in edges:
                edges[importer][target] += 1
    return edges


def _package(module: str) -> str:
    """fedkey.server.api.deps -> server."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == NAMESPACE else ""


def main(argv: list[str]) -> None:
    packages = argv or layer_packages()
    edges = package_imports(packages)
    width = max(len(p) for p in packages)
    for package in packages:
        # In the order given (the layer order by default): what a package imports reads
        # left to right from the layer just below it.
        targets = ", ".join(f"{t} ({edges[package][t]})" for t in packages if edges[package][t])
        print(f"{package:<{width}} -> {targets or '(none)'}")


if __name__ == "__main__":
    main(sys.argv[1:])
