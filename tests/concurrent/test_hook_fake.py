"""The agent (libposhook.so under `pos run`) and the concurrent engine against the fake driver,
with real CRIU: the plumbing of ownership, the gates, the hoist and both kinds of image, and pos
killed at every step. The fake's "device memory" is shared memory, so pos really reads the
job's buffers from outside; what this cannot prove is GPU behaviour (tests/gpu does)."""

import json
import os
import re
import resource
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import numpy as np
import pytest

from pos import concurrent
from pos.agent.control import Agent
from pos.concurrent import predump, staging
from pos.engines import engines
from pos.errors import BadInput
from pos.image import gpu as gpuimage
from pos.image import gpuindex, names
from pos.image.gpuindex import ChunkRecord
from pos.image.kinds import ImageKind, kind
from pos.image.opened import open_image
from pos.operation.engine import Report, Save
from pos.operation.gpumap import Onto
from pos.process.criu import Criu, Options
from pos.settings import Settings
from tests.agent.conftest import FillJob, ran_past
from tests.conftest import ROOT, reaped
from tests.engines.conftest import (kernel_keeps_soft_dirty, listening, one_sentence, pos,
                                      wait_for)
from workloads.fill_job import image_values, torn


def own(name: str) -> str:
    """An image name of this test run alone: CRIU's staging folder in /run/pos/dump, which
    every pos on the host shares, is named after the image (and pos's PID)."""
    return f"{name}-{os.getpid()}"


def staged(image: Path) -> list[Path]:
    """The staging folders left in /run/pos/dump by the checkpoints of `image`."""
    return list(staging.ROOT.glob(f"{image.name}-*{names.PARTIAL_SUFFIX}"))


def test_the_agent_owns_memory_reached_through_every_lookup(fill_job) -> None:
    job = fill_job(buffers=5, size=3 << 20)
    with Agent(job.pid) as a:
        st = a.status()
        table = a.table()
        raw = a._ask("table")
    assert raw["version"] == 2 and set(raw["buffers"][0]) == {
        "va", "size", "mapped", "device", "present", "touched"}
    # cuMemAlloc came through cuGetProcAddress: owned, each rounded to the granularity
    assert st.owning and st.phase == "idle" and st.buffers == 5
    assert st.owned_bytes == 5 * (3 << 20) and st.foreign_allocs == 0
    assert {b.size for b in table} == {3 << 20} and all(b.mapped % (2 << 20) == 0 for b in table)
    # placed high, a granule apart: no pair of small integers, and no buffer's end address,
    # reads as a pointer into one of them
    assert all(b.va >= 0x7000_0000_0000 for b in table)
    assert all(b.va + b.mapped < c.va for b, c in zip(table, table[1:]))


def test_memory_pos_cannot_own_is_counted_and_refused_for_gpu_only_images(
        fill_job, tmp_path: Path, criu_ready, gpu_env) -> None:
    job = fill_job(pool_bytes=3 << 20)
    with Agent(job.pid) as a:
        st = a.status()
    assert st.foreign_allocs == 1 and st.foreign_bytes == 3 << 20 and st.buffers == 12
    r = pos("checkpoint", str(job.pid), "-D", str(tmp_path / "g"), "--concurrent", "--gpu-only",
            env=gpu_env)
    one_sentence(r, 2, f"holds {3 << 20} bytes of device memory in 1 allocations pos does not "
                 "own", "whole-process image")
    assert not (tmp_path / "g").exists() and not names.partial(tmp_path / "g").exists()
    r = pos("checkpoint", str(job.pid), "-D", str(tmp_path / "w"), "--concurrent",
            "--leave-running", env=gpu_env)
    assert r.returncode == 0, r.stderr
    assert "3.0 MiB the agent could not own" in r.stdout and "driver's checkpoint" in r.stdout


def test_gpu_only_images_are_exact_and_restore_reads_back(fill_job, tmp_path: Path) -> None:
    job = fill_job()
    ops = []
    for i in range(3):
        ran_past(job.pid, max(ops, default=0))
        r = concurrent.checkpoint_gpu(job.pid, tmp_path / f"img{i}")
        v = image_values(Path(r.path))
        assert not torn(v), v        # the memset (dlsym) is gated: the cut is exact
        ops.append(max(v))
        assert r.device.release_s < 5 and r.device.bytes == 12 << 20
        assert r.device.shadow_bytes == r.device.bytes
    assert ops == sorted(ops) and ops[0] > 0
    made = job.hold()
    rr = concurrent.restore_gpu(job.pid, open_image(tmp_path / "img0"))
    assert rr.device.bytes == 12 << 20
    back = concurrent.checkpoint_gpu(job.pid, tmp_path / "back")
    assert image_values(Path(back.path)) == image_values(tmp_path / "img0")
    job.pause.unlink()
    ran_past(job.pid, made)                     # it computes on where it was
    assert job.alive()


def test_buffers_the_shadow_cannot_hold_are_copied_from_the_running_job(
        fill_job, tmp_path: Path, monkeypatch) -> None:
    """With room for 3 of 12 buffers in the shadow, the other 9 are copied from the job's own
    memory, first (its writes to them wait for each; then what they wait for comes first): the
    image is exact all the same."""
    from pos.concurrent import gpucopy

    monkeypatch.setenv("POS_SHADOW_MAX_BYTES", str(3 << 20))
    taken: dict[int, list[int]] = {}        # by order: the copy's, and the shadow's scan's
    take = gpucopy.Order.take

    def recorded(self):   # type: ignore[no-untyped-def]
        item = take(self)
        if item is not None:
            taken.setdefault(id(self), []).append(item[0])
        return item

    monkeypatch.setattr(gpucopy.Order, "take", recorded)
    job = fill_job()
    done = 0
    for i in range(3):
        ran_past(job.pid, done)
        taken.clear()
        r = concurrent.checkpoint_gpu(job.pid, tmp_path / f"img{i}", streams=1)
        assert r.device.shadow_bytes == 3 << 20 and r.device.bytes == 12 << 20
        values = image_values(Path(r.path))
        assert not torn(values)
        done = max(values)
        # the table's first three fit; the copy begins (before the job's release) with the
        # others, and then takes first what the job's calls wait for; the scan takes only those
        # three
        copy = next(t for t in taken.values() if len(t) == 12)
        assert sorted(copy) == list(range(12)) and copy[0] not in (0, 1, 2), copy
        assert all(set(t) <= {0, 1, 2} for t in taken.values() if t is not copy), taken
        # the report says of each buffer the job's calls waited on its size, and that it was
        # handed to the job after the cut (the fill job's words hold no addresses)
        gate = r.device.gate
        assert gate is not None
        assert [w.va for w in r.device.waited_for] == list(dict.fromkeys(
            w.on for w in gate.waits if w.on))
        assert all(w.bytes == 1 << 20 and w.reaches == 0 and w.told_s is not None
                   and w.told_s > 0 for w in r.device.waited_for), r.device.waited_for


