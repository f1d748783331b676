"""THE speculation rule (docs/tracing.md, "pos analyze"), compiled with numba.

A launch may access every live allocation that one of its parameter values points into,
interior pointers included: a pointer parameter is one 8-byte value; a by-value aggregate (or a
parameter whose type is unknown) is scanned word by word at 8-byte steps from its start (the ABI
aligns a struct holding pointers to 8). A pointer to const is a read, every other match a
read-write. Scalars are ignored. A memcpy reads the allocations its device source range overlaps
and writes those its device destination range overlaps; a memset writes its range.

`launch_access` is the core on plain arrays, so that the in-process agent can call it for one
launch with its own live table; `sweep` replays a whole trace in time order over it, keeping the
table of live allocations sorted by base so that a value is matched by binary search against the
allocations live *at that launch* (addresses are reused after a free).
"""

import numba as nb
import numpy as np

from pos.analyzer.demangle import CONST_PTR, PTR, SCALAR
from pos.analyzer.ops import DST_DEVICE, OP_ALLOC, OP_FREE, OP_LAUNCH, OP_MEMCPY, SRC_DEVICE, Ops

# Evidence `param` of copies: which side of the copy matched.
COPY_DST, COPY_SRC = 0, 1


@nb.njit(cache=True, inline="always")
def _load_u64(b: np.ndarray, at: int) -> np.uint64:
    v = np.uint64(0)
    for i in range(8):
        v |= np.uint64(b[at + i]) << np.uint64(8 * i)
    return v


@nb.njit(cache=True, inline="always")
def find(bases: np.ndarray, ends: np.ndarray, n: int, v: np.uint64) -> int:
    """The index of the live allocation holding address v (bases sorted, n live), or -1."""
    lo, hi = 0, n
    while lo < hi:                       # first index with bases[i] > v
        mid = (lo + hi) >> 1
        if bases[mid] <= v:
            lo = mid + 1
        else:
            hi = mid
    j = lo - 1
    if j >= 0 and v < ends[j]:
        return j
    return -1


@nb.njit(cache=True, inline="always")
def lower_bound(bases: np.ndarray, n: int, v: np.uint64) -> int:
    """The first slot whose base is > v."""
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi) >> 1
        if bases[mid] <= v:
            lo = mid + 1
        else:
            hi = mid
    return lo


@nb.njit(cache=True)
def max_evidence(sizes: np.ndarray, kinds: np.ndarray) -> int:
    """The most evidence rows one launch of this layout can give (one per word looked at)."""
    m = 0
    for p in range(sizes.shape[0]):
        if kinds[p] == CONST_PTR or kinds[p] == PTR:
            m += 1
        elif kinds[p] != SCALAR:
            m += sizes[p] // 8
    return m


@nb.njit(cache=True)
def launch_access(params: np.ndarray, pstart: int, plen: int, offsets: np.ndarray,
                  sizes: np.ndarray, kinds: np.ndarray, bases: np.ndarray, ends: np.ndarray,
                  n_live: int, out_slot: np.ndarray, out_param: np.ndarray,
                  out_word: np.ndarray, out_off: np.ndarray, out_write: np.ndarray,
                  k: int) -> int:
    """Evidence of one launch, appended at row k of the out_* arrays; returns the new k.

    params[pstart:pstart+plen] are the captured bytes; parameter p lies at offsets[p] with
    sizes[p] bytes and kind kinds[p] (demangle.py). A row says: live slot, parameter, byte
    offset of the word inside the parameter, offset inside the allocation, written or not.
    The caller makes room for max_evidence(sizes, kinds) rows."""
    for p in range(offsets.shape[0]):
        kind = kinds[p]
        if kind == SCALAR:
            continue
        size = sizes[p]
        step_end = 8 if (kind == CONST_PTR or kind == PTR) else size
        w = 0
        while w + 8 <= step_end and w + 8 <= size:
            at = offsets[p] + w
            if at + 8 > plen:            # truncated capture: no bytes, no evidence
                break
            v = _load_u64(params, pstart + at)
            j = find(bases, ends, n_live, v)
            if j >= 0:
                out_slot[k] = j
                out_param[k] = p
                out_word[k] = w
                out_off[k] = v - bases[j]
                out_write[k] = kind != CONST_PTR
                k += 1
            w += 8
    return k


