"""The agent's shared state and its rules, as numba functions over numpy arrays.

One `State` holds every array that the CUPTI callback (application threads, no GIL), the copier
and the control thread share: the exact table of live device allocations (sorted by base, for
the analyzer's binary search), each allocation's checkpoint status, the shadow pool's extents,
the per-function parameter layouts, and control words. Every change happens under the state's
recursive pthread mutex (native.py); the `*_locked` functions take it themselves, the others are
the pure rules (unit-tested without any driver).

Status of an allocation during a checkpoint:
  NONE      not in this image (no checkpoint running, or allocated after the cut)
  PENDING   in the image, not saved yet: a call that may write it must shadow it or wait
  COPYING   the copier is reading it now: writers wait
  SHADOWED  its bytes at the cut are in the shadow pool: writers go ahead
  SHADOW_COPYING  the copier is reading its shadow
  SAVED     on its way to disk: writers go ahead
A SHADOWED allocation whose shadow copy is still being issued (the ISSUING flag: the callback
makes that driver call with the mutex released) is not claimable, and other writers wait for
it: the shadow is enqueued before any other call that may write the buffer passes.

During an on-demand restore the same statuses mean: PENDING not back yet, COPYING being
restored, SAVED back. A call that may read or write a PENDING/COPYING allocation waits (and
marks it URGENT: the restorer takes it next); other calls pass at once.

Allocations made after the cut are NONE: not in the image (the image is the state at the cut)
and never waited for. A free during a checkpoint waits until its allocation is saved (the bytes
at the cut must be read before the memory can be reused); a free during a restore waits until
its allocation is back (the restorer must not write into memory the program gave away).
"""

import numba as nb
import numpy as np

from pos.agent import native
from pos.analyzer.access import lower_bound

NONE, PENDING, COPYING, SHADOWED, SHADOW_COPYING, SAVED = 0, 1, 2, 3, 4, 5
URGENT, DIRTY, ISSUING = np.uint8(1), np.uint8(2), np.uint8(4)   # flags bits
PHASE_IDLE, PHASE_CHECKPOINT, PHASE_RESTORE = 0, 1, 2
F_EMPTY, F_QUEUED, F_VALIDATED, F_UNVALIDATED = 0, 1, 2, 3   # function table states
ALIGN = 256

# Control words (ctl[...]).
(C_N, C_PHASE, C_CUT_DONE, C_EPOCH, C_UNSAFE, C_ORDER_N, C_ORDER_POS, C_POOL_BASE,
 C_POOL_SIZE, C_POOL_USED, C_TRACK, C_LAY_N, C_NEWF_N, C_AGENT_N, C_INTERCEPTED, C_COW,
 C_COW_BYTES, C_WAITED, C_WAIT_NS, C_FALLBACKS, C_OVERFLOW, C_PENDING_BYTES, C_HELD,
 C_N_SHADOWS, C_OUT0, C_OUT1, C_COPY_ERRORS, C_HIST_OPS, C_HIST_ACC, C_FIRST_NS,
 C_CALLS, C_NESTED, C_RT_OPEN) = range(33)
N_CTL = 40
AGENT_THREADS = 16
RUNTIME_THREADS = 256      # application threads with a runtime call open, until C_NESTED is known
EVIDENCE = 1 << 16


