"""Optimize the BLT matrix factorizations `--dp-mechanism blt` ships (federation/privacy/blt_params.json).

Runs with jax-privacy, the `blt` optional extra, which the core install does not need: the server
reads only the JSON this script writes (fedkey.federation.privacy.blt). Kept apart from the core venv:

    python3.11 -m venv .venv-blt && .venv-blt/bin/pip install 'jax-privacy==2.0.0'
    .venv-blt/bin/python tools/blt_params.py                      # the table fedkey ships
    .venv-blt/bin/python tools/blt_params.py --rounds 300 --separations 7   # add entries

For each run length n and minimum separation b it calls jax-privacy's
``buffered_toeplitz.optimize(n=n, min_sep=b, max_participations=None, error="max")``: the BLT
strategy C (Dvijotham, McMahan, Pillutla, Steinke, Thakurta 2024, "Efficient and Near-Optimal
Noise Generation for Streaming Differential Privacy") minimizing the largest per-round variance of
the noisy prefix sums at unit min-separation sensitivity (McMahan, Xu, Zhang 2024, "A Hassle-free
Algorithm for Private Learning in Practice: Don't Use Tree Aggregation, Use BLTs"), and records
its parameters with the sensitivity ``toeplitz.minsep_sensitivity_squared`` computes (Kalinin and
Lampert 2024, Theorem 2; fedkey.federation.privacy.blt derives the accounting). Entries are
merged into the file (one per (n, b); b >= n is stored as b = n: one participation). ``--jobs``
runs entries in separate processes (each optimization takes seconds to minutes of a CPU core).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "federation" / "privacy" / "blt_params.json"
#: The table fedkey ships: every n with every b <= n of SEPARATIONS, and b = n.
ROUNDS = (3, 5, 10, 20, 50, 100, 200)
SEPARATIONS = (1, 2, 5, 10, 20, 50)


def optimize_entry(n: int, b: int) -> dict:
    """One table entry: jax-privacy's optimized BLT for n rounds at separation b."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import numpy as np

    jax.config.update("jax_enable_x64", True)
    from jax_privacy.matrix_factorization import buffered_toeplitz, toeplitz

    blt = buffered_toeplitz.optimize(n=n, min_sep=b, max_participations=None, error="max")
    coefs = blt.toeplitz_coefs(n)
    sens2 = toeplitz.minsep_sensitivity_squared(coefs, min_sep=b, max_participations=None)
    inv = blt.inverse() if len(blt.buf_decay) else blt
    noising = np.asarray(inv.toeplitz_coefs(n))
    error = np.asarray(toeplitz.per_query_error(noising_coef=noising))
    return {
        "rounds": n,
        "min_separation": b,
        "buf_decay": [float(x) for x in np.asarray(blt.buf_decay)],
        "output_scale": [float(x) for x in np.asarray(blt.output_scale)],
        "sensitivity": math.sqrt(float(sens2)),
        "max_participations": -(-n // b),
        # the largest per-round noise variance of the prefix sums at sensitivity 1
        "max_error": float(sens2) * float(error.max()),
    }


def write(entries: dict[tuple[int, int], dict], out: Path) -> None:
    """The table, sorted by (n, b), with how it was made."""
    import jax_privacy

    table = {
        "made_by": "tools/blt_params.py",
        "jax_privacy": jax_privacy.__version__,
        "objective": "buffered_toeplitz.optimize(error='max', max_participations=None)",
        "entries": [entries[k] for k in sorted(entries)],
    }
    out.write_text(json.dumps(table, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, nargs="+", default=list(ROUNDS))
    parser.add_argument("--separations", type=int, nargs="+", default=list(SEPARATIONS))
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--jobs", type=int, default=1)
    args = parser.parse_args(argv)
    entries: dict[tuple[int, int], dict] = {}
    if args.out.exists():
        for e in json.loads(args.out.read_text())["entries"]:
            entries[(e["rounds"], e["min_separation"])] = e
    todo = sorted(
        {(n, min(b, n)) for n in args.rounds for b in [*args.separations, n]} - set(entries)
    )
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        futures = {key: pool.submit(optimize_entry, *key) for key in todo}
        for key, future in futures.items():
            entries[key] = future.result()
            write(entries, args.out)  # every finished entry is kept
            print(f"n={key[0]} b={key[1]}: {entries[key]['sensitivity']:.4f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
