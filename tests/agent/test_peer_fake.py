"""Peer memory (pos/agent/hook/peer.c) against the fake driver: memory of another process that a
job maps, which the driver's restore fails on (cuMem imports: 801; legacy IPC: 1, measured on
two H200s), is what the agent reports, in the importer only, for as long as it is mapped; pos's
own re-imports of a job's memory are not. With every process held, pos finds each import's
owner exactly, takes the imports down so that the driver's restore passes, and puts them back;
a failure, or pos killed, never leaves a process running without its mapping, nor held."""

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest

from pos.agent import peers
from pos.agent.control import Agent, Refused
from pos.driver import DriverError
from pos.errors import BadInput, PosError
from pos.process import cudackpt
from tests.conftest import ROOT, wait_for

VMM_BYTES, IPC_BYTES = 2 << 20, 1 << 20     # what peer_job.c shares


def reported(pid: int) -> tuple[tuple[int, int, int], dict]:
    """(peer_maps, peer_bytes, ipc_maps) of `status`, and the `peers` listing."""
    with Agent(pid) as a:
        st = a.status()
        return (st.peer_maps, st.peer_bytes, st.ipc_maps), a._ask("peers")


def own_maps(pid: int) -> tuple[Optional[int], Optional[int]]:
    """(own_maps, own_bytes) of `status`: the job's own cuMem mappings."""
    with Agent(pid) as a:
        st = a.status()
        return st.own_maps, st.own_bytes


def test_an_importer_reports_the_memory_it_maps_until_it_unmaps_it(peer_job) -> None:
    owner = peer_job("own")
    importer = peer_job("import")
    va = int(re.search(r"MAPPED (0x[0-9a-f]+)", importer.printed("READY"))[1], 16)
    assert reported(owner.pid)[0] == (0, 0, 0)
    # the owner's allocation, which the driver's checkpoint would copy: its own, not a peer's
    assert own_maps(owner.pid) == (1, VMM_BYTES) and own_maps(importer.pid) == (0, 0)
    counts, listing = reported(importer.pid)
    assert counts == (1, VMM_BYTES, 0)
    assert listing["maps"] == [{"va": va, "size": VMM_BYTES, "offset": 0, "released": False,
                                "down": False, "access": [{"type": 1, "id": 0, "flags": 3}]}]
    assert listing["ipc"] == []

    exchange = Path(importer.proc.args[-1])
    (exchange / "release").touch()              # the handle goes; the mapping holds the memory
    importer.printed("RELEASED")
    counts, listing = reported(importer.pid)
    assert counts == (1, VMM_BYTES, 0) and listing["maps"][0]["released"]
    (exchange / "unmap").touch()
    importer.printed("UNMAPPED")
    assert reported(importer.pid) == ((0, 0, 0), {"ok": True, "maps": [], "ipc": []})


def test_a_legacy_ipc_opening_is_reported_until_it_is_closed(peer_job) -> None:
    """The owner's memory is the driver's own (POS_OWN=0): legacy IPC shares cuMemAlloc's
    memory only, not the VMM memory the agent makes of it."""
    owner = peer_job("ipc-own", own=False)
    opener = peer_job("ipc-open")
    va = int(re.search(r"OPENED (0x[0-9a-f]+)", opener.printed("READY"))[1], 16)
    assert reported(owner.pid)[0] == (0, 0, 0)
    counts, listing = reported(opener.pid)
    assert counts == (0, 0, 1)
    assert listing["ipc"] == [{"va": va, "size": IPC_BYTES, "flags": 1}]
    (Path(opener.proc.args[-1]) / "close").touch()
    opener.printed("CLOSED")
    assert reported(opener.pid)[0] == (0, 0, 0)


def test_pos_mapping_a_jobs_own_memory_back_is_not_peer_memory(fill_job) -> None:
    job = fill_job(buffers=3)
    with Agent(job.pid) as a:
        a.cut(5)
        fds = a.export().fds
        a.hoist()
        a.remap(fds)
        a.end()
        st = a.status()
    for fd in fds:
        os.close(fd)
    assert st.imported == 3 and (st.peer_maps, st.peer_bytes, st.ipc_maps) == (0, 0, 0)


