"""A small Chit-Chat dataset in the package's layout, and a tiny base model pretrained on it, for
the tests of `--data chitchat`, `fedkey pretrain` and `--init` (the real dataset takes seconds to
read)."""

from __future__ import annotations

import json
import random
from pathlib import Path

from fedkey.common.config import DataConfig, TrainConfig
from fedkey.models.config import ModelConfig

#: The public chat the small dataset is made of: everyday words, none of them rare.
PHRASES = (
    "hey how are you doing today ?",
    "i am good thanks , and you ?",
    "not bad , just got back from work",
    "what are you up to this weekend ?",
    "i think i will go see a movie",
    "that sounds fun , which one ?",
    "no idea yet , maybe something funny",
    "haha nice , let me know how it is",
    "do you like to cook ?",
    "yes i love making pasta at home",
)
ENDINGS = ("", " lol", " for real", " !", " haha")


def chitchat_json(path: Path, senders: int = 40, conversations: int = 60, seed: int = 0) -> Path:
    """A dataset.json of `conversations` between pairs of `senders` (ids like the real ones'),
    turns of one to three messages, in the package's layout."""
    rng = random.Random(seed)
    people = [f"{rng.getrandbits(128):032x}" for _ in range(senders)]
    data = {}
    for c in range(conversations):
        pair = rng.sample(people, 2)
        turns = []
        for t in range(rng.randint(4, 10)):
            stamp = f"2018-05-{1 + c % 28:02d}T{t // 60:02d}:{t % 60:02d}:00Z"
            messages = [
                {
                    "text": (rng.choice(PHRASES) + rng.choice(ENDINGS)).capitalize(),
                    "timestamp": stamp,
                    "sender": pair[t % 2],
                }
                for _ in range(rng.randint(1, 3))
            ]
            turns.append(messages)
        data[f"conversation-{c}"] = {"messages": turns}
    path.write_text(json.dumps(data))
    return path


def tiny(vocab_size: int) -> ModelConfig:
    """A 16-unit GRU."""
    return ModelConfig(vocab_size=vocab_size, emb_size=16, hidden_size=16)


#: How the tests pretrain: the small dataset's pretraining senders, a small vocabulary.
DATA = DataConfig(data="chitchat", vocab_size=200, max_eval_sentences=40)
TRAIN = TrainConfig(batch_size=10, lr=0.5, precision="fp32")


def tiny_base(root: Path) -> Path:
    """A base model (fedkey pretrain, one epoch) of a small Chit-Chat dataset written in `root`,
    read in place of the installed one; -> its path, ROOT/run/base.safetensors."""
    import pytest

    from fedkey.corpora import chitchat
    from fedkey.runners.pretrain import PretrainConfig, pretrain

    path = chitchat_json(root / "dataset.json")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(chitchat, "dataset_path", lambda: path)
        config = PretrainConfig(
            DATA, TRAIN, tiny, str(root / "run"), 1, "cpu", ksr_sentences=0, progress=False
        )
        _, base = pretrain(config)
    return base
