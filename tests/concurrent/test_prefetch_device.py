"""Which GPU a whole-process restore fills (concurrent/prefetch.py fill_device): found by the driver
alone from the image's GPU index, NVML asked only when the driver does not see that GPU."""

from typing import Optional

import pytest

from pos.concurrent import devices, prefetch
from pos.concurrent import gpucopy
from pos.errors import PosError

HERE = "GPU-aaaaaaaa-0000-0000-0000-000000000001"
ELSEWHERE = "GPU-bbbbbbbb-0000-0000-0000-000000000002"


def _device(onto: Optional[str], taken_on: Optional[str]) -> int:
    return prefetch.fill_device(onto, taken_on, [])


@pytest.fixture
def driver_sees(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The driver sees HERE as its device 1; NVML (`home`) is not to be asked unless said."""
    asked: list[str] = []

    def ordinal(uuid: str) -> int:
        if uuid != HERE:
            raise PosError(f"the CUDA driver does not see {uuid}", "check CUDA_VISIBLE_DEVICES")
        return 1

    def home(_gpus: object) -> Optional[str]:
        asked.append("nvml")
        return None            # the host has not the image's GPU

    monkeypatch.setattr(gpucopy, "ordinal", ordinal)
    monkeypatch.setattr(devices, "home", home)
    return asked


def test_the_gpu_the_image_was_taken_on_is_found_by_the_driver(driver_sees) -> None:
    assert _device(None, HERE) == 1
    assert driver_sees == []


def test_where_the_job_moves_comes_first(driver_sees) -> None:
    assert _device(HERE, ELSEWHERE) == 1


def test_a_gpu_this_host_has_not_falls_back_to_device_0_through_nvml(driver_sees) -> None:
    assert _device(None, ELSEWHERE) == 0
    assert _device(None, None) == 0
    assert driver_sees == ["nvml", "nvml"]
