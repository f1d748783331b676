"""The DAG of a trace and what a checkpoint can learn from it.

Nodes are launches, copies and sets; an edge joins two of them through a buffer (an allocation)
when the later one reads what the earlier wrote (RAW), overwrites it (WAW), or overwrites what
the earlier read (WAR). Training and serving loops repeat one launch sequence: its period is
found on the sequence of kernel names (and copy kinds), and per buffer the writes per iteration
and *when* in the iteration the first write comes give the order in which a checkpoint should
copy buffers (soonest written first: each one copied before the application overwrites it is a
soft copy-on-write avoided) and the predicted costs of a stop-the-world and of a concurrent
checkpoint, with the bandwidths measured on the H100 (bench/results/README.md).
"""

from dataclasses import dataclass
from typing import Optional

import numba as nb
import numpy as np

from pos.analyzer.access import Evidence
from pos.analyzer.ops import OP_ALLOC, OP_FREE, OP_LAUNCH, OP_MEMCPY, Ops

RAW, WAW, WAR = 0, 1, 2
EDGE_NAMES = ("RAW", "WAW", "WAR")
# Measured on the H100 (bench/results/README.md): what the copies of a checkpoint run at.
D2H_PINNED_BPS = 53e9          # pos's copier, pinned device -> host
DRIVER_CHECKPOINT_BPS = 1.8e9  # cuCheckpointProcessCheckpoint, stop-the-world
D2D_BPS = 1.44e12              # a soft copy-on-write into a device shadow
LOCK_UNLOCK_S = 0.002          # cuCheckpointProcessLock + Unlock


@nb.njit(cache=True)
def accesses(ev_start: np.ndarray, ev_alloc: np.ndarray, ev_word: np.ndarray,
             ev_write: np.ndarray, n_alloc: int):
    """Each op's distinct buffers with read/write flags (CSR), from its evidence rows."""
    n = ev_start.shape[0] - 1
    seen = np.full(n_alloc, -1, np.int64)      # buffer -> its row in this op's accesses
    start = np.empty(n + 1, np.int64)
    buf = np.empty(ev_alloc.shape[0], np.int64)
    rd = np.zeros(ev_alloc.shape[0], np.bool_)
    wr = np.zeros(ev_alloc.shape[0], np.bool_)
    k = 0
    for i in range(n):
        start[i] = k
        for r in range(ev_start[i], ev_start[i + 1]):
            b = ev_alloc[r]
            if seen[b] < start[i]:
                seen[b] = k
                buf[k] = b
                rd[k] = False
                wr[k] = False
                k += 1
            j = seen[b]
            if ev_word[r] >= 0 or not ev_write[r]:     # a launch reads all it may access
                rd[j] = True
            if ev_write[r]:
                wr[j] = True
    start[n] = k
    return start, buf[:k], rd[:k], wr[:k]


@nb.njit(cache=True)
def edges(start: np.ndarray, buf: np.ndarray, rd: np.ndarray, wr: np.ndarray, n_alloc: int):
    """(src op, dst op, buffer, RAW/WAW/WAR) of every dependency, in op order."""
    n_acc = buf.shape[0]
    last_writer = np.full(n_alloc, -1, np.int64)
    head = np.full(n_alloc, -1, np.int64)      # readers since the last write: a linked list
    nxt = np.empty(n_acc, np.int64)
    who = np.empty(n_acc, np.int64)
    src = np.empty(2 * n_acc, np.int64)
    dst = np.empty(2 * n_acc, np.int64)
    via = np.empty(2 * n_acc, np.int64)
    typ = np.empty(2 * n_acc, np.int8)
    e = 0
    n_readers = 0
    for i in range(start.shape[0] - 1):
        for k in range(start[i], start[i + 1]):
            b = buf[k]
            w = last_writer[b]
            if w >= 0 and (rd[k] or wr[k]):
                src[e], dst[e], via[e], typ[e] = w, i, b, RAW if rd[k] else WAW
                e += 1
            if wr[k]:
                r = head[b]
                while r >= 0:
                    if who[r] != i:
                        src[e], dst[e], via[e], typ[e] = who[r], i, b, WAR
                        e += 1
                    r = nxt[r]
                head[b] = -1
                last_writer[b] = i
            else:
                who[n_readers] = i
                nxt[n_readers] = head[b]
                head[b] = n_readers
                n_readers += 1
    return src[:e], dst[:e], via[:e], typ[:e]


