"""The job's own cuMem memory taken as pos takes the memory it owns (pos/agent/hook/peer.c:
own-take, own-down, own-up), against the fake driver. NCCL's buffers are such memory: the job
made and mapped them itself, its peers import them, and the driver's checkpoint copies them into
the job's host memory, which CRIU then writes while the job is frozen (a third of a 2-rank job's
hold, bench/results/2026-11-29.md). Taken, they live in what pos holds through the driver's
cycle and come back at the same address; the job's later calls on the handle it made reach the
memory it has now; the job never runs while they are down."""

import os
import re
import time
from pathlib import Path

import pytest

from pos.agent import peers
from pos.agent.control import Agent, Refused
from pos.process import cudackpt
from tests.agent.test_peer_fake import SEVEN, VMM_BYTES, gone, held, let_go


def mapped_at(importer) -> int:
    return int(re.search(r"MAPPED (0x[0-9a-f]+)", importer.printed("READY"))[1], 16)


def driver_cycle(*pids: int) -> None:
    """The driver's checkpoint and restore of each, in place."""
    for p in pids:
        cudackpt.lock(p, 5000)
        cudackpt.checkpoint(p)
    for p in pids:
        cudackpt.restore(p)
        cudackpt.unlock(p)


def taken(agents: list[Agent]) -> tuple[list[peers.Link], list[int]]:
    """Every import down, then the owner's (agents[-1]) own memory taken and down: the links
    and pos's descriptors of that memory."""
    links = peers.match(agents)
    peers.take_down(agents, links)
    got = agents[-1].own_take()
    vas, fds = got.vas, got.fds
    assert vas == [agents[-1].exports()[0].va] and not got.same
    assert agents[-1].own_down() == VMM_BYTES
    return links, fds


def test_own_memory_taken_through_the_drivers_cycle_comes_back_at_its_address(
        peer_job) -> None:
    owner = peer_job("own")
    importer = peer_job("import")
    va = mapped_at(importer)
    agents = held(importer, owner)
    fds: list[int] = []
    try:
        own_va = agents[1].exports()[0].va
        links, fds = taken(agents)
        assert len(fds) == 1
        st = agents[1].status()
        assert (st.own_maps, st.own_down) == (1, 1)
        assert [(a.va, a.down) for a in agents[1].exports()] == [(own_va, True)]
        with pytest.raises(Refused, match="put them back first"):
            agents[1].end()                     # never a run with its own memory down
        driver_cycle(importer.pid, owner.pid)
        assert agents[1].own_up(fds) == 1
        assert agents[1].status().own_down == 0
        assert peers.put_back(agents, links) == 1
        assert agents[0].peek(va) == SEVEN      # the owner's bytes, through the importer
        nonce = os.urandom(16)
        agents[1].stamp(own_va, nonce)
        assert agents[0].peek(va) == nonce      # one memory, the owner's and the importer's
        agents[1].unstamp()
    finally:
        for fd in fds:
            os.close(fd)
        let_go(agents)
    with open(f"/proc/{owner.pid}/mem", "rb", buffering=0) as mem:
        assert os.pread(mem.fileno(), 16, own_va) == SEVEN


def test_pieces_that_follow_each_other_in_one_reservation_come_back_each_in_place(
        peer_job) -> None:
    """Pieces mapped one after another in one reservation, as PyTorch's expandable segments
    map them, their access given once over all of them, and one apart: own-up maps each back
    at its address with its access, every piece's bytes its own."""
    job = peer_job("segment")
    fds: list[int] = []
    with Agent(job.pid) as a:
        a.cut(5)
        vas = [e.va for e in a.exports()]
        assert len(vas) == 4 and vas[1] - vas[0] == vas[2] - vas[1] == VMM_BYTES
        got = a.own_take()
        fds = got.fds
        try:
            assert got.vas == vas and a.own_down() == 4 * VMM_BYTES
            driver_cycle(job.pid)
            assert a.own_up(fds) == 4
            assert a.status().own_down == 0
            with open(f"/proc/{job.pid}/mem", "rb", buffering=0) as mem:
                back = [os.pread(mem.fileno(), 16, v) for v in vas]
            assert back == [bytes([7 + i, 0, 0, 0]) * 4 for i in range(4)]
        finally:
            for fd in fds:
                os.close(fd)
        a.end()


def test_the_handle_the_job_made_exports_the_memory_it_has_after_the_take(peer_job) -> None:
    """NCCL exports a buffer's first handle again for a peer that connects later: the agent
    answers with the memory mapped there now (the driver does not export the imported handle
    that maps it, and the first one is gone: the fake driver refuses it)."""
    owner = peer_job("own")
    importer = peer_job("import")
    agents = held(importer, owner)
    fds: list[int] = []
    try:
        links, fds = taken(agents)
        driver_cycle(owner.pid)
        agents[1].own_up(fds)
        peers.put_back(agents, links)
        own_va = agents[1].exports()[0].va
    finally:
        for fd in fds:
            os.close(fd)
        let_go(agents)
    exchange = Path(owner.proc.args[-1])
    (exchange / "export").touch()
    owner.printed("EXPORTED")
    late = exchange.parent / "late"
    late.mkdir()
    (late / "owner").write_text((exchange / "owner2").read_text())
    newcomer = peer_job("import", folder="late")
    va = mapped_at(newcomer)
    nonce = os.urandom(16)                      # written where the owner maps it now
    with open(f"/proc/{owner.pid}/mem", "r+b", buffering=0) as mem:
        os.pwrite(mem.fileno(), nonce, own_va)
    with Agent(newcomer.pid) as a:
        a.cut(5)
        try:
            assert a.peek(va) == nonce
        finally:
            a.end()


