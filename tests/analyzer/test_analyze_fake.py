"""`pos analyze` end to end: the fake driver's workload traced with real uprobes, then the
read/write sets of every launch, copy and set compared with what its printed ground truth says
each call touches (kernels.cu: which parameter is a const pointer, which struct holds which
buffer)."""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from pos.cli import cli
from tests.conftest import trace_app

pytestmark = pytest.mark.bpf

# What each launch of cuda_app's launch phase touches, by the names of its allocations
# (phase_alloc: A B C D P S, and V the VMM mapping): (reads, writes).
LAUNCHES = [
    ("_Z4axpyfPKfPfi", "AB", "B"),            # x = A+16 (const float *, interior), y = B
    ("_Z9pair_copy4Pairf", "CP", "CP"),       # Pair{a = C, b = P}: struct words, read-write
    ("_Z5mixed5MixedPKd", "SV", "S"),         # Mixed{p = S} after padding; src = V (const)
    ("_Z7scalarscsixdPf", "D", "D"),          # five scalars, out = D
    ("_Z4fillIfEvPT_S0_i", "C", "C"),
    ("_Z4fillIiEvPT_S0_i", "S", "S"),         # out = S+1024, through `extra`
    ("no_params", "", ""),
    ("no_params", "", ""),
]
# Copies and sets in call order: (reads, writes); host sides are not device memory.
COPIES = [("", "A"), ("A", "V"), ("V", ""), ("", "A"), ("A", "V"), ("V", ""), ("V", "B"),
          ("B", ""), ("", "D"), ("", "C"), ("", "S"), ("", "P"), ("D", ""), ("S", "")]


def test_analyze_json_gives_the_exact_access_sets(fakegpu: dict[str, Path], bpf_ready: None,
                                                  tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    truth, _, _ = trace_app([str(fakegpu["cuda_app"]), "cubin", str(fakegpu["dir"])], db)
    allocs = [a for a in truth["alloc"]["allocs"] if a["kind"] == "alloc"]
    ptr = dict(zip("ABCDPSV", (a["ptr"] for a in allocs)))

    def ptrs(names: str) -> list[str]:
        return sorted((ptr[n] for n in names), key=lambda p: int(p, 16))

    r = CliRunner().invoke(cli, ["analyze", str(db), "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    got = [(e["name"], sorted(e["reads"], key=lambda p: int(p, 16)),
            sorted(e["writes"], key=lambda p: int(p, 16))) for e in doc["launches"]]
    assert got == [(name, ptrs(rd), ptrs(wr)) for name, rd, wr in LAUNCHES]
    assert [l["name"] for l in truth["launch"]["launches"]] == [n for n, _, _ in LAUNCHES]
    assert all(e["layout_known"] for e in doc["launches"])
    # the evidence of the interior pointer and of the pointer after padding in Mixed
    axpy, _, mixed = doc["launches"][:3]
    assert {"ptr": ptr["A"], "param": 1, "struct_offset": 0, "offset": 16,
            "access": "read"} in axpy["evidence"]
    assert {"ptr": ptr["S"], "param": 0, "struct_offset": 8, "offset": 0,
            "access": "read-write"} in mixed["evidence"]
    assert [(sorted(e["reads"]), sorted(e["writes"])) for e in doc["copies"]] == \
        [(ptrs(rd), ptrs(wr)) for rd, wr in COPIES]
    assert [e["api"] for e in doc["copies"]] == \
        [c["api"] for c in sorted(truth["launch"]["copies"] + truth["launch"]["memsets"],
                                  key=lambda c: c["seq"])]

    buffers = {b["ptr"]: b for b in doc["buffers"]}
    assert {p: buffers[p]["size"] for p in ptr.values()} == {a["ptr"]: a["size"] for a in allocs}
    # no repeating sequence in one pass: the whole trace is one "iteration"
    assert doc["iterations"]["detected"] is False
    writes = {n: sum(n in wr for _, _, wr in LAUNCHES) + sum(n in wr for _, wr in COPIES)
              for n in ptr}
    assert {n: buffers[ptr[n]]["writes_per_iteration"] for n in ptr} == writes
    assert all(buffers[p]["freed_ns"] is not None for p in ptr.values())

    report = CliRunner().invoke(cli, ["analyze", str(db), "--dot", str(tmp_path / "dag.dot")])
    assert report.exit_code == 0, report.output
    assert "8 launches, 14 copies/sets, 7 allocations" in report.output
    dot = (tmp_path / "dag.dot").read_text()
    assert dot.startswith("digraph") and "axpy" in dot and "RAW" in dot
