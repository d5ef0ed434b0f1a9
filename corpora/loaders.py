"""Corpora for the simulated phones: one in-memory data model and loaders for every layout we read.

Every loader returns a :class:`Corpus`: three lists of items (one sentence or message per item,
tokens separated by single spaces) plus, where the corpus has natural owners, the owner of every
training item. Tokenization into ids (start/end tokens, vocabulary) happens later, in ``models/``.

Layouts (see :func:`load_corpus` for the dispatch):

* ``"demo"``: the embedded, generated demo corpus (:mod:`fedkey.corpora.demo`), the default.
* ``"chitchat"``, ``"chitchat-heldout"``: public chat to pretrain on, and the senders held out of
  it (:mod:`fedkey.corpora.chitchat`; shipped by the ``chitchat-dataset`` package).
* ``"nus-sms"``, ``"ubuntu-irc"``: the real per-sender corpora in the data directory
  (:mod:`fedkey.corpora.datadir`), read by :mod:`fedkey.corpora.nus_sms` and :mod:`fedkey.corpora.ubuntu_irc`; a
  directory laid out as theirs (the NUS zip; ``train/*.raw.txt`` logs) loads the same way.
* a directory with ``train.txt``, ``valid.txt``, ``test.txt`` (PTB, WikiText-2): :func:`load_text_dir`.
  Read as is (already tokenized), or with the seed papers' preprocessing (``paper_protocol=True``).
* a ``.jsonl`` file of ``{"user": ..., "text": ...}`` lines: :func:`load_jsonl`.
* a Stack Exchange ``Posts.xml`` (or a directory holding one): :func:`load_stackexchange_posts`.
* any other directory of ``<user>.txt`` files, one message per line: :func:`load_user_dir`.

Raw user text (jsonl, user directories, Stack Exchange) goes through :func:`normalize_text`; the
text-directory corpora are already tokenized and are not touched apart from whitespace.
"""

from __future__ import annotations

import json
import random
import re
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

from fedkey.common.text import is_terminator, is_word, normalize_text

__all__ = [
    "ACCEPTED_LAYOUTS",
    "CHITCHAT_CORPORA",
    "NAMED_CORPORA",
    "Corpus",
    "article_starts",
    "load_corpus",
    "load_jsonl",
    "load_stackexchange_posts",
    "load_text_dir",
    "load_user_dir",
    "normalize_text",
    "split_sentences",
    "split_user_messages",
]


@dataclass
class Corpus:
    """A language-modelling corpus split three ways.

    Items are sentences or messages whose tokens are separated by single spaces. ``train_users``
    gives the owner of each training item (same length as ``train``), or is ``None`` when the
    corpus has no natural users (PTB, WikiText-2). ``train_articles`` gives the article of each
    training item where the text is made of articles (WikiText-2: :func:`article_starts`), so a
    partition can give each phone whole articles (``fedkey.corpora.partition.by_article``).
    ``unseen_test`` holds the messages of held-out senders who never train (the real per-sender
    corpora, :mod:`fedkey.corpora.senders`), ``unseen_users`` their owners; ``None`` elsewhere.
    ``valid_users`` / ``test_users`` give the owner of each validation / test item where the
    corpus knows it (the per-sender corpora), so the held-out text can be cut to the senders who
    have a phone (:func:`fedkey.corpora.dataset.load_cut`).
    """

    name: str
    train: list[str]
    valid: list[str]
    test: list[str]
    train_users: list[str] | None = None
    train_articles: list[str] | None = None
    unseen_test: list[str] | None = None
    unseen_users: list[str] | None = None
    valid_users: list[str] | None = None
    test_users: list[str] | None = None

    def __post_init__(self) -> None:
        checks = (
            ("train_users", self.train_users, "train", self.train),
            ("train_articles", self.train_articles, "train", self.train),
            ("unseen_users", self.unseen_users, "unseen_test", self.unseen_test or []),
            ("valid_users", self.valid_users, "valid", self.valid),
            ("test_users", self.test_users, "test", self.test),
        )
        for label, labels, split, items in checks:
            if labels is not None and len(labels) != len(items):
                raise ValueError(
                    f"corpus {self.name!r}: {label} has {len(labels)} entries "
                    f"but {split} has {len(items)} items"
                )

    @property
    def users(self) -> list[str]:
        """Distinct owners of the training items in first-appearance order ([] without users)."""
        return list(dict.fromkeys(self.train_users)) if self.train_users is not None else []

    def num_words(self, split: str = "train") -> int:
        """Number of whitespace tokens in one split ("train", "valid" or "test")."""
        return sum(len(item.split()) for item in getattr(self, split))


