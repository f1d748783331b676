"""NCCL's defaults in miniature, against the fake driver with real CRIU (issue 42): two
processes under one `pos run`, one importing and mapping the other's cuMem memory (peer_job.c),
as NCCL's P2P and SHM transports do. The fake's restore of a process with an import mapped
fails as the driver's does (801), so each of these passes only because the concurrent engine
took the import down at its cut and put it back after the driver's restore: in place
(--leave-running), or in the restored processes; the import is then the owner's memory again
at its old address."""

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from pos.agent import peers
from pos.agent.control import Agent
from pos.image import names
from tests.concurrent.test_ownmem import written
from tests.conftest import ROOT, ShellJobs, kill, reaped
from tests.engines.conftest import one_sentence, pos, wait_for

SEVEN = bytes([7, 0, 0, 0]) * 4      # peer_job's owner's memory
VMM_BYTES = 2 << 20


class Pair(ShellJobs):
    """`pos run -- sh -c 'peer_job own D & peer_job import D & wait'`."""

    def __init__(self, fakegpu: dict[str, Path], folder: Path, env: dict[str, str]) -> None:
        self.dir = folder / "exchange"
        self.dir.mkdir()
        self.outs = [folder / "own.out", folder / "import.out"]
        job = str(fakegpu["peer_job"])
        script = (f"{job} own {self.dir} > {self.outs[0]} 2>&1 & "
                  f"{job} import {self.dir} > {self.outs[1]} 2>&1 & wait")
        self.proc = subprocess.Popen([sys.executable, "-m", "pos.cli", "run", "--", "sh", "-c",
                                      script], cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)
        self.root = self.proc.pid
        wait_for(self.ready, 30, lambda: f"both to print READY: {self.said()}")
        self.owner, self.importer = (int(o.read_text().split("READY")[1].split()[0])
                                     for o in self.outs)
        self.va = int(re.search(r"MAPPED (0x[0-9a-f]+)", self.outs[1].read_text())[1], 16)

    def kill(self) -> None:
        kill([self.importer, self.owner, self.root], self.proc)


@pytest.fixture
def pair(tmp_path: Path, fakegpu: dict[str, Path], gpu_env: dict[str, str], criu_ready
         ) -> Iterator[Pair]:
    p = Pair(fakegpu, tmp_path, gpu_env)
    yield p
    p.kill()


def shares_the_owners_memory(pair: Pair) -> None:
    """The importer maps the owner's memory at its old address: it reads the owner's bytes,
    and a nonce the owner writes; every job then runs on (idle), nothing down."""
    owner, importer = Agent(pair.owner), Agent(pair.importer)
    try:
        for a in (owner, importer):
            a.cut(5)
        assert importer.peek(pair.va) == SEVEN
        nonce = os.urandom(16)
        owner.stamp(owner.exports()[0].va, nonce)
        assert importer.peek(pair.va) == nonce
        owner.unstamp()
        for a in (owner, importer):
            a.end()
        st = importer.status()
        assert (st.phase, st.peer_maps, st.peer_bytes, st.peer_down) == ("idle", 1, VMM_BYTES, 0)
    finally:
        owner.close()
        importer.close()


def test_leave_running_takes_the_import_down_and_puts_it_back_in_place(
        pair: Pair, tmp_path: Path, gpu_env) -> None:
    img = tmp_path / "img"
    r = pos("checkpoint", str(pair.root), "-D", str(img), "--concurrent", "--leave-running",
            "--json", env=gpu_env)
    assert r.returncode == 0, r.stderr
    [link] = peers.read(img)
    assert (link.importer, link.va, link.size, link.owner) == (
        pair.importer, pair.va, VMM_BYTES, pair.owner)
    # the report names the owner's own cuMem memory, which pos took into the image (the
    # driver's checkpoint would have copied it into the owner's host memory)
    report = json.loads(r.stdout)
    ranks = {x["pid"]: x["timings"] for x in report["ranks"]}
    assert ranks[pair.owner]["own_maps_bytes"] == VMM_BYTES
    assert ranks[pair.importer]["own_maps_bytes"] == 0
    assert report["timings"]["own_taken_bytes"] == VMM_BYTES
    # its copy's device memory made, and the memory exported and mapped, before the cut: the
    # ranks held only for the check that it is the same memory, and the copy
    assert report["timings"]["own_reserved_bytes"] == VMM_BYTES
    assert report["timings"]["own_ready_bytes"] == VMM_BYTES
    assert {"own_ready_export", "own_ready_map", "own_ready_room"} <= set(report["timings"])
    assert {"own_export", "own_copy"} <= set(ranks[pair.owner])
    assert "own_map" not in ranks[pair.owner]
    index, data = names.own_memory(pair.owner)
    assert (img / data).read_bytes()[:16] == SEVEN and (img / index).is_file()
    assert not (img / names.own_memory(pair.importer)[0]).exists()
    shares_the_owners_memory(pair)