class State:
    """Every shared array, allocated once (the callback holds their addresses)."""

    def __init__(self, capacity: int = 1 << 16, shadows: int = 1 << 12,
                 functions: int = 1 << 14, layout_words: int = 1 << 18,
                 history: int = 1 << 15) -> None:
        self.ctl = np.zeros(N_CTL, np.int64)
        self.bases = np.zeros(capacity, np.uint64)
        self.ends = np.zeros(capacity, np.uint64)
        self.status = np.zeros(capacity, np.int8)
        self.flags = np.zeros(capacity, np.uint8)
        self.shadow = np.full(capacity, -1, np.int64)
        self.order = np.zeros(capacity, np.uint64)
        self.sh_off = np.zeros(shadows, np.uint64)
        self.sh_size = np.zeros(shadows, np.uint64)       # 0: extent free
        self.sh_event = np.zeros(shadows, np.uint64)      # CUevent per extent (copier waits)
        self.fkey = np.zeros(functions, np.uint64)
        self.fstate = np.zeros(functions, np.int8)
        self.fstart = np.zeros(functions, np.int64)
        self.fcount = np.zeros(functions, np.int64)
        self.lay_off = np.zeros(layout_words, np.int64)
        self.lay_size = np.zeros(layout_words, np.int64)
        self.lay_kind = np.zeros(layout_words, np.int8)
        self.newf = np.zeros(1024, np.uint64)
        # CUPTI cbid (runtime ids after the driver's: callbacks.RUNTIME_BASE) -> callbacks.K_*
        self.cbkind = np.zeros(4096, np.int8)
        self.cbflag = np.zeros(4096, np.int8)              # callbacks.ASYNC | PER_THREAD | ...
        self.ident = np.arange(capacity, dtype=np.int64)   # slot -> slot (range rule ids)
        self.agents = np.zeros(AGENT_THREADS, np.uint64)
        self.rt_tid = np.zeros(RUNTIME_THREADS, np.uint64)     # thread -> runtime calls open
        self.rt_depth = np.zeros(RUNTIME_THREADS, np.int64)
        self.scratch = np.zeros(1 << 14, np.uint8)        # one launch's parameter bytes
        self.ev_slot = np.zeros(EVIDENCE, np.int64)        # evidence rows of one call
        self.ev_param = np.zeros(EVIDENCE, np.int32)
        self.ev_word = np.zeros(EVIDENCE, np.int32)
        self.ev_off = np.zeros(EVIDENCE, np.uint64)
        self.ev_write = np.zeros(EVIDENCE, np.bool_)
        self.writes = np.zeros(capacity, np.int64)        # slots one call may write
        self.copies = np.zeros((4, capacity), np.uint64)  # src, dst, size, extent of shadows
        # history of tracked writing calls (dirty tracking on): a ring of calls (key: the
        # function handle of a launch, -kind for copies/sets) and a ring of (call, base)
        self.hist_key = np.zeros(history, np.int64)
        self.hist_op = np.zeros(2 * history, np.int64)
        self.hist_base = np.zeros(2 * history, np.uint64)
        self._sync, self.mutex, self.cond = native.sync_objects()

    def arrays(self) -> tuple:
        """The table arrays in the order the rules take them."""
        return (self.ctl, self.bases, self.ends, self.status, self.flags, self.shadow)

    def live(self) -> list[tuple[int, int]]:
        """(base, size) of every live allocation (a copy, under the lock, without the GIL)."""
        b = np.empty(self.bases.shape[0], np.uint64)
        e = np.empty(self.bases.shape[0], np.uint64)
        n = live_locked(self.mutex, self.ctl, self.bases, self.ends, b, e)
        return [(int(x), int(y - x)) for x, y in zip(b[:n], e[:n])]


# ---- the allocation table -----------------------------------------------------------------

@nb.njit(cache=True)
def slot_of(bases: np.ndarray, n: int, base: np.uint64) -> int:
    """The slot whose allocation starts exactly at base, or -1."""
    j = lower_bound(bases, n, base) - 1
    if j >= 0 and bases[j] == base:
        return j
    return -1


@nb.njit(cache=True)
def table_insert(ctl, bases, ends, status, flags, shadow, base: np.uint64,
                 size: np.uint64) -> bool:
    """Add a live allocation (status NONE: allocated after any cut); False when full."""
    n = ctl[C_N]
    j = slot_of(bases, n, base)
    if j >= 0:                                  # a free we did not see: replaced
        ends[j] = base + size
        status[j] = NONE
        flags[j] = DIRTY
        shadow[j] = -1
        return True
    if n >= bases.shape[0]:
        ctl[C_OVERFLOW] += 1
        return False
    pos = lower_bound(bases, n, base)
    for t in range(n, pos, -1):
        bases[t] = bases[t - 1]
        ends[t] = ends[t - 1]
        status[t] = status[t - 1]
        flags[t] = flags[t - 1]
        shadow[t] = shadow[t - 1]
    bases[pos] = base
    ends[pos] = base + size
    status[pos] = NONE
    flags[pos] = DIRTY                          # new memory: not in any parent image
    shadow[pos] = -1
    ctl[C_N] = n + 1
    return True


