"""pos/concurrent/ownmem.py: its setting, an image whose own-memory files do not agree, and the
copy a take makes, against the fake driver. The whole cycle runs in
tests/agent/test_own_fake.py and tests/agent/test_peer_checkpoint_fake.py."""

import ctypes as C
import json
import mmap
import os
from pathlib import Path
from typing import Any, Callable, Optional

import pytest

from pos.agent.control import Agent, Refused
from pos import image
from pos.concurrent import gpucopy, ownmem
from pos.errors import BadInput
from pos.image import filehash, names
from pos.image.opened import open_image
from pos.settings import Settings
from tests.agent.test_peer_fake import SEVEN, VMM_BYTES
from tests.conftest import wait_for
from tests.image.conftest import manifest


@pytest.mark.parametrize("value, taken", [(None, 4 << 30), ("0", 0), ("8", 8 << 30),
                                          ("0.5", 1 << 29)])
def test_the_setting_bounds_what_is_taken(value, taken) -> None:
    env = {} if value is None else {"POS_OWN_MEMORY_MAX_GIB": value}
    assert Settings.from_env(env).own_memory_max_bytes == taken


@pytest.mark.parametrize("value", ["-1", "lots", "inf"])
def test_a_bad_setting_is_refused_in_one_sentence(value) -> None:
    with pytest.raises(BadInput, match="POS_OWN_MEMORY_MAX_GIB"):
        Settings.from_env({"POS_OWN_MEMORY_MAX_GIB": value})


def test_an_image_without_own_memory_lists_none(tmp_path: Path) -> None:
    assert ownmem.saved(tmp_path, 7) == []


def test_own_memory_whose_bytes_do_not_match_its_index_is_refused(tmp_path: Path) -> None:
    index, data = names.own_memory(7)
    (tmp_path / index).write_text(json.dumps([{"va": 1 << 40, "size": 2 << 20, "device": 0}]))
    (tmp_path / data).write_bytes(b"\0" * (1 << 20))
    with pytest.raises(BadInput, match="does not hold what"):
        ownmem.saved(tmp_path, 7)
    (tmp_path / data).unlink()
    with pytest.raises(BadInput, match="does not hold what"):
        ownmem.saved(tmp_path, 7)
    (tmp_path / index).write_text("[{")
    with pytest.raises(BadInput, match="is damaged"):
        ownmem.saved(tmp_path, 7)


def timed_into(timings: dict[str, float]) -> ownmem.Timed:
    """A `timed` for the take that notes which parts it timed."""
    def timed(name: str, fn: Callable[[], Any]) -> Any:
        timings[name] = 0.0
        return fn()
    return timed


def ready(agent: Agent, drv: Any, size: int, timings: Optional[dict[str, float]] = None
          ) -> ownmem.Ready:
    """What a checkpoint makes before its cut: ownmem.ready, then (the host's room checked)
    the mapping, its host memory faulted in."""
    made = ownmem.ready(agent, drv, 0, size, timed_into({} if timings is None else timings))
    made.map(drv, timed_into({} if timings is None else timings), True)
    return made