@pytest.mark.parametrize("shadow_max, size", [(None, 1 << 20), (3 << 20, 1 << 20),
                                              (None, (1 << 20) + 4)])
def test_chunks_hashed_on_the_gpu_make_an_exact_image_that_restores(
        shadow_max, size: int, fill_job, tmp_path: Path, monkeypatch) -> None:
    """POS_HASH_ON's default: pos's kernel hashes and scans each chunk (the fake runs it with
    hash.h's code, and refuses a chunk that is not 16-byte aligned, as the GPU's loads would)
    and the savers only write, from the shadow (buffers of a size that is no multiple of 16
    among them) or (3 of 12 buffers shadowed) from the running job; every chunk says its
    checksum is of kind `blocks`, the image is exact, and a restore checks and fills it: the
    job computes on from there."""
    if shadow_max:
        monkeypatch.setenv("POS_SHADOW_MAX_BYTES", str(shadow_max))
    job = fill_job(size=size)
    ran_past(job.pid, 0)
    r = concurrent.checkpoint_gpu(job.pid, tmp_path / "img")
    assert "hash_load" in r.timings
    index = gpuindex.read(Path(r.path))
    assert {c.kind for b in index.buffers for c in b.chunks} == {"blocks"}
    saved = image_values(Path(r.path))
    assert not torn(saved)
    made = job.hold()
    concurrent.restore_gpu(job.pid, open_image(Path(r.path)))
    monkeypatch.setenv("POS_HASH_ON", "cpu")
    back = concurrent.checkpoint_gpu(job.pid, tmp_path / "back")
    assert {c.kind for b in gpuindex.read(Path(back.path)).buffers for c in b.chunks} == \
        {"words"}
    assert image_values(Path(back.path)) == saved
    job.pause.unlink()
    ran_past(job.pid, made)
    assert job.alive()


def test_a_driver_that_cannot_load_the_checksum_kernel(fill_job, tmp_path: Path,
                                                       monkeypatch) -> None:
    """A driver older than the kernel's PTX: by default the savers hash on the CPU and the
    image is exact; POS_HASH_ON=gpu is refused in one sentence before the cut, and the job
    runs on."""
    monkeypatch.setenv("POS_FAKECUDA_FAIL", "cuModuleLoadData")
    job = fill_job()
    ran_past(job.pid, 0)
    r = concurrent.checkpoint_gpu(job.pid, tmp_path / "img")
    assert {c.kind for b in gpuindex.read(Path(r.path)).buffers for c in b.chunks} == {"words"}
    assert not torn(image_values(Path(r.path)))
    monkeypatch.setenv("POS_HASH_ON", "gpu")
    with pytest.raises(BadInput, match="cannot load pos's checksum kernel "
                                       r"\(CUDA_ERROR_UNSUPPORTED_PTX_VERSION\)"):
        concurrent.checkpoint_gpu(job.pid, tmp_path / "refused")
    assert not (tmp_path / "refused").exists()
    ran_past(job.pid, max(image_values(Path(r.path))))
    assert job.alive()


def test_a_gpu_only_image_is_not_restored_as_a_process(fill_job, tmp_path: Path,
                                                      gpu_env) -> None:
    job = fill_job()
    img = concurrent.checkpoint_gpu(job.pid, tmp_path / "g").path
    one_sentence(pos("restore", "-D", img, env=gpu_env), 2, "is a GPU-only image",
                 "pos restore --gpu-only PID")


def test_the_hoist_shrinks_the_context_stack_and_the_remap_puts_it_back(fill_job) -> None:
    """Local memory is the stack times every GPU thread, copied by the driver's checkpoint:
    the hoist makes the stack as small as pos asks, the remap gives the job its own back (a
    second hoist finds 1 KiB again); a hoist not asked to leaves it."""
    job = fill_job(buffers=2)
    with Agent(job.pid) as a:
        for _ in range(2):
            a.cut(5)
            fds = a.export().fds
            h = a.hoist(stack=0)
            assert (h.stack, h.stack_rc) == (1024, 0)
            assert a.remap(fds).stack_rc == 0
            a.end()
            for fd in fds:
                os.close(fd)
        a.cut(5)
        fds = a.export().fds
        h = a.hoist()
        assert (h.stack, h.stack_rc) == (0, -1)
        a.remap(fds)
        a.end()
        for fd in fds:
            os.close(fd)


def test_the_hoist_trims_the_heap_only_when_asked(fill_job) -> None:
    """A hoist asked to trim has the job's heap give its free memory back (glibc's
    malloc_trim: less for CRIU to dump), and says how long it took; one not asked says -1.
    Either way the job runs on after the remap."""
    job = fill_job(buffers=2)
    with Agent(job.pid) as a:
        for trim in (True, False):
            a.cut(5)
            fds = a.export().fds
            h = a.hoist(trim=trim)
            assert (h.trim_s >= 0) if trim else h.trim_s == -1.0, h
            a.remap(fds)
            a.end()
            for fd in fds:
                os.close(fd)
    ran_past(job.pid, 0)


def test_a_cut_whose_pos_goes_away_releases_the_job(fill_job) -> None:
    job = fill_job()
    a = Agent(job.pid)
    a.cut(5)
    assert a.status().phase == "hold"
    a.close()                                   # pos gone in the middle of the cut
    with Agent(job.pid) as b:
        wait_for(lambda: b.status().phase == "idle", what="the release")


def test_an_arena_smaller_than_the_job_streams_an_exact_image(
        fill_job, tmp_path: Path, monkeypatch) -> None:
    """Two 1 MiB slots of page-locked memory for a job of 12 MiB (3 shadowed): the copy waits
    for the disk to give slots back, and the image is the state after one exact operation all
    the same."""
    from pos.concurrent import copier

    monkeypatch.setattr(copier, "MIN_ARENA", 1 << 20)
    monkeypatch.setenv("POS_PIN_MAX_GIB", str(2 / 1024))
    monkeypatch.setenv("POS_SHADOW_MAX_BYTES", str(3 << 20))
    job = fill_job()
    done = 0
    for i in range(2):
        ran_past(job.pid, done)
        r = concurrent.checkpoint_gpu(job.pid, tmp_path / f"img{i}", chunk_mb=1)
        assert r.timings["pinned_peak_bytes"] == 2 << 20 and r.device.bytes == 12 << 20
        values = image_values(Path(r.path))
        assert not torn(values)
        done = max(values)