@nb.njit(cache=True)
def table_remove(ctl, bases, ends, status, flags, shadow, base: np.uint64) -> bool:
    n = ctl[C_N]
    j = slot_of(bases, n, base)
    if j < 0:
        return False
    for t in range(j, n - 1):
        bases[t] = bases[t + 1]
        ends[t] = ends[t + 1]
        status[t] = status[t + 1]
        flags[t] = flags[t + 1]
        shadow[t] = shadow[t + 1]
    ctl[C_N] = n - 1
    return True


# ---- the shadow pool: first fit over extents -------------------------------------------------

@nb.njit(cache=True)
def pool_alloc(ctl, sh_off, sh_size, size: np.uint64) -> int:
    """An extent of the pool holding `size` bytes (offset in sh_off), or -1 when full."""
    need = (size + np.uint64(ALIGN - 1)) // np.uint64(ALIGN) * np.uint64(ALIGN)
    cap = np.uint64(ctl[C_POOL_SIZE])
    if need > cap - np.uint64(ctl[C_POOL_USED]):
        return -1
    free_idx = -1
    for i in range(sh_size.shape[0]):
        if sh_size[i] == 0:
            free_idx = i
            break
    if free_idx < 0:
        return -1
    # lowest offset at which [off, off+need) meets no used extent
    off = np.uint64(0)
    moved = True
    while moved:
        moved = False
        for i in range(sh_size.shape[0]):
            if sh_size[i] != 0 and sh_off[i] < off + need and off < sh_off[i] + sh_size[i]:
                off = sh_off[i] + sh_size[i]
                moved = True
        if off + need > cap:
            return -1
    sh_off[free_idx] = off
    sh_size[free_idx] = need
    ctl[C_POOL_USED] += need
    ctl[C_N_SHADOWS] += 1
    return free_idx


@nb.njit(cache=True)
def pool_free(ctl, sh_size, i: int) -> None:
    ctl[C_POOL_USED] -= sh_size[i]
    ctl[C_N_SHADOWS] -= 1
    sh_size[i] = 0


# ---- soft copy-on-write: what one call that may write `slots` must do --------------------

@nb.njit(cache=True)
def plan_writes(ctl, bases, ends, status, flags, shadow, sh_off, sh_size, slots, n_slots: int,
                everything: bool, shadow_ok: bool, copies) -> tuple[int, bool]:
    """Decide, for a call that may write the allocations in slots[:n_slots] (or every one when
    `everything`: an unvalidated kernel, an unknown layout, an opaque graph), which PENDING
    allocations get a shadow (rows of `copies`: src, dst offset in the pool, size, extent) and
    whether the call must wait. A PENDING allocation that does not fit in the pool, or one
    being copied, makes the call wait and is marked URGENT (the copier takes it next). A
    `everything` call never shadows: it waits until nothing is PENDING or COPYING. A free
    (shadow_ok False) waits until its allocation is SAVED. Also marks the slots DIRTY."""
    n_copies = 0
    wait = False
    if everything:
        for j in range(ctl[C_N]):
            flags[j] |= DIRTY
        return 0, ctl[C_UNSAFE] > 0
    for r in range(n_slots):
        j = slots[r]
        flags[j] |= DIRTY
        s = status[j]
        if s == PENDING and shadow_ok and ctl[C_CUT_DONE] == 1:
            size = ends[j] - bases[j]
            e = pool_alloc(ctl, sh_off, sh_size, size)
            if e >= 0:
                status[j] = SHADOWED
                flags[j] |= ISSUING                  # cleared once the copy is enqueued
                shadow[j] = e
                ctl[C_UNSAFE] -= 1
                copies[0, n_copies] = bases[j]
                copies[1, n_copies] = sh_off[e]
                copies[2, n_copies] = size
                copies[3, n_copies] = e
                n_copies += 1
                continue
        if s == SHADOWED and (flags[j] & ISSUING):      # another call is enqueueing its shadow
            wait = True
            continue
        if s == PENDING or s == COPYING or (not shadow_ok and (s == SHADOWED or s == SHADOW_COPYING)):
            flags[j] |= URGENT
            wait = True
    return n_copies, wait


