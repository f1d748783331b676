"""pos's mapping of a job's buffers (gpucopy.Imported), against the fake driver: every buffer in
one address range of pos's, one after another, access set once; what a failure leaves behind."""

import ctypes as C
import os
from typing import Any

import pytest

from pos.agent.control import Buffer
from pos.concurrent import gpucopy
from pos.driver import DriverError

MIB = 1 << 20
SIZES = [2 * MIB, 4 * MIB, 2 * MIB]     # multiples of the fake's granularity (2 MiB)


def buffers() -> list[Buffer]:
    return [Buffer(0, n, n, 0, True) for n in SIZES]


def test_buffers_made_anew_lie_one_after_another_and_their_descriptors_hold_them(drv) -> None:
    """A restore's memory: mapped in pos one buffer after another in one range, each buffer's
    descriptor mapping the same memory (what the job maps at its own address)."""
    made, fds = gpucopy.Imported.create(drv, buffers())
    seen = gpucopy.Imported(drv, buffers(), fds)         # the job's side, through the fds
    try:
        assert [b - made.local[0] for b in made.local] == [0, SIZES[0], SIZES[0] + SIZES[1]]
        for k, (at, n) in enumerate(zip(made.local, SIZES)):
            drv.cuMemcpyHtoD_v2(at, C.c_char_p(bytes([k + 1]) * n), n)
        for k, (at, n) in enumerate(zip(seen.local, SIZES)):
            back = C.create_string_buffer(n)
            drv.cuMemcpyDtoH_v2(back, at, n)
            assert back.raw == bytes([k + 1]) * n
    finally:
        seen.close()
        made.close()
        for fd in fds:
            os.close(fd)
    assert (made.local, made.handles, seen.local, seen.handles) == ([], [], [], [])


def test_a_failed_access_call_lets_go_of_every_mapping_the_range_and_the_handles(
        drv, monkeypatch) -> None:
    """The driver refuses the access: each buffer mapped so far is unmapped, the one range
    freed, every handle released, and the driver's sentence raised."""
    calls: dict[str, list[tuple[Any, ...]]] = {"cuMemUnmap": [], "cuMemAddressFree": [],
                                                 "cuMemRelease": []}
    for name, seen in calls.items():
        real = getattr(drv.raw, name)

        def spy(*args: Any, _real: Any = real, _seen: Any = seen) -> Any:
            _seen.append(args)
            return _real(*args)
        monkeypatch.setattr(drv.raw, name, spy)

    def refused(*_args: Any) -> None:
        raise DriverError("cuMemSetAccess", 1, "CUDA_ERROR_INVALID_VALUE")
    monkeypatch.setattr(drv, "cuMemSetAccess", refused)
    with pytest.raises(DriverError, match="cuMemSetAccess"):
        gpucopy.Imported.create(drv, buffers())
    assert [args[1] for args in calls["cuMemUnmap"]] == SIZES
    assert [args[1] for args in calls["cuMemAddressFree"]] == [sum(SIZES)]
    assert len(calls["cuMemRelease"]) == len(SIZES)