@pytest.mark.parametrize("where", ["ready", "ready-host", "device", "host", "split"])
def test_the_image_gets_the_bytes_of_the_take_written_after_it(peer_job, drv, tmp_path: Path,
                                                              monkeypatch, where: str) -> None:
    """The take copies the memory while the job is held (into device memory made before the
    cut, through the export and mapping made then too; or at the take as far as pos's shadow
    rule leaves room, the rest into host memory); the image is written later, once the job
    runs and writes its memory again: it gets the bytes of the take. Where the GPU had no
    room before the cut, the host memory made and faulted in then is what the take fills."""
    owner = peer_job("own")
    agent = Agent(owner.pid)
    early: dict[str, float] = {}
    if where == "ready-host":
        monkeypatch.setattr(gpucopy, "shadow_room", lambda _drv: 0)
    made = ready(agent, drv, agent.status().own_bytes, early) if "ready" in where else None
    pieces = made.host if made else None
    assert (pieces.bytes if pieces else 0) == (VMM_BYTES if where == "ready-host" else 0)
    if pieces:        # faulted in behind the mapping, the job running
        wait_for(lambda: pieces.faulted == VMM_BYTES, what="the host memory faulted in")
    if where in ("host", "split"):
        room = 0 if where == "host" else VMM_BYTES // 2 - 4096
        monkeypatch.setattr(gpucopy, "shadow_room", lambda _drv: room)
    agent.cut(5)
    timings: dict[str, float] = {}
    shadow, fds = (made.shadow, list(made.fds)) if made else (None, [])
    taken = ownmem.take(agent, drv, 0, timed_into(timings), made)
    try:
        on_host = where in ("host", "split", "ready-host")
        assert set(timings) == ({"own_export"} | ({"own_map"} if made is None else set())
                                | ({"own_copy"} if where not in ("host", "ready-host")
                                   else set())
                                | ({"own_host"} if on_host else set()))
        assert (taken.shadow is not None, bool(taken.host)) == (
            where not in ("host", "ready-host"), on_host)
        # every piece made and faulted in before the cut filled by the take, let go with the
        # copy
        assert (taken.faulted, taken.fault_s is not None) == (
            (VMM_BYTES, True) if pieces else (0, False))
        assert set(early) == ({"own_ready_export", "own_ready_map", "own_ready_room"}
                              if made else set())
        assert pieces is None or (pieces in taken.later and pieces.bytes == 0)
        assert taken.bytes - taken.on_device == sum(len(p) for run in taken.host for p in run)
        # pos's mapping of the job's memory (and the copy's page-locked memory) let go only
        # with the copy, once the job runs again: not while it is held
        assert any(isinstance(m, gpucopy.Imported) for m in taken.later)
        assert made is None or (taken.shadow is shadow and taken.fds == fds
                                and (made.shadow, made.fds, made.mem) == (None, [], None))
        agent.stamp(taken.regions[0].va, os.urandom(16))     # the job writes after the take
        taken.write(drv, tmp_path, 7)
        agent.unstamp()
        assert ownmem.saved(tmp_path, 7) == taken.regions
        data = written(tmp_path, 7)
        assert data[16:] == SEVEN * (VMM_BYTES // len(SEVEN) - 1)
        assert data[:16] == SEVEN       # not what the job wrote after the take
        assert (taken.shadow, taken.host, taken.later) == (None, [], [])   # let go
    finally:
        taken.close()
        agent.end()
        agent.close()


def test_memory_made_before_the_cut_too_small_for_the_take_holds_its_first_bytes(
        peer_job, drv) -> None:
    """The job made more of its own memory after the reservation (or the GPU had room for only
    some): the take copies what the reservation holds on the device, the rest into host
    memory."""
    owner = peer_job("own")
    agent = Agent(owner.pid)
    small = gpucopy.Shadow(drv, 4096)
    agent.cut(5)
    timings: dict[str, float] = {}
    taken = ownmem.take(agent, drv, 0, timed_into(timings), ownmem.Ready(shadow=small))
    try:
        assert taken.shadow is small and taken.on_device == 4096
        assert [[len(p) for p in run] for run in taken.host] == [[VMM_BYTES - 4096]]
        assert {"own_copy", "own_host"} <= set(timings)
    finally:
        taken.close()
        agent.end()
        agent.close()


def test_no_room_on_the_gpu_reserves_no_device_memory(peer_job, drv, monkeypatch) -> None:
    """Where pos's shadow rule leaves the GPU no room, the take's device memory is not made
    before the cut, but the job's own memory is still exported and mapped; where it leaves
    some, as much as that; with nothing to take, nothing is asked of the job."""
    agent = Agent(peer_job("own").pid)
    try:
        monkeypatch.setattr(gpucopy, "shadow_room", lambda _drv: 0)
        none = ready(agent, drv, 2 << 20)
        assert none.shadow is None and none.bytes == VMM_BYTES and none.mem is not None
        none.close()
        assert (none.fds, none.mem) == ([], None)
        nothing = ownmem.ready(None, drv, 0, 0,      # type: ignore[arg-type]  # never asked
                               timed_into({}))
        assert (nothing.shadow, nothing.regions, nothing.fds) == (None, [], [])
        monkeypatch.setattr(gpucopy, "shadow_room", lambda _drv: 1 << 20)
        # as much as there is room for
        some = ready(agent, drv, 2 << 20)
        assert some.shadow is not None and some.shadow.size == 1 << 20
        some.close()
    finally:
        agent.close()


def test_a_job_whose_own_memory_changed_since_the_export_is_exported_again(
        peer_job, drv, tmp_path: Path) -> None:
    """The job's own allocations are no longer those exported before the cut (the agent's
    serials): the take exports and maps them afresh, lets the early ones go, and the image
    still gets the job's bytes."""
    agent = Agent(peer_job("own").pid)
    made = ready(agent, drv, agent.status().own_bytes)
    made.serials = [n + 1000 for n in made.serials]      # as if the job had mapped anew
    early = list(made.fds)
    agent.cut(5)
    timings: dict[str, float] = {}
    taken = ownmem.take(agent, drv, 0, timed_into(timings), made)
    try:
        assert set(timings) == {"own_export", "own_map", "own_copy"}
        assert taken.fds and not set(taken.fds) & set(early) and made.fds == []
        taken.write(drv, tmp_path, None)
        assert (tmp_path / names.own_memory(None)[1]).read_bytes()[:16] == SEVEN
    finally:
        taken.close()
        agent.end()
        agent.close()


def test_a_job_that_mapped_more_since_the_export_has_only_that_exported_again(
        peer_job, drv, tmp_path: Path) -> None:
    """The job mapped one more piece after the export before the cut (PyTorch's expandable
    segments grow so): the take keeps the descriptor and mapping of the piece exported before
    and exports and maps only the new one; the image holds both."""
    owner = peer_job("own")
    agent = Agent(owner.pid)
    made = ready(agent, drv, agent.status().own_bytes)
    early, first = list(made.fds), made.mem
    (Path(owner.proc.args[-1]) / "more").touch()
    owner.printed("MORE")
    agent.cut(5)
    timings: dict[str, float] = {}
    taken = ownmem.take(agent, drv, 0, timed_into(timings), made)
    try:
        assert len(taken.regions) == 2 and taken.fds[0] == early[0]
        assert taken.fds[1] not in early and made.fds == []
        assert "own_map" in timings and first in taken.later and len(taken.later) == 2
        taken.write(drv, tmp_path, None)
        eights = bytes([8, 0, 0, 0]) * (VMM_BYTES // 4)
        assert written(tmp_path, None) == SEVEN * (VMM_BYTES // len(SEVEN)) + eights
    finally:
        taken.close()
        agent.end()
        agent.close()


def test_the_copy_into_host_memory_lands_each_piece_whole_in_order(drv, monkeypatch) -> None:
    """Each thread copies its run of pieces through its page-locked memory into host memory:
    every piece lands whole, in order, whatever its bytes, in memory made and faulted in
    before where there is some of its size (the rest made then)."""
    monkeypatch.setattr(ownmem, "PIECE", 64 << 10)
    monkeypatch.setattr(ownmem.filehash, "workers", lambda: 2)
    want = os.urandom(MIB + 4096)
    src = gpucopy.Shadow(drv, len(want))
    try:
        drv.cuMemcpyHtoD_v2(src.ptr, C.c_char_p(want), len(want))
        work = [(src.ptr + at, at, min(64 << 10, len(want) - at))
                for at in range(0, len(want), 64 << 10)]
        before = ownmem.HostPieces([64 << 10] * 4 + [4096, 8192])
        before.fault_behind()
        before.settle()
        host = ownmem._to_host(drv, work, None, before)
        assert len(host) == 2 and all(len(run) > 2 for run in host)
        assert b"".join(bytes(p) for run in host for p in run) == want
        assert before.bytes == 8192         # the one piece of a size the copy had none of
        before.close()
    finally:
        src.close()


def written(folder: Path, pid: Optional[int]) -> bytes:
    """The data parts of an image's own memory, one after another."""
    data, k = b"", 0
    while (part := folder / names.own_memory_part(pid, k)).exists():
        data, k = data + part.read_bytes(), k + 1
    return data


MIB = 1 << 20


def anonymous(data: bytes) -> mmap.mmap:
    """A piece of a take's copy in host memory, holding `data`."""
    m = mmap.mmap(-1, len(data))
    m[:] = data
    return m


def sealed(folder: Path, written: Optional[dict[str, filehash.Written]] = None
           ) -> tuple[Path, image.Manifest]:
    """The image in `folder` (made by image.prepare), sealed as pos seals one (`written`: files
    hashed as written), and its manifest."""
    done = image.seal(folder, manifest(), written=written)
    return done, image.check_files(done)


def filled(drv, regions: list[ownmem.Region], folder: Path, want: bytes) -> None:
    """A restore makes `regions` anew from the image in `folder` and fills them with `want`."""
    made = ownmem.Made(drv, 0, folder, None, regions, image.check_files(folder))
    try:
        back = C.create_string_buffer(len(want))
        at = 0
        for r, local in zip(regions, made.mem.local):
            drv.cuMemcpyDtoH_v2(C.addressof(back) + at, local, r.size)
            at += r.size
        assert back.raw == want
    finally:
        made.close()


@pytest.mark.parametrize("piece, sizes", [(4 * MIB, (2 * MIB, 2 * MIB, 2 * MIB)),
                                          (MIB, (2 * MIB, 6 * MIB, 2 * MIB))],
                         ids=["each-below-a-piece", "one-of-several-pieces"])
def test_allocations_of_several_sizes_are_written_each_whole_in_order(
        drv, tmp_path: Path, monkeypatch, piece: int, sizes: tuple[int, ...]) -> None:
    """NCCL's buffers come in several sizes, most below a piece: each is written whole, in the
    index's order, whether the take left its copy on the device (in parts, a thread each), in
    host memory (a part each of its runs) or the first on the device and the rest in host
    memory; a restore makes them anew and fills them with those bytes, chunks of the
    manifest's (here smaller than a piece, and across the allocations) checked as read."""
    monkeypatch.setattr(ownmem, "PIECE", piece)
    monkeypatch.setattr(ownmem.filehash, "workers", lambda: 4)
    monkeypatch.setattr(image, "CHUNK_BYTES", 3 * MIB // 2)
    regions = [ownmem.Region((i + 1) << 40, n, 0) for i, n in enumerate(sizes)]
    want = os.urandom(sum(sizes))
    for where, on_device in (("device", len(want)), ("host", 0), ("split", 3 * MIB)):
        folder = image.prepare(tmp_path / where, 0)
        taken = ownmem.Taken(regions, [])
        if on_device:
            taken.shadow = gpucopy.Shadow(drv, on_device)
            drv.cuMemcpyHtoD_v2(taken.shadow.ptr, C.c_char_p(want), on_device)
        rest = want[on_device:]     # two runs, the second of two pieces
        taken.host = [[anonymous(rest[:MIB])], [anonymous(rest[MIB:2 * MIB]),
                                                anonymous(rest[2 * MIB:])]] if rest else []
        hashed = taken.write(drv, folder, None)
        assert sorted(hashed) == sorted(p.name for p in folder.glob("own-memory*.bin"))
        read_back = filehash.checksums(folder, list(hashed), image.CHUNK_BYTES)
        assert {n: w.record() for n, w in hashed.items()} == read_back, where
        folder, _ = sealed(folder, hashed)
        assert ownmem.saved(folder, None) == regions
        assert written(folder, None) == want, where
        parts = len(list(folder.glob("own-memory*.bin")))    # the device's pieces, a run each
        assert parts == min(4, -(-on_device // piece)) + (2 if on_device < len(want) else 0)
        filled(drv, regions, folder, want)


def own_image(tmp_path: Path, parts: list[bytes]) -> Path:
    """An image of one 2 MiB allocation whose bytes are held by `parts`, sealed."""
    folder = image.prepare(tmp_path / "img", 0)
    (folder / names.own_memory(None)[0]).write_text(json.dumps(
        [{"va": 1 << 40, "size": 2 << 20, "device": 0}]))
    for k, part in enumerate(parts):
        (folder / names.own_memory_part(None, k)).write_bytes(part)
    return sealed(folder)[0]


def test_parts_split_inside_a_piece_fill_it_whole(drv, tmp_path: Path, monkeypatch) -> None:
    """Parts of the right sizes in all, split inside a piece and inside a chunk of the
    manifest: the restore's fill reads them as the one run of bytes they hold."""
    monkeypatch.setattr(ownmem, "PIECE", MIB)
    monkeypatch.setattr(image, "CHUNK_BYTES", MIB // 2)
    want = os.urandom(2 * MIB)
    folder = own_image(tmp_path, [want[:3 << 19], want[3 << 19:]])
    regions = [ownmem.Region(1 << 40, 2 * MIB, 0)]
    assert ownmem.saved(folder, None) == regions
    filled(drv, regions, folder, want)


@pytest.mark.parametrize("damage", ["byte", "digest"])
def test_a_chunk_that_does_not_match_its_checksum_is_refused_as_it_is_read(
        drv, tmp_path: Path, monkeypatch, damage: str) -> None:
    """A byte of the job's own memory changed in the image, or the manifest's digests changed:
    the fill refuses the image in one sentence naming the bytes (the restore checks these
    files' chunks as it reads them, not before)."""
    monkeypatch.setattr(image, "CHUNK_BYTES", MIB // 2)
    want = os.urandom(2 * MIB)
    folder = own_image(tmp_path, [want])
    part = folder / names.own_memory_part(None, 0)
    if damage == "byte":
        os.chmod(part, 0o600)
        with open(part, "r+b") as f:
            f.seek(MIB + 7)
            f.write(bytes([want[MIB + 7] ^ 1]))
        match = f"bytes {MIB}-{MIB + MIB // 2 - 1} of {part.name} do not match"
    else:
        m = image.load(folder)
        m.files[part.name]["chunks"][0] = "0" * 16
        image.write_manifest(folder, m)
        match = f"the checksum of {part.name} does not match its manifest"
    regions = ownmem.saved(folder, None)
    with pytest.raises(BadInput, match=match):
        filled(drv, regions, folder, want)
    assert part.name not in open_image(folder).checked_by_restore


def test_an_agent_that_cannot_export_before_the_cut_has_its_memory_taken_at_it(
        peer_job, drv, monkeypatch) -> None:
    """The job's agent refuses own-export (a job started under an older pos, whose agent lacks
    it): the device memory is still made before the cut, and the take exports and maps at it."""
    agent = Agent(peer_job("own").pid)

    def refused() -> None:
        raise Refused(agent.pid, {"ok": False, "error": "unknown request"})

    monkeypatch.setattr(agent, "own_export", refused)
    made = ready(agent, drv, agent.status().own_bytes)
    assert made.regions == [] and made.shadow is not None
    agent.cut(5)
    timings: dict[str, float] = {}
    taken = ownmem.take(agent, drv, 0, timed_into(timings), made)
    try:
        assert set(timings) == {"own_export", "own_map", "own_copy"}
        assert taken.bytes == VMM_BYTES and taken.shadow is not None
    finally:
        taken.close()
        agent.end()
        agent.close()
