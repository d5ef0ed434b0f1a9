"""The documentation's reference pages, generated from the code at build time so they cannot drift.

mkdocs.yml names this file under ``hooks:``; its ``on_files`` adds the pages below to the site
(none is a file in docs/), each written by its module of tools/reference_pages:

    reference/cli.md            the `fedkey` command tree: every command, its help, its arguments
                                and options (cli_page)
    reference/configuration.md  fedkey.server.settings.Settings: every field, its FEDKEY_* variable, type,
                                default and meaning (configuration_page)
    reference/http-api.md       the federation server's OpenAPI document (http_api_page)
    reference/metrics.md        a metrics row's fields (metrics_page)
    reference/checkpoint.md     the checkpoint file (checkpoint_page)

Each generator returns the page's Markdown; tests/test_docs.py calls them (through the names
below). mkdocs loads this file by path, so it puts the checkout on sys.path and imports the page
modules here, at load time.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the hook is loaded by path: the build documents this checkout
    sys.path.insert(0, str(ROOT))

from tools.reference_pages.checkpoint_page import checkpoint_reference  # noqa: E402
from tools.reference_pages.cli_page import cli_commands, cli_reference  # noqa: E402
from tools.reference_pages.configuration_page import (  # noqa: E402
    configuration_reference,
    settings_fields,
)
from tools.reference_pages.http_api_page import http_api_reference, openapi_document  # noqa: E402
from tools.reference_pages.metrics_page import metrics_reference  # noqa: E402

__all__ = [
    "PAGES",
    "checkpoint_reference",
    "cli_commands",
    "cli_reference",
    "configuration_reference",
    "http_api_reference",
    "metrics_reference",
    "on_files",
    "openapi_document",
    "settings_fields",
]

#: docs path -> its generator.
PAGES: dict[str, Callable[[], str]] = {
    "reference/cli.md": cli_reference,
    "reference/configuration.md": configuration_reference,
    "reference/http-api.md": http_api_reference,
    "reference/metrics.md": metrics_reference,
    "reference/checkpoint.md": checkpoint_reference,
}


# -- the mkdocs hook -------------------------------------------------------------------------------


def on_files(files: Any, config: Any) -> Any:
    """mkdocs hook: add every generated page to the site's files."""
    from mkdocs.structure.files import File

    for path, generate in PAGES.items():
        existing = files.get_file_from_path(path)
        if existing is not None:
            files.remove(existing)
        files.append(File.generated(config, path, content=generate()))
    return files


if __name__ == "__main__":  # python tools/docs_reference.py reference/cli.md: print one page
    for page in sys.argv[1:] or list(PAGES):
        print(PAGES[page]())
