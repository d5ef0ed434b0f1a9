"""The reads behind a round's bounding (fedkey.federation.influence.bounding): every stored update read as few times
as the algebra allows, each read serving everything that can be computed from it.

Why. ``bound_round`` at 300 stored updates of a 1.17M-parameter model took 17 s on one core
(10.7 s without the cosine filter), in four float64 passes over every update: two slice passes
for the filter's norms and dot products, a slice pass for the trim's order statistics
(np.partition), and a pass trimming each whole update again for its norm. Measured with py-spy
(bound_round on m = 100 stored updates), the trim's np.partition was 47% of bound_round's time, the
slice reads (a safetensors ``safe_open`` per slice of a phone) and the float64 copies most of
the rest.

What, pass by pass (m phones, n parameters):

* :func:`norm_scan` and :func:`cosine_scan`: one phone at a time, its file mapped whole
  (SliceReader.mapped: no copy, where a ``pread`` copied the 14 MB of the default model), worked
  on ``BLOCK`` elements at a time: each layer's squared norm ``||u_i^l||^2``, and, for the cosine
  filter, the sum of the unit deltas ``V = sum_j u_j / ||u_j||`` (one model-sized vector: the
  phone's norm is known once its layers are read, so its unit delta is added at once). A second
  phone pass gives ``u_i . V``: the filter's score needs V whole before any dot product, so its
  two passes cannot be one (short of the m x m Gram matrix, O(m^2 n): 23 s at m = 1,000 where a
  pass is about 2).
* :func:`trim_scan`: the cohort stacked slice by slice (``chunk`` elements across the kept
  phones at a time, one ``pread`` per phone and slice, fedkey.federation.updates.slices), each
  slice laid out as blocks of ``ORDER_BLOCK`` elements (a few hundred columns of every phone,
  contiguous) worked on in cache (:func:`_trim_block`): the block transposed (a coordinate's m
  values contiguous), the trim's order statistics selected (fedkey.federation.influence.selection:
  two quickselects per coordinate, the sort's values, half its time at 1,000 phones; smaller
  cohorts and DP's exact scan sort, :func:`_order_statistics`), and in the same read every
  phone's trimmed layer norms (the block clamped, the global subtracted, squared and summed).
  Transposed straight out of the slice, whose rows are ``chunk / m`` elements apart, a block
  took 9 ns a value at 1,000 phones (8,388 floats apart: the cache's sets) against 0.9 from its
  own contiguous copy.
* :func:`weighted_scan`, the strategy's pass (influence.BoundedRound.weighted_sum): FedAvg's
  weights and FedAtt's attention are known once the bound is (FedAtt scores the bounded
  distances, the trimmed norms times the clip factors), so the step ``sum_k c_k^l u_k^l`` is
  one weighted sum: a few phones' files mapped at once, each block clamped in the update's
  dtype, widened and summed by BLAS (torch's, on torch's one thread) into a float64
  accumulator that stays in cache. The clip factor goes into the coefficient. The
  update-at-a-time path it replaces (each upload read
  into buffers, trimmed and clipped in place, then widened and accumulated a whole layer at a
  time in float64) took 3 times as long (1.3 s against 0.42 at 300 uploads of 1.14M
  parameters). Other strategies, DP's exact clip and bfloat16 updates iterate the round
  (:meth:`influence.BoundedRound.__iter__`, :func:`load_state`).

Four passes, and no fewer without holding the cohort in memory (4.6 GB at 1,000 uploads of a
1.14M-parameter model): each needs what the one before it finished (V, then the kept phones,
then every trimmed norm for the clip's median and the strategy's weights). Per pass, one core,
1,000 uploads of 1.14M parameters whose read once took 1.8-2.2 s of CPU (safetensors, page
cache warm, the shared machine busy; phases timed by hand, ``fedkey-bench aggregation`` gives
the totals, experiments/results/aggregation): the filter's two phone passes 5.2-6.5 s, the
trim's pass 15 (32 with the sort and the transposes out of the slice; timed piece by piece,
17.6: the selection 7.4, the slice reads 3.2 and their copy into blocks 2.4, the transposes
2.3, the clamp and the norms 2.3), the weighted sum 4.1-4.5. Each pass costs two reads or more: three times the read
is out of reach of four passes.

The trim's bounds are kept as values, not deltas: ``theta + clamp(theta_k - theta, lo - theta,
hi - theta)`` is ``clamp(theta_k, lo, hi)`` (the delta is monotone in the value and the bounds
are phones' own values), so :func:`clamp_state` trims in the update's own dtype, with no
float64 round trip, and gives the same numbers.

Precision. Updates are stacked in float32 (float64 when the model or an update is float64),
which holds their bfloat16, float16 and float32 values exactly, so the trim's order statistics
and the clamp are exact. The deltas are subtracted, squared and multiplied in that dtype; the
trim's sums run over at most ``ORDER_COLUMNS`` coordinates of a block in float32, the phone
passes' are BLAS's ``np.dot`` within a block (2e-7 relative on 65,536 random elements, as the
pairwise sum; 0.28 ms of CPU for 3.55M elements where ``np.square(d).sum()`` took 2.2, timed by
hand), the sums of blocks, slices and layers added in float64: the cosine scores and the norms
of a 1.17M-parameter float32 model agree with the float64 reference to about 1e-7 relative
(tests/federation/influence/test_cohort_scan.py). The weighted sum is float64 (each block widened exactly,
BLAS's dgemv): it rounds once where the update-at-a-time clip rounded each clipped update to
float32 first, and agrees with it to that rounding. ``exact`` (the DP clip's norms, which its
sensitivity analysis bounds): float64 arithmetic throughout, as before.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from functools import partial
from itertools import pairwise

import numpy as np
import torch
from torch import Tensor

from fedkey.federation.influence.selection import SELECT_FROM, select_limits
from fedkey.federation.updates.slices import SliceReader
from fedkey.federation.updates.store import StoredState

#: Per floating layer, the trim's lowest and highest value of each coordinate (the global's shape).
Limits = dict[str, tuple[Tensor, Tensor]]
#: Elements worked on at a time (256 KB of float32: in a 2 MB L2 cache with the operands).
BLOCK = 1 << 16
#: Elements of the trim's stack ordered at a time (a few columns across the cohort: 512 KB of
#: float32, with its transposed copy in the L2 cache) (:func:`trim_scan`).
ORDER_BLOCK = 1 << 17
#: At most this many columns in one such block (each phone's float32 sum over a block's columns
#: has at most this many terms).
ORDER_COLUMNS = 512
#: Phones sorted together by the trim (:func:`_order_statistics`).
SORT_GROUP = 512
#: Phones summed together by :func:`weighted_scan` (their files mapped at once).
PHONE_GROUP = 8


def floating_keys(global_state: Mapping[str, Tensor]) -> list[str]:
    """The layers that are bounded: the model's floating tensors."""
    return [k for k, v in global_state.items() if torch.is_floating_point(v)]


