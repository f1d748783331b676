"""pos/nvml.py's driver version: the loaded kernel module's (sysfs), NVML's only without it."""

from pathlib import Path

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
