"""`fedkey data`: the real corpora in the data directory (fedkey.corpora.datadir). `fedkey data fetch
nus-sms|ubuntu-irc` downloads one from its upstream and checks its sha256; `fedkey data where`
says where the directory is and what it holds."""

from __future__ import annotations

from enum import StrEnum

import typer

from fedkey.corpora.datadir import SOURCES, data_dir, fetch, is_present

data_app = typer.Typer(
    help="The real corpora (NUS SMS, Ubuntu IRC): where they live, and fetching them.",
    no_args_is_help=True,
)


class Name(StrEnum):
    """The corpora `fedkey data fetch` knows (fedkey.corpora.datadir.SOURCES)."""

    nus_sms = "nus-sms"
    ubuntu_irc = "ubuntu-irc"


@data_app.command("fetch")
def data_fetch(
    name: Name = typer.Argument(..., metavar="CORPUS", help="The corpus to download."),
    url: str | None = typer.Option(
        None, "--url", help="Download from here instead of the upstream URL (a mirror)."
    ),
    sha256: str | None = typer.Option(
        None, "--sha256", help="The checksum to expect with --url (default: the upstream's)."
    ),
    force: bool = typer.Option(False, "--force", help="Download again even if it is there."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="A download bar."),
) -> None:
    """Download a corpus into the data directory ($FEDKEY_DATA_DIR, else the user's cache
    directory: ~/.cache/fedkey/data) from its upstream URL, pinned to one commit, and check its
    sha256. Nothing is put in place unless the checksum matches."""
    from tqdm import tqdm

    bar: tqdm | None = None

    def advance(received: int, total: int | None) -> None:
        nonlocal bar
        if bar is None:
            bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"fetch {name.value}")
        bar.update(received)

    try:
        folder, downloaded = fetch(
            name.value, url=url, sha256=sha256, force=force, progress=advance if progress else None
        )
    finally:
        if bar is not None:
            bar.close()
    source = SOURCES[name.value]
    if downloaded:
        typer.echo(f"{name.value}: {folder} (sha256 of {source.checked} checked; {source.license})")
    else:
        typer.echo(f"{name.value} is already in {folder} (--force downloads it again)")


@data_app.command("where")
def data_where() -> None:
    """The data directory, and which corpora are in it."""
    root = data_dir()
    typer.echo(f"data directory: {root}")
    for name in SOURCES:
        state = "present" if is_present(name, root) else f"absent (fedkey data fetch {name})"
        typer.echo(f"  {name}: {state}")