def _numpy(t: Tensor) -> np.ndarray:
    """A tensor as numpy, in float32 or float64 (bfloat16 and float16 widen exactly)."""
    if t.dtype not in (torch.float32, torch.float64):
        t = t.to(torch.float32)
    return t.detach().numpy()


def flat_slice(state: Mapping[str, Tensor], key: str, a: int, b: int) -> Tensor:
    """Elements ``a:b`` of the flattened tensor ``key`` of ``state`` (its own ``flat_slice`` when
    it has one, as the server's stored uploads do)."""
    read = getattr(state, "flat_slice", None)
    if read is not None:
        return read(key, a, b)
    return state[key].detach().reshape(-1)[a:b]


class Cohort:
    """The round's states as the scans read them: a stored upload through a :class:`SliceReader`
    (its header parsed once, here), anything else through its mapping or ``flat_slice``."""

    def __init__(self, global_state: Mapping[str, Tensor], states: Sequence[Mapping[str, Tensor]]):
        self.global_state = global_state
        self.states = states
        self.readers = [
            SliceReader.open(s.path) if isinstance(s, StoredState) else None for s in states
        ]

    def __len__(self) -> int:
        return len(self.states)

    def wide(self, key: str) -> np.dtype:
        """The dtype a layer is stacked in: float64 when the model's or any update's is, else
        float32 (which holds bfloat16, float16 and float32 values exactly)."""
        if self.global_state[key].dtype == torch.float64:
            return np.dtype(np.float64)
        for s, r in zip(self.states, self.readers, strict=True):
            dtype = r.dtype(key) if r is not None else None
            if dtype is None:
                dtype = "F64" if flat_slice(s, key, 0, 1).dtype == torch.float64 else "other"
            if dtype == "F64":
                return np.dtype(np.float64)
        return np.dtype(np.float32)

    def native(self, key: str) -> bool:
        """Whether every phone's layer ``key`` has the global layer's shape and dtype, float32 or
        float64 (what :func:`weighted_scan` sums)."""
        glob = self.global_state[key]
        stored = {torch.float32: "F32", torch.float64: "F64"}.get(glob.dtype)
        if stored is None:
            return False
        for s, r in zip(self.states, self.readers, strict=True):
            if r is None and key not in s:
                return False  # the strategy's own read says what is missing
            if r is not None and r.dtype(key) is not None:
                if r.dtype(key) != stored or r.shape(key) != tuple(glob.shape):
                    return False
            elif key not in s or s[key].dtype != glob.dtype or s[key].shape != glob.shape:
                return False
        return True

    def global_flat(self, key: str, dtype: np.dtype) -> np.ndarray:
        """The global layer, flattened, in ``dtype``."""
        g = self.global_state[key].detach().reshape(-1)
        return _numpy(g).astype(dtype, copy=False)

    def phone(self, i: int, buffers: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Phone ``i``'s layers ``buffers`` names, whole and flat: a stored upload's float32 or
        float64 layers of the buffer's dtype on a mapping of its file (no copy:
        SliceReader.mapped), any other read into its buffer."""
        reader = self.readers[i]
        views = reader.mapped() if reader is not None else {}
        out: dict[str, np.ndarray] = {}
        for key, buf in buffers.items():
            view = views.get(key)
            if view is not None and view.dtype == buf.dtype and view.size == buf.size:
                out[key] = view
            else:
                self.read(i, key, 0, buf.size, buf)
                out[key] = buf
        return out

    def read(self, i: int, key: str, a: int, b: int, out: np.ndarray) -> None:
        """Phone ``i``'s elements ``a:b`` of layer ``key`` into ``out`` (contiguous, ``b - a``
        elements of :meth:`wide`'s dtype)."""
        reader = self.readers[i]
        if reader is not None and reader.read_into(key, a, b, out):
            return
        values = _numpy(flat_slice(self.states[i], key, a, b))
        if values.shape != out.shape:
            raise ValueError(
                f"update {i}: layer {key!r} has {values.size} elements at {a}:{b}, "
                f"expected {out.size}: its shape differs from the model's"
            )
        out[:] = values


