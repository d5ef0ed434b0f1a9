"""Element ranges of a stored upload's tensors, read with one ``pread`` each.

Why. The round's bounding (fedkey.federation.influence.bounding) reads every stored upload slice by slice: the
coordinate trim stacks one slice of every phone at a time (``TRIM_CHUNK`` elements across the
cohort), so a 1,000-phone round of a 1.17M-parameter model is 140,000 reads of 33 KB per pass.
``StoredState.flat_slice`` opens the file with safetensors' ``safe_open`` for each of them (open,
parse the JSON header, mmap, copy, unmap): 147 us a read, 20 s a pass; an ``os.pread`` at the
offset the header gives, parsed once per file and pass, is 13 us (timed by hand on 100
stored updates, this 2-core machine; the script was not kept). The slice pass maps nothing, so
its resident memory stays the slices being stacked, whatever the cohort (a safetensors handle
kept open per phone would map, and count, every page it touched); a pass that reads phones whole
maps one phone's file at a time (:meth:`SliceReader.mapped`).

What. The safetensors layout (https://huggingface.co/docs/safetensors, "Format"): 8 bytes, the
little-endian length N of a JSON header; the header, ``{name: {"dtype", "shape", "data_offsets":
[begin, end]}}`` (offsets into the data that follows it, C order); then the data. Only the
floating dtypes are read here (F64, F32, F16, BF16), widened exactly into the caller's float32 or
float64 buffer; anything else, or a header this reader does not understand, answers None and the
caller reads through ``StoredState`` as before.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import sys

import numpy as np

#: The floating dtypes read here: safetensors' name -> (bytes per element, numpy dtype of the
#: stored bits). BF16 is read as its 16 bits and widened by hand (numpy has no bfloat16).
FLOAT_DTYPES: dict[str, tuple[int, str]] = {
    "F64": (8, "<f8"),
    "F32": (4, "<f4"),
    "F16": (2, "<f2"),
    "BF16": (2, "<u2"),
}
#: A header longer than this is not a model's (safetensors itself refuses headers over 100 MB).
MAX_HEADER = 100_000_000


class SliceReader:
    """One safetensors file's floating tensors, read by element range without mapping the file.

    The header is parsed once (:meth:`open` answers None when the file is not one this reader
    understands); each :meth:`read_into` opens the file, preads the bytes of the range and
    closes it, so no descriptor stays open between reads."""

    def __init__(
        self,
        path: str,
        entries: dict[str, tuple[str, int, int]],
        shapes: dict[str, tuple[int, ...]] | None = None,
    ):
        self.path = path
        self._entries = entries  # name -> (dtype, byte offset of element 0, element count)
        self._shapes = shapes or {}

    @classmethod
    def open(cls, path: str) -> SliceReader | None:
        """The reader of ``path``, or None when its header is not a little-endian machine's
        plain safetensors header (the caller then reads another way)."""
        if sys.byteorder != "little":
            return None
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                n = int.from_bytes(f.read(8), "little")
                if not 0 < n <= min(MAX_HEADER, size - 8):
                    return None
                header = json.loads(f.read(n))
        except (OSError, ValueError):
            return None
        if not isinstance(header, dict):
            return None
        base = 8 + n
        entries: dict[str, tuple[str, int, int]] = {}
        shapes: dict[str, tuple[int, ...]] = {}
        for name, info in header.items():
            if name == "__metadata__" or not isinstance(info, dict):
                continue
            dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
            if dtype not in FLOAT_DTYPES or not isinstance(shape, list):
                continue
            if not isinstance(offsets, list) or len(offsets) != 2:
                return None
            try:
                numel = math.prod(int(s) for s in shape)
                begin, end = (int(o) for o in offsets)
            except (TypeError, ValueError):
                return None
            width = FLOAT_DTYPES[dtype][0]
            if numel < 0 or begin < 0 or end - begin != numel * width or base + end > size:
                return None
            entries[name] = (dtype, base + begin, numel)
            shapes[name] = tuple(int(d) for d in shape)
        return cls(path, entries, shapes)

    def dtype(self, key: str) -> str | None:
        """The safetensors dtype of ``key`` (None: not a floating tensor of this file)."""
        entry = self._entries.get(key)
        return entry[0] if entry else None

    def shape(self, key: str) -> tuple[int, ...] | None:
        """The shape of ``key`` (None: not a floating tensor of this file)."""
        return self._shapes.get(key)

    def mapped(self) -> dict[str, np.ndarray]:
        """The file's float32 and float64 tensors as flat read-only arrays on one mapping of it
        (MAP_POPULATE: its pages mapped at once), for a pass that reads a phone whole: no copy,
        where :meth:`read_into` copies (0.27 ms against 1.06 for 14 MB from the page cache, CPU
        time, timed by hand). The mapping lasts as long as the arrays: hold them for one phone's
        work (their pages count in the resident memory while mapped). float16 and bfloat16
        tensors are left out (read them with :meth:`read_into`)."""
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        with open(self.path, "rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                return {}
            mapping = mmap.mmap(f.fileno(), 0, flags=flags, prot=mmap.PROT_READ)
        out: dict[str, np.ndarray] = {}
        for name, (dtype, start, numel) in self._entries.items():
            if dtype in ("F32", "F64"):
                try:
                    out[name] = np.frombuffer(mapping, FLOAT_DTYPES[dtype][1], numel, start)
                except ValueError:
                    raise ValueError(
                        f"{self.path}: {name!r} ends early (the upload file was cut short)"
                    ) from None
        return out

    def read_into(self, key: str, a: int, b: int, out: np.ndarray) -> bool:
        """Elements ``a:b`` of the flattened tensor ``key``, widened exactly into ``out`` (a
        contiguous float32 or float64 array of ``b - a`` elements). False, with ``out``
        untouched, when ``key`` is not one of the file's floating tensors or would not fit
        ``out``'s dtype exactly (float64 into float32)."""
        entry = self._entries.get(key)
        if entry is None or not 0 <= a <= b <= entry[2] or out.shape != (b - a,):
            return False
        dtype, start, _ = entry
        width, bits = FLOAT_DTYPES[dtype]
        if dtype == "F64" and out.dtype != np.float64:
            return False
        direct = np.dtype(bits) == out.dtype
        target = out if direct else np.empty(b - a, dtype=bits)
        view = target.data.cast("B")
        fd = os.open(self.path, os.O_RDONLY)
        try:
            got = os.preadv(fd, [view], start + a * width)
        finally:
            os.close(fd)
        if got != len(view):
            raise ValueError(f"{self.path}: {key!r} ends early (the upload file was cut short)")
        if direct:
            return True
        if dtype == "BF16":  # a bfloat16 is the top half of the float32 with the same value
            out[:] = (target.astype(np.uint32) << 16).view(np.float32)
        else:
            out[:] = target
        return True