@nb.njit(cache=True)
def shadow_issued(ctl, bases, status, flags, shadow, sh_size, base: np.uint64, ok: bool) -> None:
    """The callback's shadow copy of `base` is enqueued (ok) or failed: clear ISSUING; on a
    failure the allocation is PENDING again and URGENT (its callers wait for the copier)."""
    j = slot_of(bases, ctl[C_N], base)
    if j < 0:
        return
    flags[j] &= ~ISSUING
    if not ok and status[j] == SHADOWED:
        pool_free(ctl, sh_size, shadow[j])
        status[j] = PENDING
        shadow[j] = -1
        flags[j] |= URGENT
        ctl[C_UNSAFE] += 1
        ctl[C_COPY_ERRORS] += 1


@nb.njit(cache=True)
def plan_restore(ctl, status, flags, slots, n_slots: int, everything: bool) -> bool:
    """Whether a call that may touch slots[:n_slots] (or anything, `everything`) must wait
    during an on-demand restore: it touches an allocation not back yet; those become URGENT."""
    if everything:
        return ctl[C_UNSAFE] > 0
    wait = False
    for r in range(n_slots):
        j = slots[r]
        if status[j] == PENDING or status[j] == COPYING:
            flags[j] |= URGENT
            wait = True
    return wait


@nb.njit(cache=True)
def record_history(ctl, hist_key, hist_op, hist_base, bases, key: np.int64, slots,
                   n_slots: int) -> None:
    """Append one tracked writing call (its key and the bases it may write) to the rings."""
    op = ctl[C_HIST_OPS]
    hist_key[op % hist_key.shape[0]] = key
    a = ctl[C_HIST_ACC]
    cap = hist_op.shape[0]
    for r in range(n_slots):
        hist_op[(a + r) % cap] = op
        hist_base[(a + r) % cap] = bases[slots[r]]
    ctl[C_HIST_ACC] = a + n_slots
    ctl[C_HIST_OPS] = op + 1


@nb.njit(cache=True)
def dedupe(slots, n: int) -> int:
    """Sort slots[:n] and drop repeats (a launch may name one buffer twice)."""
    a = np.sort(slots[:n])
    k = 0
    for i in range(n):
        if k == 0 or a[i] != slots[k - 1]:
            slots[k] = a[i]
            k += 1
    return k


# ---- the copier's side --------------------------------------------------------------------

@nb.njit(cache=True)
def begin_checkpoint(ctl, bases, ends, status, flags, shadow, order, predicted, only_dirty: bool) -> int:
    """The cut's table step: every live allocation (only the DIRTY ones for an incremental
    image) becomes PENDING; the copy order is `predicted` (bases, soonest written first)
    followed by the rest by descending size. Returns how many allocations the image holds."""
    n = ctl[C_N]
    k = 0
    for j in range(n):
        shadow[j] = -1
        flags[j] &= ~URGENT
        if only_dirty and not (flags[j] & DIRTY):
            status[j] = NONE
        else:
            status[j] = PENDING
            k += 1
    _make_order(ctl, bases, ends, status, flags, order, predicted, True)
    ctl[C_UNSAFE] = k
    return k