@pytest.mark.parametrize("where", ["write", "write-hashing", "handout"])
def test_a_copy_that_fails_midway_ends_in_its_error_and_the_job_runs_on(
        fill_job, tmp_path: Path, monkeypatch, where: str) -> None:
    """A chunk's write (a full disk; the GPU hashed it, or its saver hashes it as it writes:
    POS_HASH_ON=cpu), or what its scan tells the handout, failing on one of the copy's threads,
    with a small arena whose slots the failed chunk held: the checkpoint ends in that error,
    not a hang; no image is left; the job computes on, its agent idle."""
    from pos.concurrent import copier
    from pos.concurrent.handout import Handout

    monkeypatch.setattr(copier, "MIN_ARENA", 1 << 20)
    monkeypatch.setenv("POS_PIN_MAX_GIB", str(2 / 1024))
    calls = [0]
    target = {"write": (gpuimage.Writer, "put"),
              "write-hashing": (gpuimage.Writer, "put_scanned"),
              "handout": (Handout, "points")}[where]
    if where == "write-hashing":
        monkeypatch.setenv("POS_HASH_ON", "cpu")
    real = getattr(*target)

    def failing(*args, **kw):   # type: ignore[no-untyped-def]
        calls[0] += 1
        if calls[0] == 3:
            raise OSError(28, "No space left on device")
        return real(*args, **kw)

    monkeypatch.setattr(*target, failing)
    job = fill_job()
    with pytest.raises(OSError, match="No space left"):
        concurrent.checkpoint_gpu(job.pid, tmp_path / "img", chunk_mb=1)
    assert not (tmp_path / "img").exists() and not names.partial(tmp_path / "img").exists()
    with Agent(job.pid) as a:
        assert a.status().phase == "idle"
    first = image_values(Path(concurrent.checkpoint_gpu(job.pid, tmp_path / "a", chunk_mb=1).path))
    ran_past(job.pid, max(first))
    then = image_values(Path(concurrent.checkpoint_gpu(job.pid, tmp_path / "b", chunk_mb=1).path))
    assert job.alive() and not torn(then) and max(then) > max(first)


@pytest.mark.parametrize("kernel, layout_known", [("_Z4axpyfPKfPfi", True),
                                                   ("_Z6axpy_2fPKfPfi", False)])
@pytest.mark.parametrize("gate", ["restore", "copy"])
def test_a_launch_in_a_gate_waits_only_for_the_buffers_its_parameters_name(
        fill_job, kernel: str, layout_known: bool, gate: str) -> None:
    """The job launches axpy(x=y=its first buffer) over and over. While that buffer is not back
    (a restore) or not saved (a checkpoint's copy) its launches wait; once it is they go
    through, the other buffers still pending. A kernel whose parameters the driver cannot
    describe (the fake knows axpy's only) waits for all."""
    job = fill_job(buffers=4, launches=kernel)
    first = int(job.out.read_text().split("BUFFER0 ")[1].split()[0], 16)
    with Agent(job.pid) as a:
        a.cut(5)
        fds = []
        if gate == "restore":
            fds = a.export().fds
            a.hoist()
            a.remap(fds, restore=True)          # every buffer pending
        else:
            a.copy()                            # every buffer pending
        try:
            others = [b.va for b in a.table() if b.va != first]
            assert len(others) == 3
            a.done(others[:2])
            # its own buffer is still pending; pos copies it first (the gate's account of the
            # wait is checked against the time below)
            _held_on(a, [first] if layout_known else [])
            a.done([first])                      # others[2] still pending
            if not layout_known:
                time.sleep(0.2)                  # as above: none may pass in it
                assert a.status().gate.passed == 0
                a.done(others[2:])
            wait_for(lambda: a.status().gate.passed > 100, what="the launches to go through")
            assert a.status().phase == gate
        finally:
            gate = a.end()
        for fd in fds:
            os.close(fd)
    # the gate's account of the wait: the launch, by its kernel's name, waited for its own
    # buffer, or (parameters unknown) for every buffer
    longest = max(gate.waits, key=lambda w: w.s)
    assert longest.s == gate.held_max_s and longest.end_s >= 0.2
    assert longest.what == kernel
    assert longest.on == (first if layout_known else None)
    assert (gate.held_all >= 1) == (not layout_known)


# kernels named as PyTorch's elementwise kernels for one output, and as its kernel for several
ELEMENTWISE = ("_ZN2at6native29vectorized_elementwise_kernelILi4EN4test4CopyESt5arrayIPcLm2EEEE"
               "viT0_T1_")
UNROLLED = "_ZN2at6native27unrolled_elementwise_kernelIN4test4CopyESt5arrayIPcLm2EELi4EEEviT_T0_"
MULTI = ("_ZN2at6native45unrolled_elementwise_kernel_for_multi_outputsILi2EN4test4CopyESt5arrayI"
         "PcLm2EEEEviT0_T1_")
# and as its reduction and foreach kernels, which take every address they use by value
REDUCE = "_ZN2at6native13reduce_kernelILi512ELi1EN4test4CopyEEEvT1_"
FOREACH = ("_ZN2at6native50_GLOBAL__N__b6ca21f8_17_ForeachUnaryOp_cu_77fe623d25multi_tensor_apply_"
           "kernelIN4test4CopyEEEvT_")


@pytest.mark.parametrize("kernel, reads_pass", [(ELEMENTWISE, True), (UNROLLED, True),
                                                (MULTI, False)])
def test_an_elementwise_kernel_passes_the_copy_gate_while_only_its_input_is_pending(
        fill_job, kernel: str, reads_pass: bool) -> None:
    """The job launches a kernel with the parameters PyTorch's elementwise kernels take: its
    data array names the second buffer (the output), then the first (the input); its functor
    holds the third's address. In the checkpoint's copy its launches wait while the output or
    the functor's address is pending, and pass while only the input is, which the kernel only
    reads. A kernel of another name (PyTorch's for several outputs) waits for the input too."""
    job = fill_job(buffers=4, elementwise=kernel)
    source, output, held = _launched(job)
    with Agent(job.pid) as a:
        a.cut(5)
        a.copy()                                # every buffer pending
        try:
            a.done([b.va for b in a.table() if b.va not in (source, output, held)])
            for waited in (held, output):       # in the order of the parameters
                _held_on(a, [waited])
                a.done([waited])
            if not reads_pass:
                time.sleep(0.2)                 # as above: the input pending
                assert a.status().gate.passed == 0
                a.done([source])
            wait_for(lambda: a.status().gate.passed > 100, what="the launches to go through")
        finally:
            gate = a.end()
    assert gate.held_max_s >= 0.4 and {w.what for w in gate.waits} == {kernel}


def _held_on(a: Agent, wanted: list[int]) -> None:
    """The job's launches wait on the buffers `wanted` (as its agent tells pos, once a launch
    has come to the gate), and none passes in a time after that (a time, not a wait)."""
    wait_for(lambda: a.wanted() == wanted, what=lambda: f"a launch waiting on {wanted}, "
             f"not {a.wanted()} (the agent: {a.status()})")
    time.sleep(0.2)
    assert a.status().gate.passed == 0 and a.wanted() == wanted


def _launched(job: FillJob) -> tuple[int, int, int]:
    """The buffers the fill job's launches name as PyTorch's elementwise kernels: the input,
    the output, and the one its functor holds."""
    printed = job.out.read_text()
    source, output, held = (int(printed.split(f"BUFFER{i} ")[1].split()[0], 16)
                            for i in range(3))
    return source, output, held