@pytest.mark.parametrize("setting, taken, in_host", [
    ({"POS_OWN_MEMORY_MAX_GIB": "0", "POS_FAKECUDA_FREE_MIB": "1"}, True, VMM_BYTES),
    ({"POS_OWN_MEMORY_MAX_GIB": "0.001", "POS_FAKECUDA_FREE_MIB": "1025"}, True, VMM_BYTES // 2),
    ({"POS_OWN_MEMORY_MAX_GIB": "0.001", "POS_OWN_MEMORY_ON_GPU": "0"}, False, None),
    ({"POS_OWN_MEMORY_MAX_GIB": "0.001"}, True, 0)],
    ids=["no-room", "room-for-half", "not-taken", "room"])
def test_own_memory_past_the_setting_is_copied_on_the_gpu_as_far_as_it_has_room(
        pair: Pair, tmp_path: Path, gpu_env, setting, taken: bool, in_host) -> None:
    """More of the processes' own memory than POS_OWN_MEMORY_MAX_GIB (a rank with PyTorch's
    expandable segments) is taken unless POS_OWN_MEMORY_ON_GPU is 0 (the driver's checkpoint
    keeps it then): copied at the cut on the GPU as far as it has room (a GPU of 1 GiB and 1
    MiB free has 1 MiB for pos), the rest into host memory; the image holds all of it."""
    img = tmp_path / "img"
    r = pos("checkpoint", str(pair.root), "-D", str(img), "--concurrent", "--leave-running",
            "--json", env={**gpu_env, **setting})
    assert r.returncode == 0, r.stderr
    timings = json.loads(r.stdout)["timings"]
    assert timings.get("own_taken_bytes") == (VMM_BYTES if taken else None)
    assert timings.get("own_host_bytes") == in_host
    assert bool(list(img.glob(names.OWN_MEMORY_INDEXES))) is taken
    if taken:
        assert written(img, pair.owner) == SEVEN * (VMM_BYTES // len(SEVEN))
    shares_the_owners_memory(pair)


def test_a_process_alone_has_its_own_memory_taken_and_frees_it_as_pytorch_does(
        peer_job, tmp_path: Path, gpu_env, criu_ready) -> None:
    """Own cuMem memory of a process alone (PyTorch's expandable segments: all of such a job's
    memory) is taken at the cut, as NCCL's buffers are, where its GPU has room: the driver's
    checkpoint no longer copies it while the job is held. The job then frees it as PyTorch
    does, unmapping it and then releasing the handle it made, which the driver no longer
    knows: the agent releases the memory mapped there since."""
    owner = peer_job("own")
    img = tmp_path / "img"
    r = pos("checkpoint", str(owner.pid), "-D", str(img), "--concurrent",
            "--leave-running", "--json", env=gpu_env)
    assert r.returncode == 0, r.stderr
    timings = json.loads(r.stdout)["timings"]
    assert timings["own_taken_bytes"] == VMM_BYTES and timings["own_host_bytes"] == 0
    index, data = names.own_memory(None)
    assert (img / data).read_bytes()[:16] == SEVEN and (img / index).is_file()
    with Agent(owner.pid) as a:
        st = a.status()
    assert (st.own_maps, st.own_kept, st.own_down) == (1, 1, 0)
    (Path(owner.proc.args[-1]) / "free").touch()
    owner.printed("FREED")
    with Agent(owner.pid) as a:
        st = a.status()
    assert (st.own_maps, st.own_bytes, st.peer_lost) == (0, 0, 0)


def test_a_process_alone_keeps_its_own_through_the_driver_when_asked(
        peer_job, tmp_path: Path, gpu_env, criu_ready) -> None:
    """With POS_OWN_MEMORY_ON_GPU=0 a process alone keeps its own memory through the driver's
    checkpoint, as before; asked not to take it, pos makes no context of its own for a process
    that owns nothing else."""
    owner = peer_job("own")
    img = tmp_path / "img"
    r = pos("checkpoint", str(owner.pid), "-D", str(img), "--concurrent",
            "--leave-running", "--json", env={**gpu_env, "POS_OWN_MEMORY_ON_GPU": "0"})
    assert r.returncode == 0, r.stderr
    timings = json.loads(r.stdout)["timings"]
    assert "own_taken_bytes" not in timings and "context" not in timings
    assert not list(img.glob(names.OWN_MEMORY_INDEXES))
    with Agent(owner.pid) as a:
        st = a.status()
    assert (st.own_maps, st.own_kept, st.imported) == (1, 0, 0)


@pytest.mark.parametrize("free_mib, in_host, ahead", [("1", VMM_BYTES, "1"),
                                                      ("1025", VMM_BYTES // 2, "0")],
                         ids=["no-room-faulted-ahead", "room-for-half-faulted-as-copied"])
def test_a_process_alone_without_room_on_its_gpu_is_copied_into_host_memory_and_restored(
        peer_job, tmp_path: Path, gpu_env, criu_ready, free_mib: str, in_host: int,
        ahead: str) -> None:
    """Where its GPU has no room for all of its own memory (PyTorch's expandable segments
    filling the GPU), a process alone has the rest copied into host memory at the cut rather
    than kept by the driver, into memory faulted in before the cut unless POS_OWN_HOST_AHEAD
    is 0; ended and restored, it has all of it back at its address."""
    owner = peer_job("own")
    with Agent(owner.pid) as a:
        va = a.exports()[0].va
    img = tmp_path / "img"
    env = {**gpu_env, "POS_FAKECUDA_FREE_MIB": free_mib, "POS_OWN_HOST_AHEAD": ahead}
    r = pos("checkpoint", str(owner.pid), "-D", str(img), "--concurrent", "--json", env=env)
    assert r.returncode == 0, r.stderr
    timings = json.loads(r.stdout)["timings"]
    assert (timings["own_taken_bytes"], timings["own_host_bytes"]) == (VMM_BYTES, in_host)
    assert timings["own_host_planned_bytes"] == in_host
    # faulted in from before the cut until the take: as far as it came by then
    assert (0 <= timings["own_faulted_bytes"] <= in_host) if ahead == "1" else \
        timings["own_faulted_bytes"] == 0
    assert ("own_fault" in timings) == (ahead == "1")
    owner.proc.wait(timeout=30)
    r = pos("restore", "-D", str(img), env=gpu_env)
    assert r.returncode == 0, r.stderr
    with open(f"/proc/{owner.pid}/mem", "rb", buffering=0) as mem:
        assert os.pread(mem.fileno(), VMM_BYTES, va) == SEVEN * (VMM_BYTES // len(SEVEN))


@pytest.mark.parametrize("setting", ["1", "0"], ids=["taken", "driver"])
def test_a_process_alone_with_only_its_own_memory_is_restored_with_it(
        peer_job, tmp_path: Path, gpu_env, criu_ready, setting) -> None:
    """Checkpointed and ended: restored, its own memory is what the checkpoint saved, at its
    address, whether pos took it (and fills it anew) or the driver's checkpoint kept it."""
    owner = peer_job("own")
    with Agent(owner.pid) as a:
        va = a.exports()[0].va
    img = tmp_path / "img"
    env = {**gpu_env, "POS_OWN_MEMORY_ON_GPU": setting}
    r = pos("checkpoint", str(owner.pid), "-D", str(img), "--concurrent", env=env)
    assert r.returncode == 0, r.stderr
    owner.proc.wait(timeout=30)
    r = pos("restore", "-D", str(img), env=env)
    assert r.returncode == 0, r.stderr
    with open(f"/proc/{owner.pid}/mem", "rb", buffering=0) as mem:
        assert os.pread(mem.fileno(), 16, va) == SEVEN


def test_own_memory_mapped_back_is_taken_again_whatever_the_setting(
        pair: Pair, tmp_path: Path, gpu_env) -> None:
    """After pos mapped the owner's memory back from its descriptors, the driver cannot
    checkpoint it (it is an import now): a later checkpoint takes it again though the setting
    is off, and the stop-the-world engine refuses the job."""
    r = pos("checkpoint", str(pair.root), "-D", str(tmp_path / "one"), "--concurrent",
            "--leave-running", env=gpu_env)
    assert r.returncode == 0, r.stderr
    with Agent(pair.owner) as a:
        st = a.status()
    assert (st.own_kept, st.imported) == (1, 1)
    off = {**gpu_env, "POS_OWN_MEMORY_MAX_GIB": "0"}
    r = pos("checkpoint", str(pair.root), "-D", str(tmp_path / "two"), "--concurrent",
            "--leave-running", "--json", env=off)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["timings"]["own_taken_bytes"] == VMM_BYTES
    shares_the_owners_memory(pair)
    r = pos("checkpoint", str(pair.owner), "-D", str(tmp_path / "stw"), "--leave-running",
            env=off)
    assert r.returncode == 2 and "were mapped back" in r.stderr, r.stderr


def test_restored_processes_map_the_owners_fresh_export_at_the_old_address(
        pair: Pair, tmp_path: Path, gpu_env) -> None:
    img = tmp_path / "img"
    r = pos("checkpoint", str(pair.root), "-D", str(img), "--concurrent", env=gpu_env)
    assert r.returncode == 0, r.stderr
    assert (img / names.PEER_LINKS).is_file()
    pair.proc.wait(timeout=30)                      # CRIU's dump, then the tree ended
    for p in (pair.owner, pair.importer):
        wait_for(lambda: reaped(p), what=f"process {p}'s end")
    r = pos("restore", "-D", str(img), "--json", "--until-filled", env=gpu_env)
    assert r.returncode == 0, r.stderr
    # the owner's memory came from the image: CRIU's dump did not hold it; made and filled
    # while CRIU restored the processes
    timings = json.loads(r.stdout)["timings"]
    assert timings["own_back_bytes"] == VMM_BYTES and 0 < timings["own_at"]
    assert timings["own_make"] > 0 and timings["own_fill"] > 0
    shares_the_owners_memory(pair)
    again = tmp_path / "again"                      # a second checkpoint after the restore
    r = pos("checkpoint", str(pair.root), "-D", str(again), "--concurrent", "--leave-running",
            env=gpu_env)
    assert r.returncode == 0, r.stderr
    shares_the_owners_memory(pair)


@pytest.mark.parametrize("damage", ["cut-short", "a-byte-changed"])
def test_an_image_whose_own_memory_was_damaged_is_refused_in_one_sentence(
        pair: Pair, tmp_path: Path, gpu_env, damage: str) -> None:
    """Cut short, the restore refuses before CRIU; a byte changed, the restore's fill finds it
    as it reads the chunk, and no process of the job is left (the own memory's chunks are
    checked as read, not before the job runs)."""
    img = tmp_path / "img"
    r = pos("checkpoint", str(pair.root), "-D", str(img), "--concurrent", env=gpu_env)
    assert r.returncode == 0, r.stderr
    pair.proc.wait(timeout=30)
    for p in (pair.owner, pair.importer):
        wait_for(lambda: reaped(p), what=f"process {p}'s end")
    data = img / names.own_memory(pair.owner)[1]
    if damage == "cut-short":
        os.truncate(data, data.stat().st_size // 2)
    else:
        with open(data, "r+b") as f:
            first = f.read(1)
            f.seek(0)
            f.write(bytes([first[0] ^ 1]))
    r = pos("restore", "-D", str(img), env=gpu_env)
    one_sentence(r, 2, data.name)
    assert damage == "cut-short" or "do not match their checksum" in r.stderr, r.stderr
    for p in (pair.root, pair.owner, pair.importer):
        assert state(p) in ("X", "Z"), p


def test_the_stop_the_world_engine_still_refuses_untouched(pair: Pair, tmp_path: Path,
                                                           gpu_env) -> None:
    r = pos("checkpoint", str(pair.root), "-D", str(tmp_path / "img"), "--leave-running",
            env=gpu_env)
    assert r.returncode == 2 and "maps another process's GPU memory" in r.stderr, r.stderr
    assert not (tmp_path / "img").exists()
    shares_the_owners_memory(pair)


def state(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "X"


@pytest.mark.parametrize("step", ["cut", "hoist", "checkpoint", "dump", "restore", "copy"])
def test_pos_killed_at_each_step_leaves_each_process_running_whole_or_ended(
        pair: Pair, tmp_path: Path, gpu_env, step: str) -> None:
    """The watchdog gives each job its memory back and puts the import back (the image's
    links), so both run on whole: the owner with its bytes, the importer with its import
    mapped (where that fails it ends instead: the test below)."""
    with Agent(pair.owner) as a:
        owner_va = a.exports()[0].va
    r = pos("checkpoint", str(pair.root), "-D", str(tmp_path / "img"), "--concurrent",
            "--leave-running", env={**gpu_env, "POS_FAULT_AT": f"{step}=KILL"})
    assert r.returncode == -9, (r.returncode, r.stderr)
    log = Path(gpu_env["POS_WATCHDOG_LOG"])
    wait_for(lambda: log.exists() and "undo" in log.read_text() and (
        "undo done" in log.read_text() or "undo failed" in log.read_text()), timeout=60,
        what="the watchdog's undo")
    with Agent(pair.owner) as a:
        wait_for(lambda: a.status().phase == "idle", what="the owner's release")
    with open(f"/proc/{pair.owner}/mem", "rb", buffering=0) as mem:
        assert os.pread(mem.fileno(), 16, owner_va) == SEVEN
    wait_for(lambda: state(pair.importer) in "XZ" or _idle(pair.importer), timeout=30,
             what=f"the importer running on or ended: {log.read_text()}")
    assert state(pair.importer) not in "XZ", pair.said()
    with Agent(pair.importer) as a:
        st = a.status()
    assert (st.peer_maps, st.peer_down) == (1, 0)
    shares_the_owners_memory(pair)
    if step not in ("cut", "copy"):             # the import was down when pos died
        assert "putting back 1 imports" in log.read_text()


def test_an_import_that_cannot_come_back_ends_its_process_never_held(
        tmp_path: Path, fakegpu, gpu_env, criu_ready) -> None:
    """pos dies with the import down, and the owner dies too: the watchdog cannot put it back,
    and the importer, let go, stays held for its stall bound, then ends itself rather than run
    without it."""
    pair = Pair(fakegpu, tmp_path, {**gpu_env, "POS_AGENT_STALL_S": "5"})
    try:
        cannot_come_back(pair, tmp_path, gpu_env)
    finally:
        pair.kill()


def cannot_come_back(pair: Pair, tmp_path: Path, gpu_env: dict[str, str]) -> None:
    r = pos("checkpoint", str(pair.root), "-D", str(tmp_path / "img"), "--concurrent",
            "--leave-running", env={**gpu_env, "POS_FAULT_AT": "dump=KILL"})
    assert r.returncode == -9, (r.returncode, r.stderr)
    os.kill(pair.owner, signal.SIGKILL)
    log = Path(gpu_env["POS_WATCHDOG_LOG"])
    wait_for(lambda: log.exists() and "undo" in log.read_text() and (
        "undo done" in log.read_text() or "undo failed" in log.read_text()), timeout=60,
        what="the watchdog's undo")
    wait_for(lambda: state(pair.importer) in "XZ", timeout=30,
             what=f"the importer's end: {log.read_text()} {pair.said()}")
    assert "ending the process" in pair.outs[1].read_text()


def _idle(pid: int) -> bool:
    try:
        with Agent(pid, timeout=5) as a:
            return a.status().phase == "idle"
    except Exception:
        return False


@pytest.fixture(scope="module")
def libnccl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty library named as NCCL's: what pos looks for in a rank's mappings."""
    folder = tmp_path_factory.mktemp("nccl")
    (folder / "empty.c").write_text("int pos_test_nccl_stand_in;\n")
    out = folder / "libnccl.so.2"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(out), str(folder / "empty.c")],
                   check=True, timeout=60)
    return out


@pytest.mark.parametrize("nvls", ["", "0"], ids=["nvls-default", "nvls-off"])
def test_nvlink_sharp_left_on_is_refused_untouched(tmp_path: Path, fakegpu, gpu_env, criu_ready,
                                                   libnccl: Path, nvls: str) -> None:
    """NCCL's multicast memory is not a cuMem import pos can take down: a rank whose settings
    leave NVLS on is refused before the cut; with NCCL_NVLS_ENABLE=0 the job is saved."""
    env = {**gpu_env, "LD_PRELOAD": str(libnccl), "LOCAL_WORLD_SIZE": "2",
           **({"NCCL_NVLS_ENABLE": nvls} if nvls else {})}
    pair = Pair(fakegpu, tmp_path, env)
    try:
        r = pos("checkpoint", str(pair.root), "-D", str(tmp_path / "img"), "--concurrent",
                "--leave-running", env=gpu_env)
        if nvls == "0":
            assert r.returncode == 0, r.stderr
        else:
            assert r.returncode == 2 and "leave NVLink SHARP on" in r.stderr and \
                "NCCL_NVLS_ENABLE=0" in r.stderr, r.stderr
            assert not (tmp_path / "img").exists()
        shares_the_owners_memory(pair)
    finally:
        pair.kill()


def test_an_image_whose_processes_map_each_other_is_not_moved_to_other_gpus(
        pair: Pair, tmp_path: Path, gpu_env) -> None:
    """The putback gives each import its old access, which names its old GPU: refused before
    anything is restored (the job, still running, untouched)."""
    img = tmp_path / "img"
    r = pos("checkpoint", str(pair.root), "-D", str(img), "--concurrent", "--leave-running",
            env=gpu_env)
    assert r.returncode == 0, r.stderr
    r = pos("restore", "-D", str(img), "--to-gpu", "1", env=gpu_env)
    assert r.returncode == 2 and "map each other's GPU memory" in r.stderr and \
        "without --to-gpu" in r.stderr, r.stderr
    shares_the_owners_memory(pair)
