"""pos/nvml.py's driver version: the loaded kernel module's (sysfs), NVML's only without it."""

from pathlib import Path
from typing import Optional

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


class Persistence:
    """pynvml's calls that the GPUs' listing makes: GPUs in persistence mode or not (None: a
    GPU that cannot say)."""
    NVML_FEATURE_ENABLED = 1

    class NVMLError(Exception):
        pass

    def __init__(self, modes: list[Optional[int]]) -> None:
        self.modes = modes

    def nvmlDeviceGetCount(self) -> int:
        return len(self.modes)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetPersistenceMode(self, handle: int) -> int:
        if self.modes[handle] is None:
            raise self.NVMLError("Not Supported")
        return self.modes[handle]

    def nvmlDeviceGetUUID(self, handle: int) -> bytes:
        return f"GPU-{handle}".encode()

    def nvmlDeviceGetName(self, handle: int) -> str:
        return "NVIDIA H200"


@pytest.mark.parametrize("modes, every", [([1, 1, 1, 1], True), ([1, 0], False), ([], True),
                                          ([1, None], False)])
def test_persistence_mode_of_every_gpu(monkeypatch, modes, every) -> None:
    monkeypatch.setattr(nvml, "_nvml", lambda: Persistence(modes))
    assert nvml.persistent() is every
    assert [(g.uuid, g.persistent) for g in nvml.gpus()] == [
        (f"GPU-{i}", m == 1) for i, m in enumerate(modes)]


def test_without_nvml_no_persistence_is_known(monkeypatch) -> None:
    monkeypatch.setattr(nvml, "_nvml", lambda: None)
    assert nvml.persistent() is False