@nb.njit(cache=True)
def _make_order(ctl, bases, ends, status, flags, order, predicted, clear_dirty: bool) -> None:
    """The copy order of the PENDING allocations: `predicted` (bases) first, then the rest by
    descending size; sets C_ORDER_N/POS and C_PENDING_BYTES."""
    n = ctl[C_N]
    m = 0
    for i in range(predicted.shape[0]):
        j = slot_of(bases, n, predicted[i])
        if j >= 0 and status[j] == PENDING:
            order[m] = bases[j]
            m += 1
            status[j] = -PENDING                    # mark as ordered
    sizes = np.empty(n, np.uint64)
    for j in range(n):
        sizes[j] = ends[j] - bases[j] if status[j] == PENDING else np.uint64(0)
    by_size = np.argsort(sizes)[::-1]
    for i in range(n):
        j = by_size[i]
        if status[j] == PENDING:
            order[m] = bases[j]
            m += 1
    pending_bytes = 0
    for j in range(n):
        if status[j] == -PENDING:
            status[j] = PENDING
        if status[j] == PENDING:
            pending_bytes += ends[j] - bases[j]
            if clear_dirty:
                flags[j] &= ~DIRTY                  # dirty again only if written from now on
    ctl[C_ORDER_N] = m
    ctl[C_ORDER_POS] = 0
    ctl[C_PENDING_BYTES] = pending_bytes


@nb.njit(cache=True)
def begin_restore(ctl, bases, ends, status, flags, shadow, order, image_bases,
                  predicted) -> int:
    """The table step of an on-demand restore: the allocations at `image_bases` (sorted)
    become PENDING (not back yet), every other one NONE; order as for a checkpoint."""
    n = ctl[C_N]
    k = 0
    for j in range(n):
        shadow[j] = -1
        flags[j] &= ~(URGENT | ISSUING)
        i = lower_bound(image_bases, image_bases.shape[0], bases[j]) - 1
        if i >= 0 and image_bases[i] == bases[j]:
            status[j] = PENDING
            flags[j] |= DIRTY                   # no longer what the last image holds
            k += 1
        else:
            status[j] = NONE
    _make_order(ctl, bases, ends, status, flags, order, predicted, False)
    ctl[C_UNSAFE] = k
    ctl[C_FIRST_NS] = 0
    return k


@nb.njit(cache=True, inline="always")
def _claimable(s, f) -> bool:
    return s == PENDING or (s == SHADOWED and not (f & ISSUING))


@nb.njit(cache=True)
def any_issuing(ctl, flags) -> bool:
    for j in range(ctl[C_N]):
        if flags[j] & ISSUING:
            return True
    return False


@nb.njit(cache=True)
def claim(ctl, bases, ends, status, flags, shadow, order, sh_off, out) -> bool:
    """The next allocation the copier saves: an URGENT one first, then the copy order. Sets
    out = (base, src address, size, shadow extent or -1); False when none is left."""
    n = ctl[C_N]
    pick = -1
    for j in range(n):
        if (flags[j] & URGENT) and _claimable(status[j], flags[j]):
            pick = j
            break
    while pick < 0 and ctl[C_ORDER_POS] < ctl[C_ORDER_N]:
        j = slot_of(bases, n, order[ctl[C_ORDER_POS]])
        ctl[C_ORDER_POS] += 1
        if j >= 0 and _claimable(status[j], flags[j]):
            pick = j
    if pick < 0:                                     # shadows made after the order passed them
        for j in range(n):
            if status[j] == SHADOWED and _claimable(status[j], flags[j]):
                pick = j
                break
    if pick < 0:
        return False
    j = pick
    out[0] = np.int64(bases[j])
    out[2] = np.int64(ends[j] - bases[j])
    if status[j] == PENDING:
        status[j] = COPYING
        out[1] = np.int64(bases[j])
        out[3] = -1
    else:
        status[j] = SHADOW_COPYING
        out[1] = np.int64(np.uint64(ctl[C_POOL_BASE]) + sh_off[shadow[j]])
        out[3] = shadow[j]
    return True


@nb.njit(cache=True)
def finish(ctl, bases, ends, status, flags, shadow, sh_size, base: np.uint64) -> None:
    """The copier has the bytes of `base` (from the buffer or its shadow) in host memory."""
    j = slot_of(bases, ctl[C_N], base)
    if j < 0:
        return
    if status[j] == COPYING:
        ctl[C_UNSAFE] -= 1
    elif status[j] == SHADOW_COPYING:
        pool_free(ctl, sh_size, shadow[j])
        shadow[j] = -1
    status[j] = SAVED
    flags[j] &= ~URGENT


