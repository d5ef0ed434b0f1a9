"""The documentation's generated reference pages (tools/docs_reference.py) cover the code they are
generated from: every `fedkey` command and option, every Settings field, every HTTP route, every
metrics-row field and checkpoint key. The site itself is built by `make docs` (mkdocs --strict),
which CI runs; these tests call the generators only, so they stay fast."""

import re
from pathlib import Path

import pytest

from tools import docs_reference as ref

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cli_page() -> str:
    return ref.cli_reference()


def test_the_cli_reference_lists_every_command_and_option(cli_page):
    commands = ref.cli_commands()
    names = [name for name, _ in commands]
    assert "fedkey simulate" in names and "fedkey server" in names
    for name, command in commands:
        assert f"## `{name}`" in cli_page, name
        section = cli_page.split(f"## `{name}`", 1)[1].split("\n## ", 1)[0]
        for param in command.params:
            if getattr(param, "hidden", False) or param.param_type_name != "option":
                continue
            assert f"`{param.opts[0]}`" in section, (name, param.opts[0])


def test_the_configuration_reference_lists_every_settings_field():
    page = ref.configuration_reference()
    for name in ref.settings_fields():
        row = next(
            (r for r in page.splitlines() if r.startswith(f"| `FEDKEY_{name.upper()}` ")), ""
        )
        assert row, name
        meaning = row.rstrip(" |").rsplit("|", 1)[-1].strip()
        assert meaning, f"FEDKEY_{name.upper()} has no description (a flag's help or a comment)"


def test_the_http_reference_lists_every_route():
    doc = ref.openapi_document()
    page = ref.http_api_reference()
    for path, operations in doc["paths"].items():
        for method in operations:
            assert f"## `{method.upper()} {path}`" in page
    assert "`WS /v1/events`" in page


def test_the_metrics_and_checkpoint_references_list_every_declared_field():
    from fedkey.federation.metrics_row import FIELDS
    from fedkey.models.checkpoint import METADATA

    metrics = ref.metrics_reference()
    for name in FIELDS:
        assert f"| `{name}` |" in metrics
    checkpoint = ref.checkpoint_reference()
    for key in METADATA:
        assert f"| `{key}` |" in checkpoint


def test_the_site_navigates_every_page_and_every_generated_one():
    config = (ROOT / "mkdocs.yml").read_text()
    in_nav = set(re.findall(r":\s*([\w/-]+\.md)\s*$", config, re.M))
    written = {str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md")}
    assert written <= in_nav
    assert set(ref.PAGES) <= in_nav
    assert not set(ref.PAGES) & written  # generated only: never a stale copy in docs/
