"""Ubuntu IRC chat: real typed messages from the #ubuntu channel (2004-2018), one phone per nickname.

The raw logs of the IRC disentanglement data: Jonathan K. Kummerfeld et al. (2019). A Large-Scale
Corpus for Conversation Disentanglement. ACL 2019 (github.com/jkkummerfeld/irc-disentanglement,
``data/{train,dev,test}/*.raw.txt``; CC BY 4.0; `fedkey data fetch ubuntu-irc` downloads them,
:mod:`fedkey.corpora.datadir`). Their own train/dev/test split is of conversations, not of people: here
all 173 files are one pool of messages, cut by :mod:`fedkey.corpora.senders`' rules.

A log line is ``[HH:MM] <nick> text`` for a message. What is not a message is dropped: ``=== ...``
system lines (joins, quits, nick changes), ``* nick ...`` action lines, the channel's bots
(ubottu, ubotu, ubot3, FloodBot1, ...) and the commands people send them (``!info vlc``). A
message that begins by addressing someone who speaks in the same log (``bob2: try this``,
``Matt|, oh k``) has that nickname replaced by :data:`NAME`: a keyboard can suggest that a name
comes, not which. A message's time is its file's date and its line in the file.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

from fedkey.common.text import normalize_text
from fedkey.corpora.loaders import Corpus
from fedkey.corpora.senders import Message, SenderRules, sender_corpus

__all__ = ["NAME", "is_bot", "load_ubuntu_irc", "log_files", "read_log", "read_messages"]

#: The token that stands for the nickname a message addresses.
NAME = "<name>"

_LINE = re.compile(r"\[(\d\d):(\d\d)\] <([^>\s]+)> ?(.*)")
_BOT = re.compile(r"(?:ubot+u|lubotu|ubot\d+|floodbot\d*)", re.I)
_ADDRESS = re.compile(r"(\S+?)[:,](?:\s+|$)(.*)", re.S)
_COMMAND = re.compile(r"!\w")


def is_bot(nick: str) -> bool:
    """The channel's bots: ubottu/ubotu (factoids), ubot2..5, FloodBot1..4 (flood warnings)."""
    return _BOT.fullmatch(nick) is not None


def log_files(path: str | Path) -> list[Path]:
    """The ``*.raw.txt`` logs under ``path`` (its train/dev/test folders, or itself), by name:
    the name starts with the log's date, so this is time order."""
    root = Path(path).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(f"Ubuntu IRC directory not found: {root}")
    files = sorted(root.glob("*/*.raw.txt"), key=lambda p: (p.name, str(p))) or sorted(
        root.glob("*.raw.txt")
    )
    if not files:
        raise FileNotFoundError(f"{root} holds no *.raw.txt logs (nor train/, dev/, test/ of them)")
    return files


def read_log(lines: list[str]) -> Iterator[tuple[int, str, str]]:
    """The messages of one log: (line number, nick, text as typed with its address replaced);
    system, action and bot lines and bot commands left out."""
    parsed = [
        (i, m.group(3), m.group(4)) for i, line in enumerate(lines) if (m := _LINE.match(line))
    ]
    speakers = {nick.casefold() for _, nick, _ in parsed}
    for i, nick, text in parsed:
        text = text.strip()
        if is_bot(nick) or not text or _COMMAND.match(text):
            continue
        address = _ADDRESS.match(text)
        if address and address.group(1).casefold() in speakers:
            text = f"{NAME} {address.group(2)}"
        yield i, nick, text


def read_messages(path: str | Path) -> Iterator[Message]:
    """Every message of the logs under ``path``, normalized (the address token kept whole)."""
    for order, f in enumerate(log_files(path)):
        for i, nick, text in read_log(f.read_text(encoding="utf-8", errors="replace").splitlines()):
            named = text.startswith(NAME + " ")
            rest = normalize_text(text[len(NAME) + 1 :] if named else text)
            if rest:
                yield Message(nick, (order, i), f"{NAME} {rest}" if named else rest)


def load_ubuntu_irc(path: str | Path, seed: int = 0, rules: SenderRules = SenderRules()) -> Corpus:
    """The Ubuntu IRC logs under ``path`` (holding train/, dev/, test/), one phone per nickname."""
    return sender_corpus("ubuntu-irc", read_messages(path), rules, seed)
