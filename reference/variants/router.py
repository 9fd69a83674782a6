"""The router's top-K among equal probabilities: undefined upstream, so each implementation has its own.

transformers' ``DiffusionGemmaTextRouter`` takes ``torch.topk(probs, K)``. torch documents that "the indices
of tied elements are not guaranteed to be stable"; what its CPU kernel (``aten/src/ATen/native/TopKImpl.h``)
actually returns is whatever the C++ standard library's selection leaves in front:

* when 64 K <= E: ``std::partial_sort`` of the (value, index) pairs (a heap of the first K, then a sorted
  heap), comparing values only;
* otherwise ``std::nth_element`` (introselect: median-of-three quicksort partitions while more than 3
  remain, then insertion sort) followed by ``std::sort`` of the first K - 1.

Which of several equal experts comes out therefore depends on every value of the row and on E and K, not
on the tied experts' indices: of [1, 1, 1, 0] with K = 2 it keeps experts 1 and 2; of eight equal values
with K = 2 it keeps 6 and 5. On CUDA ties come out in yet another order (pytorch/pytorch#127196: of
[3, 2, 3, 2, 1, 1] with K = 2, [0, 2] on the CPU and [2, 0] on CUDA). The reference keeps
the lower-index rule (``layers.lower_index_top_k``, trap T25), which is what JAX's ``lax.top_k`` documents
(the JAX DiffusionGemma calls ``jax.lax.approx_max_k``, exact off TPU: docs/PEERS.md). llama.cpp selects
experts with ggml's top-k, a ``std::sort`` or ``std::partial_sort`` of the expert indices by probability
depending on the version, which defines no order among equal values either.

``torch_cpu_top_k`` reproduces torch 2.13's CPU order with GNU libstdc++ (the library the PyPI wheels are
built with) from the algorithms' definitions, so that a run with exactly tied router rows can be compared
with transformers on the CPU: ``model.router_top_k = torch_cpu_top_k``. It loops in Python over rows and is
meant for tests and the cross-check, not for speed. ``boundary_ties`` says which rows the choice affects.
"""

from __future__ import annotations

import numpy as np

from ..layers import lower_index_top_k

__all__ = ["ROUTER_TOP_K", "torch_cpu_top_k", "boundary_ties"]


def boundary_ties(probs: np.ndarray, k: int) -> np.ndarray:
    """(N,) bool: rows whose K-th and (K+1)-th largest probabilities are equal, so that the set of experts
    kept depends on the tie rule. Ties inside the kept K change only their order (the summation order of
    the expert outputs, last bits). probs: (N, E); K < E, else no row can be tied at the boundary."""
    probs = np.asarray(probs)
    if k >= probs.shape[-1]:
        return np.zeros(probs.shape[0], dtype=bool)
    ranked = -np.sort(-probs, axis=-1)
    return ranked[:, k - 1] == ranked[:, k]


def torch_cpu_top_k(probs: np.ndarray, k: int) -> np.ndarray:
    """``torch.topk(probs, k).indices`` as torch 2.13 computes it on the CPU (largest, sorted), ties included.

    probs: (N, E) float; k: 1 <= K <= E. Returns (N, K) int64. NaN is not handled (torch ranks it first;
    the reference's router never sees NaN probabilities without failing later).
    """
    probs = np.asarray(probs)
    out = np.empty((probs.shape[0], k), dtype=np.int64)
    for row, values in enumerate(probs):
        pairs = [(float(v), j) for j, v in enumerate(values)]
        if k * 64 <= len(pairs):
            _partial_sort(pairs, 0, k, len(pairs))
        else:
            _nth_element(pairs, k - 1, len(pairs))
            _sort(pairs, 0, k - 1)
        out[row] = [j for _, j in pairs[:k]]
    return out


# the router selections by name: the reference's own and torch's CPU order
ROUTER_TOP_K = {"lower-index": lower_index_top_k, "torch-cpu": torch_cpu_top_k}


# ------------------------------------------------------------- the standard library's algorithms, in order
# ``a`` is a list of (value, index) pairs; "before" is the comparator torch passes: a larger value. Ranges
# are half-open [lo, hi), as in C++.
def _before(x: tuple, y: tuple) -> bool:
    return x[0] > y[0]


def _median_to_front(a: list, front: int, i: int, j: int, m: int) -> None:
    """Move the median of a[i], a[j], a[m] (by ``_before``) to position ``front``."""
    x, y, z = a[i], a[j], a[m]
    if _before(x, y):
        pick = j if _before(y, z) else (m if _before(x, z) else i)
    else:
        pick = i if _before(x, z) else (m if _before(y, z) else j)
    a[front], a[pick] = a[pick], a[front]