def op_keys(ops: Ops) -> tuple[np.ndarray, np.ndarray]:
    """(indices of the launches/copies/sets, their keys): a kernel name's number, or the kind
    of copy. Iterations are periods of this sequence."""
    idx = np.flatnonzero((ops.kind != OP_ALLOC) & (ops.kind != OP_FREE))
    names: dict[Optional[str], int] = {}
    sig_key = np.array([names.setdefault(n if n is not None else f"?{s}", len(names))
                        for s, n in enumerate(ops.sig_name)] or [0], np.int64)
    kind = ops.kind[idx]
    keys = np.where(kind == OP_LAUNCH, sig_key[np.where(kind == OP_LAUNCH, ops.sig[idx], 0)],
                    -10 * kind.astype(np.int64) - np.where(kind == OP_MEMCPY, ops.sig[idx], 0))
    return idx, keys


def _longest_run(match: np.ndarray) -> tuple[int, int]:
    """(start, length) of the longest run of True."""
    if not match.any():
        return 0, 0
    m = np.concatenate(([0], match.view(np.int8), [0]))
    d = np.diff(m)
    starts, ends = np.flatnonzero(d == 1), np.flatnonzero(d == -1)
    i = int(np.argmax(ends - starts))
    return int(starts[i]), int(ends[i] - starts[i])


@dataclass
class Iterations:
    """The repeating part of the op sequence: `count` iterations of `period` ops from `first`
    (positions in the launches/copies/sets sequence); detected False: the whole trace as one."""

    detected: bool
    first: int
    period: int
    count: int


