"""What the driver cannot restore is refused before the job is touched (pos/operation/
restorable.py): a rank of an NCCL job whose ranks map each other's GPU memory. Against the
fake libcuda and real CRIU: the job keeps running, the driver is never called; with the
settings that work, the checkpoint goes through."""

import shutil
from pathlib import Path
from typing import Optional

import pytest

from pos.agent.control import Gate, Status
from pos.errors import BadInput
from pos.image import names
from pos.operation import restorable
from pos.operation.restorable import NcclSettings
from pos.process import procs
from tests.engines.conftest import Counter, one_sentence, pos
from tests.engines.test_engine_fake import calls, gpu, runs_unlocked  # noqa: F401  (fixture)

DEFAULTS: dict[str, str] = {}
SHM_ON_DEV_SHM = {"NCCL_P2P_DISABLE": "1", "NCCL_CUMEM_ENABLE": "0"}
SOCKETS = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_NVLS_ENABLE": "0"}


@pytest.mark.parametrize("env, ways", [
    (DEFAULTS, ["its P2P transport", "NVLink SHARP"]),
    ({"NCCL_SHM_DISABLE": "1", "NCCL_NVLS_ENABLE": "0"}, ["its P2P transport"]),
    ({"NCCL_P2P_DISABLE": "1", "NCCL_NVLS_ENABLE": "0"},
     ["its SHM transport on cuMem host memory"]),
    ({"NCCL_P2P_LEVEL": "LOC", "NCCL_NVLS_ENABLE": "0"},
     ["its SHM transport on cuMem host memory"]),
    (SHM_ON_DEV_SHM, []),
    (SOCKETS, []),
    ({**SOCKETS, "NCCL_NVLS_ENABLE": "1"}, ["NVLink SHARP"]),
])
def test_the_ways_nccl_shares_memory_as_measured(env, ways) -> None:
    """bench/results/2026-11-27-multigpu/raw/s6-call1: P2P (cuMem or IPC) and SHM on cuMem
    fail the driver's restore; SHM on /dev/shm and sockets do not."""
    assert NcclSettings.of(env).sharing() == ways


def _status(peer_maps: Optional[int], ipc_maps: Optional[int] = 0) -> Status:
    return Status(1, "idle", 0, 0, 0, 0, True, 0, Gate(0, 0.0, 0.0, 0, None), 0,
                  peer_maps, None if peer_maps is None else 64 << 20, ipc_maps)


def test_an_agent_that_sees_peer_memory_decides(monkeypatch) -> None:
    monkeypatch.setattr(restorable, "predicted_sharing", lambda pid: pytest.fail("predicted"))
    with pytest.raises(BadInput, match=r"maps another process's GPU memory \(2 mappings, 64 MiB"):
        restorable.peer_memory([7], {7: _status(2)})
    with pytest.raises(BadInput, match="NCCL_P2P_DISABLE=1 NCCL_CUMEM_ENABLE=0"):
        restorable.peer_memory([7], {7: _status(0, ipc_maps=1)})
    restorable.peer_memory([7], {7: _status(0)})            # seen: nothing mapped


def test_without_an_agent_that_can_say_pos_predicts(monkeypatch) -> None:
    monkeypatch.setattr(restorable, "predicted_sharing", lambda pid: ["its P2P transport"])
    for status in (None, _status(None)):                    # no agent, an older agent
        with pytest.raises(BadInput, match=r"settings let the ranks .* \(its P2P transport\)"):
            restorable.peer_memory([7], {7: status})


@pytest.fixture
def libnccl(tmp_path: Path, fakegpu) -> Path:
    """A file that /proc/PID/maps shows as NCCL's library (any file will do)."""
    lib = tmp_path / "lib" / "libnccl.so.2"
    lib.parent.mkdir()
    shutil.copy(fakegpu["libcuda"], lib)
    return lib


def _rank(tmp_path: Path, name: str, gpu: dict, fakegpu, libnccl: Path, counters,
          env: dict[str, str], extra: tuple[str, ...] = ()) -> Counter:
    c = Counter(tmp_path / name, cuda=fakegpu["libcuda"], extra=("--map", str(libnccl), *extra),
                env={**gpu, "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", **env})
    counters.append(c)
    return c


def test_a_rank_with_nccl_defaults_is_refused_untouched(tmp_path, gpu, fakegpu, libnccl,
                                                         counters) -> None:
    rank = _rank(tmp_path, "r0", gpu, fakegpu, libnccl, counters, DEFAULTS)
    img = tmp_path / "img"
    r = pos("checkpoint", str(rank.pid), "-D", str(img), "--leave-running", env=gpu)
    one_sentence(r, 2, "rank of an NCCL job", "its P2P transport", "cannot restore",
                 "NCCL_P2P_DISABLE=1 NCCL_CUMEM_ENABLE=0")
    assert calls(gpu, rank.pid) == []                       # the driver never called
    assert not img.exists() and not names.partial(img).exists()
    r = pos("migrate", str(rank.pid), "--to-gpu", "0", env=gpu)
    one_sentence(r, 2, "rank of an NCCL job")
    assert calls(gpu, rank.pid) == []
    runs_unlocked(rank, gpu)


def test_the_settings_that_work_pass(tmp_path, gpu, fakegpu, libnccl, counters) -> None:
    """Set at the start, or by the program after it (its live environment): checkpointed."""
    at_start = _rank(tmp_path, "r0", gpu, fakegpu, libnccl, counters, SHM_ON_DEV_SHM)
    later = _rank(tmp_path, "r1", gpu, fakegpu, libnccl, counters, {},
                  ("--setenv", "NCCL_P2P_DISABLE=1", "--setenv", "NCCL_SHM_DISABLE=1",
                   "--setenv", "NCCL_NVLS_ENABLE=0"))
    assert "NCCL_P2P_DISABLE" not in Path(f"/proc/{later.pid}/environ").read_text()
    assert procs.environment(later.pid)["NCCL_P2P_DISABLE"] == "1"
    for i, rank in enumerate((at_start, later)):
        r = pos("checkpoint", str(rank.pid), "-D", str(tmp_path / f"img{i}"), "--leave-running",
                env=gpu)
        assert r.returncode == 0, r.stderr
        assert calls(gpu, rank.pid) == ["Lock", "Checkpoint", "Restore", "Unlock"]
        runs_unlocked(rank, gpu)


def test_one_rank_alone_on_its_host_passes(tmp_path, gpu, fakegpu, libnccl, counters) -> None:
    alone = _rank(tmp_path, "r0", gpu, fakegpu, libnccl, counters,
                  {"LOCAL_WORLD_SIZE": "1", "WORLD_SIZE": "8"})
    assert restorable.predicted_sharing(alone.pid) == []


def test_nccl_config_files_join_the_environment(tmp_path, gpu, fakegpu, libnccl,
                                                counters) -> None:
    conf = tmp_path / "nccl.conf"
    conf.write_text("# the host's\nNCCL_P2P_DISABLE=1\nNCCL_CUMEM_ENABLE=0\nNCCL_SHM_DISABLE=0\n")
    rank = _rank(tmp_path, "r0", gpu, fakegpu, libnccl, counters,
                 {"NCCL_CONF_FILE": str(conf), "NCCL_SHM_DISABLE": "1"})
    merged = restorable.nccl_config(rank.pid, procs.environment(rank.pid))
    assert merged["NCCL_P2P_DISABLE"] == "1" and merged["NCCL_SHM_DISABLE"] == "1"  # env first
    assert restorable.predicted_sharing(rank.pid) == []