# ---- taking imports down and putting them back (pos/agent/peers.py; issue 42) -------------------

SEVEN = bytes([7, 0, 0, 0]) * 4      # what peer_job's owner fills its memory with


def held(*jobs) -> list[Agent]:
    """An agent for each job, its job cut (held)."""
    agents = [Agent(j.pid) for j in jobs]
    for a in agents:
        a.cut(5)
    return agents


def let_go(agents: list[Agent]) -> None:
    for a in agents:
        a.end()
        a.close()


def gone(pid: int, timeout: float = 10) -> None:
    def ended() -> bool:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        try:
            return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] in "ZX"
        except OSError:
            return True
    wait_for(ended, timeout, what=f"process {pid}'s end")


def test_the_fake_driver_cannot_restore_a_process_that_maps_an_import(peer_job) -> None:
    """As the driver (801 on two H200s); the owner restores."""
    owner = peer_job("own")
    importer = peer_job("import")
    for p in (owner.pid, importer.pid):
        cudackpt.lock(p, 5000)
        cudackpt.checkpoint(p)
    cudackpt.restore(owner.pid)
    cudackpt.unlock(owner.pid)
    with pytest.raises(DriverError) as failed:
        cudackpt.restore(importer.pid)
    assert failed.value.code == 801
    assert cudackpt.get_state(importer.pid) == "checkpointed"
    importer.kill()


def test_equal_size_owners_are_told_apart_by_what_they_hold(peer_job) -> None:
    """Two owners of one size, each imported by another process: each import is matched with
    its own owner, and every byte pos wrote is put back."""
    owners = [peer_job("own", folder=f) for f in ("a", "b")]
    importers = [peer_job("import", folder=f) for f in ("b", "a")]   # b's first: order is no guide
    agents = held(*importers, *owners)
    try:
        links = peers.match(agents)
        va = {i.pid: int(re.search(r"MAPPED (0x[0-9a-f]+)", i.printed("READY"))[1], 16)
              for i in importers}
        owner_va = {a.pid: a.exports()[0].va for a in agents[2:]}
        assert sorted((k.importer, k.va, k.owner, k.owner_va) for k in links) == sorted(
            (i.pid, va[i.pid], o.pid, owner_va[o.pid])
            for i, o in zip(importers, reversed(owners)))
        for a in agents[:2]:
            assert a.peek(va[a.pid]) == SEVEN
    finally:
        let_go(agents)


def test_an_owner_outside_the_job_is_refused_with_nothing_changed(peer_job) -> None:
    owner = peer_job("own")
    importer = peer_job("import")
    agents = held(importer)
    try:
        with pytest.raises(BadInput, match="whose owner is not a process of this job"):
            peers.match(agents)
        assert agents[0].status().peer_down == 0
    finally:
        let_go(agents)
    assert owner.alive() and importer.alive()


def test_imports_taken_down_survive_the_drivers_restore_and_are_put_back(peer_job) -> None:
    """In place (a --leave-running checkpoint): down, the driver's whole cycle, which fails 801
    with the import mapped, passes; back at the same address, the owner's memory again."""
    owner = peer_job("own")
    importer = peer_job("import")
    va = int(re.search(r"MAPPED (0x[0-9a-f]+)", importer.printed("READY"))[1], 16)
    agents = held(importer, owner)
    try:
        links = peers.match(agents)
        assert peers.take_down(agents, links) == VMM_BYTES
        st = agents[0].status()
        assert (st.peer_maps, st.peer_down) == (1, 1)
        with pytest.raises(Refused, match="put them back first"):
            agents[0].end()                     # never a run with an import down
        for call in (lambda p: cudackpt.lock(p, 5000), cudackpt.checkpoint, cudackpt.restore,
                     cudackpt.unlock):
            call(importer.pid)
        assert peers.put_back(agents, links) == 1
        assert agents[0].peek(va) == SEVEN
        nonce = os.urandom(16)
        agents[1].stamp(links[0].owner_va, nonce)
        assert agents[0].peek(va) == nonce      # the owner's memory, not a copy
        agents[1].unstamp()
        listing = agents[0].peers()
        assert [(m.va, m.size, m.down) for m in listing] == [(va, VMM_BYTES, False)]
    finally:
        let_go(agents)
    assert importer.alive() and owner.alive()
    assert reported(importer.pid)[0] == (1, VMM_BYTES, 0)


