"""Differential privacy: one class per mechanism behind one interface, their accountants, the clip
rule and the server's secret.

    round.py          RoundPrivacy: what the round engine composes (a mechanism and a clip rule)
    mechanism.py      NoiseMechanism, the interface; NoPrivacy; what the DP mechanisms share
    dp_fedavg.py      the gaussian mechanism (DP-FedAvg) with the RDP accountant
    ftrl.py           DP-FTRL's mechanisms: the tree and BLT, under minimum separation
    tree.py, blt.py   their correlated noise and zCDP accounting
    gaussian.py       Gaussian noise, the seed papers' client-side randomization, the RDP accountant
    clipping.py       the clip rule: fixed, or adaptive (adaptive_clip.py, Andrew et al. 2021)
    calibrate.py      the noise multiplier that ends the planned rounds at --dp-target-epsilon
    secret.py         the 256-bit server secret every DP draw comes from
"""