def find_iterations(keys: np.ndarray, window: int = 16, max_candidates: int = 256) -> Iterations:
    """The period whose repetition covers the longest stretch of the sequence, at least three
    times (the smallest such
    period: a multiple of it covers as much). Candidates are the distances between repeats of
    windows taken at a few places in the sequence."""
    n = len(keys)
    whole = Iterations(False, 0, n, 1 if n else 0)
    if n < 4:
        return whole
    L = max(1, min(window, n // 4))
    candidates: set[int] = set()
    for anchor in sorted({n // 4, n // 2, (3 * n) // 4, n - L}):
        w = keys[anchor:anchor + L]
        at = [int(p) for p in np.flatnonzero(keys[:n - L + 1] == w[0])
              if np.array_equal(keys[p:p + L], w)]
        candidates.update(abs(p - anchor) for p in at if 0 < abs(p - anchor) <= n // 2)
    best: Optional[tuple[int, int, int]] = None     # (covered, -period, first)
    for p in sorted(candidates)[:max_candidates]:
        first, run = _longest_run(keys[:-p] == keys[p:])
        if run >= 2 * p and (best is None or (run + p, -p) > best[:2]):
            best = (run + p, -p, first)
            if run + p >= 0.9 * n:      # nothing longer can cover more than a little more
                break
    if best is None:
        return whole
    covered, p, first = best[0], -best[1], best[2]
    return Iterations(True, first, p, covered // p)


@nb.njit(cache=True)
def _buffer_stats(seq: np.ndarray, first: int, period: int, count: int, ts: np.ndarray,
                  start: np.ndarray, buf: np.ndarray, wr: np.ndarray, sizes: np.ndarray):
    """Per buffer over the iterations: writes, sum of first-write positions and times (ns from
    the iteration's start), iterations written in; and the bytes dirtied in each iteration."""
    n_alloc = sizes.shape[0]
    writes = np.zeros(n_alloc, np.int64)
    pos_sum = np.zeros(n_alloc, np.float64)
    t_sum = np.zeros(n_alloc, np.float64)
    n_written = np.zeros(n_alloc, np.int64)
    last_it = np.full(n_alloc, -1, np.int64)
    dirtied = np.zeros(count, np.int64)
    for it in range(count):
        s = first + it * period
        t0 = ts[seq[s]]
        for q in range(s, s + period):
            op = seq[q]
            for k in range(start[op], start[op + 1]):
                if not wr[k]:
                    continue
                b = buf[k]
                writes[b] += 1
                if last_it[b] != it:
                    last_it[b] = it
                    n_written[b] += 1
                    pos_sum[b] += q - s
                    t_sum[b] += ts[op] - t0
                    dirtied[it] += sizes[b]
    return writes, pos_sum, t_sum, n_written, dirtied


def first_writes(seq: np.ndarray, keys: np.ndarray, ts: np.ndarray, start: np.ndarray,
                 buf: np.ndarray, wr: np.ndarray, sizes: np.ndarray
                 ) -> tuple["Iterations", np.ndarray, np.ndarray, np.ndarray, np.ndarray,
                            np.ndarray]:
    """Iterations of the call sequence `seq` (op indices, with their `keys`) and, per buffer,
    where in an iteration its first write comes: (iterations, writes, n_written, first_pos,
    first_s, dirtied). `start`/`buf`/`wr` are the ops' accesses (CSR by op), `ts` their times
    in ns (zeros when unknown). The one implementation for `pos analyze` and the agent."""
    it = find_iterations(keys)
    writes, pos_sum, t_sum, n_written, dirtied = _buffer_stats(
        seq, it.first, it.period, it.count, ts, start, buf, wr, sizes)
    with np.errstate(invalid="ignore", divide="ignore"):
        first_pos = np.where(n_written > 0, pos_sum / n_written, np.nan)
        first_s = np.where(n_written > 0, t_sum / n_written / 1e9, np.nan)
    return it, writes, n_written, first_pos, first_s, dirtied


def soonest_written_first(live: np.ndarray, sizes: np.ndarray,
                          first_pos: np.ndarray) -> np.ndarray:
    """THE copy-order rule: the buffers `live` ordered by the mean position of their first
    write in an iteration (soonest first: each one saved before it is overwritten is a soft
    copy-on-write avoided), never-written ones last, ties by descending size."""
    if not len(live):
        return live
    never = np.isnan(first_pos[live])
    key_pos = np.where(never, np.inf, first_pos[live])
    return live[np.lexsort((-sizes[live], key_pos))]


@dataclass
class Analysis:
    """Everything `pos analyze` reports about one trace."""

    ops: Ops
    evidence: Evidence
    acc_start: np.ndarray
    acc_buf: np.ndarray
    acc_read: np.ndarray
    acc_write: np.ndarray
    edge_src: np.ndarray
    edge_dst: np.ndarray
    edge_buf: np.ndarray
    edge_type: np.ndarray
    seq: np.ndarray                 # op index of each launch/copy/set
    iterations: Iterations
    iteration_s: float              # mean duration of an iteration (host submission times)
    writes_per_iteration: np.ndarray    # by buffer
    first_write_pos: np.ndarray     # mean op offset of the first write in an iteration, NaN never
    first_write_s: np.ndarray       # the same in seconds from the iteration's start
    written_share: np.ndarray       # by buffer: share of the iterations that write it
    dirtied_per_iteration: float    # bytes, mean
    checkpoint_op: int              # where the predicted checkpoint is taken
    live: np.ndarray                # buffers live there
    copy_order: np.ndarray          # those, in the order a checkpoint should copy them
    costs: dict[str, float]


def live_at(ops: Ops, op: int) -> np.ndarray:
    """Allocation ids live just after op `op`."""
    return np.flatnonzero((ops.alloc_op <= op) & ((ops.free_op < 0) | (ops.free_op > op)))


def predict_costs(order: np.ndarray, sizes: np.ndarray, first_write_s: np.ndarray,
                  iteration_s: float) -> dict[str, float]:
    """Stop-the-world vs concurrent for the live buffers `order` (in copy order).

    Concurrent: the copier saves them in order at the pinned D2H rate from an iteration's start
    while the job runs; a buffer the job writes (first write at first_write_s in each iteration)
    before it is saved is copied into a shadow first (soft copy-on-write, D2D), which is all
    the job waits for. Without a known iteration time every written buffer is taken as written
    at once (the worst case)."""
    sz = sizes[order].astype(np.float64)
    live_bytes = float(sz.sum())
    done = np.cumsum(sz) / D2H_PINNED_BPS
    w = first_write_s[order]
    cow = np.zeros(len(order), np.bool_)
    if iteration_s > 0:
        k = 0
        while k * iteration_s < (done[-1] if len(done) else 0):
            cow |= ~np.isnan(w) & (w + k * iteration_s < done)
            k += 1
    else:
        cow = ~np.isnan(w)
    cow_bytes = float(sz[cow].sum())
    return {"live_bytes": live_bytes,
            "stop_the_world_s": live_bytes / DRIVER_CHECKPOINT_BPS + LOCK_UNLOCK_S,
            "concurrent_copy_s": live_bytes / D2H_PINNED_BPS,
            "concurrent_cow_bytes": cow_bytes,
            "concurrent_stall_s": cow_bytes / D2D_BPS}


def analyze(ops: Ops, evidence: Evidence) -> Analysis:
    """The DAG, iterations, per-buffer stats, copy order and costs of a speculated trace."""
    n_alloc = max(1, len(ops.alloc_base))
    start, buf, rd, wr = accesses(evidence.start, evidence.alloc, evidence.word, evidence.write,
                                  n_alloc)
    src, dst, via, typ = edges(start, buf, rd, wr, n_alloc)
    seq, keys = op_keys(ops)
    sizes = ops.alloc_size.astype(np.int64) if len(ops.alloc_size) else np.zeros(1, np.int64)
    it, writes, n_written, first_pos, first_s, dirtied = first_writes(seq, keys, ops.ts, start,
                                                                       buf, wr, sizes)
    count = max(it.count, 1)
    iteration_s = 0.0
    if it.detected and it.count > 1:
        t = ops.ts[seq[it.first + np.arange(it.count) * it.period]]
        iteration_s = float(np.mean(np.diff(t))) / 1e9
    if it.count and len(seq):
        checkpoint_op = int(seq[it.first + it.count * it.period - 1])
    else:
        checkpoint_op = len(ops.kind) - 1
    live = live_at(ops, checkpoint_op)
    order = soonest_written_first(live, sizes, first_pos)
    return Analysis(ops, evidence, start, buf, rd, wr, src, dst, via, typ, seq, it, iteration_s,
                    writes / count, first_pos, first_s, n_written / count,
                    float(dirtied.mean()) if len(dirtied) else 0.0, checkpoint_op, live, order,
                    predict_costs(order, sizes, first_s, iteration_s))


def order_from_history(keys: np.ndarray, ops: np.ndarray, bases: np.ndarray,
                       live_bases: np.ndarray, live_sizes: np.ndarray) -> tuple[np.ndarray, dict]:
    """The copy order of the buffers `live_bases` from an agent's history: `keys[i]` is call i's
    key (a kernel's function handle, or a copy kind), (ops[r], bases[r]) the buffers call
    ops[r] may write (ops ascending). Same rule as `analyze`: iterations of the key sequence,
    first-write positions, `soonest_written_first`. Returns (bases in order, facts)."""
    n = len(keys)
    if n == 0 or len(live_bases) == 0:
        return np.zeros(0, np.uint64), {"calls": n, "iterations": 0, "period": 0}
    ids = np.searchsorted(live_bases, bases)
    ok = (ids < len(live_bases))
    ok[ok] = live_bases[ids[ok]] == bases[ok]        # writes to buffers freed since: dropped
    ops, ids = ops[ok], ids[ok]
    start = np.searchsorted(ops, np.arange(n + 1), side="left").astype(np.int64)
    seq = np.arange(n, dtype=np.int64)
    it, _, _, first_pos, _, _ = first_writes(seq, keys.astype(np.int64), np.zeros(n, np.int64),
                                             start, ids.astype(np.int64),
                                             np.ones(len(ids), np.bool_),
                                             live_sizes.astype(np.int64))
    order = soonest_written_first(np.arange(len(live_bases)), live_sizes.astype(np.int64),
                                  first_pos)
    written = ~np.isnan(first_pos[order])
    return live_bases[order[written]], {"calls": n, "iterations": it.count if it.detected else 0,
                                        "period": it.period if it.detected else 0,
                                        "written_buffers": int(written.sum())}
