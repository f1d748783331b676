"""The speculation rule on synthetic traces: each case of the rule, liveness at launch time, and
the numba sweep agreeing exactly with the plain-Python reference."""

import random
import struct

import numpy as np
import pytest

from pos.analyzer.access import COPY_DST, COPY_SRC, speculate
from pos.analyzer.demangle import CONST_PTR, PTR, SCALAR, SCAN, classify, parameter_kinds
from pos.analyzer.load import OpsBuilder
from pos.analyzer.reference import reference_evidence

AXPY = "_Z4axpyfPKfPfi"                  # axpy(float, const float *, float *, int)
AXPY_LAYOUT = [[0, 4], [8, 8], [16, 8], [24, 4]]
PAIR = "_Z9pair_copy4Pairf"              # pair_copy(Pair{float *a, float *b, int n}, float)
PAIR_LAYOUT = [[0, 24], [24, 4]]
SCALARS = "_Z7scalarscsixdPf"            # scalars(char, short, int, long long, double, float *)
SCALARS_LAYOUT = [[0, 1], [2, 2], [4, 4], [8, 8], [16, 8], [24, 8]]


def axpy_params(x: int, y: int) -> bytes:
    return struct.pack("<f4xQQi4x", 2.5, x, y, 1000)


def rows(ev, op: int) -> list[tuple[int, int, int, int, bool]]:
    lo, hi = ev.start[op], ev.start[op + 1]
    return [(int(ev.alloc[k]), int(ev.param[k]), int(ev.word[k]), int(ev.off[k]),
             bool(ev.write[k])) for k in range(lo, hi)]


def check_agreement(ops) -> None:
    ev = speculate(ops)
    ref = reference_evidence(ops)
    assert [rows(ev, i) for i in range(len(ops.kind))] == ref


@pytest.mark.parametrize("text, kind", [
    ("float const*", CONST_PTR), ("const float*", CONST_PTR), ("float*", PTR),
    ("float const* __restrict__", CONST_PTR), ("float* const", PTR), ("float const**", PTR),
    ("float* const*", CONST_PTR), ("int", SCALAR), ("unsigned long long", SCALAR),
    ("double", SCALAR), ("Pair", SCAN), ("at::detail::Array<char*, 3>", SCAN),
])
def test_parameter_type_classes(text: str, kind: int) -> None:
    assert classify(text) == kind


def test_kinds_from_mangled_names() -> None:
    assert parameter_kinds(AXPY, 4) == ([SCALAR, CONST_PTR, PTR, SCALAR], True)
    assert parameter_kinds("_Z4fillIfEvPT_S0_i", 3) == ([PTR, SCALAR, SCALAR], True)
    # a C name, or a layout that disagrees with the name: every parameter scanned, read-write
    assert parameter_kinds("triton_poi_fused_add_0", 2) == ([SCAN, SCAN], False)
    assert parameter_kinds(AXPY, 3) == ([SCAN] * 3, False)


def test_const_pointer_reads_interior_pointer_and_pointer_writes() -> None:
    b = OpsBuilder()
    a = b.alloc(1, 0x10000, 8192)
    bb = b.alloc(2, 0x20000, 4000)
    b.launch(3, AXPY, AXPY_LAYOUT, axpy_params(0x10000 + 16, 0x20000))
    ops = b.finish()
    ev = speculate(ops)
    assert rows(ev, 2) == [(a, 1, 0, 16, False), (bb, 2, 0, 0, True)]
    assert ev.sets(2) == ([a, bb], [bb])
    check_agreement(ops)


def test_struct_words_are_scanned_and_scalars_ignored() -> None:
    b = OpsBuilder()
    c = b.alloc(1, 0x100000, 1 << 20)
    p = b.alloc(2, 0x300000, 64000)
    b.launch(3, PAIR, PAIR_LAYOUT, struct.pack("<QQi4xf", 0x100000 + 8, 0x300000, 64, 0.5))
    # scalars: the long long holds a value inside C, but it is a scalar; only `out` counts
    b.launch(4, SCALARS, SCALARS_LAYOUT,
             struct.pack("<bxhiqdQ", 67, 0x1234, 5, 0x100000 + 4, 6.25, 0x300000 + 40))
    ops = b.finish()
    ev = speculate(ops)
    assert rows(ev, 2) == [(c, 0, 0, 8, True), (p, 0, 8, 0, True)]
    assert rows(ev, 3) == [(p, 5, 0, 40, True)]
    check_agreement(ops)