# --------------------------------------------------------------------------------------------
# Normalization of raw text
# --------------------------------------------------------------------------------------------


def _has_word(tokens: Iterable[str]) -> bool:
    return any(is_word(t) for t in tokens)


def split_sentences(text: str) -> list[str]:
    """Split normalized text into sentences after ``.``, ``!``, ``?`` tokens (and runs of them).

    The terminator stays at the end of its sentence; pieces without any word (a lone "...") are
    dropped. ``"hi . how are you ? ok"`` -> ``["hi .", "how are you ?", "ok"]``.
    """
    sentences: list[str] = []
    current: list[str] = []
    tokens = text.split()
    for i, tok in enumerate(tokens):
        current.append(tok)
        nxt = tokens[i + 1] if i + 1 < len(tokens) else ""
        if is_terminator(tok) and not is_terminator(nxt):
            if _has_word(current):
                sentences.append(" ".join(current))
            current = []
    if current and _has_word(current):
        sentences.append(" ".join(current))
    return sentences


# --------------------------------------------------------------------------------------------
# Text directories: PTB, WikiText-2
# --------------------------------------------------------------------------------------------

_SPLITS = ("train", "valid", "test")


def _read_lines(path: Path) -> list[str]:
    with path.open(encoding="utf-8") as f:
        return f.read().splitlines()


def _paper_sentences(line: str) -> list[str]:
    """The seed authors' preprocessing of one line (fed-att ``DatasetLM``): split on " . ",
    lowercase, drop empty pieces. The period tokens between sentences disappear (the end token
    the tokenizer adds replaces them). The line is padded with a space on each side so that a
    final " ." is split off even when the file has no trailing space (the authors' files do)."""
    return [" ".join(piece.lower().split()) for piece in f" {line} ".split(" . ") if piece.strip()]


_TITLE = re.compile(r"^= [^=].* =$")  # matched on the stripped line


def article_starts(lines: Sequence[str]) -> list[int]:
    """The line numbers at which a WikiText article begins: a level-1 heading ``" = Title = "``
    with a blank line before and after it.

    WikiText (Merity et al. 2016) keeps each Wikipedia article whole, its title as a level-1
    heading and its sections as ``" = = Section = = "``. A few tables inside articles also
    render as level-1 lines (a hockey legend's ``" = Goals ; A = "``), but those sit between
    text lines, never between blank ones: this rule finds WikiText-2's 600 / 60 / 60 articles
    exactly (train / valid / test) where the pattern alone finds 629 in train.
    """
    return [
        i
        for i, line in enumerate(lines)
        if _TITLE.match(line.strip())
        and (i == 0 or not lines[i - 1].strip())
        and (i + 1 == len(lines) or not lines[i + 1].strip())
    ]


def load_text_dir(
    path: str | Path, paper_protocol: bool = False, *, drop_headings: bool = False
) -> Corpus:
    """Load a directory holding ``train.txt``, ``valid.txt`` and ``test.txt`` (PTB, WikiText-2).

    Standard protocol (``paper_protocol=False``): every non-empty line is one item, with its
    whitespace collapsed to single spaces; case and ``<unk>`` are kept. WikiText section headings
    (``= = Gameplay = =``) are kept by default, because the usual WikiText-2 protocol (and the
    token counts the seed papers report: 2,088,628 = words + one end token per line) keeps them;
    ``drop_headings=True`` removes lines that start and end with ``=``.

    Seed protocol (``paper_protocol=True``): each line is lowercased and split on ``" . "`` into
    sentences; empty pieces are dropped. Start/end tokens are added later by the tokenizer.

    Where the training text has article titles (:func:`article_starts`; WikiText-2, not PTB),
    ``train_articles`` names the article of every training item (``"0007 Nebraska Highway 88"``:
    its order in the file and its title), the title line included in its own article.

    PTB, standard protocol: 42,068 / 3,370 / 3,761 items and 887,521 / 70,390 / 78,669 words.
    """
    root = Path(path).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(f"text corpus directory not found: {root}")
    missing = [f"{s}.txt" for s in _SPLITS if not (root / f"{s}.txt").is_file()]
    if missing:
        raise FileNotFoundError(
            f"text corpus directory {root} lacks {', '.join(missing)} "
            "(expected train.txt, valid.txt and test.txt)"
        )
    splits: dict[str, list[str]] = {}
    articles: list[str] = []
    for split in _SPLITS:
        items: list[str] = []
        lines = _read_lines(root / f"{split}.txt")
        starts = article_starts(lines) if split == "train" else []
        title_of = {line: f"{k:04d} {lines[line].strip()[2:-2]}" for k, line in enumerate(starts)}
        article = ""  # text before the first title, if any, is an article of its own
        for i, line in enumerate(lines):
            article = title_of.get(i, article)
            stripped = line.strip()
            if not stripped:
                continue
            if drop_headings and len(stripped) > 1 and stripped[0] == "=" == stripped[-1]:
                continue
            before = len(items)
            if paper_protocol:
                items.extend(_paper_sentences(line))
            else:
                items.append(" ".join(stripped.split()))
            if split == "train":
                articles += [article] * (len(items) - before)
        splits[split] = items
    return Corpus(
        name=root.name,
        train=splits["train"],
        valid=splits["valid"],
        test=splits["test"],
        train_articles=articles if any(articles) else None,
    )


