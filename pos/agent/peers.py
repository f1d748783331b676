"""Other processes' memory across a held job (issue 42, NCCL's defaults): each import matched
with its owner exactly, taken down before the driver's checkpoint, put back after its restore.

Why: the driver restores the owner of a cuMem allocation but not a process that maps another's
(CUDA_ERROR_NOT_SUPPORTED, and the process is lost); an importer that unmapped and released the
import before the checkpoint, and mapped a fresh export of the owner's at the same address after
the restore, came through (bench/peer_probe.py, two H200s). NCCL's P2P and SHM buffers are such
imports, and are often of one size, so an import's owner is found by what it holds, not by its
size or order: every candidate allocation of every rank gets a nonce of its own (its 16 bytes
kept by its agent) and each importer reads one through its mapping; then every byte is put back.

Every rank must be held (cut) for all of it: nothing of the job runs while pos writes its nonces
or while an import is down. The agent never lets a rank run with an import down: it refuses
`end` then, and a connection that ends then ends the process (hook/peer.c), whose image, taken
with the imports down, restores it. The concurrent engine calls this at its cut, records the
links in the image (`write`), and puts the imports back after the driver's restore, in place
(--leave-running) or in the restored processes (`read`, `renamed`); the stop-the-world engine,
which has no agent in the cut, refuses such a job (pos/operation/restorable.py).
"""

import json
import os
import secrets
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Mapping, Sequence

from pos.agent.control import Agent, OwnAlloc, PeerMap
from pos.errors import BadInput, PosError

NONCE = 16           # bytes written into each candidate (hook/peer.c's STAMP)


@dataclass(frozen=True)
class Link:
    """An import and its owner: process `importer` maps [va, va+size) of the allocation that
    process `owner` has at `owner_va`, from `offset`."""

    importer: int
    va: int
    size: int
    offset: int
    owner: int
    owner_va: int


def write(folder: Path, links: Sequence[Link]) -> None:
    """The links into an image being written (none: no file)."""
    from pos.image import names

    if links:
        (folder / names.PEER_LINKS).write_text(json.dumps([asdict(k) for k in links]) + "\n")


def read(folder: Path) -> list[Link]:
    """An image's links ([] when its checkpoint took nothing down)."""
    from pos.image import names

    path = folder / names.PEER_LINKS
    if not path.exists():
        return []
    try:
        return [Link(**{f: int(v) for f, v in k.items()}) for k in json.loads(path.read_text())]
    except (ValueError, TypeError) as e:
        raise BadInput(f"{path} is damaged ({e})", "restore another image of the job") from None


def renamed(links: Sequence[Link], live: Mapping[int, int]) -> list[Link]:
    """The links with the PIDs the restored processes have (`live`: saved PID -> PID now)."""
    return [replace(k, importer=live[k.importer], owner=live[k.owner]) for k in links]


def match(agents: Sequence[Agent]) -> list[Link]:
    """Every live import of every agent's job with its owner among them, found by nonce. Every
    byte pos wrote is put back before this returns or raises. BadInput, nothing else changed,
    when an import has no owner in the job (outside the saved tree, or the owner gave its handle
    up and cannot export it again)."""
    maps = {a.pid: [m for m in a.peers() if not m.down] for a in agents}
    owns = {a.pid: a.exports() for a in agents}
    links: list[Link] = []
    lonely: list[tuple[int, PeerMap]] = []
    for offset in sorted({m.offset for ms in maps.values() for m in ms}):
        links_at, lonely_at = _round(agents, maps, owns, offset)
        links += links_at
        lonely += lonely_at
    if lonely:
        pid, m = lonely[0]
        raise BadInput(f"PID {pid} maps {len(lonely)} allocations of another process's GPU "
                       f"memory (the first {m.size / 2**20:g} MiB at 0x{m.va:x}) whose owner is "
                       "not a process of this job", "checkpoint the tree that holds both "
                       "processes (the launcher's), or start the job with NCCL_P2P_DISABLE=1 "
                       "NCCL_CUMEM_ENABLE=0")
    released = [k for k in links if _own(owns[k.owner], k.owner_va).released]
    if released:
        k = released[0]
        raise BadInput(f"PID {k.owner} gave up its handle of the allocation at 0x{k.owner_va:x} "
                       f"that PID {k.importer} maps, so it cannot export it again after the "
                       "driver's restore", "start the job with NCCL_P2P_DISABLE=1 "
                       "NCCL_CUMEM_ENABLE=0")
    return links


def _own(allocs: list[OwnAlloc], va: int) -> OwnAlloc:
    return next(o for o in allocs if o.va == va)


def _round(agents: Sequence[Agent], maps: dict[int, list[PeerMap]],
           owns: dict[int, list[OwnAlloc]], offset: int
           ) -> tuple[list[Link], list[tuple[int, PeerMap]]]:
    """The imports mapped from `offset`: a nonce at that offset of every allocation that has
    one, read back by every importer, then every byte put back."""
    nonces: dict[bytes, tuple[int, int]] = {}
    stamped: list[Agent] = []
    try:
        for a in agents:
            for o in owns[a.pid]:
                if o.size >= offset + NONCE:
                    n = secrets.token_bytes(NONCE)
                    stamped.append(a)
                    a.stamp(o.va + offset, n)
                    nonces[n] = (a.pid, o.va)
        links, lonely = [], []
        for a in agents:
            for m in maps[a.pid]:
                if m.offset != offset:
                    continue
                owner = nonces.get(a.peek(m.va))
                if owner is None:
                    lonely.append((a.pid, m))
                else:
                    links.append(Link(a.pid, m.va, m.size, m.offset, *owner))
        return links, lonely
    finally:
        for a in dict.fromkeys(stamped):    # each agent once; a failure ends its job closed
            a.unstamp()


def take_down(agents: Sequence[Agent], links: Sequence[Link]) -> int:
    """Every importer's imports unmapped and released (their addresses kept); the bytes."""
    importers = {k.importer for k in links}
    return sum(a.peer_down() for a in agents if a.pid in importers)


def put_back(agents: Sequence[Agent], links: Sequence[Link]) -> int:
    """Each owner exports each linked allocation again and each importer maps the exports at
    its old addresses with its old access; the mappings put back. A failure raises, the
    importer still held with its imports down (its agent ends it when pos lets it go)."""
    by_pid = {a.pid: a for a in agents}
    owner_of = {(k.importer, k.va): k for k in links}
    up = 0
    for a in agents:
        down = [m for m in a.peers() if m.down]
        if not down:
            continue
        fds: list[int] = []
        try:
            for m in down:
                k = owner_of.get((a.pid, m.va))
                owner = by_pid.get(k.owner) if k else None
                if k is None or owner is None:
                    raise PosError(f"PID {a.pid} has an import at 0x{m.va:x} taken down whose "
                                   "owner pos cannot reach", "restore the job from its image")
                fds.append(owner.peer_export(k.owner_va))
            up += a.peer_up(fds)
        finally:
            for fd in fds:
                os.close(fd)
    return up