def test_an_export_failing_mid_putback_never_lets_an_importer_run_without_its_mapping(
        peer_job) -> None:
    owners = [peer_job("own", folder=f) for f in ("a", "b")]
    importers = [peer_job("import", folder=f, stall_s=5) for f in ("a", "b")]
    agents = held(*importers, *owners)
    links = peers.match(agents)
    peers.take_down(agents, links)
    owners[1].kill()                            # b's owner: its export fails
    with pytest.raises(PosError):
        peers.put_back(agents, links)           # a's importer first: put back
    agents[3].close()
    assert agents[0].status().peer_down == 0
    with pytest.raises(Refused, match="put them back first"):
        agents[1].end()
    let_go([agents[0], agents[2]])
    agents[1].close()          # pos lets b's importer go: held until its stall bound, then ended
    with Agent(importers[1].pid) as a:
        assert a.status().phase == "hold"
    gone(importers[1].pid, timeout=15)
    assert "ending the process" in importers[1].out.read_text()
    assert importers[0].alive() and owners[0].alive()


@pytest.mark.parametrize("step", ["stamped", "down", "exported", "up"])
def test_pos_killed_at_each_step_leaves_every_process_running_or_ended(
        peer_job, gpu_env, step) -> None:
    """The owner always runs on with its bytes; the importer runs on with its mapping, or, if
    pos died while it was down (and nothing put it back within its stall bound), ends (its
    image would restore it): never held for good."""
    owner = peer_job("own")
    importer = peer_job("import", stall_s=5)
    with Agent(owner.pid) as a:
        owner_va = a.exports()[0].va
    r = subprocess.run([sys.executable, str(Path(__file__).with_name("peer_steps.py")), step,
                        str(owner.pid), str(importer.pid)], cwd=ROOT, env=gpu_env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == -9 and f"KILLED AT {step}" in r.stdout, (r.returncode, r.stderr)
    with Agent(owner.pid) as a:
        wait_for(lambda: a.status().phase == "idle", what="the owner's release")
    with open(f"/proc/{owner.pid}/mem", "rb", buffering=0) as mem:
        assert os.pread(mem.fileno(), 16, owner_va) == SEVEN     # its bytes back
    if step in ("down", "exported"):            # held for its stall bound, then ended
        gone(importer.pid, timeout=15)
        return
    with Agent(importer.pid) as a:
        wait_for(lambda: a.status().phase == "idle", what="the importer's release")
        st = a.status()
    assert importer.alive() and (st.peer_maps, st.peer_down) == (1, 0)


@pytest.mark.parametrize("engine", [("--concurrent",), ()], ids=["concurrent", "stw"])
def test_a_record_the_agent_could_not_keep_makes_pos_refuse_the_job(
        peer_job, tmp_path, gpu_env, engine) -> None:
    """Issue 45: an agent short of memory used to drop a record silently, and the job then
    looked as if it mapped nothing of another's. POS_AGENT_PEER_MAX=0 makes it keep none."""
    owner = peer_job("own")
    importer = peer_job("import", env={"POS_AGENT_PEER_MAX": "0"})
    with Agent(importer.pid) as a:
        st = a.status()
    assert st.peer_lost and st.peer_maps == 0
    r = subprocess.run([sys.executable, "-m", "pos.cli", "checkpoint", str(importer.pid), "-D",
                        str(tmp_path / "img"), "--leave-running", *engine], cwd=ROOT,
                       env=gpu_env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and (
        f"Error: the agent of PID {importer.pid} lost track of {st.peer_lost} of the job's "
        "mappings of other processes' GPU memory") in r.stderr
    assert not (tmp_path / "img").exists()
    assert importer.alive() and owner.alive()
    with Agent(importer.pid) as a:
        assert a.status().phase == "idle"
