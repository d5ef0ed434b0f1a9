"""Where a run lives on disk: checkpoints/, metrics.jsonl and perplexity.png.

RUN_DIR/checkpoints/round_0003.safetensors   the global model after round 3 (round_0000 = init)
RUN_DIR/checkpoints/server_opt_0003.safetensors  a server optimizer's buffers after round 3
RUN_DIR/metrics.jsonl                        one JSON object per round
RUN_DIR/perplexity.png                       validation and test perplexity per round
RUN_DIR/secret.key                           under DP, the noise's secret (fedkey.federation.privacy.secret)
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection
from pathlib import Path

from fedkey.common.files import atomic_write

#: The noise's secret of a DP run (fedkey.federation.privacy.secret).
SECRET_FILE = "secret.key"


class RunStorage:
    def __init__(self, out_dir: str | Path):
        self.root = Path(out_dir)
        self.checkpoints = self.root / "checkpoints"
        self.checkpoints.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.root / "metrics.jsonl"
        self.plot_path = self.root / "perplexity.png"

    def checkpoint_path(self, round_idx: int) -> Path:
        return self.checkpoints / f"round_{round_idx:04d}.safetensors"

    def server_opt_path(self, round_idx: int) -> Path:
        return self.checkpoints / f"server_opt_{round_idx:04d}.safetensors"

    def latest_checkpoint(self) -> Path | None:
        found = sorted(self.checkpoints.glob("round_*.safetensors"))
        return found[-1] if found else None

    def reset(self) -> None:
        """Forget an earlier run in this directory: its metrics, checkpoints and DP secret (a
        fresh run draws fresh noise: two runs noised alike would cancel it in their difference)."""
        self.metrics_path.unlink(missing_ok=True)
        (self.root / SECRET_FILE).unlink(missing_ok=True)
        for pattern in (f"{kind}_*.safetensors" for kind in ROUND_FILE_KINDS):
            for path in self.checkpoints.glob(pattern):
                path.unlink()

    def append_metrics(self, row: dict) -> None:
        """Append a row to metrics.jsonl (made readable by its owner alone: under DP it names
        the phones and holds the scores on their text)."""
        with open(self.metrics_path, "a", opener=_owner_only) as f:
            f.write(json.dumps(row) + "\n")

    def write_metrics(self, rows: list[dict]) -> None:
        """Replace metrics.jsonl atomically (used when a resumed run repairs it)."""
        text = "".join(json.dumps(r) + "\n" for r in rows)
        atomic_write(self.metrics_path, text, mode=0o600)

    def read_metrics(self) -> list[dict]:
        """The rows of metrics.jsonl; a torn last line (a crash in the middle of its append) is
        left out, as the round it began is not committed (its checkpoint is the commit point)."""
        if not self.metrics_path.exists():
            return []
        lines = [line for line in self.metrics_path.read_text().splitlines() if line]
        rows = []
        for i, line in enumerate(lines):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                if i < len(lines) - 1:
                    raise ValueError(
                        f"{self.metrics_path}: line {i + 1} is not JSON; repair or remove it"
                    ) from None
        return rows

    def plot(self, title: str = "") -> Path:
        return plot_perplexity({title or self.root.name: self.read_metrics()}, self.plot_path)


def _owner_only(path: str, flags: int) -> int:
    """open()'s opener for a file only its owner may read (0600 when it is created)."""
    return os.open(path, flags, 0o600)


#: The stems of a run's per-round files in checkpoints/: "round_0003", "server_opt_0003".
ROUND_FILE_KINDS = ("round", "server_opt")


def prune_checkpoints(run_dir: str | Path, keep: Collection[int]) -> tuple[int, int]:
    """Delete the per-round files of RUN_DIR/checkpoints (the model, the server optimizer's
    buffers) of every round not in `keep`; (files, bytes) deleted. For a finished run whose
    other rounds no longer matter: nothing resumes it, and its best model is one round's."""
    removed, size = 0, 0
    for path in (Path(run_dir) / "checkpoints").glob("*.safetensors"):
        kind, _, number = path.stem.rpartition("_")
        if kind in ROUND_FILE_KINDS and number.isdigit() and int(number) not in keep:
            size += path.stat().st_size
            path.unlink()
            removed += 1
    return removed, size


#: Perplexities past this are drawn at it: a diverged run (an undefended x100 update) reaches 1e290
#: or inf, where the log axis's ticks overflow.
PLOT_CAP = 1e100


def _capped(values: list[float]) -> list[float]:
    return [min(v, PLOT_CAP) for v in values]


def plot_perplexity(runs: dict[str, list[dict]], out: str | Path) -> Path:
    """Validation (dashed) and test (solid) perplexity per round, one colour per run (values
    past PLOT_CAP drawn at it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (label, rows) in enumerate(runs.items()):
        color = f"C{i % 10}"
        rows = [r for r in rows if r.get("test_ppl") is not None]
        rounds = [r["round"] for r in rows]
        ax.plot(
            rounds, _capped([r["test_ppl"] for r in rows]), color=color, label=f"{label} (test)"
        )
        ax.plot(
            rounds,
            _capped([r["val_ppl"] for r in rows]),
            color=color,
            ls="--",
            alpha=0.6,
            label=f"{label} (valid)",
        )
    ax.set_yscale("log")
    ax.set_xlabel("round")
    ax.set_ylabel("perplexity (log scale)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return Path(out)