def test_unknown_layout_scans_every_captured_slot() -> None:
    b = OpsBuilder()
    x = b.alloc(1, 0x10000, 4096)
    # recorded as 8-byte slots: a pointer, a scalar that happens to look like one, 4 odd bytes
    b.launch(2, AXPY, None, struct.pack("<QQI", 0x10010, 0x10ff8, 7))
    ops = b.finish()
    ev = speculate(ops)
    assert rows(ev, 1) == [(x, 0, 0, 0x10, True), (x, 1, 0, 0xff8, True)]
    assert ops.sig_layout_known == [False] and ops.sig_types_known == [False]
    check_agreement(ops)


def test_liveness_at_launch_time_with_reused_addresses() -> None:
    b = OpsBuilder()
    b.launch(1, AXPY, AXPY_LAYOUT, axpy_params(0x10000, 0x20000))    # nothing allocated yet
    old = b.alloc(2, 0x10000, 4096)
    y = b.alloc(3, 0x20000, 4096)
    b.launch(4, AXPY, AXPY_LAYOUT, axpy_params(0x10000, 0x20000))
    b.free(5, 0x10000)
    b.launch(6, AXPY, AXPY_LAYOUT, axpy_params(0x10000, 0x20000))    # x points to freed memory
    new = b.alloc(7, 0x10000, 256)                                   # the same address, smaller
    b.launch(8, AXPY, AXPY_LAYOUT, axpy_params(0x10000 + 512, 0x10000 + 8))
    ops = b.finish()
    ev = speculate(ops)
    assert rows(ev, 0) == []
    assert ev.sets(3) == ([old, y], [y])
    assert ev.sets(5) == ([y], [y])
    assert rows(ev, 7) == [(new, 2, 0, 8, True)]                     # +512 is past its end
    assert list(ops.free_op) == [4, -1, -1]
    check_agreement(ops)


def test_copies_and_sets_cover_the_allocations_their_ranges_overlap() -> None:
    b = OpsBuilder()
    a = b.alloc(1, 0x10000, 0x1000)
    a2 = b.alloc(2, 0x11000, 0x1000)
    v = b.alloc(3, 0x40000, 0x1000)
    b.memcpy(4, 0x40000, 0x10800, 0x1000, "DtoD")      # source spans a and a2
    b.memcpy(5, 0x10000, 0x7fff0000, 64, "HtoD")       # host source: not looked up
    b.memcpy(6, 0x7fff0000, 0x40000, 64, "DtoH")
    b.memset(7, 0x11000 + 16, 32)
    ops = b.finish()
    ev = speculate(ops)
    assert rows(ev, 3) == [(a2, COPY_SRC, -1, 0, False), (a, COPY_SRC, -1, 0x800, False),
                           (v, COPY_DST, -1, 0, True)]
    assert ev.sets(3) == ([a, a2], [v])
    assert ev.sets(4) == ([], [a])
    assert ev.sets(5) == ([v], [])
    assert rows(ev, 6) == [(a2, COPY_DST, -1, 16, True)]
    check_agreement(ops)


def test_truncated_capture_gives_no_evidence_past_its_bytes() -> None:
    b = OpsBuilder()
    b.alloc(1, 0x10000, 4096)
    b.launch(2, AXPY, AXPY_LAYOUT, axpy_params(0x10000, 0x10000)[:16])   # y was not captured
    ops = b.finish()
    assert speculate(ops).sets(1) == ([0], [])
    check_agreement(ops)


def test_random_traces_agree_with_the_reference() -> None:
    rng = random.Random(7)
    b = OpsBuilder()
    live: list[int] = []
    for t in range(3000):
        r = rng.random()
        if r < 0.1 or not live:
            base = rng.randrange(1, 200) * 0x10000
            if base not in live:
                b.alloc(t, base, rng.choice([256, 4096, 0x10000]))
                live.append(base)
        elif r < 0.15:
            b.free(t, live.pop(rng.randrange(len(live))))
        elif r < 0.2:
            b.memcpy(t, rng.choice(live) + 8, rng.choice(live), rng.choice([8, 0x20000]),
                     rng.choice(["DtoD", "HtoD", "DtoH", "default"]))
        else:
            def ptr() -> int:
                return rng.choice(live) + rng.choice([0, 8, 255, 4095, 0x10000])
            if rng.random() < 0.5:
                b.launch(t, AXPY, AXPY_LAYOUT, axpy_params(ptr(), ptr()))
            else:
                b.launch(t, PAIR, PAIR_LAYOUT if rng.random() < 0.8 else None,
                         struct.pack("<QQi4xf", ptr(), ptr(), 3, 1.0))
    ops = b.finish()
    ev = speculate(ops)
    assert len(ev.alloc) > 1000
    assert np.any(~ev.write) and np.any(ev.write)
    check_agreement(ops)