def _saved_not_done(job: FillJob, pending: set[int], waits_on: Optional[int]) -> None:
    """In the checkpoint's copy, the buffers `pending` not done but their own bytes saved: the
    launches go (waits_on None), or they wait for `waits_on` until everything is done."""
    with Agent(job.pid) as a:
        a.cut(5)
        a.copy()                                # every buffer pending
        try:
            a.done([b.va for b in a.table() if b.va not in pending])
            a.saved(sorted(pending))
            if waits_on is not None:
                _held_on(a, [waits_on])
                a.done(sorted(pending))
            wait_for(lambda: a.status().gate.passed > 100, what="the launches to go through")
        finally:
            a.end()


@pytest.mark.parametrize("kernel, goes", [(ELEMENTWISE, True), (UNROLLED, True), (MULTI, False)])
def test_an_elementwise_kernel_writes_a_buffer_whose_own_bytes_are_saved(
        fill_job, kernel: str, goes: bool) -> None:
    """In the checkpoint's copy, the output pending but its own bytes saved (shadowed, or in
    host memory), what it points into perhaps not: the elementwise kernel, which only writes it
    at its parameters' addresses, goes; a kernel of another name waits until it is done."""
    job = fill_job(buffers=4, elementwise=kernel)
    _source, output, _held = _launched(job)
    _saved_not_done(job, {output}, None if goes else output)


@pytest.mark.parametrize("kernel, goes", [(REDUCE, True), (FOREACH, True), (ELEMENTWISE, False),
                                          (MULTI, False)])
def test_a_kernel_taking_its_addresses_by_value_writes_buffers_whose_own_bytes_are_saved(
        fill_job, kernel: str, goes: bool) -> None:
    """In the checkpoint's copy, the three buffers the launch names pending but saved: a
    reduction or a foreach kernel, which writes only at its parameters' addresses, goes; the
    elementwise kernel waits for the buffer its functor names, and the kernel for several
    outputs for the first it names (the same), until they are done."""
    job = fill_job(buffers=4, elementwise=kernel)
    source, output, held = _launched(job)
    _saved_not_done(job, {source, output, held}, None if goes else held)


def test_an_elementwise_kernel_waits_in_the_restore_gate_for_its_input(fill_job) -> None:
    """In a restore a kernel reads only what is back: the elementwise kernel's launches wait
    for their input as for every buffer they name."""
    job = fill_job(buffers=4, elementwise=ELEMENTWISE)
    source = int(job.out.read_text().split("BUFFER0 ")[1].split()[0], 16)
    with Agent(job.pid) as a:
        a.cut(5)
        fds = a.export().fds
        a.hoist()
        a.remap(fds, restore=True)              # every buffer pending
        try:
            a.done([b.va for b in a.table() if b.va != source])
            _held_on(a, [source])
            a.done([source])
            wait_for(lambda: a.status().gate.passed > 100, what="the launches to go through")
        finally:
            gate = a.end()
        for fd in fds:
            os.close(fd)
    assert max(gate.waits, key=lambda w: w.s).on == source


def test_the_buffers_the_job_uses_once_released_are_marked_hot_in_its_image(
        fill_job, tmp_path: Path) -> None:
    """The job launches axpy on its first buffer only: the image says that buffer is the one
    its calls used after the checkpoint released it (a restore fills it first), and no other."""
    job = fill_job(buffers=4, size=16 << 20, launches="_Z4axpyfPKfPfi")
    first = int(job.out.read_text().split("BUFFER0 ")[1].split()[0], 16)
    r = concurrent.checkpoint_gpu(job.pid, tmp_path / "img", chunk_mb=1)
    index = gpuindex.read(Path(r.path))
    assert len(index.buffers) == 4
    assert index.hot == {first}
    with Agent(job.pid) as a:      # the next operation starts afresh
        a.cut(5)
        try:
            assert not any(b.touched for b in a.table())
        finally:
            a.end()


# the restore's fill: beside CRIU and paused for the driver's restore (the default), never
# paused (read with pread, not mapped), or only from the job's release; pieces of several sizes;
# the job's host memory from CRIU's lazy-pages daemon (POS_LAZY_PAGES=1) while the fill runs
@pytest.mark.parametrize("fill_from,mapped,piece,lazy", [
    ("pause", "1", "2048", "0"), ("start", "0", "256", "0"), ("release", "1", "1024", "0"),
    ("pause", "1", "2048", "1")])
def test_whole_process_checkpoint_then_restore_in_a_new_process(fill_job, tmp_path: Path,
                                                                criu_ready, gpu_env,
                                                                fill_from: str, mapped: str,
                                                                piece: str, lazy: str) -> None:
    job = fill_job()
    ran_past(job.pid, 0)
    img = tmp_path / "full"
    r = pos("checkpoint", str(job.pid), "-D", str(img), "--concurrent", env=gpu_env)
    assert r.returncode == 0, r.stderr
    assert "the job was held" in r.stdout
    job.proc.wait(timeout=30)                   # CRIU ended it after the dump
    saved = image_values(img)
    assert not torn(saved)
    r = pos("restore", "-D", str(img), "--json", "--until-filled", env={
        **gpu_env, "POS_FILL_FROM": fill_from, "POS_FILL_MAPPED": mapped,
        "POS_FILL_PIECE_KIB": piece, "POS_LAZY_PAGES": lazy})
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["restored_pid"] == job.pid
    assert ("lazy_done_at" in report["timings"]) == (lazy == "1")
    ran_past(job.pid, max(saved))
    assert job.alive()
    now = concurrent.checkpoint_gpu(job.pid, tmp_path / "after")
    later = image_values(Path(now.path))
    assert not torn(later) and max(later) > max(saved)   # it went on from the image


def test_migrate_concurrent_sends_the_whole_image_and_the_job_goes_on_there(
        fill_job, tmp_path: Path, criu_ready, gpu_env) -> None:
    """`pos migrate --to HOST --concurrent`: the whole-process concurrent image taken here,
    sent whole to `pos migrate --listen` (here the same machine, over TCP), restored there in
    a new process that goes on from the image."""
    job = fill_job()
    ran_past(job.pid, 0)
    # "the other host" shares this PID namespace: the job's PID is free for its restore there
    # once this test, its parent, has reaped the original
    threading.Thread(target=job.proc.wait, daemon=True).start()
    port = 7170 + os.getpid() % 500
    gpu_env = {**gpu_env, "POS_MIGRATE_KEY": str(tmp_path / "key")}
    assert pos("migrate", "--new-key", env=gpu_env).returncode == 0
    rx = subprocess.Popen([sys.executable, "-m", "pos.cli", "migrate", "--listen", "-D",
                           str(tmp_path / "in"), "--address", "127.0.0.1", "--port", str(port)],
                          cwd=ROOT, env=gpu_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True)
    try:
        wait_for(lambda: listening(port) or rx.poll() is not None, what="the listener")
        tx = pos("migrate", str(job.pid), "--to", f"127.0.0.1:{port}", "--concurrent", "--json",
                 env=gpu_env)
        out, err = rx.communicate(timeout=120)
    finally:
        if rx.poll() is None:
            rx.kill()
    assert tx.returncode == 0, (tx.stdout, tx.stderr, err)
    assert rx.returncode == 0, err
    report = json.loads(tx.stdout)
    assert report["restored_pid"] == job.pid
    assert {"checkpoint", "send", "there", "checkpoint.d2h"} <= set(report["timings"])
    assert f"restored PID {job.pid}" in out
    assert kind(tmp_path / "in") is ImageKind.CONCURRENT
    saved = image_values(tmp_path / "in")       # what was sent, as received and sealed there
    assert not torn(saved)
    wait_for(job.alive, what="the migrated job")
    ran_past(job.pid, max(saved))
    later = image_values(Path(concurrent.checkpoint_gpu(job.pid, tmp_path / "after").path))
    assert not torn(later) and max(later) > max(saved)   # it went on from the image


