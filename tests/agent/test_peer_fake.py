"""Peer memory (pos/agent/hook/peer.c) against the fake driver: memory of another process that a
job maps, which the driver's restore fails on (cuMem imports: 801; legacy IPC: 1, measured on
two H200s), is what the agent reports, in the importer only, for as long as it is mapped; pos's
own re-imports of a job's memory are not."""

import os
import re
from pathlib import Path

from pos.agent.control import Agent

VMM_BYTES, IPC_BYTES = 2 << 20, 1 << 20     # what peer_job.c shares


def peers(pid: int) -> tuple[tuple[int, int, int], dict]:
    """(peer_maps, peer_bytes, ipc_maps) of `status`, and the `peers` listing."""
    with Agent(pid) as a:
        st = a.status()
        return (st.peer_maps, st.peer_bytes, st.ipc_maps), a._ask("peers")


def test_an_importer_reports_the_memory_it_maps_until_it_unmaps_it(peer_job) -> None:
    owner = peer_job("own")
    importer = peer_job("import")
    va = int(re.search(r"MAPPED (0x[0-9a-f]+)", importer.printed("READY"))[1], 16)
    assert peers(owner.pid)[0] == (0, 0, 0)
    counts, listing = peers(importer.pid)
    assert counts == (1, VMM_BYTES, 0)
    assert listing["maps"] == [{"va": va, "size": VMM_BYTES, "offset": 0, "released": False,
                                "access": [{"type": 1, "id": 0, "flags": 3}]}]
    assert listing["ipc"] == []

    exchange = Path(importer.proc.args[-1])
    (exchange / "release").touch()              # the handle goes; the mapping holds the memory
    importer.printed("RELEASED")
    counts, listing = peers(importer.pid)
    assert counts == (1, VMM_BYTES, 0) and listing["maps"][0]["released"]
    (exchange / "unmap").touch()
    importer.printed("UNMAPPED")
    assert peers(importer.pid) == ((0, 0, 0), {"ok": True, "maps": [], "ipc": []})


def test_a_legacy_ipc_opening_is_reported_until_it_is_closed(peer_job) -> None:
    """The owner's memory is the driver's own (POS_OWN=0): legacy IPC shares cuMemAlloc's
    memory only, not the VMM memory the agent makes of it."""
    owner = peer_job("ipc-own", own=False)
    opener = peer_job("ipc-open")
    va = int(re.search(r"OPENED (0x[0-9a-f]+)", opener.printed("READY"))[1], 16)
    assert peers(owner.pid)[0] == (0, 0, 0)
    counts, listing = peers(opener.pid)
    assert counts == (0, 0, 1)
    assert listing["ipc"] == [{"va": va, "size": IPC_BYTES, "flags": 1}]
    (Path(opener.proc.args[-1]) / "close").touch()
    opener.printed("CLOSED")
    assert peers(opener.pid)[0] == (0, 0, 0)


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
