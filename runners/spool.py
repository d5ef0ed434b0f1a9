"""Where `fedkey simulate` keeps a round's uploads until it aggregates them.

In memory while the whole cohort's uploads fit in ``MEMORY_BYTES``; past that, each upload in a
safetensors file of its own under the run directory, read back a tensor at a time as the HTTP
server reads its stored uploads (fedkey.federation.updates.store.StoredState), so memory does not grow with
the cohort: a round of 1,000 phones of a 14 MB model would hold 14 GB of uploads. The files go
once the round is aggregated.

    spool = UploadSpool(out_dir / "uploads")
    spool.start(cohort=len(plan.cohort), upload_bytes=tensor_bytes(global_state))
    uploads[d] = spool.keep(state)          # the state itself, or a StoredState of its file
    ...                                     # Federation.complete_round(plan, updates)
    spool.clear()
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path

from safetensors.torch import save_file
from torch import Tensor

from fedkey.federation.updates.store import StoredState

#: The most a round's uploads may take in memory before they go to disk (2 GiB: about 150 phones
#: of the cpu bench preset's 14 MB model; the demo's rounds never reach it).
MEMORY_BYTES = 2 << 30


def tensor_bytes(state: Mapping[str, Tensor]) -> int:
    """The bytes of a state's tensors (an upload's, less its header)."""
    return sum(t.numel() * t.element_size() for t in state.values())


class UploadSpool:
    """A round's uploads, in memory or in `folder` (one file each, numbered as they come)."""

    def __init__(self, folder: Path, memory_bytes: int | None = None):
        self.folder = folder
        self.memory_bytes = MEMORY_BYTES if memory_bytes is None else memory_bytes
        self.on_disk = False
        self._count = 0

    def start(self, cohort: int, upload_bytes: int) -> None:
        """A new round of `cohort` phones, each upload `upload_bytes`: on disk if together they
        would pass memory_bytes (the last round's files, if any, removed)."""
        self.clear()
        self.on_disk = cohort * upload_bytes > self.memory_bytes

    def keep(self, state: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
        """The upload to aggregate: `state` itself, or its file read back lazily."""
        if not self.on_disk:
            return state
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"{self._count:06d}.safetensors"
        self._count += 1
        save_file({k: v.detach().cpu().contiguous() for k, v in state.items()}, path)
        return StoredState(path)

    def clear(self) -> None:
        """Remove the round's files (and any an interrupted run left)."""
        shutil.rmtree(self.folder, ignore_errors=True)
        self._count = 0
