"""The NUS SMS Corpus (English): real text messages typed on phones, one phone per sender.

Tao Chen and Min-Yen Kan (2013). Creating a Live, Public Short Message Service Corpus: The NUS SMS
Corpus. Language Resources and Evaluation 47(2):299-355. The release of 2015-03-09, as its authors
ship it (github.com/WING-NUS/nus-sms-corpus, ``smsCorpus_en_xml_2015.03.09_all.zip``; `fedkey data
fetch nus-sms` downloads it, :mod:`fedkey.corpora.datadir`): 55,835 messages from 343 anonymized senders.

The XML is read straight from the zip, one ``<message>`` at a time (``iterparse``; about a second
for its 44 MB): the sender is ``source/userProfile/userID``, the time ``messageProfile/@time``
(three spellings: ``2010.10.24 11:59[:06]``, ``1/18/2011 8:23:20 PM``, and a few with no space
before the hour; ``unknown`` for the 2003 collection, which keeps the file's order), the text
``text``, through :func:`fedkey.common.text.normalize_text`. The rest is :mod:`fedkey.corpora.senders`' rules.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
import zipfile
from collections.abc import Iterator
from pathlib import Path

from fedkey.common.text import normalize_text
from fedkey.corpora.loaders import Corpus
from fedkey.corpora.senders import Message, SenderRules, sender_corpus

__all__ = ["ZIP_NAME", "find_zip", "load_nus_sms", "parse_time", "read_messages"]

ZIP_NAME = "smsCorpus_en_xml_2015.03.09_all.zip"

_DOTTED = re.compile(r"(\d{4})\.(\d{1,2})\.(\d{1,2})\s*(\d{1,2}):(\d{2})(?::(\d{2}))?")
_US = re.compile(r"(\d{1,2})/(\d{1,2})/(\d{4})\s+(\d{1,2}):(\d{2})(?::(\d{2}))?\s*([AP]M)?", re.I)


def parse_time(value: str | None) -> tuple[int, ...]:
    """``(year, month, day, hour, minute, second)`` of a ``messageProfile`` time; ``()`` when it
    is unknown or unreadable."""
    if not value:
        return ()
    if m := _DOTTED.match(value.strip()):
        y, mo, d, h, mi, s = m.groups()
        return (int(y), int(mo), int(d), int(h), int(mi), int(s or 0))
    if m := _US.match(value.strip()):
        mo, d, y, h, mi, s, half = m.groups()
        hour = int(h)
        if half:  # 12:05 AM is 00:05, 12:05 PM is 12:05
            hour = hour % 12 + (12 if half.upper() == "PM" else 0)
        return (int(y), int(mo), int(d), hour, int(mi), int(s or 0))
    return ()


def find_zip(path: str | Path) -> Path:
    """The corpus zip: ``path`` itself, or the one zip of the release inside directory ``path``."""
    p = Path(path).expanduser()
    if p.is_dir():
        found = sorted(p.glob("smsCorpus_en_xml_*.zip"))
        if not found:
            raise FileNotFoundError(f"{p} holds no smsCorpus_en_xml_*.zip (expected {ZIP_NAME})")
        return found[-1]
    if not p.is_file():
        raise FileNotFoundError(f"NUS SMS zip not found: {p}")
    return p


def read_messages(path: str | Path) -> Iterator[Message]:
    """Every message of the zip (or its directory), in the file's order, its text normalized."""
    with zipfile.ZipFile(find_zip(path)) as z:
        xml_names = [n for n in z.namelist() if n.endswith(".xml")]
        if len(xml_names) != 1:
            raise ValueError(f"{path}: expected one .xml file in the zip, found {xml_names}")
        with z.open(xml_names[0]) as f:
            for _event, elem in ET.iterparse(f, events=("end",)):
                if elem.tag != "message":
                    continue
                sender = elem.findtext("source/userProfile/userID")
                profile = elem.find("messageProfile")
                text = normalize_text(elem.findtext("text") or "")
                if sender is not None and text:
                    when = parse_time(profile.get("time") if profile is not None else None)
                    yield Message(sender.strip(), when, text)
                elem.clear()


def load_nus_sms(path: str | Path, seed: int = 0, rules: SenderRules = SenderRules()) -> Corpus:
    """The NUS SMS corpus at ``path`` (the zip or its directory), one phone per sender."""
    return sender_corpus("nus-sms", read_messages(path), rules, seed)