@nb.njit(cache=True)
def end_checkpoint(ctl, status, flags, sh_size) -> None:
    """Back to no checkpoint: statuses cleared, the pool emptied."""
    ctl[C_PHASE] = PHASE_IDLE
    ctl[C_CUT_DONE] = 0
    for j in range(ctl[C_N]):
        status[j] = NONE
        flags[j] &= ~(URGENT | ISSUING)
    for i in range(sh_size.shape[0]):
        sh_size[i] = 0
    ctl[C_POOL_USED] = 0
    ctl[C_N_SHADOWS] = 0
    ctl[C_UNSAFE] = 0


# ---- function layouts ---------------------------------------------------------------------

@nb.njit(cache=True)
def fslot(fkey, f: np.uint64) -> int:
    """The slot of function handle f in the open-addressing table (its own or the empty one
    where it would go); -1 when the table is full."""
    cap = fkey.shape[0]
    i = int((f * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(40)) % cap
    for _ in range(cap):
        if fkey[i] == f or fkey[i] == 0:
            return i
        i = (i + 1) % cap
    return -1


@nb.njit(cache=True)
def function_add(ctl, fkey, fstate, fstart, fcount, lay_off, lay_size, lay_kind, f: np.uint64,
                 offsets, sizes, kinds, validated: bool) -> bool:
    """Record f's parameter layout (False when the tables are full: f stays a fallback)."""
    i = fslot(fkey, f)
    n = offsets.shape[0]
    at = ctl[C_LAY_N]
    if i < 0 or at + n > lay_off.shape[0]:
        return False
    for p in range(n):
        lay_off[at + p] = offsets[p]
        lay_size[at + p] = sizes[p]
        lay_kind[at + p] = kinds[p]
    fkey[i] = f
    fstart[i] = at
    fcount[i] = n
    ctl[C_LAY_N] = at + n
    fstate[i] = F_VALIDATED if validated else F_UNVALIDATED
    return True


@nb.njit(cache=True)
def function_seen(ctl, fkey, fstate, newf, f: np.uint64) -> int:
    """f's table slot; a new f is queued for the agent to resolve (its state F_QUEUED)."""
    i = fslot(fkey, f)
    if i < 0:
        return -1
    if fkey[i] == 0:
        fkey[i] = f
        fstate[i] = F_QUEUED
        if ctl[C_NEWF_N] < newf.shape[0]:
            newf[ctl[C_NEWF_N]] = f
            ctl[C_NEWF_N] += 1
    return i


# ---- locked entry points for Python threads (nogil: the GIL is released while waiting) ----

@nb.njit(nogil=True)
def claim_locked(mutex: int, cond: int, ctl, bases, ends, status, flags, shadow, order, sh_off,
                 out) -> bool:
    """claim; when nothing is claimable but a shadow copy is being issued, wait for it (it
    becomes claimable within microseconds). False when the phase ended (an abort) too."""
    native.mutex_lock(mutex)
    phase = ctl[C_PHASE]
    while True:
        if ctl[C_PHASE] != phase or ctl[C_PHASE] == PHASE_IDLE:
            ok = False
            break
        ok = claim(ctl, bases, ends, status, flags, shadow, order, sh_off, out)
        if ok or not any_issuing(ctl, flags):
            break
        native.timed_wait(cond, mutex, 10_000_000)
    native.mutex_unlock(mutex)
    return ok


@nb.njit(nogil=True)
def live_locked(mutex: int, ctl, bases, ends, out_b, out_e) -> int:
    native.mutex_lock(mutex)
    n = ctl[C_N]
    for j in range(n):
        out_b[j] = bases[j]
        out_e[j] = ends[j]
    native.mutex_unlock(mutex)
    return n


# ---- is a runtime call's inner driver call reported too? ---------------------------------------
# Whether CUPTI reports the driver calls that a runtime call makes inside is not documented. The
# callback finds out: a driver call on a thread with a runtime call open says yes (C_NESTED),
# and from then on the driver domain alone is acted on (it names a CUfunction, which every
# kernel's layout comes from). Until then both are: a call handled twice is handled alike.

@nb.njit(cache=True)
def runtime_open(ctl, rt_tid, rt_depth, me: np.uint64, step: int) -> None:
    """One more (step 1) or one fewer (step -1) runtime call open on thread `me`; C_RT_OPEN
    counts them over all threads (0: no driver call need look)."""
    free = -1
    for i in range(rt_tid.shape[0]):
        if rt_tid[i] == me:
            if rt_depth[i] + step >= 0:
                rt_depth[i] += step
                ctl[C_RT_OPEN] += step
            return
        if free < 0 and rt_depth[i] == 0:
            free = i
    if step > 0 and free >= 0:
        rt_tid[free] = me
        rt_depth[free] = step
        ctl[C_RT_OPEN] += step


@nb.njit(cache=True)
def inside_runtime(rt_tid, rt_depth, me: np.uint64) -> bool:
    for i in range(rt_tid.shape[0]):
        if rt_tid[i] == me:
            return rt_depth[i] > 0
    return False


@nb.njit(nogil=True)
def agent_add_locked(mutex: int, ctl, agents, me: np.uint64) -> bool:
    """Register an agent thread in a free slot. Slots never move (a thread that reads the
    array without the lock, the callback, always finds its own id); C_AGENT_N is the high-water
    mark."""
    native.mutex_lock(mutex)
    ok = False
    for i in range(agents.shape[0]):
        if agents[i] == me:
            ok = True
            break
    if not ok:
        for i in range(agents.shape[0]):
            if agents[i] == 0:
                agents[i] = me
                if i + 1 > ctl[C_AGENT_N]:
                    ctl[C_AGENT_N] = i + 1
                ok = True
                break
    native.mutex_unlock(mutex)
    return ok


@nb.njit(nogil=True)
def agent_remove_locked(mutex: int, agents, me: np.uint64) -> None:
    native.mutex_lock(mutex)
    for i in range(agents.shape[0]):
        if agents[i] == me:
            agents[i] = 0
    native.mutex_unlock(mutex)


@nb.njit(nogil=True)
def history_locked(mutex: int, ctl, hist_key, hist_op, hist_base, keys, ops, obases) -> tuple:
    """Copy the history rings, oldest first: (first call number, calls, accesses); keys[i] is
    call first+i, and (ops[r], obases[r]) the accesses of calls >= first."""
    native.mutex_lock(mutex)
    n_ops = ctl[C_HIST_OPS]
    n_acc = ctl[C_HIST_ACC]
    rk = hist_key.shape[0]
    ra = hist_op.shape[0]
    first = max(0, n_ops - rk)                   # the oldest call whose key is still there
    lo = max(0, n_acc - ra)                      # the oldest access still there
    if lo > 0:                                   # that call may have lost older accesses
        first = max(first, hist_op[lo % ra] + 1)
    first = min(first, n_ops)
    m = 0
    for a in range(lo, n_acc):
        op = hist_op[a % ra]
        if op >= first:
            ops[m] = op - first
            obases[m] = hist_base[a % ra]
            m += 1
    for i in range(first, n_ops):
        keys[i - first] = hist_key[i % rk]
    native.mutex_unlock(mutex)
    return first, n_ops - first, m

@nb.njit(nogil=True)
def finish_locked(mutex: int, cond: int, ctl, bases, ends, status, flags, shadow, sh_size,
                  base: np.uint64) -> None:
    native.mutex_lock(mutex)
    finish(ctl, bases, ends, status, flags, shadow, sh_size, base)
    native.cond_broadcast(cond)
    native.mutex_unlock(mutex)


@nb.njit(nogil=True)
def set_phase_locked(mutex: int, cond: int, ctl, phase: int) -> int:
    """Enter `phase` and start a new epoch; returns the previous epoch's parity (the calls
    that passed their entry callback before this instant are counted under it). Calls still
    counted under the new epoch's parity (left from two epochs ago: a call that stayed inside
    the driver across a whole checkpoint) are waited for first, so that the two counters never
    mix epochs: new calls count under the old parity until the flip, so this wait ends."""
    native.mutex_lock(mutex)
    while ctl[C_OUT0 + ((ctl[C_EPOCH] + 1) & 1)] > 0:
        native.cond_wait(cond, mutex)
    old = ctl[C_EPOCH] & 1
    ctl[C_EPOCH] += 1
    ctl[C_PHASE] = phase
    ctl[C_CUT_DONE] = 0
    native.cond_broadcast(cond)
    native.mutex_unlock(mutex)
    return old


@nb.njit(nogil=True)
def cut_done_locked(mutex: int, cond: int, ctl) -> None:
    """The cut's synchronisation has returned: shadows may be taken from now on."""
    native.mutex_lock(mutex)
    ctl[C_CUT_DONE] = 1
    native.cond_broadcast(cond)
    native.mutex_unlock(mutex)


@nb.njit(nogil=True)
def wait_epoch_locked(mutex: int, cond: int, ctl, parity: int, timeout_ns: int) -> bool:
    """Until every call counted under `parity` has left the driver (its work is enqueued);
    False after timeout_ns (the caller aborts rather than wait for ever)."""
    native.mutex_lock(mutex)
    deadline = native.now_ns() + timeout_ns
    ok = True
    while ctl[C_OUT0 + parity] > 0:
        if native.now_ns() >= deadline:
            ok = False
            break
        native.timed_wait(cond, mutex, 50_000_000)
    native.mutex_unlock(mutex)
    return ok


@nb.njit(nogil=True)
def begin_restore_locked(mutex: int, ctl, bases, ends, status, flags, shadow, order,
                         image_bases, predicted) -> int:
    native.mutex_lock(mutex)
    k = begin_restore(ctl, bases, ends, status, flags, shadow, order, image_bases, predicted)
    native.mutex_unlock(mutex)
    return k


@nb.njit(nogil=True)
def begin_locked(mutex: int, ctl, bases, ends, status, flags, shadow, order, predicted,
                 only_dirty: bool) -> int:
    native.mutex_lock(mutex)
    k = begin_checkpoint(ctl, bases, ends, status, flags, shadow, order, predicted, only_dirty)
    native.mutex_unlock(mutex)
    return k


@nb.njit(nogil=True)
def end_locked(mutex: int, cond: int, ctl, status, flags, sh_size) -> None:
    """Back to no checkpoint or restore; every held call is released (the broadcast)."""
    native.mutex_lock(mutex)
    ctl[C_EPOCH] += 1
    end_checkpoint(ctl, status, flags, sh_size)
    native.cond_broadcast(cond)
    native.mutex_unlock(mutex)


@nb.njit(nogil=True)
def function_add_locked(mutex: int, cond: int, ctl, fkey, fstate, fstart, fcount, lay_off,
                        lay_size, lay_kind, f: np.uint64, offsets, sizes, kinds,
                        validated: bool) -> bool:
    """function_add; calls held because f's layout was unknown re-check (broadcast)."""
    native.mutex_lock(mutex)
    ok = function_add(ctl, fkey, fstate, fstart, fcount, lay_off, lay_size, lay_kind, f,
                      offsets, sizes, kinds, validated)
    native.cond_broadcast(cond)
    native.mutex_unlock(mutex)
    return ok


@nb.njit(nogil=True)
def take_new_functions_locked(mutex: int, ctl, newf, out) -> int:
    """Move the queued unresolved function handles into `out`; returns how many."""
    native.mutex_lock(mutex)
    n = min(ctl[C_NEWF_N], out.shape[0])
    for i in range(n):
        out[i] = newf[i]
    ctl[C_NEWF_N] = 0
    native.mutex_unlock(mutex)
    return n
