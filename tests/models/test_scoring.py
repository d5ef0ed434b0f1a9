"""fedkey.models.scoring: one ranking rule for the neural model (torch) and the n-grams (numpy)."""

import numpy as np
import torch

from fedkey.models.scoring import TOP, target_ranks

SPECIAL = [0, 1, 2]


def test_ranks_count_the_tokens_ahead_ties_to_the_lower_id_on_numpy_and_torch():
    scores = np.array(
        [
            [5.0, 0.0, 0.0, 1.0, 1.0, 1.0],  # <unk> first, then x y z tied: y is behind x
            [0.0, 0.0, 0.0, 1.0, 1.0, 1.0],  # z behind x and y
            [0.0, 0.0, 9.0, 3.0, 2.0, 1.0],  # x behind </s> only
            [0.0, 0.0, 0.0, 1.0, 1.0, np.nan],  # a NaN target ranks last
        ]
    )
    targets = np.array([4, 5, 3, 5])
    rank, bar = target_ranks(scores, targets, SPECIAL)
    assert rank[:3].tolist() == [2, 2, 1] and bar[:3].tolist() == [1, 2, 0]
    assert rank[3] >= TOP and bar[3] >= TOP
    t_rank, t_bar = target_ranks(torch.tensor(scores), torch.tensor(targets), SPECIAL)
    assert (t_rank.tolist(), t_bar.tolist()) == (rank.tolist(), bar.tolist())


def test_ranks_past_the_top_three_stay_past_it():
    scores = np.array([[0.0, 0.0, 0.0, 4.0, 3.0, 2.0, 1.0, 1.0]])
    rank, bar = target_ranks(scores, np.array([7]), SPECIAL)  # behind 4 words, tied with one
    assert rank[0] >= TOP and bar[0] >= TOP
