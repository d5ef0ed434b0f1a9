"""The trim's order statistics by selection instead of a sort: each coordinate's (k+1)-th smallest
and (k+1)-th largest value over the cohort, the same values as sorting the cohort's values
(fedkey.federation.influence.cohort_scan._order_statistics, kept as the reference and for DP), in
about half its time at 1,000 phones.

How. The block's float values are mapped to integers of their width whose order is the floats'
(the sign-magnitude trick of radix sorts: a non-negative float's bits read as a signed integer
are already in order; a negative float's magnitude bits are flipped, ``i ^ 0x7fffffff``, so a
larger magnitude is a smaller integer; -0.0 becomes -1, just below +0.0's 0, which compare
equal as floats). Then two selections per coordinate, numpy's ``ndarray.partition`` (introselect,
Musser 1997, "Introspective Sorting and Selection Algorithms": quickselect, Hoare 1961, with a
linear-time fallback; numpy 2's x86-simd-sort quickselect where its build and the CPU have
it): position k (from 0) of the whole row, which puts the k smallest before it, then position
m-2k-2 of the rest, the (k+1)-th largest, with the k largest after it. Expected linear time
where the sort is m log m; each selected integer is mapped back to its float (the map is its own
inverse), bit for bit one of the coordinate's own values.

Error: none. A monotone map leaves the order statistics where they are, so these are the sort's
values (tests/federation/influence/test_selection.py checks them equal to np.sort's, ties,
infinities, signed zeros and 300-1,000 phones included). Where the map does not order the
values, a NaN (a negative NaN's bits map below every number, where np.sort puts NaN last), the
block is left to the sort: a NaN's key is below -inf's or above +inf's, so it is among a row's
k+1 smallest or k+1 largest keys once they are selected, and a look at those finds it (stored
uploads are refused when not finite, fedkey.federation.updates.validation: the look is all it
costs).

Why not an approximation. The issue asked for one (a histogram or sampled quantile with a
bounded error) and the measurements, one core of this machine's AVX2 EPYC (no AVX-512: numpy's
SIMD sort there is its AVX2 one), timed by hand on blocks of 131,072 float32 values, rule it out:
np.sort 7-10 ns a value at 300-1,000 phones; these two selections 4.7-5.8; a count of the
values below a threshold per coordinate (what a histogram or a bisection is made of) 0.6 ns a
value and a threshold, so a value error of 1/64 of a coordinate's range already costs as much
as the sort; a sampled quantile needs most of the cohort to hold its rank error to a few ranks
(a sample of s of m phones misses the 10% quantile by about m sqrt(0.09/s) ranks: 19 of 500
with s = 64); and a sort of 16-bit keys (quantized values) has no SIMD path here (45 ns a
value).
"""

from __future__ import annotations

import numpy as np

#: Cohorts of at least this many phones are selected, smaller ones sorted: numpy's partition
#: costs more a row than its sort, so the selection was slower at 300 phones (8.4 ns a value
#: against the sort's 7.0), faster from 500 (6.4 against 7.1) and half at 1,000 (4.7 against
#: 10.0, the sort there two groups' and their merge), timed by hand on blocks of 131,072 float32
#: values, one core.
SELECT_FROM = 400

#: Per float width, the signed integer of that width and its magnitude bits.
_KEYS: dict[np.dtype, tuple[np.dtype, np.integer]] = {
    np.dtype(np.float32): (np.dtype(np.int32), np.int32(0x7FFFFFFF)),
    np.dtype(np.float64): (np.dtype(np.int64), np.int64(0x7FFFFFFFFFFFFFFF)),
}


def _flip(bits: np.ndarray, magnitude: np.integer) -> np.ndarray:
    """``bits ^ magnitude`` where ``bits`` is negative, ``bits`` else: a new array. Its own
    inverse (the sign bit is left as it is)."""
    keys = np.right_shift(bits, bits.dtype.itemsize * 8 - 1)  # -1 where negative, 0 else
    np.bitwise_and(keys, magnitude, out=keys)
    return np.bitwise_xor(keys, bits, out=keys)


def ordered_keys(values: np.ndarray) -> np.ndarray:
    """Integers in the order of ``values`` (float32 or float64, no NaN): equal floats other than
    -0.0 and +0.0 give equal keys, a smaller float a smaller key. A new array."""
    dtype, magnitude = _KEYS[values.dtype]
    return _flip(values.view(dtype), magnitude)


def from_keys(keys: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """The floats of dtype ``dtype`` whose :func:`ordered_keys` are ``keys``, bit for bit."""
    return _flip(keys, _KEYS[np.dtype(dtype)][1]).view(dtype)


def select_limits(cols: np.ndarray, k: int, lo: np.ndarray, hi: np.ndarray) -> bool:
    """Each row's (k+1)-th smallest and (k+1)-th largest value into ``lo`` and ``hi`` (``cols``: a
    contiguous coordinates x phones array of float32 or float64, left as it is; m > 2k phones),
    by selection (module docstring): the values np.sort gives. False, with nothing written,
    where a value is NaN (its key is below -inf's or above +inf's: the caller sorts the block)."""
    if cols.dtype not in _KEYS:
        return False
    m = cols.shape[1]
    keys = ordered_keys(cols)
    keys.partition(k, axis=1)  # the k smallest before column k
    rest = keys[:, k + 1 :]  # every value at or above the (k+1)-th smallest
    top = m - 2 * k - 2  # the (k+1)-th largest's place in the rest
    if top >= 0:
        rest.partition(top, axis=1)  # the k largest after it
    # A NaN, if any, is among the row's k + 1 smallest keys (a negative one) or its k + 1 largest.
    inf = ordered_keys(np.array([-np.inf, np.inf], cols.dtype))
    tail = keys[:, k + 1 + top :] if top >= 0 else keys[:, k:]
    if keys[:, : k + 1].min() < inf[0] or tail.max() > inf[1]:
        return False
    low = keys[:, k]
    lo[:] = from_keys(low, cols.dtype)
    hi[:] = from_keys(rest[:, top] if top >= 0 else low, cols.dtype)  # m = 2k + 1: the median
    return True
