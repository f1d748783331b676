"""The speculation and its run-time validator on real kernels (tests/gpu/kernels/suite.cu):
predicted write sets are exactly the declared ones, kernels write what they declare, every
kernel the speculation can see is validated, and every kernel that writes through pointers it
cannot see (pointer arrays, an address in a scalar) is flagged unvalidated."""

import pytest

from tests.gpu.kernels.suite import load_truth, run_suite


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_suite(tmp_path_factory.mktemp("suite"))


def test_every_case_ran(records: list[dict]) -> None:
    assert [r["case"] for r in records] == [c["case"] for c in load_truth()]


@pytest.mark.parametrize("i", range(len(load_truth())), ids=[c["case"] for c in load_truth()])
def test_case(records: list[dict], i: int) -> None:
    r = records[i]
    want = r["declared"]
    assert r["observed"] == sorted(want["writes"]), r       # the kernel did what it declares
    assert r["predicted"] == sorted(want["predicted"]), r   # the rule, exactly
    if want["visible"]:
        assert r["outside"] == [] and r["validated"], r
    else:
        assert r["outside"] and not r["validated"], r      # caught by the validator
