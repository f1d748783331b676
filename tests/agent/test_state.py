"""The agent's rules without any driver: the live table, soft copy-on-write decisions, pool
accounting, the copier's order."""

import numpy as np

from pos.agent import state as S

MB = 1 << 20


def make(pool: int = 4 * MB) -> S.State:
    st = S.State(capacity=64, shadows=8, functions=16, layout_words=64)
    st.ctl[S.C_POOL_SIZE] = pool
    st.ctl[S.C_POOL_BASE] = 0x900000000
    for base, size in ((0x3000, MB), (0x1000, MB), (0x2000, 3 * MB)):
        assert S.table_insert(*st.arrays(), np.uint64(base), np.uint64(size))
    return st


def begin(st: S.State, predicted=(), only_dirty=False) -> int:
    n = S.begin_checkpoint(*st.arrays(), st.order, np.asarray(predicted, np.uint64), only_dirty)
    st.ctl[S.C_PHASE] = S.PHASE_CHECKPOINT
    st.ctl[S.C_CUT_DONE] = 1
    return n


def plan(st: S.State, slots, everything=False, shadow_ok=True):
    a = np.asarray(slots, np.int64)
    return S.plan_writes(*st.arrays(), st.sh_off, st.sh_size, a, len(a), everything, shadow_ok,
                         st.copies)


def issued(st: S.State, base: int, ok: bool = True) -> None:
    S.shadow_issued(st.ctl, st.bases, st.status, st.flags, st.shadow, st.sh_size,
                    np.uint64(base), ok)


def test_table_sorted_insert_remove_and_replace() -> None:
    st = make()
    assert list(st.bases[:3]) == [0x1000, 0x2000, 0x3000]
    assert S.table_remove(*st.arrays(), np.uint64(0x2000))
    assert not S.table_remove(*st.arrays(), np.uint64(0x2000))
    assert list(st.bases[:2]) == [0x1000, 0x3000]
    assert S.table_insert(*st.arrays(), np.uint64(0x1000), np.uint64(5))   # same base again
    assert st.ctl[S.C_N] == 2 and st.ends[0] == 0x1005


def test_pending_write_is_shadowed_within_the_pool() -> None:
    st = make()
    assert begin(st) == 3 and st.ctl[S.C_UNSAFE] == 3
    n, wait = plan(st, [0])
    assert (n, wait) == (1, False)
    assert st.status[0] == S.SHADOWED and st.ctl[S.C_UNSAFE] == 2
    assert st.copies[0, 0] == 0x1000 and st.copies[2, 0] == MB and st.ctl[S.C_POOL_USED] == MB
    # written by another call while the shadow copy is being enqueued: it waits
    assert st.flags[0] & S.ISSUING and plan(st, [0]) == (0, True)
    out = np.zeros(4, np.int64)
    assert not S.claim(*st.arrays(), st.order, st.sh_off, out) or out[0] != 0x1000
    issued(st, 0x1000)
    # written again once enqueued: nothing to do
    assert plan(st, [0]) == (0, False)


def test_pool_full_waits_and_marks_urgent() -> None:
    st = make(pool=2 * MB)
    begin(st)
    n, wait = plan(st, [1])                  # 3 MiB buffer, 2 MiB pool
    assert (n, wait) == (0, True)
    assert st.status[1] == S.PENDING and st.flags[1] & S.URGENT
    out = np.zeros(4, np.int64)
    assert S.claim(*st.arrays(), st.order, st.sh_off, out)
    assert out[0] == 0x2000 and out[3] == -1           # the copier takes it next
    assert st.status[1] == S.COPYING
    assert plan(st, [1]) == (0, True)                   # being copied: still wait
    S.finish(*st.arrays(), st.sh_size, np.uint64(0x2000))
    assert plan(st, [1]) == (0, False)                  # saved: go


def test_no_shadow_before_the_cut_synchronised() -> None:
    st = make()
    begin(st)
    st.ctl[S.C_CUT_DONE] = 0
    assert plan(st, [0]) == (0, True)


def test_everything_and_frees_wait() -> None:
    st = make()
    begin(st)
    assert plan(st, [], everything=True) == (0, True)
    assert plan(st, [0]) == (1, False)                  # shadowed ...
    assert plan(st, [0], shadow_ok=False) == (0, True)  # ... but a free waits until saved