def test_pos_gone_with_own_memory_down_ends_the_job_after_its_stall_bound(peer_job) -> None:
    """The job never runs without the memory it mapped: held while pos's watchdog may still put
    it back, then ended (its image restores it)."""
    owner = peer_job("own", stall_s=5)
    agents = held(owner)
    for fd in agents[0].own_take().fds:
        os.close(fd)
    agents[0].own_down()
    agents[0].close()
    with Agent(owner.pid) as a:
        assert a.status().phase == "hold"
    gone(owner.pid, timeout=15)
    assert "ending the process" in owner.out.read_text()


def test_the_jobs_export_while_its_memory_is_down_waits_for_it(peer_job) -> None:
    """A peer connecting while pos holds the memory: NCCL's proxy exports the buffer's first
    handle; the export waits for own-up, as the job's other calls wait for their memory, and
    then reaches the memory mapped there."""
    owner = peer_job("own")
    agents = held(owner)
    fds: list[int] = []
    try:
        fds = agents[0].own_take().fds
        agents[0].own_down()
        exchange = Path(owner.proc.args[-1])
        (exchange / "export").touch()
        time.sleep(1)
        assert "EXPORTED" not in owner.out.read_text()
        driver_cycle(owner.pid)
        agents[0].own_up(fds)
        owner.printed("EXPORTED")
    finally:
        for fd in fds:
            os.close(fd)
        let_go(agents)


def test_memory_an_own_down_left_mapped_keeps_its_own(peer_job) -> None:
    """own-up takes one descriptor for each allocation own-take took: one still mapped (an
    own-down that failed part way, or none) stays the job's, and the job runs on."""
    owner = peer_job("own")
    agents = held(owner)
    got = agents[0].own_take()
    vas, fds = got.vas, got.fds
    try:
        assert agents[0].own_up(fds) == 0
        assert [(a.va, a.down) for a in agents[0].exports()] == [(vas[0], False)]
        assert agents[0].status().own_kept == 0
    finally:
        for fd in fds:
            os.close(fd)
        let_go(agents)
    with open(f"/proc/{owner.pid}/mem", "rb", buffering=0) as mem:
        assert os.pread(mem.fileno(), 16, vas[0]) == SEVEN


def test_an_export_before_the_cut_serves_the_take_while_the_memory_is_the_same(peer_job) -> None:
    """own-export, while the job runs, exports what own-take would and marks nothing; own-take
    given its serials exports nothing more while those allocations are the job's (`same`), and
    freshly once they are not: after an own-up, the memory mapped there is pos's, not what the
    export named."""
    owner = peer_job("own")
    with Agent(owner.pid) as a:
        early = a.own_export()
        assert a.status().phase == "idle" and not early.same
    fds = list(early.fds)
    agents = held(owner)
    try:
        assert early.vas == [agents[0].exports()[0].va] and len(early.serials) == 1
        assert agents[0].own_take([early.serials[0] + 1]).same is False   # not those: fresh
        for fd in agents[0].own_take([early.serials[0] + 1]).fds:
            os.close(fd)
        got = agents[0].own_take(early.serials)
        assert (got.same, got.vas, got.fds) == (True, early.vas, [])
        assert agents[0].own_down() == VMM_BYTES       # own-take marked it: down it goes
        driver_cycle(owner.pid)
        assert agents[0].own_up(fds) == 1
        again = agents[0].own_take(early.serials)
        fds += again.fds
        assert not again.same and again.serials != early.serials and len(again.fds) == 1
    finally:
        for fd in fds:
            os.close(fd)
        let_go(agents)
    with open(f"/proc/{owner.pid}/mem", "rb", buffering=0) as mem:
        assert os.pread(mem.fileno(), 16, early.vas[0]) == SEVEN


def test_a_request_gets_every_descriptor_it_announces_past_4096(peer_job) -> None:
    """The agent keeps every descriptor a request announces, however many: a job with
    PyTorch's expandable segments at 60% of an H200 gave its own memory up in 4,561 pieces,
    and the agent, with room for 4,096, had the job end rather than run without them
    (bench/results/2026-12-01.md). Here 5,000 descriptors for the one allocation taken: the
    agent counts them all and refuses the count, at once."""
    from pos.process import fdroom

    n = 5000
    fdroom.make(n + 64)
    owner = peer_job("own")
    with Agent(owner.pid) as a:
        room = a.room(n + 64)
        if room.room < room.top + n:
            pytest.skip(f"this host's limit of open files ({room.room}) is below {n} "
                        "descriptors; raise the hard RLIMIT_NOFILE to run this test")
        a.cut(5)
        for fd in a.own_take().fds:
            os.close(fd)
        fds = [os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC) for _ in range(n)]
        t0 = time.monotonic()
        try:
            with pytest.raises(Refused, match=f"after 0 of {n}"):
                a.own_up(fds)
        finally:
            for fd in fds:
                os.close(fd)
        assert time.monotonic() - t0 < 10          # not the wait for descriptors never sent
        a.end()
