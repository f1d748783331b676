"""GPU tests: they need an NVIDIA GPU with PyTorch (bench/ has the measurements) and are
skipped wherever none is present -- a skip is reported, never counted as a pass."""

import shutil
import signal
import subprocess
import sys
from types import FrameType
from typing import Optional

import pytest


def _has_gpu() -> bool:
    if shutil.which("nvidia-smi") is None:
        return False
    return subprocess.run([sys.executable, "-c", "import torch, sys; "
                           "sys.exit(not torch.cuda.is_available())"],
                          capture_output=True).returncode == 0


def _interrupted(signum: int, _frame: Optional[FrameType]) -> None:
    """A run stopped by SIGTERM (a time limit's) unwinds as an interrupt does, so that each GPU
    test's `finally` ends its job and removes its image."""
    raise KeyboardInterrupt(f"stopped by signal {signum}")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    gpu_items = [i for i in items if "tests/gpu/" in str(i.fspath)]
    if not gpu_items:
        return
    ok = _has_gpu()
    if ok:      # killed outright, the 85% test left a 127 GB image and its job on the GPU
        signal.signal(signal.SIGTERM, _interrupted)
    for item in gpu_items:
        item.add_marker(pytest.mark.gpu)
        if not ok:
            item.add_marker(pytest.mark.skip(reason="needs an NVIDIA GPU with PyTorch"))
