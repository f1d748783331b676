"""The concurrent engine's tests take their `pos run` jobs over the fake driver from the agent's
fixtures, and CRIU and pos as a command from the engines'; `drv`: pos's driver over the fake
libcuda in this process, with a context of its own."""

from pathlib import Path

import pytest

from tests.agent.conftest import fill_job, gpu_env, peer_job  # noqa: F401  (fixtures)
from tests.engines.conftest import *  # noqa: F401,F403


@pytest.fixture
def drv(fakegpu: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("POS_LIBCUDA", str(fakegpu["libcuda"]))
    monkeypatch.setenv("POS_FAKECUDA_STATE_DIR", str(tmp_path / "fakecuda"))
    from pos.concurrent import gpucopy

    return gpucopy.Context(0).drv
