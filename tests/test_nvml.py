"""pos/nvml.py's driver version: the loaded kernel module's (sysfs), NVML's only without it."""

from pathlib import Path
from types import SimpleNamespace

import pytest

from pos import nvml


def test_the_driver_version_is_the_kernel_modules(tmp_path: Path, monkeypatch) -> None:
    version = tmp_path / "version"
    version.write_text("580.159.04\n")
    monkeypatch.setattr(nvml, "MODULE_VERSION", str(version))
    monkeypatch.setattr(nvml, "_query", lambda _fn: pytest.fail("NVML asked"))
    assert nvml.driver_version() == "580.159.04"


@pytest.mark.parametrize("text", [None, ""], ids=["no module", "empty"])
def test_without_the_modules_version_nvml_answers(tmp_path: Path, monkeypatch, text) -> None:
    version = tmp_path / "version"
    if text is not None:
        version.write_text(text)
    monkeypatch.setattr(nvml, "MODULE_VERSION", str(version))
    monkeypatch.setattr(nvml, "_query", lambda _fn: "570.1")
    assert nvml.driver_version() == "570.1"


# -- the GPUs listed without attaching them ---------------------------------------------------

INFO = "Model: \t\t {model}\nIRQ:   \t\t 42\nGPU UUID: \t {uuid}\nBus Location: \t {bus}\n" \
    "Device Minor: \t 0\n"


def proc_gpus(root: Path, *gpus: tuple[str, str, str]) -> Path:
    """The driver's /proc/driver/nvidia/gpus with a folder per (bus id, UUID, model)."""
    for bus, uuid, model in gpus:
        (root / bus).mkdir(parents=True)
        (root / bus / "information").write_text(INFO.format(model=model, uuid=uuid, bus=bus))
    return root


class FakeNvml:
    """The pynvml calls that memory_free makes, recording which GPUs were attached."""
    class NVMLError(Exception):
        pass

    def __init__(self, free: dict[str, int]) -> None:
        self.free, self.attached = free, []

    def nvmlDeviceGetHandleByPciBusId(self, bus: str) -> str:
        self.attached.append(bus)
        if bus not in self.free:
            raise self.NVMLError(bus)
        return bus

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
        raise self.NVMLError(uuid)

    def nvmlDeviceGetMemoryInfo(self, handle: str) -> SimpleNamespace:
        return SimpleNamespace(free=self.free[handle])


def test_the_gpus_are_listed_from_the_drivers_files_in_bus_order(tmp_path: Path,
                                                                  monkeypatch) -> None:
    """Attaching an idle GPU took 0.25 s on the H200 hosts: listing them attaches none."""
    monkeypatch.setattr(nvml, "PROC_GPUS", proc_gpus(
        tmp_path, ("0000:9a:00.0", "GPU-b", "NVIDIA H100 80GB HBM3"),
        ("0000:18:00.0", "GPU-a", "NVIDIA H200")))
    monkeypatch.setattr(nvml, "available", lambda: True)
    monkeypatch.setattr(nvml, "_query", lambda _fn: pytest.fail("NVML asked"))
    assert nvml.gpus() == [nvml.Gpu(0, "GPU-a", "NVIDIA H200"),
                           nvml.Gpu(1, "GPU-b", "NVIDIA H100 80GB HBM3")]


@pytest.mark.parametrize("info", [None, "Model: \t NVIDIA H200\n"], ids=["none", "no uuid"])
def test_without_the_drivers_files_nvml_lists_the_gpus(tmp_path: Path, monkeypatch,
                                                       info) -> None:
    if info is not None:
        (tmp_path / "0000:18:00.0").mkdir()
        (tmp_path / "0000:18:00.0" / "information").write_text(info)
    monkeypatch.setattr(nvml, "PROC_GPUS", tmp_path / "gpus" if info is None else tmp_path)
    monkeypatch.setattr(nvml, "available", lambda: True)
    monkeypatch.setattr(nvml, "_query", lambda _fn: [nvml.Gpu(0, "GPU-n", "from NVML")])
    assert nvml.gpus() == [nvml.Gpu(0, "GPU-n", "from NVML")]


def test_only_the_gpus_asked_about_are_attached(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(nvml, "PROC_GPUS", proc_gpus(
        tmp_path, *[(f"0000:{b}:00.0", f"GPU-{b}", "NVIDIA H200") for b in ("18", "2a", "3b")]))
    fake = FakeNvml({"0000:2a:00.0": 7 << 30, "0000:3b:00.0": 9 << 30})
    monkeypatch.setattr(nvml, "_nvml", lambda: fake)
    assert nvml.memory_free(["GPU-2a", "GPU-elsewhere"]) == {"GPU-2a": 7 << 30}
    assert fake.attached == ["0000:2a:00.0"]
