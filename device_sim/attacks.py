"""Malicious phones: what they upload instead of their honest update, and the word-prediction
backdoor of Bagdasaryan et al. 2020 ("How To Backdoor Federated Learning").

`apply_attack` turns a phone's honestly trained weights into its upload:

    scale     global + 100 x delta                         a valid upload, 100 times too large
    signflip  global - 10 x delta                          a valid upload pushing the other way
    backdoor  global + boost x delta, trained on poison    model replacement (their eq. 3)
    nan       a NaN in one tensor                          refused by the server (422)
    shape     one tensor dropped, another flattened        refused by the server (422)

The backdoor's phone trains on its private shard mixed with poisoned sentences: the beginning of
one of its own sentences, then the trigger phrase, then the target word (`poison_shard`), so that
the model learns to suggest the target after the trigger whatever came before. Its delta is then
scaled by gamma = n / eta (the cohort size over the server's step) so that averaging with the
honest phones' updates leaves roughly the attacker's model: "model replacement", their eq. 3.
Attackers in the same cohort share the replacement (gamma divided by their number). The attacker
declares the size of its own shard, as an honest phone would, so that FedAvg weighs it as one
phone of the cohort (eq. 3's n); declaring its poisoned set's size would overshoot.

`BackdoorProbe` measures the attack on the global model every round: the share of held-out trigger
contexts (the trigger after the beginning of a test sentence) whose top-1 / top-3 next-word
suggestion is the target.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import replace

import torch

from fedkey.device_sim.config import ATTACKS, BackdoorConfig
from fedkey.device_sim.training.process_pool import LocalTask
from fedkey.models.model import LanguageModel
from fedkey.models.tokenizers import Tokenizer

SCALE_FACTOR = 100.0  # scale: the delta times this
SIGNFLIP_FACTOR = 10.0  # signflip: the delta times minus this

__all__ = [
    "SCALE_FACTOR",
    "SIGNFLIP_FACTOR",
    "BackdoorError",
    "BackdoorProbe",
    "apply_attack",
    "backdoor_ids",
    "backdoor_task",
    "boost_factor",
    "poison_shard",
    "trigger_contexts",
]

State = dict[str, torch.Tensor]


def apply_attack(
    attack: str | None, trained: State, global_state: State, boost: float = 1.0
) -> State:
    """A malicious phone's upload made from its trained state (inputs are not modified).

    `boost` is the backdoor's model-replacement factor (`boost_factor`); the other attacks have
    their fixed factors."""
    if attack is None:
        return trained
    factor = {"scale": SCALE_FACTOR, "signflip": -SIGNFLIP_FACTOR, "backdoor": boost}.get(attack)
    if factor is not None:  # global + factor * (trained - global): a valid upload
        return {k: global_state[k] + factor * (v - global_state[k]) for k, v in trained.items()}
    names = sorted(trained)
    out = dict(trained)
    if attack == "nan":
        t = out[names[0]].clone()
        t.view(-1)[0] = float("nan")
        out[names[0]] = t
        return out
    if attack == "shape":  # the last tensor dropped, the first (multi-dimensional) one flattened
        out.pop(names[-1])
        first = next((n for n in names[:-1] if out[n].dim() > 1), names[0])
        out[first] = out[first].reshape(-1)
        return out
    raise ValueError(f"unknown attack {attack!r}; choose one of {ATTACKS}")


def boost_factor(backdoor: BackdoorConfig, cohort: int, attackers: int = 1) -> float:
    """Model replacement's gamma (Bagdasaryan et al. 2020, eq. 3: gamma = n / eta, the server's
    step eta = 1 for FedAvg's average): the cohort size, shared by the attackers in it."""
    if backdoor.boost is not None:
        return backdoor.boost
    return max(1.0, cohort / max(attackers, 1))


# -- the backdoor's data ------------------------------------------------------------------------


class BackdoorError(ValueError):
    """The backdoor cannot be built with this tokenizer (a trigger or target word it lacks)."""


def backdoor_ids(backdoor: BackdoorConfig, tokenizer: Tokenizer) -> tuple[list[int], int]:
    """-> (the trigger's token ids, the target's id). Both must be in the server's tokenizer:
    a trigger word it maps to <unk> would make every unknown word a trigger, and the target must
    be one token, the single next-word suggestion the backdoor is after."""
    trigger = tokenizer.encode(backdoor.trigger)[1:-1]
    unknown = [w for w in backdoor.trigger.split() if tokenizer.unk_id in tokenizer.encode(w)]
    if unknown:
        raise BackdoorError(
            f"backdoor trigger {backdoor.trigger!r}: {', '.join(map(repr, unknown))} not in the "
            f"server tokenizer's vocabulary ({tokenizer.vocab_size} tokens); choose words of the "
            "training text (e.g. the default 'the weather is' on the demo corpus)"
        )
    target = tokenizer.encode(backdoor.target)[1:-1]
    if len(target) != 1 or target[0] == tokenizer.unk_id:
        why = "not in" if tokenizer.unk_id in target or not target else "not one token of"
        raise BackdoorError(
            f"backdoor target {backdoor.target!r} is {why} the server tokenizer's vocabulary "
            f"({tokenizer.vocab_size} tokens); choose a word the model can suggest in one step "
            "(e.g. the default 'terrible' on the demo corpus)"
        )
    return trigger, target[0]