def _partition(a: list, lo: int, hi: int) -> int:
    """Median-of-three pivot moved to ``lo``, then Hoare partition of [lo + 1, hi) around it; returns the cut."""
    _median_to_front(a, lo, lo + 1, lo + (hi - lo) // 2, hi - 1)
    pivot, first, last = a[lo], lo + 1, hi
    while True:
        while _before(a[first], pivot):
            first += 1
        last -= 1
        while _before(pivot, a[last]):
            last -= 1
        if first >= last:
            return first
        a[first], a[last] = a[last], a[first]
        first += 1


def _insertion_sort(a: list, lo: int, hi: int) -> None:
    for i in range(lo + 1, hi):
        value = a[i]
        if _before(value, a[lo]):  # goes to the very front: shift the whole prefix
            a[lo + 1:i + 1] = a[lo:i]
            a[lo] = value
        else:
            _insert_unguarded(a, i)


def _insert_unguarded(a: list, i: int) -> None:
    """Shift a[i] left past every element it goes before (something to its left stops it)."""
    value = a[i]
    while _before(value, a[i - 1]):
        a[i] = a[i - 1]
        i -= 1
    a[i] = value


def _sift(a: list, lo: int, hole: int, size: int, value: tuple) -> None:
    """Heap adjustment of the heap a[lo:lo+size] (its top is the element everything else goes before):
    move the hole at ``hole`` down to a leaf along the larger children, then push ``value`` up from there."""
    top, child = hole, hole
    while child < (size - 1) // 2:
        child = 2 * (child + 1)
        if _before(a[lo + child], a[lo + child - 1]):
            child -= 1
        a[lo + hole] = a[lo + child]
        hole = child
    if size % 2 == 0 and child == (size - 2) // 2:
        child = 2 * (child + 1)
        a[lo + hole] = a[lo + child - 1]
        hole = child - 1
    parent = (hole - 1) // 2
    while hole > top and _before(a[lo + parent], value):
        a[lo + hole] = a[lo + parent]
        hole, parent = parent, (parent - 1) // 2
    a[lo + hole] = value


def _make_heap(a: list, lo: int, hi: int) -> None:
    size = hi - lo
    for parent in range((size - 2) // 2, -1, -1) if size >= 2 else ():
        _sift(a, lo, parent, size, a[lo + parent])


def _pop_into(a: list, lo: int, hi: int, slot: int) -> None:
    """Put the heap a[lo:hi]'s top into ``slot`` and the element that was there into the heap."""
    value = a[slot]
    a[slot] = a[lo]
    _sift(a, lo, 0, hi - lo, value)


def _heap_select(a: list, lo: int, mid: int, hi: int) -> None:
    _make_heap(a, lo, mid)
    for i in range(mid, hi):
        if _before(a[i], a[lo]):
            _pop_into(a, lo, mid, i)


def _partial_sort(a: list, lo: int, mid: int, hi: int) -> None:
    _heap_select(a, lo, mid, hi)
    for end in range(mid - 1, lo, -1):  # sort the heap
        _pop_into(a, lo, end, end)


def _nth_element(a: list, nth: int, hi: int) -> None:
    lo = 0
    if nth == hi:
        return
    depth = 2 * ((hi - lo).bit_length() - 1)
    while hi - lo > 3:
        if depth == 0:
            _heap_select(a, lo, nth + 1, hi)
            a[lo], a[nth] = a[nth], a[lo]
            return
        depth -= 1
        cut = _partition(a, lo, hi)
        if cut <= nth:
            lo = cut
        else:
            hi = cut
    _insertion_sort(a, lo, hi)


def _introsort(a: list, lo: int, hi: int, depth: int) -> None:
    while hi - lo > 16:
        if depth == 0:
            _partial_sort(a, lo, hi, hi)
            return
        depth -= 1
        cut = _partition(a, lo, hi)
        _introsort(a, cut, hi, depth)
        hi = cut


def _sort(a: list, lo: int, hi: int) -> None:
    if hi - lo < 2:
        return
    _introsort(a, lo, hi, 2 * ((hi - lo).bit_length() - 1))
    if hi - lo > 16:
        _insertion_sort(a, lo, lo + 16)
        for i in range(lo + 16, hi):
            _insert_unguarded(a, i)
    else:
        _insertion_sort(a, lo, hi)
