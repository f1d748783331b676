"""The job's own cuMem memory, taken into the image as pos takes the memory it owns: allocations
the job made and mapped itself, which pos's agent does not own (NCCL's buffers, which the rank's
peers import). Left in the job, the driver's checkpoint copies them into its host memory and
CRIU writes them while the job is frozen: with NCCL's defaults about a third of a 2-rank Llama
job's hold (1.4 of 3.9 s on two H200s, bench/results/2026-11-29.md, with NCCL's channels cut
to two).

Taken, each is copied while every process is held (the peers write into it through their own
mappings, which no gate of its owner sees), given up by the job (the agent's own-down: pos's
descriptors hold the memory), and mapped back after the driver's restore (own-up), in place; a
restored process gets it made anew and filled before any process of the job runs. The agent's
side, and how the job's later calls on the handle it made are answered: pos/agent/hook/peer.c.

The image holds, for each process with such memory, an index (address, size, device of each
allocation, in the agent's `exports` order) and the bytes, one allocation after another
(names.own_memory)."""

from __future__ import annotations

import ctypes as C
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Optional

from pos.agent.control import Agent, Buffer
from pos.errors import BadInput, PosError
from pos.image import names

if TYPE_CHECKING:
    from pos.driver import Driver

PIECE = 64 << 20    # bytes copied between the device and the host at a time


@dataclass(frozen=True)
class Region:
    """One of the job's own allocations, mapped at [va, va+size) on `device`."""

    va: int
    size: int
    device: int


class Taken:
    """What a checkpoint took of one job's own memory: pos's descriptors, which hold it while
    the job has given it up (own-up maps them back in place)."""

    def __init__(self, regions: list[Region], fds: list[int]) -> None:
        self.regions, self.fds = regions, fds

    @property
    def bytes(self) -> int:
        return sum(r.size for r in self.regions)

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []


def take(agent: Agent, drv: "Driver", device: int, folder: Path, pid: Optional[int]) -> Taken:
    """The held job's own allocations that the driver exports, copied into `folder` (the image
    being written; `pid`: the process's, in an image of several), and kept as descriptors. The
    job still maps them: its agent's own-down gives them up."""
    size = {a.va: a.size for a in agent.exports()}
    vas, fds = agent.own_take() if size else ([], [])
    taken = Taken([Region(va, size[va], device) for va in vas], fds)
    if not vas:       # none the driver would export: the driver's checkpoint keeps them
        return taken
    try:
        _write(drv, taken, folder, pid)
    except BaseException:
        taken.close()
        raise
    return taken


def _buffers(regions: list[Region]) -> list[Buffer]:
    return [Buffer(r.va, r.size, r.size, r.device, True) for r in regions]


def _staging(regions: list[Region]) -> C.Array[C.c_char]:
    """The host memory each copy between the device and the image goes through."""
    return C.create_string_buffer(min(PIECE, max((r.size for r in regions), default=0)) or 1)


def _pieces(regions: list[Region], local: list[int]) -> Iterator[tuple[int, int]]:
    """Each piece of the regions, mapped in pos at `local`, in the image's order: its address
    in pos and its bytes."""
    for r, base in zip(regions, local):
        for at in range(0, r.size, PIECE):
            yield base + at, min(PIECE, r.size - at)


def _write(drv: "Driver", taken: Taken, folder: Path, pid: Optional[int]) -> None:
    from pos.concurrent import gpucopy

    index_name, data_name = names.own_memory(pid)
    mem = gpucopy.Imported(drv, _buffers(taken.regions), taken.fds)
    try:
        host = _staging(taken.regions)
        with open(folder / data_name, "wb") as f:
            for at, n in _pieces(taken.regions, mem.local):
                drv.cuMemcpyDtoH_v2(host, at, n)
                f.write(memoryview(host)[:n])
    finally:
        mem.close()
    (folder / index_name).write_text(json.dumps([asdict(r) for r in taken.regions]) + "\n")


def saved(folder: Path, pid: Optional[int]) -> list[Region]:
    """The job's own allocations an image holds ([] where its checkpoint took none)."""
    index_name, data_name = names.own_memory(pid)
    path = folder / index_name
    if not path.exists():
        return []
    try:
        regions = [Region(int(r["va"]), int(r["size"]), int(r["device"]))
                   for r in json.loads(path.read_text())]
    except (ValueError, TypeError, KeyError) as e:
        raise BadInput(f"{path} is damaged ({e})", "restore another image of the job") from None
    data = folder / data_name
    if (data.stat().st_size if data.exists() else -1) != sum(r.size for r in regions):
        raise BadInput(f"{folder / data_name} does not hold what {path} lists",
                       "restore another image of the job")
    return regions


def put_back(agent: Agent, drv: "Driver", device: int, folder: Path, pid: Optional[int],
             listed: list[Region]) -> int:
    """A restored job's own allocations, as the image lists them (`saved`), made anew on
    `device`, filled from the image and mapped at their addresses (the job's agent: own-up),
    before any process of the job runs; the bytes."""
    from pos.concurrent import gpucopy

    regions = [Region(r.va, r.size, device) for r in listed]
    if not regions:
        return 0
    down = [(a.va, a.size) for a in agent.exports() if a.down]
    if down != [(r.va, r.size) for r in regions]:
        raise PosError(f"the restored process {agent.pid}'s own allocations do not match "
                       f"{folder}'s", "take a new checkpoint")
    mem, fds = gpucopy.Imported.create(drv, _buffers(regions))
    try:
        host = _staging(regions)
        with open(folder / names.own_memory(pid)[1], "rb") as f:
            for at, n in _pieces(regions, mem.local):
                if f.readinto(memoryview(host)[:n]) != n:
                    raise BadInput(f"{folder} ends inside the job's own memory",
                                   "restore another image of the job")
                drv.cuMemcpyHtoD_v2(at, host, n)
        agent.own_up(fds)
    finally:
        for fd in fds:
            os.close(fd)
        mem.close()        # the job's mappings hold the memory now
    return sum(r.size for r in regions)