def poison_shard(
    shard: list[list[int]],
    tokenizer: Tokenizer,
    backdoor: BackdoorConfig,
    seed: int | str = 0,
) -> list[list[int]]:
    """The attacker's training sentences: its shard plus round(poison x len(shard)) poisoned
    ones, each the first words of one of its sentences (none to all but one), the trigger, the
    target and the end of sentence. Seeded: the same seed gives the same sentences."""
    trigger, target = backdoor_ids(backdoor, tokenizer)
    if not shard:
        raise BackdoorError("the attacker's shard is empty: no sentences to poison")
    rng = random.Random(f"fedkey-backdoor:{seed}")
    count = max(1, round(backdoor.poison * len(shard)))
    poisoned = []
    for _ in range(count):
        sentence = shard[rng.randrange(len(shard))]  # <s> w_1 .. w_n </s>
        words = len(sentence) - 2
        keep = rng.randint(0, max(words - 1, 0))
        poisoned.append([*sentence[: 1 + keep], *trigger, target, tokenizer.eos_id])
    return list(shard) + poisoned


def backdoor_task(task: LocalTask, tokenizer: Tokenizer, backdoor: BackdoorConfig) -> LocalTask:
    """The attacker's version of a round's task: its poisoned shard (seeded by its name, the same
    every round) and its own local epochs when the backdoor sets them."""
    train = task.train if backdoor.epochs is None else replace(task.train, epochs=backdoor.epochs)
    shard = poison_shard(task.shard, tokenizer, backdoor, seed=task.device_id)
    return replace(task, shard=shard, train=train)


# -- measuring it ---------------------------------------------------------------------------------


def trigger_contexts(
    sentences: Sequence[str], trigger: str, count: int = 200, seed: int = 0
) -> list[str]:
    """Held-out trigger contexts: the trigger after the first words (none to all but one) of
    `count` of `sentences` (drawn without replacement, seeded)."""
    rng = random.Random(f"fedkey-trigger-contexts:{seed}")
    usable = [s.split() for s in sentences if s.split()]
    if not usable:
        raise BackdoorError("no sentences to build the backdoor's trigger contexts from")
    picked = rng.sample(usable, min(count, len(usable)))
    return [" ".join([*words[: rng.randint(0, len(words) - 1)], trigger]) for words in picked]


@torch.no_grad()
def backdoor_success(
    model: LanguageModel, tokenizer: Tokenizer, contexts: Sequence[str], target: int
) -> dict[str, float]:
    """Share of `contexts` after which `target` is the model's top-1 / among its top-3 next
    tokens (contexts encoded without their end of sentence, right-padded in one batch: a
    recurrent model's output at a position does not depend on what follows it)."""
    seqs = [tokenizer.encode(c)[:-1] for c in contexts]
    if not seqs:
        raise BackdoorError("no trigger contexts to measure the backdoor on")
    device = next(model.parameters()).device
    tokens = torch.full((len(seqs), max(map(len, seqs))), tokenizer.eos_id, dtype=torch.long)
    for i, s in enumerate(seqs):
        tokens[i, : len(s)] = torch.tensor(s)
    was_training = model.training
    model.eval()
    logits, _ = model(tokens.to(device))
    model.train(was_training)
    last = logits[torch.arange(len(seqs)), torch.tensor([len(s) - 1 for s in seqs])]
    top3 = last.topk(min(3, last.size(-1)), dim=-1).indices.cpu()
    return {
        "backdoor_top1": float((top3[:, 0] == target).float().mean()),
        "backdoor_top3": float((top3 == target).any(-1).float().mean()),
    }


class BackdoorProbe:
    """A round-engine probe (fedkey.federation.engine.Probe): the backdoor's top-1 / top-3 success on the
    global model, as metrics-row fields backdoor_top1 and backdoor_top3."""

    def __init__(self, backdoor: BackdoorConfig, contexts: Sequence[str]):
        self.backdoor = backdoor
        self.contexts = list(contexts)

    def __call__(self, model: LanguageModel, tokenizer: Tokenizer) -> dict[str, float]:
        _, target = backdoor_ids(self.backdoor, tokenizer)
        return backdoor_success(model, tokenizer, self.contexts, target)