@nb.njit(cache=True)
def _range_access(lo: np.uint64, size: np.uint64, bases: np.ndarray, ends: np.ndarray,
                  n_live: int, ids: np.ndarray, side: int, write: bool, ev_alloc: np.ndarray,
                  ev_param: np.ndarray, ev_word: np.ndarray, ev_off: np.ndarray,
                  ev_write: np.ndarray, k: int) -> int:
    """Evidence of a copy side: every live allocation that [lo, lo+size) overlaps."""
    if size == 0:
        return k
    hi = lo + size
    j = find(bases, ends, n_live, hi - np.uint64(1))
    if j < 0:                            # the last byte is in no allocation: the one before it?
        lo2, hi2 = 0, n_live
        while lo2 < hi2:
            mid = (lo2 + hi2) >> 1
            if bases[mid] < hi:
                lo2 = mid + 1
            else:
                hi2 = mid
        j = lo2 - 1
    while j >= 0 and ends[j] > lo:
        ev_alloc[k] = ids[j]
        ev_param[k] = side
        ev_word[k] = -1
        ev_off[k] = lo - bases[j] if lo > bases[j] else np.uint64(0)
        ev_write[k] = write
        k += 1
        j -= 1
    return k


@nb.njit(cache=True)
def _grow(a: np.ndarray, n: int) -> np.ndarray:
    b = np.empty(n, a.dtype)
    b[: a.shape[0]] = a
    return b


@nb.njit(cache=True)
def sweep(op_kind: np.ndarray, op_a: np.ndarray, op_b: np.ndarray, op_c: np.ndarray,
          op_sig: np.ndarray, op_pstart: np.ndarray, op_plen: np.ndarray, pbytes: np.ndarray,
          sig_start: np.ndarray, sig_off: np.ndarray, sig_size: np.ndarray,
          sig_kind: np.ndarray, max_live: int):
    """Replay a trace's operations in order; evidence rows of every op (CSR by op).

    ALLOC: a=base, b=size, c=allocation id. FREE: a=base. LAUNCH: op_sig/op_pstart/op_plen.
    MEMCPY: a=dst, b=src, c=size, op_sig=DST_DEVICE|SRC_DEVICE flags. MEMSET: a=dst, c=size.
    Returns (ev_start, ev_alloc, ev_param, ev_word, ev_off, ev_write)."""
    n_ops = op_kind.shape[0]
    bases = np.empty(max_live + 1, np.uint64)
    ends = np.empty(max_live + 1, np.uint64)
    ids = np.empty(max_live + 1, np.int64)
    n_live = 0
    cap = max(1024, 2 * n_ops)
    ev_alloc = np.empty(cap, np.int64)
    ev_param = np.empty(cap, np.int32)
    ev_word = np.empty(cap, np.int32)
    ev_off = np.empty(cap, np.uint64)
    ev_write = np.empty(cap, np.bool_)
    ev_start = np.empty(n_ops + 1, np.int64)
    k = 0
    for i in range(n_ops):
        ev_start[i] = k
        kind = op_kind[i]
        if kind == OP_ALLOC:
            base, end = op_a[i], op_a[i] + op_b[i]
            j = find(bases, ends, n_live, base)
            if j >= 0 and bases[j] == base:          # a free we did not see: replaced
                ends[j] = end
                ids[j] = op_c[i]
                continue
            pos = j + 1 if j >= 0 else 0
            if j < 0:                                # insertion point among the bases
                pos = lower_bound(bases, n_live, base)
            for t in range(n_live, pos, -1):
                bases[t] = bases[t - 1]
                ends[t] = ends[t - 1]
                ids[t] = ids[t - 1]
            bases[pos] = base
            ends[pos] = end
            ids[pos] = op_c[i]
            n_live += 1
        elif kind == OP_FREE:
            j = find(bases, ends, n_live, op_a[i])
            if j >= 0 and bases[j] == op_a[i]:
                for t in range(j, n_live - 1):
                    bases[t] = bases[t + 1]
                    ends[t] = ends[t + 1]
                    ids[t] = ids[t + 1]
                n_live -= 1
        elif kind == OP_LAUNCH:
            s = op_sig[i]
            lo_p, hi_p = sig_start[s], sig_start[s + 1]
            need = max_evidence(sig_size[lo_p:hi_p], sig_kind[lo_p:hi_p])
            if k + need > ev_alloc.shape[0]:
                cap = 2 * (k + need)
                ev_alloc, ev_param, ev_word = _grow(ev_alloc, cap), _grow(ev_param, cap), _grow(ev_word, cap)
                ev_off, ev_write = _grow(ev_off, cap), _grow(ev_write, cap)
            k2 = launch_access(pbytes, op_pstart[i], op_plen[i], sig_off[lo_p:hi_p],
                               sig_size[lo_p:hi_p], sig_kind[lo_p:hi_p], bases, ends, n_live,
                               ev_alloc, ev_param, ev_word, ev_off, ev_write, k)
            for r in range(k, k2):               # live slots -> allocation ids
                ev_alloc[r] = ids[ev_alloc[r]]
            k = k2
        else:
            if k + 2 * n_live + 2 > ev_alloc.shape[0]:
                cap = 2 * (k + 2 * n_live + 2)
                ev_alloc, ev_param, ev_word = _grow(ev_alloc, cap), _grow(ev_param, cap), _grow(ev_word, cap)
                ev_off, ev_write = _grow(ev_off, cap), _grow(ev_write, cap)
            if kind == OP_MEMCPY:
                if op_sig[i] & SRC_DEVICE:
                    k = _range_access(op_b[i], op_c[i], bases, ends, n_live, ids, COPY_SRC, False,
                                      ev_alloc, ev_param, ev_word, ev_off, ev_write, k)
                if op_sig[i] & DST_DEVICE:
                    k = _range_access(op_a[i], op_c[i], bases, ends, n_live, ids, COPY_DST, True,
                                      ev_alloc, ev_param, ev_word, ev_off, ev_write, k)
            else:
                k = _range_access(op_a[i], op_c[i], bases, ends, n_live, ids, COPY_DST, True,
                                  ev_alloc, ev_param, ev_word, ev_off, ev_write, k)
    ev_start[n_ops] = k
    return ev_start, ev_alloc[:k], ev_param[:k], ev_word[:k], ev_off[:k], ev_write[:k]


