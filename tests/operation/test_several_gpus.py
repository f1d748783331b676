"""A process on several GPUs is refused before it is touched: the driver cannot restore it
(pos/operation/restorable.py several_gpus), with either stop-the-world command."""

import subprocess
from pathlib import Path

import pytest

from pos import nvml
from pos.engines import migrate, stopworld
from pos.errors import BadInput
from pos.operation import restorable
from pos.operation.engine import Save
from pos.operation.gpumap import Onto
from pos.process import cudackpt
from pos.settings import Settings

TWO = {"GPU-a": 1 << 30, "GPU-b": 4 << 30}


@pytest.fixture
def on_two_gpus(monkeypatch: pytest.MonkeyPatch):
    """A live process that NVML sees on two GPUs and that holds CUDA state, as pos sees it."""
    p = subprocess.Popen(["sleep", "60"])
    monkeypatch.setattr(nvml, "gpus_of", lambda pids: TWO if p.pid in pids else {})
    monkeypatch.setattr(nvml, "available", lambda: True)
    monkeypatch.setattr(nvml, "gpus", lambda: [nvml.Gpu(0, "GPU-a", "H200", True),
                                               nvml.Gpu(1, "GPU-b", "H200", True)])
    monkeypatch.setattr(cudackpt, "gpu_pids", lambda pids: [p.pid])
    monkeypatch.setattr(cudackpt, "lock", lambda *a: pytest.fail("the driver was called"))
    yield p
    p.kill()
    p.wait()


def test_one_gpu_passes_and_two_are_refused_in_one_sentence(on_two_gpus) -> None:
    with pytest.raises(BadInput, match="uses 2 GPUs.*cannot restore a process on several"):
        restorable.several_gpus([on_two_gpus.pid])
    restorable.several_gpus([on_two_gpus.pid + 10**6])     # on none: nothing to refuse


def test_checkpoint_and_migrate_refuse_it_untouched(on_two_gpus, tmp_path: Path,
                                                    criu_ready) -> None:
    with pytest.raises(BadInput, match="one process per GPU"):
        stopworld.checkpoint(on_two_gpus.pid, tmp_path / "img", Save(leave_running=True),
                             Settings.from_env())
    with pytest.raises(BadInput, match="one process per GPU"):
        migrate.to_gpu(on_two_gpus.pid, Onto.parse("0=1,1=0"), 10_000)
    assert not list(tmp_path.iterdir())                  # no image begun
    assert on_two_gpus.poll() is None
    state = Path(f"/proc/{on_two_gpus.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    assert state == "S"
