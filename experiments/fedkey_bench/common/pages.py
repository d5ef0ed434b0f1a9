"""A benchmark's results folder keyed by population (`typing`, `dpfinetune`): FOLDER/results.json
({"populations": {name: ...}}) and FOLDER/results.md, the page rendered from it alone."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fedkey.common.files import atomic_write

#: results.json -> results.md
Render = Callable[[dict[str, Any]], str]


def load(folder: Path) -> dict[str, Any]:
    """FOLDER/results.json ({"populations": {}} before the first)."""
    path = folder / "results.json"
    if not path.exists():
        return {"populations": {}}
    data: dict[str, Any] = json.loads(path.read_text())
    data.setdefault("populations", {})
    return data


def save(folder: Path, results: dict[str, Any], render: Render) -> Path:
    """FOLDER/results.json, and FOLDER/results.md rendered from it; -> the page's path."""
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write(folder / "results.json", json.dumps(results, indent=1) + "\n")
    return rebuild(folder, render)


def rebuild(folder: Path, render: Render) -> Path:
    """FOLDER/results.md from FOLDER/results.json; -> its path."""
    path = folder / "results.md"
    atomic_write(path, render(load(folder)))
    return path


def commands(populations: dict[str, Any], runs: str) -> str:
    """The page's commands, indented as a code block: each population's bench command (once),
    then the command of every run under its `runs` key ("runs", "cells"), machine paths hidden."""
    from fedkey_bench.common.checkout import shown

    lines = sorted({shown(p["command"]) for p in populations.values() if p.get("command")})
    for pop in populations.values():
        lines += [shown(r["command"]) for r in (pop.get(runs) or {}).values() if r.get("command")]
    return "\n".join(f"    {c}" for c in lines)
