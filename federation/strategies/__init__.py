"""Aggregation strategies: ``get_strategy(name, **options)`` builds one.

Names: fedsgd, fedavg, fedatt, fedattopt, fedmed, and adafl (FedAvg with the AdaFL selector).
The pure arithmetic is in :mod:`fedkey.federation.strategies.aggregate`, selection in
:mod:`fedkey.federation.strategies.selection`.
"""

from __future__ import annotations

import inspect
from typing import Any

from fedkey.federation.strategies.base import Bound, ClientUpdate, Info, Strategy
from fedkey.federation.strategies.methods import AdaFL, FedAtt, FedAttOpt, FedAvg, FedMed, FedSGD

STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls for cls in (FedSGD, FedAvg, FedAtt, FedAttOpt, FedMed, AdaFL)
}

__all__ = [
    "STRATEGIES",
    "AdaFL",
    "Bound",
    "ClientUpdate",
    "FedAtt",
    "FedAttOpt",
    "FedAvg",
    "FedMed",
    "FedSGD",
    "Info",
    "Strategy",
    "get_strategy",
    "strategy_options",
]


def strategy_options(cls: type[Strategy]) -> list[str]:
    """The keyword options ``cls`` accepts (its own plus, through ``**selection``, its bases')."""
    names: list[str] = []
    for klass in cls.__mro__:
        init = vars(klass).get("__init__")
        if init is None:
            continue
        params = inspect.signature(init).parameters.values()
        names += [p.name for p in params if p.kind is p.KEYWORD_ONLY and p.name not in names]
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            break
    return names


def get_strategy(name: str, **options: Any) -> Strategy:
    """Build the strategy ``name`` with ``options``.

    Raises ValueError for an unknown name (listing the valid ones) and TypeError for an option the
    strategy does not take (listing the ones it does).
    """
    key = str(name).lower()
    if key not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; valid: {', '.join(sorted(STRATEGIES))}")
    cls = STRATEGIES[key]
    valid = strategy_options(cls)
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise TypeError(
            f"strategy {key!r} got unknown option(s) {', '.join(unknown)}; "
            f"it accepts: {', '.join(valid) or '(none)'}"
        )
    return cls(**options)