def norm_scan(cohort: Cohort, keys: Sequence[str], exact: bool) -> np.ndarray:
    """Every phone's squared layer norms ``||theta_k^l - theta^l||^2``: an m x len(keys) array,
    from one pass, one phone's layers at a time. ``exact``: in float64 arithmetic (the DP clip's
    norms); else in the stacking dtype (:meth:`Cohort.wide`)."""
    return _phone_scan(cohort, keys, direction=False, exact=exact)[0]


def cosine_scan(cohort: Cohort, keys: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """:func:`norm_scan`'s squared layer norms (not exact) and the cosine filter's ``u_i . V``,
    with ``V`` the sum of the unit deltas (fedkey.federation.strategies.outliers.mean_cosines): one pass for
    the norms and V, one for the dot products (V must be whole before any of them)."""
    sq, dots = _phone_scan(cohort, keys, direction=True, exact=False)
    return sq, dots if dots is not None else np.zeros(len(cohort))


def _phone_scan(
    cohort: Cohort, keys: Sequence[str], direction: bool, exact: bool
) -> tuple[np.ndarray, np.ndarray | None]:
    """The phone passes of :func:`norm_scan` (one) and :func:`cosine_scan` (two): each phone's
    layers whole (:meth:`Cohort.phone`: a stored upload mapped, not copied), worked on ``BLOCK``
    elements at a time (in cache). The squares and products are summed by BLAS (``np.dot``: 0.28
    ms for 3.55M float32 elements where ``np.square(d).sum()`` took 2.2, CPU time, timed by hand;
    the same error as numpy's pairwise sum within a block, 2e-7 relative on 65,536 random
    elements), the blocks' and layers' sums added in float64."""
    m = len(cohort)
    stacked = {k: cohort.wide(k) for k in keys}
    work = {k: np.dtype(np.float64) if exact else stacked[k] for k in keys}
    glob = {k: cohort.global_flat(k, work[k]) for k in keys}
    rows = {k: np.empty(glob[k].size, stacked[k]) for k in keys}
    scratch = {k: np.empty(min(BLOCK, glob[k].size), work[k]) for k in keys}
    sq = np.zeros((m, len(keys)))
    total = {k: np.zeros(glob[k].size, work[k]) for k in keys} if direction else {}

    def squares(d: np.ndarray, a: int, b: int) -> float:
        return float(np.dot(d, d))

    for i in range(m):
        row = cohort.phone(i, rows)
        for j, k in enumerate(keys):
            sq[i, j] = _blocks(row[k], glob[k], scratch[k], squares)
        norm = float(np.sqrt(sq[i].sum()))
        if direction and norm > 0:
            for k in keys:
                _blocks(row[k], glob[k], scratch[k], _adder(total[k], 1.0 / norm))
        del row  # the phone's mapping, if it has one, goes with it
    if not direction:
        return sq, None
    dots = np.zeros(m)
    for i in range(m):
        row = cohort.phone(i, rows)
        for k in keys:
            dots[i] += _blocks(row[k], glob[k], scratch[k], _dotter(total[k]))
        del row
    return sq, dots


def _blocks(
    row: np.ndarray,
    glob: np.ndarray,
    scratch: np.ndarray,
    work: Callable[[np.ndarray, int, int], float],
) -> float:
    """``work(d, a, b)`` on each ``BLOCK`` of the delta ``d = row[a:b] - glob[a:b]`` (in
    ``scratch``, which it may overwrite); the sum of what it returns."""
    out = 0.0
    for a in range(0, row.size, BLOCK):
        b = min(a + BLOCK, row.size)
        out += work(np.subtract(row[a:b], glob[a:b], out=scratch[: b - a]), a, b)
    return out


def _adder(total: np.ndarray, scale: float) -> Callable[[np.ndarray, int, int], float]:
    """A :func:`_blocks` work adding ``scale`` times the delta into ``total``."""

    def add(d: np.ndarray, a: int, b: int) -> float:
        np.add(total[a:b], np.multiply(d, scale, out=d), out=total[a:b])
        return 0.0

    return add


def _dotter(total: np.ndarray) -> Callable[[np.ndarray, int, int], float]:
    """A :func:`_blocks` work giving the delta's dot product with ``total``."""

    def dot(d: np.ndarray, a: int, b: int) -> float:
        return float(np.dot(d, total[a:b]))

    return dot


def trim_scan(
    cohort: Cohort, keys: Sequence[str], k: int, chunk: int, exact: bool, threads: int = 1
) -> tuple[Limits, np.ndarray]:
    """The trim's bounds (each coordinate's (k+1)-th smallest and largest value over the cohort,
    as tensors of the global's shape) and every phone's squared layer norms after the trim (an
    m x len(keys) array), from one slice-stacked read of the cohort: ``chunk`` elements across
    the phones at a time, then worked on ``ORDER_BLOCK`` elements (a few columns) at a time, in
    cache (:func:`_trim_block`). ``exact``: the norms in float64 arithmetic (the DP clip's).
    ``threads``: each slice's blocks shared among that many threads (numpy's sorts and copies
    release the GIL; the sort is most of the scan)."""
    m = len(cohort)
    step = max(1, chunk // max(m, 1))
    width = max(1, min(ORDER_COLUMNS, ORDER_BLOCK // max(m, 1)))  # a block's columns
    limits: Limits = {}
    sq = np.zeros((m, len(keys)))
    with ThreadPoolExecutor(threads) if threads > 1 else nullcontext() as pool:
        for j, key in enumerate(keys):
            dtype = cohort.wide(key)
            g = cohort.global_flat(key, dtype)
            g64 = cohort.global_flat(key, np.dtype(np.float64)) if exact else None
            lo, hi = np.empty(g.size, dtype), np.empty(g.size, dtype)
            row = np.empty(min(step, g.size), dtype)
            # the slice block by block: block c // width is the phones' columns c : c + width,
            # contiguous (a phone's row of the whole slice is ``step`` elements long: transposed
            # from such a stride, a block took 9 ns a value at 1,000 phones, 0.9 from its own)
            blocks = np.empty((-(-row.size // width), m, width), dtype)
            for a in range(0, g.size, step):
                b = min(a + step, g.size)
                full = (b - a) // width
                for i in range(m):
                    cohort.read(i, key, a, b, row[: b - a])
                    blocks[:full, i] = row[: full * width].reshape(full, width)
                    blocks[full : full + 1, i, : b - a - full * width] = row[full * width : b - a]
                # the blocks of columns c : c + width of this slice, its elements a + c on
                work = partial(_trim_block, blocks, a, b - a, width, k, (lo, hi), g, g64)
                starts = range(0, b - a, width)
                done = map(work, starts) if pool is None else pool.map(work, starts)
                for got in done:
                    sq[:, j] += got
            shape = cohort.global_state[key].shape
            limits[key] = (torch.from_numpy(lo).reshape(shape), torch.from_numpy(hi).reshape(shape))
    return limits, sq


def _trim_block(
    blocks: np.ndarray,
    a: int,
    n: int,
    width: int,
    k: int,
    limits: tuple[np.ndarray, np.ndarray],
    g: np.ndarray,
    g64: np.ndarray | None,
    c: int,
) -> np.ndarray:
    """One block of the trim scan: columns ``c : c + width`` of the stacked slice (m phones x
    the layer's ``n`` elements from ``a``, ``blocks[c // width]``) give their (k+1)-th smallest
    and largest values into ``limits`` (the layer's lo and hi arrays: by selection from
    ``SELECT_FROM`` phones, fedkey.federation.influence.selection, the same values as the
    sort, :func:`_order_statistics`, which DP's exact scan keeps), and each phone's squared
    distance to ``g`` over these columns after the trim (returned; ``g64`` given: in float64
    arithmetic, the DP clip's norms). Worked on transposed (a column's values contiguous:
    numpy's elementwise loops then run along m phones rather than a few columns, about half the
    time), sized to stay in cache (``ORDER_BLOCK``). Each phone's sum over the block's columns
    is a float32 one (at most ``ORDER_COLUMNS`` terms), the blocks' added in float64 by the
    caller."""
    part = blocks[c // width, :, : min(width, n - c)]
    at = slice(a + c, a + c + part.shape[1])
    lo, hi, g = limits[0][at], limits[1][at], g[at]
    cols = part.T.copy()  # a copy always (ascontiguousarray may give a view)
    if g64 is not None or cols.shape[1] < SELECT_FROM or not select_limits(cols, k, lo, hi):
        _order_statistics(cols.copy(), k, lo, hi)  # the reference, and DP's
    np.maximum(cols, lo[:, None], out=cols)  # np.clip: a third slower
    np.minimum(cols, hi[:, None], out=cols)
    if g64 is not None:
        d = cols.astype(np.float64) - g64[at, None]
        return np.einsum("ij,ij->j", d, d)
    np.subtract(cols, g[:, None], out=cols)
    return np.einsum("ij,ij->j", cols, cols).astype(np.float64)


def _order_statistics(cols: np.ndarray, k: int, lo: np.ndarray, hi: np.ndarray) -> None:
    """Each row's (k+1)-th smallest and largest value into ``lo`` and ``hi`` (``cols``: a
    contiguous columns x phones array, reordered in place). The phones are sorted in groups of
    at most ``SORT_GROUP`` (numpy's SIMD sort orders rows of up to 512 float32 with sorting
    networks, 1.2 ns an element, and rows of 1,000 at 5.6, timed by hand on this machine's AVX-512
    EPYC), then each group's k+1 smallest and k+1 largest values sorted together: the cohort's
    k+1 smallest values are each among their group's k+1 smallest, so the (k+1)-th smallest of
    those candidates is the cohort's (and so for the largest). The same values as one np.sort
    of the whole row (NaN last, as np.sort puts it)."""
    m = cols.shape[1]
    groups = -(-m // SORT_GROUP)
    if groups == 1:
        cols.sort(axis=1)
        lo[:], hi[:] = cols[:, k], cols[:, m - k - 1]
        return
    edges = [m * t // groups for t in range(groups + 1)]
    for a, b in pairwise(edges):
        cols[:, a:b].sort(axis=1)
    low = np.concatenate([cols[:, a : min(a + k + 1, b)] for a, b in pairwise(edges)], axis=1)
    low.sort(axis=1)
    lo[:] = low[:, k]
    high = np.concatenate([cols[:, max(b - k - 1, a) : b] for a, b in pairwise(edges)], axis=1)
    high.sort(axis=1)
    hi[:] = high[:, high.shape[1] - k - 1]


def weighted_scan(
    cohort: Cohort, keys: Sequence[str], limits: Limits | None, coefs: np.ndarray
) -> dict[str, np.ndarray]:
    """Per layer, ``sum_i coefs[i, l] clamp(theta_i^l, lo^l, hi^l)`` (flat, float64) from one pass
    over the cohort, ``PHONE_GROUP`` phones at a time (a stored upload mapped, not copied:
    :meth:`Cohort.phone`), ``BLOCK`` elements at a time: each phone's block clamped to the trim's
    range (``limits``; None: no trim) in its own dtype (exact), the group's blocks widened to
    float64 and summed by BLAS (``coefs @ block``), so the accumulator, the range and the
    global's block are read once a group and stay in cache. The sum is torch's ``addmv_``,
    which keeps to torch's threads (one in the server's aggregation process): numpy's
    ``np.dot`` ran OpenBLAS's gemv on every core, busy-waiting (1.3 ms of CPU for 8 x 65,536
    against 0.2-0.3 on one; weighted_scan of 200 uploads 3.6 s of CPU against 0.7, timed by
    hand). Every phone's layers must be in the global's dtype (:meth:`Cohort.native`)."""
    m = len(cohort)
    group = max(1, min(PHONE_GROUP, m))
    dtypes = {key: np.dtype(_numpy(cohort.global_state[key]).dtype) for key in keys}
    sizes = {key: cohort.global_state[key].numel() for key in keys}
    bufs = [{key: np.empty(sizes[key], dtypes[key]) for key in keys} for _ in range(group)]
    flat = {
        key: (_numpy(lo).reshape(-1), _numpy(hi).reshape(-1))
        for key, (lo, hi) in (limits or {}).items()
    }
    out = {key: np.zeros(sizes[key]) for key in keys}
    acc = {key: torch.from_numpy(out[key]) for key in keys}  # the same memory
    wide = np.empty((group, BLOCK))
    narrow = {dt: np.empty((group, BLOCK), dt) for dt in set(dtypes.values())}
    for g0 in range(0, m, group):
        rows = [cohort.phone(i, bufs[i - g0]) for i in range(g0, min(g0 + group, m))]
        n = len(rows)
        for j, key in enumerate(keys):
            c = torch.from_numpy(np.ascontiguousarray(coefs[g0 : g0 + n, j], dtype=np.float64))
            stack = narrow[dtypes[key]]
            bounds = flat.get(key)
            for a in range(0, sizes[key], BLOCK):
                b = min(a + BLOCK, sizes[key])
                block = stack[:n, : b - a]
                for r, row in enumerate(rows):
                    if bounds is None:
                        block[r] = row[key][a:b]
                    else:
                        np.maximum(row[key][a:b], bounds[0][a:b], out=block[r])
                        np.minimum(block[r], bounds[1][a:b], out=block[r])
                if block.dtype != np.float64:
                    block = wide[:n, : b - a]
                    block[...] = stack[:n, : b - a]
                acc[key][a:b].addmv_(torch.from_numpy(block).T, c)  # += block^T c
        del rows  # the group's mappings, if any, go with them
    return out


#: The safetensors dtype each tensor dtype is read from by :func:`load_state`.
_STORED = {torch.float32: ("F32", np.float32), torch.float64: ("F64", np.float64)}


def load_state(
    state: Mapping[str, Tensor], global_state: Mapping[str, Tensor]
) -> dict[str, Tensor] | None:
    """A stored upload's tensors in fresh buffers of its own (None: not a stored upload this
    reader understands): each floating layer stored in the global layer's dtype (float32 or
    float64) and shape read with one ``pread`` (fedkey.federation.updates.slices), anything else through
    ``StoredState``. The strategy pass reads each upload through this once, and the trim and the
    clip then work in these buffers in place (:func:`clamp_state`, influence.scale_deltas)
    instead of mapping the file for each tensor and copying each tensor twice more."""
    if not isinstance(state, StoredState):
        return None
    reader = SliceReader.open(state.path)
    if reader is None:
        return None
    out: dict[str, Tensor] = {}
    for key in state:
        g = global_state.get(key)
        stored, dtype = _STORED.get(g.dtype, (None, None)) if g is not None else (None, None)
        if g is None or stored != reader.dtype(key) or reader.shape(key) != tuple(g.shape):
            out[key] = state[key]
            continue
        buf = np.empty(g.numel(), dtype)
        if not reader.read_into(key, 0, buf.size, buf):
            out[key] = state[key]
            continue
        out[key] = torch.from_numpy(buf).reshape(g.shape)
    return out


def clamp_state(
    state: Mapping[str, Tensor], limits: Limits | None, inplace: bool = False
) -> Mapping[str, Tensor]:
    """The trimmed update: each coordinate clamped to the cohort's range of values, in the
    update's own dtypes (the state itself when there is no trim). The same numbers as clamping
    the delta to the range of deltas and adding the global back (module docstring).
    ``inplace``: the state's tensors are its own (:func:`load_state`), clamped where they are."""
    if limits is None:
        return state
    out = dict(state)
    for key, (lo, hi) in limits.items():
        c = state[key].detach()
        if c.shape != lo.shape:
            raise ValueError(
                f"layer {key!r}: update shape {tuple(c.shape)} != model {tuple(lo.shape)}"
            )
        if c.dtype == lo.dtype:
            out[key] = torch.clamp(c, lo, hi, out=c) if inplace else torch.clamp(c, lo, hi)
        else:  # bfloat16 / float16 updates: clamped in float32, which holds them exactly
            out[key] = torch.clamp(c.to(lo.dtype), lo, hi).to(c.dtype)
    return out