def test_pool_first_fit_reuses_freed_extents() -> None:
    st = make(pool=2 * MB)
    a = S.pool_alloc(st.ctl, st.sh_off, st.sh_size, np.uint64(MB))
    b = S.pool_alloc(st.ctl, st.sh_off, st.sh_size, np.uint64(MB))
    assert st.sh_off[a] == 0 and st.sh_off[b] == MB
    assert S.pool_alloc(st.ctl, st.sh_off, st.sh_size, np.uint64(1)) == -1
    S.pool_free(st.ctl, st.sh_size, a)
    c = S.pool_alloc(st.ctl, st.sh_off, st.sh_size, np.uint64(100))
    assert st.sh_off[c] == 0 and st.ctl[S.C_POOL_USED] == MB + S.ALIGN


def test_copy_order_predicted_first_then_by_size_and_shadows_from_the_pool() -> None:
    st = make()
    begin(st, predicted=[0x3000])
    plan(st, [0])                                       # 0x1000 shadowed
    issued(st, 0x1000)
    out = np.zeros(4, np.int64)
    got = []
    while S.claim(*st.arrays(), st.order, st.sh_off, out):
        got.append((int(out[0]), int(out[1]), int(out[3])))
        S.finish(*st.arrays(), st.sh_size, np.uint64(out[0]))
    e = got[2][2]
    assert [g[0] for g in got] == [0x3000, 0x2000, 0x1000]
    assert got[2][1] == 0x900000000 + int(st.sh_off[e]) and e >= 0
    assert st.ctl[S.C_POOL_USED] == 0 and st.ctl[S.C_UNSAFE] == 0
    assert all(st.status[:3] == S.SAVED)


def test_incremental_takes_only_dirty_buffers() -> None:
    st = make()
    begin(st)
    S.end_checkpoint(st.ctl, st.status, st.flags, st.sh_size)
    st.ctl[S.C_PHASE] = S.PHASE_IDLE
    plan(st, [2], shadow_ok=False)                      # tracked write to 0x3000
    assert begin(st, only_dirty=True) == 1
    assert list(st.status[:3]) == [S.NONE, S.NONE, S.PENDING]


def test_function_table_queues_unknown_and_stores_layouts() -> None:
    st = make()
    i = S.function_seen(st.ctl, st.fkey, st.fstate, st.newf, np.uint64(0xABC))
    assert st.fstate[i] == S.F_QUEUED and st.ctl[S.C_NEWF_N] == 1 and st.newf[0] == 0xABC
    assert S.function_add(st.ctl, st.fkey, st.fstate, st.fstart, st.fcount, st.lay_off,
                          st.lay_size, st.lay_kind, np.uint64(0xABC), np.array([0, 8]),
                          np.array([8, 8]), np.array([1, 2], np.int8), True)
    assert st.fstate[i] == S.F_VALIDATED and st.fcount[i] == 2


def test_failed_shadow_copy_goes_back_to_pending_and_urgent() -> None:
    st = make()
    begin(st)
    assert plan(st, [0]) == (1, False)
    issued(st, 0x1000, ok=False)
    assert st.status[0] == S.PENDING and st.flags[0] & S.URGENT
    assert not st.flags[0] & S.ISSUING and st.ctl[S.C_POOL_USED] == 0
    assert st.ctl[S.C_UNSAFE] == 3 and st.ctl[S.C_COPY_ERRORS] == 1
    assert plan(st, [0]) == (1, False)                  # a later writer may shadow it again


