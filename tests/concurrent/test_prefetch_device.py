"""Which GPU a whole-process restore fills (concurrent/prefetch.py fill_device): found by the driver
alone from the image's GPU index, NVML asked only when the driver does not see that GPU; and
which GPUs pos's own CUDA sees in a restore (devices.start_cuda, Driver.init_seeing)."""

import os
import threading
import types
from pathlib import Path
from typing import Optional

import pytest

from pos import driver as cu
from pos import nvml
from pos.concurrent import devices, prefetch
from pos.concurrent import gpucopy
from pos.errors import PosError
from pos.settings import Settings

HERE = "GPU-aaaaaaaa-0000-0000-0000-000000000001"
ELSEWHERE = "GPU-bbbbbbbb-0000-0000-0000-000000000002"
OTHER = "GPU-cccccccc-0000-0000-0000-000000000003"


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


# -- the GPUs pos's own CUDA sees in a restore -----------------------------------------------

class Started:
    """The driver's init_seeing, recording what it was asked."""

    def __init__(self) -> None:
        self.seeing: list[list[str]] = []

    def init_seeing(self, uuids: list[str]) -> bool:
        self.seeing.append(uuids)
        return True


@pytest.fixture
def host_has(monkeypatch: pytest.MonkeyPatch) -> Started:
    """This host has HERE and OTHER (NVML, started), in persistence mode, and a driver that records how
    CUDA is started."""
    started = Started()
    monkeypatch.setattr(nvml, "available", lambda: True)
    monkeypatch.setattr(nvml, "gpus", lambda: [nvml.Gpu(0, HERE, "H200", True),
                                               nvml.Gpu(1, OTHER, "H200", True)])
    monkeypatch.setattr(cu, "driver", lambda: started)
    return started


def test_cuda_sees_only_the_gpus_the_restore_fills(host_has) -> None:
    """cuInit starts every GPU it sees: 0.91-1.04 s for four H200s, 0.19-0.33 s for one."""
    assert devices.start_cuda([HERE])
    assert devices.start_cuda([OTHER, OTHER])
    assert host_has.seeing == [[HERE], [OTHER]]


@pytest.mark.parametrize("targets", [[ELSEWHERE], [HERE, ELSEWHERE], [HERE, None], [],
                                     [OTHER, HERE, OTHER]],
                         ids=["a GPU the host lacks", "one of two", "no GPU known", "none",
                              "every GPU of the host"])
def test_otherwise_cuda_sees_every_gpu(host_has, targets) -> None:
    """(every GPU: narrowing gains nothing, and the fill's threads start CUDA beside CRIU)"""
    assert not devices.start_cuda(targets)
    assert host_has.seeing == []


@pytest.mark.parametrize("targets", [[HERE], [None], []], ids=["narrowed", "not", "none"])
def test_nvml_starts_before_cuda_whatever_cuda_sees(host_has, monkeypatch, targets) -> None:
    """The restore's checks ask NVML: started after the fill's threads had begun CUDA, it took
    1.0 s of every restore of a torchrun job on 4x H200 hosts."""
    order: list[str] = []
    monkeypatch.setattr(nvml, "available", lambda: order.append("nvml") or True)
    monkeypatch.setattr(host_has, "init_seeing", lambda u: order.append("cuda") or True)
    devices.start_cuda(targets)
    assert order == (["nvml", "cuda"] if targets == [HERE] else ["nvml"])


def test_without_nvml_cuda_starts_as_it_would(host_has, monkeypatch) -> None:
    monkeypatch.setattr(nvml, "available", lambda: False)
    assert not devices.start_cuda([HERE])
    assert host_has.seeing == []


def test_without_persistence_mode_cuda_sees_every_gpu(host_has, monkeypatch) -> None:
    """(or without NVML, which would say)"""
    monkeypatch.setattr(nvml, "gpus", lambda: [nvml.Gpu(0, HERE, "H200", True),
                                               nvml.Gpu(1, OTHER, "H200", False)])
    assert not devices.start_cuda([HERE])
    assert host_has.seeing == []


def _driver(cuinit) -> object:
    """A Driver whose cuInit is `cuinit` (none of libcuda loaded)."""
    drv = cu.Driver.__new__(cu.Driver)
    drv._initialised, drv._lock = False, threading.Lock()
    drv.cuInit = cuinit
    return drv


def test_the_variable_is_set_for_cuinit_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """CRIU and whatever else pos starts afterwards never see it."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    seen: list[object] = []
    drv = _driver(lambda flags: seen.append((flags, os.environ.get("CUDA_VISIBLE_DEVICES"))))
    assert drv.init_seeing([HERE, OTHER])
    assert seen == [(0, f"{HERE},{OTHER}")]
    assert "CUDA_VISIBLE_DEVICES" not in os.environ
    assert not drv.init_seeing([HERE])      # started already: as it saw then
    drv.init()
    assert len(seen) == 1


def test_a_failed_cuinit_takes_the_variable_away(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    def refuse(_flags: int) -> None:
        raise PosError("cuInit failed", "look at the driver")

    with pytest.raises(PosError):
        _driver(refuse).init_seeing([HERE])
    assert "CUDA_VISIBLE_DEVICES" not in os.environ


def test_a_variable_the_user_set_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    seen: list[object] = []
    drv = _driver(lambda flags: seen.append(os.environ.get("CUDA_VISIBLE_DEVICES")))
    assert not drv.init_seeing([HERE])
    drv.init()
    assert seen == ["1"]


# -- a process of the tree with no device memory ---------------------------------------------

def test_a_process_with_no_device_memory_gets_no_context(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """torchrun's own process, under the agent with none of the job's memory: a context
    would cost its GPU 0.5 GB and the restore 0.6 s; its fill is done at once."""
    index = types.SimpleNamespace(pid=7, gpu=None, buffers=[])
    img = types.SimpleNamespace(path=Path("/nowhere"), gpus=[], index=lambda rank: index)
    monkeypatch.setattr(prefetch.gpuindex, "saved", lambda path, idx: {})

    def no_context(device: int) -> None:
        raise AssertionError(f"a context was made on device {device}")

    monkeypatch.setattr(gpucopy, "Context", no_context)
    monkeypatch.setattr(devices, "home", lambda gpus: pytest.fail("NVML was asked"))
    pre = prefetch.Prefetch(img, 4, Settings.from_env(), threading.Event(), rank=7)
    pre.start()
    assert pre.ready.wait(10)
    pre.resume()
    assert pre.join() == gpucopy.Copy(0, 0.0, 0.0)
    pre.close()
    assert pre.context is None and pre.mem is None and pre.fds == []
