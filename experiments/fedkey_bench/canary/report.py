"""The canary audit's results page: `fedkey audit canary` (fedkey.runners.canary_audit, a product
feature) runs the arms and writes results.json, results.md and exposure.png; this rebuilds the
two from a results folder's results.json alone, as the other benches' reports do:

    python -m fedkey_bench.canary.report experiments/results/canary
"""

from __future__ import annotations

import sys
from pathlib import Path

from fedkey.runners.canary_audit import Results, write_report
from fedkey_bench.common.checkout import RESULTS


def rebuild(folder: Path) -> Path:
    """FOLDER/results.md and exposure.png from FOLDER/results.json; -> results.md."""
    results = Results(folder)
    write_report(results.read(), folder, results.commands())
    return folder / "results.md"


if __name__ == "__main__":
    print(rebuild(Path(sys.argv[1]) if len(sys.argv) > 1 else RESULTS / "canary"))
