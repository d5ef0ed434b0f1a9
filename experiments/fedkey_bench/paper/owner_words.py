"""Which words does a model predict worse? Test perplexity by how many phones typed the word.

    python -m fedkey_bench.paper.owner_words A.safetensors B.safetensors --data demo

Where phones hold their owners' own text (`--partition user`), a word that few owners type
reaches the server only in those owners' updates. A defence that judges each coordinate of an
update by the range of the round's others (fedkey.federation.influence.bounding's coordinate trim, which clamps
each coordinate to its range without the ceil(beta m) most extreme phones at each end) can
leave such a word's parameters where they were. This scores checkpoints on the held-out text,
token by token, and groups the tokens by the number of owners whose training text holds the
target word (end of sentence: every owner), so two models' gap shows where it lies.

The owners are the corpus's own (`Corpus.train_users`), as `--partition user` deals them; the
held-out text is cut as a run cuts it (`--paper-protocol`, `--seed`). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from fedkey_bench.common.markdown import markdown_table
from fedkey_bench.paper.tables import _f

if TYPE_CHECKING:
    from fedkey.models.tokenizers import Tokenizer


def owner_counts(train: Sequence[str], users: Sequence[str], encode) -> dict[int, int]:
    """Token id -> how many distinct users' training sentences hold it (`encode`: a tokenizer's,
    begin and end of sentence included, so they count for every user)."""
    holders: dict[int, set[str]] = {}
    for sentence, user in zip(train, users, strict=True):
        for tok in set(encode(sentence)):
            holders.setdefault(tok, set()).add(user)
    return {tok: len(who) for tok, who in holders.items()}


def bin_of(owners: int) -> str:
    """The table's group of a count: 0, 1, then powers of two (2-3, 4-7, ...)."""
    if owners < 2:
        return str(owners)
    low = 1 << (owners.bit_length() - 1)
    return f"{low}-{2 * low - 1}"


def _order(label: str) -> int:
    return int(label.split("-")[0])


def by_owners(
    nll_of: Sequence[tuple[int, float]], counts: dict[int, int]
) -> dict[str, tuple[int, float]]:
    """(target id, its NLL) per test token -> per owner-count group: (tokens, summed NLL)."""
    out: dict[str, tuple[int, float]] = {}
    for tok, nll in nll_of:
        label = bin_of(counts.get(tok, 0))
        n, total = out.get(label, (0, 0.0))
        out[label] = (n + 1, total + nll)
    return out


def token_nlls(checkpoint: Path, sentences: list[str]) -> tuple[list[tuple[int, float]], Tokenizer]:
    """Every held-out token's (target id, NLL) under the model of `checkpoint`, and its tokenizer."""
    import torch.nn.functional as F

    from fedkey.models.checkpoint import load_checkpoint
    from fedkey.models.metrics import token_log_probs

    model, tokenizer, _ = load_checkpoint(checkpoint)
    out: list[tuple[int, float]] = []
    for targets, logp in token_log_probs(model, tokenizer, sentences):
        nll = F.nll_loss(logp, targets, reduction="none")
        out += zip(targets.tolist(), nll.tolist(), strict=True)
    return out, tokenizer


def table(names: Sequence[str], groups: Sequence[dict[str, tuple[int, float]]], users: int) -> str:
    """One row per owner-count group: its share of the test tokens and each model's perplexity
    over them; a last row over every token."""
    labels = sorted({g for grp in groups for g in grp}, key=_order)
    total = sum(n for n, _ in groups[0].values())
    header = [f"owners (of {users}) who typed the word", "test tokens", "share",
              *(f"ppl: {n}" for n in names)]  # fmt: skip
    rows = []
    for label in labels:
        n = groups[0].get(label, (0, 0.0))[0]
        rows.append([label, n, f"{n / max(total, 1):.1%}",
                     *(_f(math.exp(g[label][1] / g[label][0])) if label in g else "-"
                       for g in groups)])  # fmt: skip
    rows.append(["all", total, "100.0%", *(_f(math.exp(sum(t for _, t in g.values()) / total))
                                           for g in groups)])  # fmt: skip
    return markdown_table(header, rows)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m fedkey_bench.paper.owner_words", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("checkpoints", nargs="+", type=Path, help="round_*.safetensors files")
    ap.add_argument("--data", default="demo", help="the corpus with owners (default: demo)")
    ap.add_argument("--seed", type=int, default=0, help="the runs' --seed (it cuts the demo)")
    ap.add_argument("--paper-protocol", action=argparse.BooleanOptionalAction, default=True,
                    help="cut the text as --paper-protocol does (default: on)")  # fmt: skip
    ap.add_argument(
        "--names", nargs="*", help="a column name per checkpoint (default: the run folder)"
    )
    args = ap.parse_args(argv)
    from fedkey.corpora.loaders import load_corpus

    corpus = load_corpus(args.data, paper_protocol=args.paper_protocol, seed=args.seed)
    if corpus.train_users is None:
        sys.exit(f"{args.data}: its training text has no owners; give a corpus with users (demo)")
    names = args.names or [p.parent.parent.name for p in args.checkpoints]
    if len(names) != len(args.checkpoints):
        sys.exit(f"--names: {len(names)} names for {len(args.checkpoints)} checkpoints")
    groups = []
    for path in args.checkpoints:
        if not path.is_file():
            sys.exit(f"{path}: no such checkpoint")
        nlls, tokenizer = token_nlls(path, corpus.test)
        counts = owner_counts(corpus.train, corpus.train_users, tokenizer.encode)  # its own ids
        groups.append(by_owners(nlls, counts))
    print(table(names, groups, len(set(corpus.train_users))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
