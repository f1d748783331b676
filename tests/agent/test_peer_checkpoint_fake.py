"""NCCL's defaults in miniature, against the fake driver with real CRIU (issue 42): two
processes under one `pos run`, one importing and mapping the other's cuMem memory (peer_job.c),
as NCCL's P2P and SHM transports do. The fake's restore of a process with an import mapped
fails as the driver's does (801), so each of these passes only because the concurrent engine
took the import down at its cut and put it back after the driver's restore: in place
(--leave-running), or in the restored processes; the import is then the owner's memory again
at its old address."""

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
from tests.conftest import ROOT
from tests.scheduler.conftest import pos, wait_for

SEVEN = bytes([7, 0, 0, 0]) * 4      # peer_job's owner's memory
VMM_BYTES = 2 << 20


class Pair:
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

    def said(self) -> list[str]:
        return [o.read_text() for o in self.outs if o.exists()]

    def ready(self) -> bool:
        if all(o.exists() and "READY" in o.read_text() for o in self.outs):
            return True
        assert self.proc.poll() is None, f"the job ended: {self.said()}"
        return False

    def kill(self) -> None:
        for p in (self.importer, self.owner, self.root):
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc.poll() is None:
            self.proc.wait()


@pytest.fixture
def pair(tmp_path: Path, fakegpu: dict[str, Path], gpu_env: dict[str, str], criu_ready
         ) -> Iterator[Pair]:
    p = Pair(fakegpu, tmp_path, gpu_env)
    yield p
    p.kill()


def gone(pid: int) -> bool:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
    return not Path(f"/proc/{pid}").exists()


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
            env=gpu_env)
    assert r.returncode == 0, r.stderr
    [link] = peers.read(img)
    assert (link.importer, link.va, link.size, link.owner) == (
        pair.importer, pair.va, VMM_BYTES, pair.owner)
    shares_the_owners_memory(pair)


def test_restored_processes_map_the_owners_fresh_export_at_the_old_address(
        pair: Pair, tmp_path: Path, gpu_env) -> None:
    img = tmp_path / "img"
    r = pos("checkpoint", str(pair.root), "-D", str(img), "--concurrent", env=gpu_env)
    assert r.returncode == 0, r.stderr
    assert (img / names.PEER_LINKS).is_file()
    pair.proc.wait(timeout=30)                      # CRIU's dump, then the tree ended
    for p in (pair.owner, pair.importer):
        wait_for(lambda: gone(p), what=f"process {p}'s end")
    r = pos("restore", "-D", str(img), env=gpu_env)
    assert r.returncode == 0, r.stderr
    shares_the_owners_memory(pair)
    again = tmp_path / "again"                      # a second checkpoint after the restore
    r = pos("checkpoint", str(pair.root), "-D", str(again), "--concurrent", "--leave-running",
            env=gpu_env)
    assert r.returncode == 0, r.stderr
    shares_the_owners_memory(pair)


def test_the_stop_the_world_engine_still_refuses_untouched(pair: Pair, tmp_path: Path,
                                                           gpu_env) -> None:
    r = pos("checkpoint", str(pair.root), "-D", str(tmp_path / "img"), "--leave-running",
            env=gpu_env)
    assert r.returncode == 2 and "maps another process's GPU memory" in r.stderr, r.stderr
    assert not (tmp_path / "img").exists()
    shares_the_owners_memory(pair)
