"""Print which top-level packages each top-level package imports directly (`make imports`).

    python tools/import_graph.py [PACKAGE ...]

Run from the repository root. Without arguments the packages are import-linter's root_packages
in pyproject.toml, in its layer order. A line reads `server -> common (8), export (1)`: there are
8 distinct (importing module, imported module) pairs from `server` to `common`. Every import
counts, function-level ones and those under `if TYPE_CHECKING` included, as import-linter counts
them. The graph is grimp's, the library import-linter checks its contracts with; a package that
is a single module (cli.py before it became cli/) is read with `ast`, as grimp reads the others.
"""

from __future__ import annotations

import ast
import sys
import tomllib
from collections import Counter
from pathlib import Path

import grimp


def root_packages(pyproject: Path = Path("pyproject.toml")) -> list[str]:
    with pyproject.open("rb") as f:
        packages: list[str] = tomllib.load(f)["tool"]["importlinter"]["root_packages"]
    return packages


def module_imports(path: Path, known: set[str]) -> set[str]:
    """The modules a single-file module imports (`from a import b` is a.b where that is a module)."""
    imported: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                imported.add(name if name in known else node.module)
    return imported


def top_level_imports(packages: list[str]) -> dict[str, Counter[str]]:
    """package -> Counter of the other packages it imports, by (importer, imported) module pairs."""
    sys.path.insert(0, str(Path.cwd()))
    single = [p for p in packages if not Path(p, "__init__.py").exists()]
    # External packages are kept (as their top-level name): a single-file module is one of them.
    graph = grimp.build_graph(
        *[p for p in packages if p not in single], include_external_packages=True
    )
    imports = {m: graph.find_modules_directly_imported_by(m) for m in graph.modules}
    for module in single:
        imports[module] = module_imports(Path(f"{module}.py"), graph.modules)
    edges: dict[str, Counter[str]] = {p: Counter() for p in packages}
    for module, imported_modules in imports.items():
        importer = module.split(".")[0]
        if importer not in edges:
            continue  # an external package
        for imported in imported_modules:
            target = imported.split(".")[0]
            if target != importer and target in edges:
                edges[importer][target] += 1
    return edges


def main(argv: list[str]) -> None:
    packages = argv or root_packages()
    edges = top_level_imports(packages)
    width = max(len(p) for p in packages)
    for package in packages:
        # In the order given (the layer order by default): what a package imports reads
        # left to right from the layer just below it.
        targets = ", ".join(f"{t} ({edges[package][t]})" for t in packages if edges[package][t])
        print(f"{package:<{width}} -> {targets or '(none)'}")


if __name__ == "__main__":
    main(sys.argv[1:])