class Evidence:
    """The evidence rows of every op of a trace (CSR: op i has rows start[i]:start[i+1])."""

    def __init__(self, start: np.ndarray, alloc: np.ndarray, param: np.ndarray,
                 word: np.ndarray, off: np.ndarray, write: np.ndarray) -> None:
        self.start, self.alloc, self.param, self.word = start, alloc, param, word
        self.off, self.write = off, write

    def sets(self, op: int) -> tuple[list[int], list[int]]:
        """(allocation ids op may read, those it may write), each sorted; a read-write
        access is in both."""
        lo, hi = self.start[op], self.start[op + 1]
        ids, writes = self.alloc[lo:hi], self.write[lo:hi]
        # a launch reads all it may access; a copy reads its source side only
        reads = sorted({int(a) for a, w, d in zip(ids, writes, self.word[lo:hi]) if d >= 0 or not w})
        return reads, sorted({int(a) for a in ids[writes]})


def speculate(ops: Ops) -> Evidence:
    """The evidence of every op of `ops`, by the rule of this module."""
    return Evidence(*sweep(ops.kind, ops.a, ops.b, ops.c, ops.sig, ops.pstart, ops.plen,
                           ops.pbytes, ops.sig_start, ops.sig_off, ops.sig_size, ops.sig_kind,
                           max(1, len(ops.alloc_base))))


def launch_sets(params: bytes, offsets: np.ndarray, sizes: np.ndarray, kinds: np.ndarray,
                bases: np.ndarray, ends: np.ndarray) -> tuple[set[int], set[int]]:
    """(bases read, bases written) of one launch against a live table sorted by base: the
    entry point for in-process callers (the validator, the agent)."""
    offsets = np.asarray(offsets, np.int64)
    sizes = np.asarray(sizes, np.int64)
    kinds = np.asarray(kinds, np.int8)
    n = max_evidence(sizes, kinds)
    slot, param, word = np.empty(n, np.int64), np.empty(n, np.int32), np.empty(n, np.int32)
    off, write = np.empty(n, np.uint64), np.empty(n, np.bool_)
    buf = np.frombuffer(params, np.uint8)
    k = launch_access(buf, 0, len(buf), offsets, sizes, kinds, bases, ends, len(bases),
                      slot, param, word, off, write, 0)
    reads = {int(bases[slot[r]]) for r in range(k)}
    return reads, {int(bases[slot[r]]) for r in range(k) if write[r]}