def test_migrate_concurrent_goes_with_to_host_or_to_gpu(gpu_env, tmp_path: Path) -> None:
    r = pos("migrate", "--listen", "-D", str(tmp_path), "--concurrent", env=gpu_env)
    assert r.returncode == 2 and "--concurrent goes with --to HOST or --to-gpu N" in r.stderr


FAKE_GPU = "GPU-10111213-1415-1617-1819-1a1b1c1d1e1f"     # the fake driver's one device
JOB_GPU = "GPU-00000000-0000-0000-0000-0000000000aa"      # where the fake NVML sees the job


@pytest.fixture
def two_gpus(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """NVML (in this process) naming two GPUs: GPU 0, where it sees the job, and as GPU 1 the
    fake driver's own device, so that a restore "onto GPU 1" reaches it; a migration's
    temporary image goes into tmp_path."""
    from pos import nvml
    from pos.concurrent import devices
    from pos.engines import migrate

    here = [nvml.Gpu(0, JOB_GPU, "fake", True), nvml.Gpu(1, FAKE_GPU, "fake", True)]
    monkeypatch.setattr(nvml, "available", lambda: True)
    monkeypatch.setattr(nvml, "gpus", lambda: here)
    monkeypatch.setattr(nvml, "gpus_of", lambda pids: {JOB_GPU: 1 << 20} if pids else {})
    monkeypatch.setattr(migrate, "image_dir", lambda pid: tmp_path / f"pos-migrate-{pid}")
    # pos copies on the job's GPU as NVML names it; the fake driver has one device, FAKE_GPU
    monkeypatch.setattr(devices, "cuda_device", lambda gpu: 0)
    monkeypatch.setattr(devices, "home", lambda directory: None)


def _move(pid: int, onto: Onto, keep: Path | None = None) -> Report:
    """`pos migrate PID --to-gpu N --concurrent [-D keep]`, as the command runs it."""
    return engines.Concurrent(Settings.from_env()).move(
        pid, onto, engines.Save(Options(), False, 10_000), keep)


@pytest.mark.parametrize("keep", [False, True])
def test_migrate_to_gpu_concurrent_restores_the_job_onto_the_gpu_in_a_new_process(
        fill_job, tmp_path: Path, criu_ready, gpu_env, two_gpus, keep: bool) -> None:
    """The chain a user gets from `pos migrate PID --to-gpu 1 --concurrent [-D DIR]`: the
    whole-process concurrent image, the job ended, the image restored with the GPUs swapped
    (the driver's restore is given the pair), its memory made on GPU 1; a temporary image is
    removed, one in -D kept."""
    job = fill_job()
    ran_past(job.pid, 0)
    before = image_values(Path(concurrent.checkpoint_gpu(job.pid, tmp_path / "before").path))
    reaper = threading.Thread(target=job.proc.wait)   # pos's CLI is not the job's parent
    reaper.start()
    local = tmp_path / "kept" if keep else None
    moved = _move(job.pid, Onto(index=1), local)
    reaper.join(timeout=30)
    assert moved.restored_pid == job.pid
    assert moved.timings["restore"] > 0 and moved.timings["checkpoint"] > 0
    ran_past(job.pid, max(before))
    after = image_values(Path(concurrent.checkpoint_gpu(job.pid, tmp_path / "after").path))
    assert job.alive() and not torn(after) and max(after) > max(before)
    assert not (tmp_path / f"pos-migrate-{job.pid}").exists()
    assert (tmp_path / "kept" / names.MANIFEST).is_file() == keep
    job.kill()
    wait_for(lambda: reaped(job.pid), what="the moved job's end")


def test_migrate_to_gpu_concurrent_keeps_and_names_the_image_when_the_restore_fails(
        fill_job, tmp_path: Path, criu_ready, gpu_env, two_gpus, monkeypatch) -> None:
    """The job was saved and ended, then the driver's restore failed: the image is all there
    is of it, so it stays, and the sentence names it and the command that restores it."""
    from pos.errors import PosError

    job = fill_job()
    ran_past(job.pid, 0)
    reaper = threading.Thread(target=job.proc.wait)
    reaper.start()
    monkeypatch.setenv("POS_FAKECUDA_FAIL", "cuCheckpointProcessRestore")
    with pytest.raises(PosError, match=f"PID {job.pid} was saved but not restored onto GPU 1"
                       ) as e:
        _move(job.pid, Onto(index=1))
    reaper.join(timeout=30)
    kept = Path(re.search(r"its image stays in (\S+) for", str(e.value)).group(1))
    assert kept == tmp_path / f"pos-migrate-{job.pid}"
    assert f"pos restore -D {kept} --to-gpu 1" in str(e.value)
    wait_for(lambda: reaped(job.pid), what="the half-restored job's end")
    monkeypatch.delenv("POS_FAKECUDA_FAIL")
    r = pos("restore", "-D", str(kept), env={**gpu_env, "POS_FAKECUDA_FAIL": ""})
    assert r.returncode == 0, r.stderr
    ran_past(job.pid)
    assert job.alive() and not torn(image_values(Path(
        concurrent.checkpoint_gpu(job.pid, tmp_path / "after").path)))


def test_migrate_to_gpu_concurrent_checks_the_gpu_before_the_job_is_touched(
        fill_job, gpu_env, two_gpus) -> None:
    job = fill_job()
    one_sentence(pos("migrate", str(job.pid), "--to-gpu", "1", "--concurrent", env=gpu_env), 2,
                 "NVML is not available")           # none beside the fake driver out there
    for index, says in ((2, "this host has 2 GPU(s), no GPU 2"),
                        (0, f"the job already runs where --to-gpu 0 puts it ({JOB_GPU})")):
        with pytest.raises(BadInput, match=re.escape(says)):
            _move(job.pid, Onto(index=index))
    with Agent(job.pid) as a:
        assert a.status().phase == "idle" and job.alive()


def test_plain_migrate_to_gpu_refuses_memory_pos_mapped_back(fill_job, tmp_path: Path,
                                                             criu_ready, gpu_env,
                                                             two_gpus) -> None:
    """The driver cannot restore memory that pos mapped back into the job (after a concurrent
    checkpoint): its own move would fail half way, so pos names the --concurrent form."""
    from pos.engines import migrate

    job = fill_job()
    assert pos("checkpoint", str(job.pid), "-D", str(tmp_path / "c"), "--concurrent",
               "--leave-running", env=gpu_env).returncode == 0
    with pytest.raises(BadInput, match=f"pos migrate {job.pid} --to-gpu 1 --concurrent"):
        migrate.to_gpu(job.pid, Onto(index=1), 10_000)
    assert (Path(gpu_env["POS_FAKECUDA_STATE_DIR"]) / str(job.pid)).read_text().strip() \
        == "running"
    assert job.alive()


def test_the_agent_makes_room_in_the_jobs_table_touching_no_descriptor(fill_job) -> None:
    """Before the cut, room for the export's descriptors in the job's table, so that the
    kernel does not grow it while the job is held (pos/process/fdroom.py says why); asked for
    more than the job's RLIMIT_NOFILE allows, as much as its hard limit does (the soft one
    raised for it)."""
    from tests.process.test_fdroom import table_size

    job = fill_job()
    fds = f"/proc/{job.pid}/fd"
    before = {n: os.readlink(f"{fds}/{n}") for n in os.listdir(fds)}
    size = table_size(str(job.pid))
    with Agent(job.pid) as a:
        r = a.room(size + 1000)
    assert r.made and r.top >= max(int(n) for n in before) and r.room == r.top + size + 1000
    assert table_size(str(job.pid)) > r.room
    with Agent(job.pid) as a:
        assert a.room(1 << 40).room < resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    # the agent closes its end of each connection once pos's is closed
    wait_for(lambda: {n: os.readlink(f"{fds}/{n}") for n in os.listdir(fds)} == before,
             what="the job's descriptors as they were")


def test_the_agent_raises_the_jobs_soft_limit_for_the_room(fill_job) -> None:
    """A job's own memory can come in thousands of pieces (PyTorch's expandable segments), a
    descriptor each: the agent raises the job's soft RLIMIT_NOFILE toward its hard one for the
    room asked, and no further."""
    job = fill_job()
    hard = resource.prlimit(job.pid, resource.RLIMIT_NOFILE)[1]
    assert hard >= 4096, f"a hard RLIMIT_NOFILE of {hard} leaves too little room to tell"
    resource.prlimit(job.pid, resource.RLIMIT_NOFILE, (256, hard))
    with Agent(job.pid) as a:
        r = a.room(2000)
    assert r.made and r.room == r.top + 2000
    assert resource.prlimit(job.pid, resource.RLIMIT_NOFILE) == (r.room + 1, hard)
    with Agent(job.pid) as a:
        assert a.room(1 << 40).room == hard - 1
    assert resource.prlimit(job.pid, resource.RLIMIT_NOFILE) == (hard, hard)


def test_whole_process_checkpoint_leave_running(fill_job, tmp_path: Path, criu_ready,
                                                gpu_env) -> None:
    job = fill_job()
    img = tmp_path / own("img")
    r = pos("checkpoint", str(job.pid), "-D", str(img), "--concurrent",
            "--leave-running", env=gpu_env)
    assert r.returncode == 0, r.stderr
    assert not torn(image_values(img))
    # CRIU wrote into the huge-page tmpfs while the job was frozen; its files moved into the
    # image afterwards, and nothing is left there
    timings = json.loads((img / names.MANIFEST).read_text())["timings"]
    assert "move" in timings
    # the job's export, in parts: the agent's wait for its lock and its loop, the rest of the
    # time to its answer, the descriptors' passage; together no longer than the export
    parts = [timings[f"export_{k}"] for k in ("lock", "loop", "answer", "passage")]
    assert min(parts) >= 0 and timings["export_loop"] > 0
    assert sum(parts) <= timings["export"] + 1e-3
    # the hoist's and the remap's parts, as the agent timed them: within each step's time
    assert 0 < timings["hoist_loop"] <= timings["hoist"]
    remap = [timings[f"remap_{k}"] for k in ("connect", "rx", "loop")]
    assert min(remap) >= 0 and timings["remap_loop"] > 0
    assert sum(remap) <= timings["remap"] + 1e-3
    # CRIU's kernel-feature cache kept before the cut (pos/process/kdat.py), timed
    assert timings["criu_cache"] >= 0
    assert (img / names.INVENTORY).is_file()
    assert staged(img) == []
    with Agent(job.pid) as a:
        assert a.status().phase == "idle"
    first = image_values(Path(concurrent.checkpoint_gpu(job.pid, tmp_path / "a").path))
    ran_past(job.pid, max(first))
    second = image_values(Path(concurrent.checkpoint_gpu(job.pid, tmp_path / "b").path))
    assert max(second) > max(first)             # running, and re-exported (kept descriptors)


@pytest.mark.parametrize("held", ["criu", "frozen"])
def test_savers_held_either_way_leave_an_exact_image(held: str, fill_job, tmp_path: Path,
                                                     criu_ready, gpu_env) -> None:
    """POS_SAVERS_HELD, with buffers pos could not shadow: whether the savers write while the
    driver's calls run (`criu`) or wait through the whole frozen part, the image is the state
    after one exact operation; what they had written at the dump and at the release is
    timed."""
    job = fill_job()
    ran_past(job.pid, 0)
    img = tmp_path / own("img")
    r = pos("checkpoint", str(job.pid), "-D", str(img), "--concurrent", "--leave-running",
            "--chunk-mb", "1", env={**gpu_env, "POS_SAVERS_HELD": held,
                                    "POS_SHADOW_MAX_BYTES": str(3 << 20)})
    assert r.returncode == 0, r.stderr
    assert not torn(image_values(img))
    timings = json.loads((img / names.MANIFEST).read_text())["timings"]
    assert 0 <= timings["saved_at_dump_bytes"] <= timings["saved_at_release_bytes"]
    assert job.alive()


def test_a_whole_process_checkpoint_says_whether_criu_predumped(fill_job, tmp_path: Path,
                                                               criu_ready, gpu_env) -> None:
    """Where the kernel keeps soft-dirty bits CRIU pre-dumps the running job (the fake driver
    maps no device) and the frozen dump is incremental, its parent inside the image; on every
    other kernel (all that pos was tested on) the report and the manifest say why not. Either
    way the image restores and the job goes on from it."""
    job = fill_job()
    time.sleep(0.3)
    img = tmp_path / "full"
    r = pos("checkpoint", str(job.pid), "-D", str(img), "--concurrent", "--json", env=gpu_env)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    manifest = json.loads((img / names.MANIFEST).read_text())
    assert (manifest["predumped"], manifest["predump_note"]) == (report["predumped"],
                                                                report["predump_note"])
    dump_log = (img / names.DUMP_LOG).read_text()
    if kernel_keeps_soft_dirty():
        assert report["predumped"] is True and report["predump_note"] == ""
        assert {"predump", "predump_frozen", "predump_mib"} <= set(report["timings"])
        assert f"{names.PARENT}/{names.INVENTORY}" in manifest["files"]
        assert "Will do snapshot from parent" in dump_log      # CRIU's incremental dump
    else:
        assert report["predumped"] is False
        assert "does not track dirty pages (soft-dirty)" in report["predump_note"]
        assert "predump" not in report["timings"] and not (img / names.PARENT).exists()
        assert "Will do snapshot from" not in dump_log
    job.proc.wait(timeout=30)                   # CRIU ended it after the dump
    saved = image_values(img)
    r = pos("restore", "-D", str(img), env=gpu_env)
    assert r.returncode == 0, r.stderr
    time.sleep(0.3)
    later = image_values(Path(concurrent.checkpoint_gpu(job.pid, tmp_path / "after").path))
    assert not torn(later) and max(later) > max(saved)   # it went on from the image


def test_a_predump_that_fails_leaves_the_frozen_dump_whole(
        fill_job, tmp_path: Path, criu_ready, gpu_env, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel's answer forced to yes: pos runs CRIU's pre-dump of the running job with the
    command line of predump_argv. On a kernel without soft-dirty bits CRIU refuses it, and the
    checkpoint goes on with the whole memory dumped while frozen, the job unharmed; on a kernel
    with them the pre-dump is used."""
    monkeypatch.setattr(predump, "tracks_dirty_pages", lambda _path: True)
    monkeypatch.setenv("POS_LOG_DIR", str(tmp_path / "logs"))
    ran: list[list[str]] = []
    real = Criu.predump_argv
    monkeypatch.setattr(Criu, "predump_argv",
                        lambda self, *a: ran.append(real(self, *a)) or ran[-1])
    job = fill_job()
    img = tmp_path / own("img")
    report = concurrent.checkpoint_full(job.pid, img, Save(leave_running=True))
    assert report.manifest is not None
    (argv,) = ran                                # into the folder CRIU then dumps into
    assert argv[1:3] == ["pre-dump", "-D"] and Path(argv[3]).name == names.PARENT
    assert argv[argv.index("-t") + 1] == str(job.pid)
    assert argv[-3:] == ["--track-mem", "--pre-dump-mode", "read"]
    assert "predump" in report.timings           # it ran, failed or not
    dump_log = (img / names.DUMP_LOG).read_text()
    if kernel_keeps_soft_dirty():
        assert report.manifest.predumped is True
        assert "Will do snapshot from parent" in dump_log
    else:
        assert report.manifest.predumped is False
        note = report.manifest.predump_note
        assert note.startswith("criu pre-dump failed: ") and \
            "Tracking memory is not available" in note
        assert not (img / names.PARENT).exists() and "Will do snapshot from" not in dump_log
        assert list((tmp_path / "logs").glob(f"*-{names.PREDUMP_LOG}"))   # CRIU's log kept
    assert not torn(image_values(img))
    with Agent(job.pid) as a:
        assert a.status().phase == "idle"
    first = image_values(Path(concurrent.checkpoint_gpu(job.pid, tmp_path / "a").path))
    time.sleep(0.2)
    second = image_values(Path(concurrent.checkpoint_gpu(job.pid, tmp_path / "b").path))
    assert max(second) > max(first)             # the job runs on


@pytest.mark.parametrize("step,leave_running", [
    *((step, True) for step in ("cut", "hoist", "lock", "checkpoint", "dump", "restore", "unlock",
                                "copy", "seal")),
    ("copy", False), ("seal", False)])
def test_pos_killed_at_each_step_leaves_the_job_running_with_its_memory(
        fill_job, tmp_path: Path, criu_ready, gpu_env, step: str, leave_running: bool) -> None:
    """Also without --leave-running: the job ends only once its image is sealed; until then
    CRIU leaves it stopped and its memory is pos's, so pos dying gives it back and it runs on."""
    job = fill_job()
    ran_past(job.pid, 0)
    before = image_values(Path(concurrent.checkpoint_gpu(job.pid, tmp_path / "before").path))
    img = tmp_path / own("img")
    r = pos("checkpoint", str(job.pid), "-D", str(img), "--concurrent",
            *(["--leave-running"] if leave_running else []),
            env={**gpu_env, "POS_FAULT_AT": f"{step}=KILL"})
    assert r.returncode == -9, (r.returncode, r.stderr)
    log = Path(gpu_env["POS_WATCHDOG_LOG"])
    wait_for(lambda: log.exists() and "undo done" in log.read_text(), timeout=60,
             what="the watchdog's undo")
    with Agent(job.pid) as a:
        wait_for(lambda: a.status().phase == "idle", what="the job's release")
    after = image_values(Path(concurrent.checkpoint_gpu(job.pid, tmp_path / "after").path))
    assert job.alive() and not torn(after) and max(after) > max(before)
    assert (Path(gpu_env["POS_FAKECUDA_STATE_DIR"]) / str(job.pid)).read_text().strip() \
        == "running"
    assert not names.partial(img).exists() and staged(img) == []


@pytest.mark.parametrize("point", ["criu-restore:criu=KILL", "verify=KILL", "remap=KILL",
                                   "fill=KILL"])
def test_pos_killed_during_a_whole_process_restore_ends_the_half_restored_job(
        fill_job, tmp_path: Path, criu_ready, gpu_env, point: str) -> None:
    """Before its memory is all back the restored job must not run on: the watchdog (which
    checks the image first when CRIU left the tree stopped beside the check) ends it. (pos
    restores in its own process here; tests/engines/test_detached.py kills the process that
    restores for it otherwise.)"""
    job = fill_job()
    img = tmp_path / "full"
    assert pos("checkpoint", str(job.pid), "-D", str(img), "--concurrent",
               env=gpu_env).returncode == 0
    job.proc.wait(timeout=30)
    r = pos("restore", "-D", str(img), "--no-service", env={**gpu_env, "POS_FAULT_AT": point})
    assert r.returncode == -9, (r.returncode, r.stderr)
    wait_for(lambda: not Path(f"/proc/{job.pid}").exists() or
             open(f"/proc/{job.pid}/stat").read().split()[2] == "Z", timeout=60,
             what="the half-restored job's end")


def test_concurrent_checkpoint_without_an_agent_is_one_sentence(sleeper, tmp_path: Path,
                                                                gpu_env) -> None:
    r = pos("checkpoint", str(sleeper), "-D", str(tmp_path / "img"), "--concurrent",
            env=gpu_env)
    one_sentence(r, 2, f"process {sleeper} has no pos agent", "pos run")
    assert not (tmp_path / "img").exists()


def test_pos_run_of_a_missing_command_is_a_usage_error() -> None:
    r = subprocess.run([sys.executable, "-m", "pos.cli", "run", "--", "no-such-program-42"],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 2 and "no-such-program-42: command not found" in r.stderr


def test_stop_the_world_after_a_concurrent_checkpoint_is_refused(fill_job, tmp_path: Path,
                                                                criu_ready, gpu_env) -> None:
    """After a whole-process concurrent checkpoint the job's memory is mapped back from pos's
    descriptors; the driver cannot restore that from a stop-the-world image (the H100 said
    CUDA_ERROR_NOT_SUPPORTED), so pos refuses in one sentence before touching the job, and the
    concurrent engine keeps working on it."""
    job = fill_job()
    r = pos("checkpoint", str(job.pid), "-D", str(tmp_path / "stw0"), "--leave-running",
            env=gpu_env)
    assert r.returncode == 0, r.stderr              # its own memory: the driver's engine works
    assert pos("checkpoint", str(job.pid), "-D", str(tmp_path / "c1"), "--concurrent",
               "--leave-running", env=gpu_env).returncode == 0
    with Agent(job.pid) as a:
        assert a.status().imported == 12
    one_sentence(pos("checkpoint", str(job.pid), "-D", str(tmp_path / "stw"), "--leave-running",
                     env=gpu_env), 2, "were mapped back from a whole-process concurrent",
                 "pos checkpoint --concurrent")
    assert not (tmp_path / "stw").exists() and not names.partial(tmp_path / "stw").exists()
    r = pos("checkpoint", str(job.pid), "-D", str(tmp_path / "c2"), "--concurrent",
            "--leave-running", env=gpu_env)
    assert r.returncode == 0, r.stderr
    assert not torn(image_values(tmp_path / "c2")) and job.alive()


def nvidiactl_nodes(folder: Path) -> bool:
    """Whether a character device 195:255 can be made and opened (O_PATH) here, as the fake
    driver does to leak one like the real driver's /dev/nvidiactl (root, no nodev mount)."""
    node = folder / "probe-195-255"
    try:
        os.mknod(node, 0o600 | stat.S_IFCHR, os.makedev(195, 255))
        os.close(os.open(node, os.O_PATH))
        return True
    except OSError:
        return False
    finally:
        node.unlink(missing_ok=True)


def is_nvidiactl(pid: int, fd: str) -> bool:
    try:
        st = os.stat(f"/proc/{pid}/fd/{fd}")
    except OSError:
        return False
    return stat.S_ISCHR(st.st_mode) and (os.major(st.st_rdev), os.minor(st.st_rdev)) == (195, 255)


def test_memory_the_driver_restored_itself_is_reseated_before_it_is_exported(
        fill_job, tmp_path: Path, criu_ready, gpu_env) -> None:
    """Two H200s would not export the memory that the driver's own restore brought back (two
    stop-the-world cycles that left the job running); the agent moves every buffer into new
    exportable memory at the same address, bytes included: the concurrent image goes on from
    where the job was; the nvidiactl descriptors the refusals leaked are retired, and the job
    goes on, through a later image and a restore into a new process."""
    gpu_env["POS_FAKECUDA_STALE_EXPORT"] = "1"          # the job's driver refuses such exports
    job = fill_job()
    ran_past(job.pid, 0)
    before = image_values(Path(concurrent.checkpoint_gpu(job.pid, tmp_path / "before").path))
    for i in range(2):
        r = pos("checkpoint", str(job.pid), "-D", str(tmp_path / f"stw{i}"), "--leave-running",
                env=gpu_env)
        assert r.returncode == 0, r.stderr
    with Agent(job.pid) as a:
        table = a.table()
    img = tmp_path / "full"
    r = pos("checkpoint", str(job.pid), "-D", str(img), "--concurrent", "--leave-running",
            env=gpu_env)
    assert r.returncode == 0, r.stderr
    timings = json.loads((img / names.MANIFEST).read_text())["timings"]
    assert timings["reseated_bytes"] == sum(b.mapped for b in table)
    # each refusal left a descriptor of a 195:255 node (the fake's nvidiactl) open in the
    # job: the agent put /dev/null in each one's place, and CRIU dumped the job
    leaks = len(table) if nvidiactl_nodes(tmp_path) else 0
    assert timings["leaked_closed_n"] == leaks
    assert not [fd for fd in os.listdir(f"/proc/{job.pid}/fd") if is_nvidiactl(job.pid, fd)]
    saved = image_values(img)
    assert not torn(saved) and max(saved) > max(before)     # the bytes moved with the buffers
    last = tmp_path / "last"                    # the job ended by the dump this time
    r = pos("checkpoint", str(job.pid), "-D", str(last), "--concurrent", env=gpu_env)
    assert r.returncode == 0, r.stderr
    assert "reseated_bytes" not in json.loads((last / names.MANIFEST).read_text())["timings"]
    job.proc.wait(timeout=30)
    r = pos("restore", "-D", str(last), env=gpu_env)
    assert r.returncode == 0, r.stderr
    ran_past(job.pid, max(saved))
    values = image_values(Path(concurrent.checkpoint_gpu(job.pid, tmp_path / "later").path))
    assert job.alive() and not torn(values) and max(values) > max(saved)


def test_a_corrupt_chunk_ends_the_job_it_was_being_restored_into(fill_job, tmp_path: Path,
                                                                 gpu_env) -> None:
    """The chunk's checksum fails after the job was let go on demand: it must not compute on a
    mix of restored and stale buffers, so the agent ends it; pos says why in one sentence."""
    job = fill_job()
    img = Path(concurrent.checkpoint_gpu(job.pid, tmp_path / "img").path)
    data = sorted(img.glob(names.data_prefix() + "*"))[-1]
    blob = bytearray(data.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    os.chmod(data, 0o600)
    data.write_bytes(bytes(blob))
    r = pos("restore", "--gpu-only", str(job.pid), "-D", str(img), env=gpu_env)
    one_sentence(r, 2, "does not match its checksum")
    wait_for(lambda: not job.alive(), what="the half-restored job's end")


def test_small_allocations_share_owned_slabs(fill_job, tmp_path: Path) -> None:
    """64 allocations of 4 KiB take one 2 MiB slab, not 64 granules; images and restores handle
    the slab as one buffer, and every allocation in it is still exact."""
    job = fill_job(buffers=64, size=4096)
    with Agent(job.pid) as a:
        st = a.status()
    assert st.buffers == 1 and st.owned_bytes == 2 << 20
    ran_past(job.pid, 64)                       # every allocation written
    img = Path(concurrent.checkpoint_gpu(job.pid, tmp_path / "img").path)
    (_base, (where, size, chunks)), = gpuindex.saved(img).items()
    words = np.concatenate([_chunk(where, c) for c in chunks])
    held = sorted(set(words.tolist()) - {0})
    assert size == 2 << 20 and len(held) == 64 and not torn(held)
    job.hold()
    concurrent.restore_gpu(job.pid, open_image(img))
    back = Path(concurrent.checkpoint_gpu(job.pid, tmp_path / "back").path)
    (_b, (where2, _s, chunks2)), = gpuindex.saved(back).items()
    assert [c.hash for c in chunks2] == [c.hash for c in chunks]


def _chunk(where: Path, c: ChunkRecord) -> np.ndarray:
    buf = np.empty(c.raw, np.uint8)
    gpuimage.read_chunk(where, c, buf)
    return buf.view(np.uint32)