# --------------------------------------------------------------------------------------------
# Corpora with users
# --------------------------------------------------------------------------------------------


def _check_fracs(valid_frac: float, test_frac: float) -> None:
    if not (0 <= valid_frac < 1 and 0 <= test_frac < 1 and valid_frac + test_frac < 1):
        raise ValueError(
            f"valid_frac={valid_frac} and test_frac={test_frac} must be in [0, 1) with a sum "
            "below 1 (what remains is the training share)"
        )


def _interleave(groups: Sequence[Sequence[str]], owners: Sequence[str]) -> tuple[list, list]:
    """Round-robin over the users: item 0 of every user, then item 1 of every user, ..."""
    items: list[str] = []
    users: list[str] = []
    longest = max((len(g) for g in groups), default=0)
    for i in range(longest):
        for group, owner in zip(groups, owners, strict=True):
            if i < len(group):
                items.append(group[i])
                users.append(owner)
    return items, users


def split_user_messages(
    messages_by_user: Mapping[str, Sequence[str]],
    seed: int,
    valid_frac: float = 0.1,
    test_frac: float = 0.1,
    name: str = "users",
) -> Corpus:
    """Split each user's messages into train/valid/test and build a :class:`Corpus`.

    Per user with n messages: ``floor(n * valid_frac)`` go to valid and ``floor(n * test_frac)``
    to test, chosen by a shuffle seeded with ``(seed, user)`` (so one user's split does not
    depend on the others), always leaving at least one message in train: every user with a
    message appears in train. Inside a split, a user's messages keep their original order.
    The splits interleave the users round-robin (first message of every user, then the second,
    ...), so cutting a prefix (fedkey.corpora.dataset.load_cut's caps) keeps all users. Empty messages are dropped;
    users left with none are skipped.
    """
    _check_fracs(valid_frac, test_frac)
    owners: list[str] = []
    parts: dict[str, list[list[str]]] = {s: [] for s in _SPLITS}
    for user, raw in messages_by_user.items():
        msgs = [m for m in raw if m]
        n = len(msgs)
        if n == 0:
            continue
        n_valid = int(n * valid_frac + 1e-9)
        n_test = int(n * test_frac + 1e-9)
        while n_valid + n_test > n - 1:  # keep one training message
            if n_test >= n_valid:
                n_test -= 1
            else:
                n_valid -= 1
        order = list(range(n))
        random.Random(f"{seed}/{user}").shuffle(order)
        chosen = {
            "valid": sorted(order[:n_valid]),
            "test": sorted(order[n_valid : n_valid + n_test]),
            "train": sorted(order[n_valid + n_test :]),
        }
        owners.append(str(user))
        for split in _SPLITS:
            parts[split].append([msgs[i] for i in chosen[split]])
    train, train_users = _interleave(parts["train"], owners)
    valid, _ = _interleave(parts["valid"], owners)
    test, _ = _interleave(parts["test"], owners)
    return Corpus(name=name, train=train, valid=valid, test=test, train_users=train_users)


def load_user_dir(
    path: str | Path, seed: int = 0, valid_frac: float = 0.1, test_frac: float = 0.1
) -> Corpus:
    """Load a directory with one ``<user>.txt`` per user, one message per line.

    The user id is the file stem; files are read in sorted name order. Every line goes through
    :func:`normalize_text`; blank lines are skipped. Per-user split: :func:`split_user_messages`.
    """
    root = Path(path).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(f"user corpus directory not found: {root}")
    files = sorted(p for p in root.glob("*.txt") if p.is_file())
    if not files:
        raise ValueError(f"{root} holds no .txt files; {ACCEPTED_LAYOUTS}")
    by_user: dict[str, list[str]] = {}
    for f in files:
        msgs = [normalize_text(line) for line in _read_lines(f)]
        by_user[f.stem] = [m for m in msgs if m]
    return split_user_messages(by_user, seed, valid_frac, test_frac, name=root.name)