def test_on_demand_restore_holds_only_calls_touching_buffers_not_back() -> None:
    st = make()
    image = np.array([0x1000, 0x3000], np.uint64)
    assert S.begin_restore(*st.arrays(), st.order, image, np.zeros(0, np.uint64)) == 2
    st.ctl[S.C_PHASE] = S.PHASE_RESTORE
    assert list(st.status[:3]) == [S.PENDING, S.NONE, S.PENDING]
    assert not S.plan_restore(st.ctl, st.status, st.flags, np.array([1]), 1, False)
    assert S.plan_restore(st.ctl, st.status, st.flags, np.array([1, 2]), 2, False)
    assert S.plan_restore(st.ctl, st.status, st.flags, np.zeros(0, np.int64), 0, True)
    out = np.zeros(4, np.int64)
    assert S.claim(*st.arrays(), st.order, st.sh_off, out) and out[0] == 0x3000  # URGENT first
    S.finish(*st.arrays(), st.sh_size, np.uint64(0x3000))
    assert not S.plan_restore(st.ctl, st.status, st.flags, np.array([1, 2]), 2, False)
    assert S.claim(*st.arrays(), st.order, st.sh_off, out) and out[0] == 0x1000
    assert S.plan_restore(st.ctl, st.status, st.flags, np.array([0]), 1, False)  # COPYING
    S.finish(*st.arrays(), st.sh_size, np.uint64(0x1000))
    assert not S.plan_restore(st.ctl, st.status, st.flags, np.zeros(0, np.int64), 0, True)
    assert not S.claim(*st.arrays(), st.order, st.sh_off, out)


def test_agent_slots_never_move() -> None:
    st = make()
    for me in (11, 22, 33):
        assert S.agent_add_locked(st.mutex, st.ctl, st.agents, np.uint64(me))
    S.agent_remove_locked(st.mutex, st.agents, np.uint64(11))
    assert list(st.agents[:3]) == [0, 22, 33] and st.ctl[S.C_AGENT_N] == 3
    assert S.agent_add_locked(st.mutex, st.ctl, st.agents, np.uint64(44))
    assert S.agent_add_locked(st.mutex, st.ctl, st.agents, np.uint64(44))   # idempotent
    assert list(st.agents[:4]) == [44, 22, 33, 0]


def test_a_new_epoch_first_drains_calls_left_from_two_epochs_ago() -> None:
    import threading

    st = make()
    st.ctl[S.C_EPOCH] = 2                       # idle, epoch 2; a call of epoch 1 still inside
    st.ctl[S.C_OUT1] = 1
    done = []
    t = threading.Thread(target=lambda: done.append(
        S.set_phase_locked(st.mutex, st.cond, st.ctl, S.PHASE_CHECKPOINT)))
    t.start()
    t.join(0.3)
    assert t.is_alive() and st.ctl[S.C_PHASE] == S.PHASE_IDLE
    native_leave(st, 1)
    t.join(5)
    assert done == [0] and st.ctl[S.C_EPOCH] == 3 and st.ctl[S.C_PHASE] == S.PHASE_CHECKPOINT
    assert S.wait_epoch_locked(st.mutex, st.cond, st.ctl, 0, 10**9)
    st.ctl[S.C_OUT0] = 1
    assert not S.wait_epoch_locked(st.mutex, st.cond, st.ctl, 0, 50_000_000)   # bounded


def native_leave(st: S.State, parity: int) -> None:
    """What the exit callback does for a call counted under `parity`."""
    from pos.agent import native

    native.mutex_lock(st.mutex)
    st.ctl[S.C_OUT0 + parity] -= 1
    native.cond_broadcast(st.cond)
    native.mutex_unlock(st.mutex)


def test_history_ring_keeps_whole_calls_after_wrapping() -> None:
    st = S.State(capacity=64, shadows=8, functions=16, layout_words=64, history=8)
    for base in (0x1000, 0x2000):
        S.table_insert(*st.arrays(), np.uint64(base), np.uint64(MB))
    for call in range(20):                     # each call writes both buffers: 2 accesses
        S.record_history(st.ctl, st.hist_key, st.hist_op, st.hist_base, st.bases,
                         np.int64(100 + call), np.array([0, 1]), 2)
    keys, ops = np.empty(8, np.int64), np.empty(16, np.int64)
    bases = np.empty(16, np.uint64)
    first, n, m = S.history_locked(st.mutex, st.ctl, st.hist_key, st.hist_op, st.hist_base,
                                   keys, ops, bases)
    # call 12's accesses are the oldest left: it may have lost some, so history starts at 13
    assert (first, n, m) == (13, 7, 14)
    assert list(keys[:n]) == list(range(113, 120))
    assert list(ops[:m]) == [i // 2 for i in range(14)]
    assert list(bases[:4]) == [0x1000, 0x2000, 0x1000, 0x2000]
