"""The DAG, iteration detection, per-buffer stats and copy order on synthetic traces."""

import struct

import numpy as np

from pos.analyzer.access import speculate
from pos.analyzer.dag import RAW, WAR, WAW, analyze, find_iterations
from pos.analyzer.load import OpsBuilder

AXPY = "_Z4axpyfPKfPfi"                  # axpy(float, const float *x, float *y, int)
LAYOUT = [[0, 4], [8, 8], [16, 8], [24, 4]]


def axpy(b: OpsBuilder, ts: int, x: int, y: int, name: str = AXPY) -> None:
    b.launch(ts, name, LAYOUT, struct.pack("<f4xQQi4x", 1.0, x, y, 1))


def test_edges_raw_waw_war() -> None:
    b = OpsBuilder()
    b.alloc(0, 0x1000, 256)       # buffer 0
    b.alloc(0, 0x2000, 256)       # buffer 1
    b.alloc(0, 0x3000, 256)       # buffer 2
    axpy(b, 1, 0x1000, 0x2000)    # op 3: reads 0, writes 1
    axpy(b, 2, 0x2000, 0x3000)    # op 4: reads 1 (RAW from 3), writes 2
    axpy(b, 3, 0x3000, 0x1000)    # op 5: reads 2 (RAW from 4), writes 0 (WAR after 3's read)
    b.memset(4, 0x3000, 16)       # op 6: writes 2 (WAW after 4, WAR after 5)
    ops = b.finish()
    a = analyze(ops, speculate(ops))
    got = sorted(zip(a.edge_src.tolist(), a.edge_dst.tolist(), a.edge_buf.tolist(),
                     a.edge_type.tolist()))
    assert got == sorted([(3, 4, 1, RAW), (4, 5, 2, RAW), (3, 5, 0, WAR),
                          (4, 6, 2, WAW), (5, 6, 2, WAR)])


def test_iterations_of_a_training_loop_not_its_layers() -> None:
    # warm-up, then 6 steps of: embed, 4 identical layers, loss, optimizer; then a tail
    step = [1] + [2, 3, 4] * 4 + [5, 6, 7]
    keys = np.array([9, 8, 9] + step * 6 + [11, 12], np.int64)
    it = find_iterations(keys)
    assert (it.detected, it.period, it.count) == (True, len(step), 6)
    assert list(keys[it.first:it.first + it.period]) == step
    assert not find_iterations(np.arange(50, dtype=np.int64)).detected


def test_buffer_stats_copy_order_and_costs() -> None:
    b = OpsBuilder()
    weights, grads, acts = 0x100000, 0x200000, 0x300000
    b.alloc(0, weights, 1 << 20)
    b.alloc(0, grads, 1 << 16)
    b.alloc(0, acts, 1 << 18)
    t = 10
    for _ in range(5):                                    # one step: 3 launches, 1 ms
        axpy(b, t, weights, acts, "_Z7forwardfPKfPfi")        # reads weights, writes acts
        axpy(b, t + 300_000, acts, grads, "_Z8backwardfPKfPfi")  # writes grads
        axpy(b, t + 600_000, grads, weights, "_Z4stepfPKfPfi")   # writes weights
        t += 1_000_000
    ops = b.finish()
    a = analyze(ops, speculate(ops))
    assert (a.iterations.period, a.iterations.count) == (3, 5)
    assert abs(a.iteration_s - 1e-3) < 1e-9
    assert list(a.writes_per_iteration) == [1.0, 1.0, 1.0]
    assert list(a.first_write_pos) == [2.0, 1.0, 0.0]
    assert list(a.copy_order) == [2, 1, 0]                # acts, grads, weights: soonest first
    assert a.dirtied_per_iteration == (1 << 20) + (1 << 16) + (1 << 18)
    live = (1 << 20) + (1 << 16) + (1 << 18)
    assert a.costs["live_bytes"] == live
    assert a.costs["concurrent_copy_s"] == live / 53e9
    # 1.3 MB copy at 53 GB/s takes 25 us: only acts (written at t=0) is copied on write
    assert a.costs["concurrent_cow_bytes"] == 1 << 18


def test_order_from_history_is_the_analyzers_rule() -> None:
    """The agent's order: iterations of its call keys, first-write positions, then the same
    soonest_written_first as `pos analyze`."""
    import numpy as np

    from pos.analyzer.dag import order_from_history, soonest_written_first

    # an iteration of 4 calls (keys 7 8 9 10): call 1 writes B (0x2000), call 3 writes A
    # (0x1000); C (0x3000) is never written; D (0x4000, bigger) is written by call 1 too
    keys, ops, bases = [], [], []
    for it in range(5):
        for k in range(4):
            call = 4 * it + k
            keys.append(7 + k)
            if k == 1:
                ops += [call, call]
                bases += [0x2000, 0x4000]
            elif k == 3:
                ops.append(call)
                bases.append(0x1000)
    live = np.array([0x1000, 0x2000, 0x3000, 0x4000], np.uint64)
    sizes = np.array([10, 10, 50, 40], np.int64)
    order, facts = order_from_history(np.array(keys), np.array(ops), np.array(bases, np.uint64),
                                      live, sizes)
    assert list(order) == [0x4000, 0x2000, 0x1000]      # never-written C is left to the size order
    assert facts["period"] == 4 and facts["iterations"] >= 3
    first = np.array([3.0, 1.0, np.nan, 1.0])
    assert list(soonest_written_first(np.arange(4), sizes, first)) == [3, 1, 0, 2]
    empty, _ = order_from_history(np.zeros(0, np.int64), np.zeros(0, np.int64),
                                  np.zeros(0, np.uint64), live, sizes)
    assert len(empty) == 0