def load_jsonl(
    path: str | Path, seed: int = 0, valid_frac: float = 0.1, test_frac: float = 0.1
) -> Corpus:
    """Load a JSON-lines file of ``{"user": ..., "text": ...}`` objects, one message each.

    User ids are turned into strings and kept in first-appearance order; text goes through
    :func:`normalize_text`; blank lines are skipped. Per-user split: :func:`split_user_messages`.
    """
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"jsonl corpus not found: {p}")
    by_user: dict[str, list[str]] = {}
    for lineno, line in enumerate(_read_lines(p), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{p}:{lineno}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict) or "user" not in obj or not isinstance(obj.get("text"), str):
            raise ValueError(
                f'{p}:{lineno}: expected an object {{"user": ..., "text": "..."}}, got {line[:80]!r}'
            )
        text = normalize_text(obj["text"])
        if text:
            by_user.setdefault(str(obj["user"]), []).append(text)
    if not by_user:
        raise ValueError(f"{p} holds no messages")
    return split_user_messages(by_user, seed, valid_frac, test_frac, name=p.stem)


# --------------------------------------------------------------------------------------------
# Stack Exchange Posts.xml
# --------------------------------------------------------------------------------------------

_BLOCK_TAGS = frozenset("p br div li ul ol blockquote h1 h2 h3 h4 h5 h6 hr tr table pre".split())
_SKIP_TAGS = frozenset({"pre", "script", "style"})
_URL_RE = re.compile(r"(?:https?://|www\.)\S+", re.IGNORECASE)


class _HTMLText(HTMLParser):
    """Collect the visible text of a post body: block tags become line breaks, ``<pre>`` code
    blocks are skipped, link texts are kept, character references are decoded."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self._skip = 0

    def handle_starttag(self, tag: str, attrs: list) -> None:
        if tag in _SKIP_TAGS:
            self._skip += 1
        if tag in _BLOCK_TAGS:
            self.parts.append("\n")

    def handle_endtag(self, tag: str) -> None:
        if tag in _SKIP_TAGS and self._skip:
            self._skip -= 1
        if tag in _BLOCK_TAGS:
            self.parts.append("\n")

    def handle_data(self, data: str) -> None:
        if not self._skip:
            self.parts.append(data)


def html_to_text(html: str) -> str:
    """Visible text of an HTML fragment, one line per block element (stdlib html.parser)."""
    parser = _HTMLText()
    parser.feed(html)
    parser.close()
    return "".join(parser.parts)


def _text_sentences(text: str) -> list[str]:
    out: list[str] = []
    for block in text.splitlines():
        block = _URL_RE.sub(" ", block)
        out.extend(split_sentences(normalize_text(block)))
    return out


def load_stackexchange_posts(
    path: str | Path,
    seed: int = 0,
    valid_frac: float = 0.1,
    test_frac: float = 0.1,
    *,
    include_titles: bool = True,
    post_types: Iterable[int] = (1, 2),
) -> Corpus:
    """Load a Stack Exchange data-dump ``Posts.xml`` as a per-user corpus of sentences.

    Keeps questions and answers (``PostTypeId`` 1 and 2; tag-wiki rows are community text, not a
    person's typing) that have an ``OwnerUserId``. The HTML body is reduced to its visible text
    (code blocks and URLs removed), normalized, and split into sentences at ``.``/``!``/``?``;
    a question's title counts as one more sentence of its owner (``include_titles``). The user id
    is ``OwnerUserId``. Per-user split of the sentences: :func:`split_user_messages`.
    """
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / "Posts.xml"
    if not p.is_file():
        raise FileNotFoundError(f"Stack Exchange Posts.xml not found: {p}")
    wanted = {str(t) for t in post_types}
    by_user: dict[str, list[str]] = {}
    for _event, elem in ET.iterparse(p, events=("end",)):
        if elem.tag != "row":
            continue
        attrs = elem.attrib
        owner = attrs.get("OwnerUserId")
        if owner and attrs.get("PostTypeId") in wanted:
            sentences: list[str] = []
            if include_titles and attrs.get("Title"):
                sentences.extend(_text_sentences(attrs["Title"]))
            sentences.extend(_text_sentences(html_to_text(attrs.get("Body", ""))))
            if sentences:
                by_user.setdefault(owner, []).extend(sentences)
        elem.clear()
    if not by_user:
        raise ValueError(f"{p} holds no posts with an OwnerUserId")
    name = p.parent.name or "stackexchange"
    return split_user_messages(by_user, seed, valid_frac, test_frac, name=name)


# --------------------------------------------------------------------------------------------
# Dispatch and helpers
# --------------------------------------------------------------------------------------------

ACCEPTED_LAYOUTS = (
    "accepted corpus specs: 'demo' (the built-in demo corpus); 'chitchat' or 'chitchat-heldout' "
    "(public chat: the pretraining senders, the others); 'nus-sms' or 'ubuntu-irc' (real "
    "corpora in the data directory: fedkey data fetch); a directory with train.txt, "
    'valid.txt and test.txt (PTB, WikiText-2); a .jsonl file of {"user": ..., "text": ...} '
    "lines; a Stack Exchange Posts.xml file or a directory containing Posts.xml; a directory of "
    "<user>.txt files with one message per line"
)


#: The real corpora named by a word (their folder in the data directory, fedkey.corpora.datadir).
NAMED_CORPORA = ("nus-sms", "ubuntu-irc")

#: The two parts of the Chit-Chat dataset (fedkey.corpora.chitchat), installed with fedkey: its
#: pretraining senders and those held out of pretraining.
CHITCHAT_CORPORA = ("chitchat", "chitchat-heldout")


def _load_sender_corpus(path: Path, name: str, seed: int) -> Corpus:
    if name == "nus-sms":
        from fedkey.corpora.nus_sms import load_nus_sms

        return load_nus_sms(path, seed=seed)
    from fedkey.corpora.ubuntu_irc import load_ubuntu_irc

    return load_ubuntu_irc(path, seed=seed)


def load_corpus(spec: str | Path, paper_protocol: bool = False, seed: int = 0) -> Corpus:
    """Load a corpus from a spec string; see ``ACCEPTED_LAYOUTS`` for what a spec may name.

    ``"demo"`` always means the embedded demo corpus (write ``./demo`` for a directory of that
    name), and ``"nus-sms"`` / ``"ubuntu-irc"`` the corpora of the data directory
    (:class:`fedkey.corpora.datadir.MissingCorpus` when they are not there). ``paper_protocol`` applies to text directories only (the other corpora are normalized
    text already); ``seed`` drives the generated demo corpus and the per-user splits.
    Raises FileNotFoundError for a path that does not exist and ValueError for one that matches
    no layout, both naming the accepted layouts.
    """
    if isinstance(spec, str) and spec.strip() == "demo":
        from fedkey.corpora.demo import demo_corpus

        return demo_corpus(seed=seed)
    if isinstance(spec, str) and spec.strip() in CHITCHAT_CORPORA:
        from fedkey.corpora.chitchat import load_chitchat

        return load_chitchat(spec.strip(), seed=seed)
    if isinstance(spec, str) and spec.strip() in NAMED_CORPORA:
        from fedkey.corpora.datadir import corpus_path

        return _load_sender_corpus(corpus_path(spec.strip()), spec.strip(), seed)
    p = Path(spec).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"corpus {str(spec)!r} not found; {ACCEPTED_LAYOUTS}")
    if p.is_dir():
        if any(p.glob("smsCorpus_en_xml_*.zip")):
            return _load_sender_corpus(p, "nus-sms", seed)
        if any(p.glob("train/*.raw.txt")):
            return _load_sender_corpus(p, "ubuntu-irc", seed)
        if (p / "train.txt").is_file():
            return load_text_dir(p, paper_protocol=paper_protocol)
        if (p / "Posts.xml").is_file():
            return load_stackexchange_posts(p / "Posts.xml", seed=seed)
        if any(f.is_file() for f in p.glob("*.txt")):
            return load_user_dir(p, seed=seed)
        raise ValueError(f"directory {p} matches no corpus layout; {ACCEPTED_LAYOUTS}")
    if p.suffix.lower() == ".jsonl":
        return load_jsonl(p, seed=seed)
    if p.name.lower() == "posts.xml":
        return load_stackexchange_posts(p, seed=seed)
    raise ValueError(f"file {p} matches no corpus layout; {ACCEPTED_LAYOUTS}")
