"""The concurrent engine on the GPU, measured against its baselines in the same run (root).

    python3 bench/concurrent_gpu.py --out DIR [--only overhead,consistency,big,stw,hoistfd]

Each part writes DIR/<part>.json (device, driver, date, command, commit) and prints a summary:
  overhead     a training step (workloads/torch_job.py) with no agent, with the agent not owning
               memory (POS_OWN=0), and with the agent owning it: alternated rounds, medians
  consistency  workloads/fill_job.py (48 x 64 MiB, one kernel per operation) under `pos run`,
               GPU-only checkpoints from outside at random moments: every image must be the
               state after an exact number of operations; then a restore into the paused job,
               read back by a second checkpoint: equal, buffer by buffer
  big          train_det.py with --ballast-gib G (8 and 16) under `pos run`: GPU-only concurrent
               checkpoint from outside (release time, longest held call, device-to-host GB/s
               against the 55 GB/s limit, time to disk) beside the driver's stop-the-world
               lock/checkpoint/restore/unlock of the same job
  stw          `pos checkpoint` (driver + CRIU, the job killed) of a `pos run` training job and
               `pos restore`: its losses against an uninterrupted run's, bit for bit; then, on
               another, a whole-process concurrent image first: the stop-the-world checkpoint
               after it must be refused (the driver cannot restore memory mapped back from pos)
  hoistfd      the agent gives its memory up and maps it back from descriptors that no CUDA
               context of pos holds: whether the exported descriptor alone keeps the memory
  fullexact    `pos checkpoint --concurrent` (whole process, hoisted; the job ended by the
               dump) of --exact-job (gpt: workloads/train_gpt.py) at a moment the job does not
               choose, then `pos restore` into a new process: every loss against an
               uninterrupted run's, bit for bit; restore times, the gate's waits (named), the
               first step after it and train_det's own clock around it; then the fill probe
               (fill_probe): the restore's ring fill in several shapes against the
               whole-chunk staging fill before it, reading alone, and the data files mapped,
               page-locked in place and copied to the device from the page cache
  migratehost  `pos migrate --to 127.0.0.1 --concurrent` of --exact-job at a moment it does not
               choose, to `pos migrate --listen` here: losses bit for bit, the downtime
  togpu        (two GPUs) a job on GPU 0 moved to GPU 1 by `pos migrate --to-gpu`, and by
               `pos restore --to-gpu` of a stop-the-world and of a concurrent image: losses bit
               for bit, where NVML sees it, how long it stood still
  reseat       two stop-the-world --leave-running cycles, then a concurrent image and a restore
               into a new process: memory the driver restored moved where it will not export
               it (two H200s), losses bit for bit
  fullstall    --leave-running: the driver's stop-the-world `pos checkpoint` first, then the
               concurrent one (the context's stack made 0 bytes while hoisted, then kept as it
               was: POS_HOIST_STACK=off, the local memory the driver checkpoints), on the
               same job, for each of --full-jobs (GiB of train_det ballast, or gpt); the stall
               as the job saw it, from its log's step times
  predump      whether CRIU can pre-dump a running `pos run` job (nvidia mappings still in it):
               the way to shorten the frozen part of the dump (a probe, not yet used by pos)
  faults       pos killed (SIGKILL) at each step of a whole-process concurrent checkpoint: the
               job must run on, its memory intact (fill_job's images before and after)
  restorefirst the same job checkpointed by each engine and restored into a new process: when
               its first steps came, from `pos restore`'s start (--first-gib of ballast)
"""

import argparse
import ctypes
import datetime
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from pos import concurrent  # noqa: E402
from pos import nvml  # noqa: E402
from pos.agent.control import Agent, Buffer  # noqa: E402
from pos.concurrent import gpucopy  # noqa: E402
from pos.concurrent.fill import fill, fill_order  # noqa: E402
from pos.concurrent.handout import Handout  # noqa: E402
from pos.driver import CUdeviceptr  # noqa: E402
from pos.image import gpuindex, names  # noqa: E402
from pos.image.opened import open_image  # noqa: E402
from pos.process import cudackpt  # noqa: E402
from workloads.fill_job import image_values, torn  # noqa: E402

PY = sys.executable
POS = [PY, "-m", "pos.cli"]
LIMIT_GBPS = 55.0


def machine() -> dict[str, Any]:
    gpus = nvml.gpus()
    # the device tool's copy of the tree keeps a stale HEAD: the caller names the commit
    commit = os.environ.get("POS_BENCH_COMMIT") or subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "gpu": gpus[0].name if gpus else "n/a", "driver": nvml.driver_version(),
            "kernel": os.uname().release, "command": " ".join(sys.argv), "commit": commit}


def start(argv: list[str], pos_run: bool = True, env: dict[str, str] = {},
          log: Path = Path(os.devnull)) -> subprocess.Popen:
    cmd = [*POS, "run", "--", *argv] if pos_run else argv
    return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=open(log, "ab"), env={**os.environ, **env}, text=True,
                            start_new_session=True, cwd=ROOT)


def pos_job(argv: list[str], log: Path = Path(os.devnull)) -> subprocess.Popen:
    """`pos run` ARGV in a session of its own, its standard error appended to `log`, its
    standard output discarded (the jobs here write their steps to a file)."""
    return subprocess.Popen([*POS, "run", "--", *argv], cwd=ROOT, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=open(log, "ab"),
                            start_new_session=True)


def wait_ready(p: subprocess.Popen) -> int:
    line = p.stdout.readline()
    if not line.startswith("READY"):
        raise SystemExit(f"job did not start: {line!r}")
    return int(line.split()[1])


def wait_agent(pid: int, seconds: float = 60) -> None:
    t = time.monotonic()
    while time.monotonic() - t < seconds:
        try:
            with Agent(pid, timeout=5) as a:
                if a.status().buffers:
                    return
        except Exception:
            pass
        time.sleep(0.2)
    raise SystemExit(f"the agent of {pid} never answered")


def kill(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait()


def wait_lines(log: Path, n: int = 20) -> None:
    """Until the job's log has n lines (train_det writes one per step)."""
    while not log.exists() or len(log.read_text().splitlines()) < n:
        time.sleep(0.05)


def compare_when_done(ref_log: Path, log: Path, res: dict[str, Any], timeout: float) -> None:
    """Once the restored job has written as many lines as the uninterrupted run, its lines
    against that run's, into res."""
    ref = ref_log.read_text().splitlines()
    t = time.monotonic()
    while time.monotonic() - t < timeout and len(log.read_text().splitlines()) < len(ref):
        time.sleep(0.2)
    got = log.read_text().splitlines()
    res["lines"] = [len(ref), len(got)]
    res["bit_exact"] = ref == got
    res["first_diff"] = next(([a, b] for a, b in zip(ref, got) if a != b), None)


def job_argv(job: str, log: Path, steps: int, sleep: float) -> list[str]:
    """`gpt`: workloads/train_gpt.py (GPT-2 medium's shape, ~27 GB); a number G: train_det.py
    with G GiB of ballast."""
    if job == "gpt":
        return [PY, "workloads/train_gpt.py", str(log), "--steps", str(steps), "--sleep",
                str(sleep)]
    return det_argv(log, steps, float(job), sleep)


class LineTimes:
    """When each new line of a job's log appeared, watched from outside (2 ms polls): the
    job's step times, with no change to the job."""

    def __init__(self, log: Path) -> None:
        self.log, self.stop = log, False
        self.n0 = len(log.read_text().splitlines()) if log.exists() else 0
        self.t0 = time.monotonic()
        self.times: list[float] = []
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        n = self.n0
        while not self.stop and time.monotonic() - self.t0 < 600:
            m = len(self.log.read_text().splitlines()) if self.log.exists() else 0
            self.times.extend([time.monotonic()] * (m - n))
            n = m
            time.sleep(0.002)

    def first(self, timeout: float = 300) -> Any:
        """Seconds from the start until the first new line (None if none came)."""
        t = time.monotonic()
        while not self.times and time.monotonic() - t < timeout:
            time.sleep(0.01)
        return self.times[0] - self.t0 if self.times else None

    def excess(self, start: float, end: float) -> dict[str, Any]:
        """The stall as the job saw it: the longest step overlapping [start, end] against the
        median step before start, and the steps' summed excess over that median there."""
        self.stop = True
        self.thread.join()
        gaps = [(a, b - a) for a, b in zip(self.times, self.times[1:])]
        before = [g for a, g in gaps if a + g < start]
        during = [g for a, g in gaps if a + g >= start and a <= end]
        if not before or not during:
            return {"steps_before": len(before), "steps_during": len(during)}
        median = statistics.median(before)
        return {"median_step_s": median, "worst_step_s": max(during),
                "excess_s": sum(g - median for g in during), "steps_during": len(during)}


def anon_mib(pid: int) -> float:
    """The process's anonymous memory (what CRIU dumps of it), from smaps_rollup."""
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Anonymous:"):
            return int(line.split()[1]) / 1024
    return 0.0


# (threads, piece, depth, mapped) of the fill's rings that the probe compares (the restore's
# own: 16 threads, 1 MiB x 4, mapped)
RING_VARIANTS = [(16, 2 << 20, 4, False), (16, 1 << 20, 4, False), (16, 512 << 10, 4, False),
                 (16, 256 << 10, 4, False), (16, 2 << 20, 4, True), (16, 1 << 20, 4, True),
                 (16, 512 << 10, 4, True), (16, 256 << 10, 8, True), (12, 1 << 20, 4, True),
                 (16, 4 << 20, 2, True)]


def fill_probe(image_dir: Path, threads: int = 16) -> dict[str, Any]:
    """Why a restore fills at what it does, on the image's GPU chunks (page cache) with no CRIU
    or job beside it, GB/s each: the restore's fill (`ring_T_P_D_read|mapped`: T threads,
    each a ring of D pinned pieces of P KiB, read with pread or copied out of the data files
    mapped, hashed and copied to the device piece by piece) against the fill before the
    rings (`staging`: each thread reads a whole 64 MiB chunk into pinned staging, hashing
    1 MiB pieces as they come, then copies it); and the floors: `read` (pread into 64 MiB
    buffers), `read_hash` (and hashing as the restore does), `map_hash` (hashing the mapped
    files in place, no copy at all). Page-locking the mapped files to copy from them directly
    was measured in part 7's first run (bench/results/2026-11-25/hoist21): 1.2-1.9 s for
    16 GiB, from 1 or 16 threads."""
    from pos.image import gpu as gpuimage

    saved = gpuindex.saved(image_dir)
    chunks = [(folder, c) for folder, _size, cs in saved.values() for c in cs]
    total = sum(c.raw for _f, c in chunks)
    biggest = max(c.raw for _f, c in chunks)
    res: dict[str, Any] = {"bytes": total, "chunks": len(chunks), "threads": threads}

    drv = gpucopy.Context(0).drv
    table = sorted((Buffer(base, size, size, 0, True) for base, (_f, size, _c) in saved.items()),
                   key=lambda b: b.va)
    dest = []
    for b in table:
        ptr = CUdeviceptr()
        drv.cuMemAlloc_v2(ctypes.byref(ptr), b.size)
        dest.append(ptr.value)
    mine = {b.va: saved[b.va] for b in table}
    res["staging_gbps"] = staging_fill(drv, table, dest, mine, threads)
    for n, piece, depth, mapped in RING_VARIANTS:
        rings = gpucopy.Rings(drv, n, piece, depth)
        try:
            copy = fill(drv, table, dest, mine, streams=n, handout=Handout(table), rings=rings,
                        mapped=mapped)
        finally:
            rings.close()
        how = "mapped" if mapped else "read"
        res[f"ring_{n}_{piece >> 10}_{depth}_{how}_gbps"] = round(copy.gbps, 2)
    res["staging_again_gbps"] = staging_fill(drv, table, dest, mine, threads)
    for ptr in dest:
        drv.cuMemFree_v2(ptr)
    maps = gpuimage.Maps()
    try:
        floors(chunks, threads, biggest, maps, res)
    finally:
        maps.close()
    return res


def floors(chunks: list[tuple[Path, gpuindex.ChunkRecord]], threads: int, biggest: int,
           maps: Any, res: dict[str, Any]) -> None:
    """fill_probe's floors: `read`, `read_hash` and `map_hash`, GB/s into res."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    from pos.image import gpu as gpuimage
    from pos.image.checksum import checksum

    total = sum(c.raw for _f, c in chunks)
    bufs = [np.ones(biggest, np.uint8) for _ in range(threads)]   # touched: no first faults
    for mode in ("read", "read_hash", "map_hash"):
        free = list(range(threads))
        lock = threading.Lock()
        fds: list[dict[str, int]] = [{} for _ in range(threads)]

        def one(item: tuple[Path, gpuindex.ChunkRecord]) -> None:
            with lock:
                k = free.pop()
            try:
                folder, c = item
                if mode == "read_hash":
                    gpuimage.read_chunk_into(folder, c, bufs[k], fds[k])
                    return
                if mode == "map_hash":
                    at = maps.address(folder, c) + c.at
                    checksum(np.ctypeslib.as_array((ctypes.c_uint8 * c.raw)
                                                   .from_address(at)))
                    return
                path = str(folder / c.file)
                if path not in fds[k]:
                    fds[k][path] = os.open(path, os.O_RDONLY)
                view, done = memoryview(bufs[k][:c.raw]).cast("B"), 0
                while done < c.raw:
                    done += os.preadv(fds[k][path], [view[done:]], c.at + done)
            finally:
                with lock:
                    free.append(k)

        t = time.monotonic()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, chunks))
        res[f"{mode}_gbps"] = round(total / (time.monotonic() - t) / 1e9, 2)
        for d in fds:
            for fd in d.values():
                os.close(fd)


def staging_fill(drv: Any, table: list[Buffer], dest: list[int],
                 saved: dict[int, gpuindex.Saved], n: int) -> float:
    """The fill before the rings, for comparison (GB/s): each of n threads reads a whole chunk
    into its part of one pinned arena (1 MiB pieces hashed as they come), copies it to the
    device, and waits for the copy before it reads the next."""
    from pos.image import gpu as gpuimage

    slot = 1 << (max(c.raw for _f, _s, cs in saved.values() for c in cs) - 1).bit_length()
    chunk_of, work = fill_order(table, saved)
    staging = gpucopy.Pinned(drv, n * slot)
    local, lock, taken, opened = threading.local(), threading.Lock(), [0], []

    def one(stream: Any, i: int, off: int, k: int) -> None:
        if not hasattr(local, "at"):
            with lock:
                local.at, local.fds = taken[0] * slot, {}
                taken[0] += 1
                opened.append(local.fds)
        gpuimage.read_chunk_into(saved[table[i].va][0], chunk_of[(i, off)],
                                 staging.view(local.at, k), local.fds)
        drv.cuMemcpyHtoDAsync_v2(dest[i] + off, staging.ptr + local.at, k, stream)

    try:
        seconds = gpucopy.run_chunks(drv, work, len(table), n, one)
    finally:
        staging.close()
        for fds in opened:
            for fd in fds.values():
                os.close(fd)
    return round(sum(k for _i, _o, k in work) / seconds / 1e9, 2)


# -- parts ---------------------------------------------------------------------------------
def overhead(out: Path, rounds: int) -> dict[str, Any]:
    modes = {"plain": (False, {}), "agent_not_owning": (True, {"POS_OWN": "0"}),
             "agent_owning": (True, {})}
    procs = {}
    for m, (run, env) in modes.items():
        p = subprocess.Popen([*POS, "run", "--", PY, "workloads/torch_job.py"] if run else
                             [PY, "workloads/torch_job.py"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, cwd=ROOT,
                             env={**os.environ, **env})
        p.stdout.readline()
        p.stdin.write("init\n"); p.stdin.flush(); p.stdout.readline()
        procs[m] = p
    steps: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(rounds):
        for m, p in procs.items():
            p.stdin.write("train 20\n"); p.stdin.flush()
            r = json.loads(p.stdout.readline())
            steps[m].append(r["seconds_per_step"] if "seconds_per_step" in r else r["s_per_step"])
    for p in procs.values():
        p.stdin.write("exit\n"); p.stdin.flush(); p.wait(timeout=60)
    med = {m: statistics.median(v) for m, v in steps.items()}
    return {"rounds": steps, "median_step_s": med,
            "owning_vs_plain": med["agent_owning"] / med["plain"] - 1,
            "not_owning_vs_plain": med["agent_not_owning"] / med["plain"] - 1}


def consistency(out: Path, images: Path, n_images: int) -> dict[str, Any]:
    pause = images / "pause"
    p = start([PY, "workloads/fill_job.py", "--buffers", "48", "--mib", "64",
               "--pause-file", str(pause)], log=out / "fill_job.log")
    res: dict[str, Any] = {"images": []}
    try:
        pid = wait_ready(p)
        wait_agent(pid)
        for i in range(n_images):
            time.sleep(random.uniform(0.2, 1.5))
            d = images / f"fill-{i}"
            r = concurrent.checkpoint_gpu(pid, d)
            vals = image_values(Path(r.path))
            res["images"].append({"report": r.to_json(), "ops": max(vals), "torn": torn(vals)})
        pause.touch()
        time.sleep(0.5)
        first = images / "fill-0"
        rr = concurrent.restore_gpu(pid, open_image(first))
        again = concurrent.checkpoint_gpu(pid, images / "fill-readback")
        res["restore"] = rr.to_json()
        res["readback_equal"] = image_values(first) == image_values(Path(again.path))
        pause.unlink()
        time.sleep(0.5)
        res["alive_after"] = p.poll() is None
    finally:
        kill(p)
    return res


def big(out: Path, images: Path, sizes: list[float]) -> dict[str, Any]:
    rows = []
    for gib in sizes:
        log = images / f"det-{gib}.log"
        p = start([PY, "workloads/train_det.py", str(log), "--steps", "0", "--sleep", "0.01",
                   "--ballast-gib", str(gib)], log=out / "train_det.log")
        try:
            time.sleep(3)
            pid = p.pid      # `pos run` execs the program: the PID Popen started
            wait_agent(pid)
            time.sleep(random.uniform(0.5, 1.5))
            r = concurrent.checkpoint_gpu(pid, images / f"big-{gib}")
            row: dict[str, Any] = {"gib": gib, "concurrent": r.to_json(),
                                   "d2h_vs_limit": (r.device.d2h_gbps or 0) / LIMIT_GBPS}
            import shutil
            shutil.rmtree(r.path, ignore_errors=True)
            time.sleep(1)
            t = [time.monotonic()]
            rcs = []
            for fn in (cudackpt.lock, cudackpt.checkpoint, cudackpt.restore, cudackpt.unlock):
                try:
                    fn(pid, 10000) if fn is cudackpt.lock else fn(pid)
                    rcs.append("ok")
                except Exception as e:     # measured and reported, not fatal
                    rcs.append(str(e))
                t.append(time.monotonic())
            row["stop_the_world"] = {"steps": rcs, "lock_s": t[1] - t[0], "checkpoint_s": t[2] - t[1],
                                     "restore_s": t[3] - t[2], "unlock_s": t[4] - t[3],
                                     "stall_s": t[4] - t[0]}
            row["stall_ratio"] = (r.held_s or 0) / row["stop_the_world"]["stall_s"]
            row["alive_after"] = p.poll() is None
            rows.append(row)
        finally:
            kill(p)
    return {"rows": rows}


def stw(out: Path, images: Path) -> dict[str, Any]:
    ref_log, log = images / "ref.log", images / "stw.log"
    argv = det_argv(ref_log, 300, 2)
    r = subprocess.run([*POS, "run", "--", *argv], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    res: dict[str, Any] = {"reference_rc": r.returncode}
    p = pos_job(det_argv(log, 300, 2), out / "stw-job.log")
    try:
        wait_lines(log)
        time.sleep(random.uniform(0, 0.5))
        d = images / "stw-img"
        res["checkpoint"] = pos_cmd("checkpoint", str(p.pid), "-D", str(d))
        p.wait(timeout=60)
        res["restore"] = pos_cmd("restore", "-D", str(d))
        if res["restore"]["rc"] == 0:
            compare_when_done(ref_log, log, res, 120)
    finally:
        kill(p)
    # after a whole-process concurrent image the job's memory is mapped back from pos's
    # descriptors, which the driver restored as CUDA_ERROR_NOT_SUPPORTED (2026-11-25, hoist8):
    # pos must refuse the stop-the-world checkpoint in one sentence, the job running on
    log2 = images / "stw2.log"
    p = pos_job(det_argv(log2, 300, 2), out / "stw-job2.log")
    try:
        wait_lines(log2)
        res["concurrent_first"] = pos_cmd("checkpoint", str(p.pid), "-D", str(images / "c"),
                                          "--concurrent", "--leave-running")
        res["after_concurrent"] = pos_cmd("checkpoint", str(p.pid), "-D", str(images / "s2"))
        res["runs_on"] = p.poll() is None
    finally:
        kill(p)
    return res


def restorefirst(out: Path, images: Path, gib: float) -> dict[str, Any]:
    """The same train_det job (--first-gib of ballast) checkpointed from outside by each engine
    (the job ended by the dump) and restored into a new process: when the restored job's first
    steps came, from `pos restore`'s start. The stop-the-world restore has every byte back
    before the job runs, so its gap between the restore's end and the first step is what the
    driver's restored context costs the job by itself."""
    res: dict[str, Any] = {"gib": gib}
    for engine, flags in (("stw", ()), ("concurrent", ("--concurrent",))):
        log = images / f"{engine}.log"
        p = pos_job(det_argv(log, 300, gib), out / f"restorefirst-{engine}.log")
        one: dict[str, Any] = {}
        try:
            wait_lines(log, 60)
            time.sleep(random.uniform(0, 0.5))
            d = images / f"{engine}-img"
            one["checkpoint"] = pos_cmd("checkpoint", str(p.pid), "-D", str(d), *flags)
            p.wait(timeout=60)
            lines = LineTimes(log)
            one["restore"] = pos_cmd("restore", "-D", str(d))
            one["first_step_s"] = lines.first(60)
            time.sleep(1)
            one["first_steps_s"] = [round(t - lines.t0, 3) for t in lines.times[:6]]
        finally:
            kill(p)
            subprocess.run(["pkill", "-9", "-f", str(log)])
        res[engine] = one
    return res


def hoistfd(out: Path, images: Path) -> dict[str, Any]:
    """Give the memory up with no pos CUDA context holding it, map it back from the bare
    descriptors, and compare a checkpoint before and after."""
    pause = images / "pause2"
    pause.touch()
    p = start([PY, "workloads/fill_job.py", "--buffers", "8", "--mib", "64",
               "--pause-file", str(pause)], log=out / "hoistfd.log")
    res: dict[str, Any] = {}
    try:
        pid = wait_ready(p)
        pause.unlink()
        time.sleep(1.0)
        pause.touch()
        time.sleep(0.3)
        before = image_values(Path(concurrent.checkpoint_gpu(pid, images / "hfd-0").path))
        with Agent(pid) as a:
            a.cut(10)
            fds = a.export().fds
            res["released"] = a.hoist().bytes
            res["remapped"] = a.remap(fds).mapped
            res["end"] = a.end().__dict__
        for fd in fds:
            os.close(fd)
        after = image_values(Path(concurrent.checkpoint_gpu(pid, images / "hfd-1").path))
        res["equal"] = before == after
        res["values"] = [before[:4], after[:4]]
        # a second cycle: the job's memory is now imported, re-exported by the agent
        again = image_values(Path(concurrent.checkpoint_gpu(pid, images / "hfd-2").path))
        res["second_cycle_equal"] = again == before
    except Exception as e:
        res["error"] = repr(e)
    finally:
        kill(p)
    return res


def det_argv(log: Path, steps: int, gib: float, sleep: float = 0.05) -> list[str]:
    return [PY, "workloads/train_det.py", str(log), "--steps", str(steps), "--sleep", str(sleep),
            "--ballast-gib", str(gib)]


def processes() -> str:
    """Every process with its state and where the kernel has it waiting: what a hang leaves."""
    return subprocess.run(["ps", "-eo", "pid,ppid,stat,wchan:28,etimes,args", "--sort=pid"],
                          capture_output=True, text=True).stdout[-6000:]


def agent_state(pid: int) -> Any:
    """The phase and gate of a `pos run` job's agent, or why it did not answer."""
    try:
        with Agent(pid, timeout=5) as a:
            return a.status()
    except Exception as e:
        return repr(e)


def pos_cmd(*args: str, env: dict[str, str] = {}, timeout: float = 240) -> dict[str, Any]:
    """Run pos; with --json its report is kept whole. Past `timeout` the processes are listed
    and pos gets SIGABRT, which makes Python print every thread's stack (faulthandler)."""
    t = time.monotonic()
    p = subprocess.Popen([*POS, *args], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONFAULTHANDLER": "1", **env})
    res: dict[str, Any] = {}
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        res["hung"] = processes()
        p.send_signal(signal.SIGABRT)
        try:
            out, err = p.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
    res.update({"rc": p.returncode, "s": time.monotonic() - t, "out": out[-1500:],
                "err": err[-6000:] if "hung" in res else err[-1500:]})
    if "--json" in args and p.returncode == 0 and out.strip():
        res["report"] = json.loads(out.strip().splitlines()[-1])
    return res


def fullexact(out: Path, images: Path, job: str, probe: bool = True) -> dict[str, Any]:
    steps = 60 if job == "gpt" else 300     # both run ~20 s: the checkpoint comes mid-run
    ref_log, log = images / "ref.log", images / "full.log"
    subprocess.run([*POS, "run", "--", *job_argv(job, ref_log, steps, 0.05)], cwd=ROOT,
                   timeout=240, capture_output=True)
    # train_det's own clock: where the restored job's first step spent its time
    clock = images / "clock.txt"
    p = pos_job(job_argv(job, log, steps, 0.05) + (["--clock", str(clock)] if job != "gpt"
                                                    else []), out / "fullexact-job.log")
    res: dict[str, Any] = {"job": job, "steps": steps}
    try:
        wait_lines(log, steps // 3)
        time.sleep(random.uniform(0, 0.7))
        d = images / "full-img"
        res["checkpoint"] = pos_cmd("checkpoint", str(p.pid), "-D", str(d), "--concurrent",
                                    "--json")
        res["steps_at_checkpoint"] = len(log.read_text().splitlines())
        if res["checkpoint"]["rc"] != 0:
            res["no_image"] = processes()
            return res
        # the image's buffers, biggest first: what the restore gate's waits were for
        res["buffers"] = [[f"0x{b.base:x}", b.size] for b in
                          sorted(gpuindex.read(d).buffers, key=lambda b: -b.size)]
        p.wait(timeout=60)
        lines = LineTimes(log)
        wall0 = time.time()
        res["restore"] = pos_cmd("restore", "-D", str(d), "--json", timeout=120)
        res["first_step_after_restore_s"] = lines.first(timeout=60)
        if res["first_step_after_restore_s"] is None:      # a restored job that never computes
            res["no_step"] = processes()
            restored = (res["restore"].get("report") or {}).get("restored_pid")
            if restored:
                res["no_step_agent"] = agent_state(int(restored))
        time.sleep(2)
        # the restored job's first steps, from the restore's start: a slow first step or a slow
        # start of all of them
        res["first_steps_after_restore_s"] = [round(t - lines.t0, 3) for t in lines.times[:8]]
        if clock.exists():     # the job's step parts around the restore, from its start
            marks = [ln.split() for ln in clock.read_text().splitlines()]
            after = [i for i, m in enumerate(marks) if float(m[2]) >= wall0]
            if after:
                res["clock_after_restore"] = [f"{m[0]} {m[1]} {float(m[2]) - wall0:+.4f}"
                                              for m in marks[max(0, after[0] - 3):after[0] + 12]]
        lines.stop = True
        compare_when_done(ref_log, log, res, 120)
        subprocess.run(["pkill", "-9", "-f", str(log)])
        try:
            if probe:
                res["fill_probe"] = fill_probe(d)
        except Exception as e:     # keep the restore's results
            res["fill_probe"] = {"error": repr(e)}
    finally:
        kill(p)
        subprocess.run(["pkill", "-9", "-f", str(log)])
    return res


def migratehost(out: Path, images: Path, job: str) -> dict[str, Any]:
    """`pos migrate PID --to 127.0.0.1:PORT --concurrent` of a `pos run` job at a moment it
    does not choose, to `pos migrate --listen` on this machine (the other host's part: the
    image received, sealed and restored in a new process): every loss against an uninterrupted
    run's; the downtime as the job saw it (its longest step gap) and the sender's report."""
    steps = 60 if job == "gpt" else 300
    ref_log, log = images / "ref.log", images / "mig.log"
    subprocess.run([*POS, "run", "--", *job_argv(job, ref_log, steps, 0.05)], cwd=ROOT,
                   timeout=240, capture_output=True)
    p = pos_job(job_argv(job, log, steps, 0.05), out / "migratehost-job.log")
    # the job's PID is free for its restore "there" once this process has reaped it
    threading.Thread(target=p.wait, daemon=True).start()
    port = 7400 + os.getpid() % 400
    rx = subprocess.Popen([*POS, "migrate", "--listen", "-D", str(images / "in"), "--address",
                           "127.0.0.1", "--port", str(port), "--json"], cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    res: dict[str, Any] = {"job": job, "steps": steps}
    try:
        wait_lines(log, steps // 3)
        time.sleep(random.uniform(0, 0.7))
        lines = LineTimes(log)
        t = time.monotonic()
        res["send"] = pos_cmd("migrate", str(p.pid), "--to", f"127.0.0.1:{port}",
                              "--concurrent", "--json", timeout=180)
        try:
            rx_out, rx_err = rx.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            res["listener_hung"] = processes()
            rx.kill()
            rx_out, rx_err = rx.communicate()
        res["listen"] = {"rc": rx.returncode, "out": rx_out[-1500:], "err": rx_err[-3000:]}
        res["send_s"] = time.monotonic() - t
        compare_when_done(ref_log, log, res, 120)
        lines.stop = True
        gaps = [b - a for a, b in zip(lines.times, lines.times[1:])]
        if gaps:
            res["downtime_s"] = round(max(gaps), 3)   # the longest gap between two steps
            res["median_step_s"] = round(statistics.median(gaps), 4)
    finally:
        if rx.poll() is None:
            rx.kill()
        kill(p)
        subprocess.run(["pkill", "-9", "-f", str(log)])
    return res


def togpu(out: Path, images: Path, gib: float) -> dict[str, Any]:
    """On a machine with two GPUs, a train_det job (--first-gib of ballast) started on GPU 0,
    moved to GPU 1 four ways, each against an uninterrupted run, bit for bit: `pos migrate
    PID --to-gpu 1` (the driver alone; the job runs on), `pos checkpoint` then `pos restore
    --to-gpu 1`, `pos checkpoint --concurrent` then `pos restore --to-gpu 1`, and the last two
    chained by `pos migrate PID --to-gpu 1 --concurrent`; where NVML sees the job afterwards,
    and the time the job stood still (its longest step gap)."""
    gpus = nvml.gpus()
    if len(gpus) < 2:
        return {"skipped": f"{len(gpus)} GPU(s) here; this part needs two"}
    ref_log = images / "ref.log"
    subprocess.run([*POS, "run", "--", *det_argv(ref_log, 300, gib)], cwd=ROOT, timeout=300,
                   capture_output=True)
    res: dict[str, Any] = {"gpus": [g.uuid for g in gpus]}
    for way in ("migrate", "stw", "concurrent", "migrate-concurrent"):
        log, d = images / f"{way}.log", images / f"{way}-img"
        p = pos_job(det_argv(log, 300, gib), out / f"togpu-{way}-job.log")
        row: dict[str, Any] = {}
        try:
            wait_lines(log, 60)
            time.sleep(random.uniform(0, 0.5))
            row["before"] = list(nvml.gpus_of([p.pid]))
            lines = LineTimes(log)
            if way == "migrate-concurrent":   # the job ends and comes back with its PID, which
                threading.Thread(target=p.wait, daemon=True).start()   # its zombie would hold
            if way.startswith("migrate"):
                row["move"] = pos_cmd("migrate", str(p.pid), "--to-gpu", "1", "--json",
                                      *(["--concurrent"] if way.endswith("concurrent") else []))
                pid = (row["move"].get("report") or {}).get("restored_pid") or p.pid
            else:
                row["checkpoint"] = pos_cmd("checkpoint", str(p.pid), "-D", str(d),
                                            *(["--concurrent"] if way == "concurrent" else []),
                                            "--json")
                p.wait(timeout=60)
                row["move"] = pos_cmd("restore", "-D", str(d), "--to-gpu", "1", "--json")
                pid = (row["move"].get("report") or {}).get("restored_pid") or p.pid
            time.sleep(1)
            row["after"] = list(nvml.gpus_of([pid]))
            compare_when_done(ref_log, log, row, 120)
            lines.stop = True
            gaps = [b - a for a, b in zip(lines.times, lines.times[1:])]
            row["stood_still_s"] = round(max(gaps), 3) if gaps else None
        finally:
            kill(p)
            subprocess.run(["pkill", "-9", "-f", str(log)])
            subprocess.run(["rm", "-rf", str(d)])
        res[way] = row
    return res


def reseat(out: Path, images: Path, gib: float) -> dict[str, Any]:
    """Memory the driver's own restore brought back: a train_det job (--first-gib of ballast)
    through two stop-the-world `--leave-running` cycles, then `pos checkpoint --concurrent`
    (on two H200s the driver would not export that memory and the agent moved it: the image's
    `reseated_bytes`, `reseat`, `leaked_closed_n`), then `pos restore` into a new process:
    losses bit for bit against an uninterrupted run."""
    ref_log, log, d = images / "ref.log", images / "reseat.log", images / "reseat-img"
    subprocess.run([*POS, "run", "--", *det_argv(ref_log, 300, gib)], cwd=ROOT, timeout=300,
                   capture_output=True)
    p = pos_job(det_argv(log, 300, gib), out / "reseat-job.log")
    res: dict[str, Any] = {"gib": gib}
    try:
        wait_lines(log, 40)
        res["stop_the_world"] = [pos_cmd("checkpoint", str(p.pid), "-D", str(images / f"stw{i}"),
                                         "--leave-running", "--json") for i in range(2)]
        subprocess.run(["rm", "-rf", str(images / "stw0"), str(images / "stw1")])
        time.sleep(random.uniform(0, 0.5))
        res["checkpoint"] = pos_cmd("checkpoint", str(p.pid), "-D", str(d), "--concurrent",
                                    "--json")
        timings = (res["checkpoint"].get("report") or {}).get("timings") or {}
        res["reseat"] = {k: timings.get(k) for k in ("reseat", "reseated_bytes",
                                                      "leaked_closed_n", "export")}
        if res["checkpoint"]["rc"] != 0:
            return res
        p.wait(timeout=60)
        res["restore"] = pos_cmd("restore", "-D", str(d), "--json", timeout=120)
        compare_when_done(ref_log, log, res, 120)
    finally:
        kill(p)
        subprocess.run(["pkill", "-9", "-f", str(log)])
    return res


def fullstall(out: Path, images: Path, jobs: list[str]) -> dict[str, Any]:
    rows = []
    for job in jobs:
        log = images / f"stall-{job}.log"
        p = pos_job(job_argv(job, log, 0, 0.01), out / "fullstall-job.log")
        row: dict[str, Any] = {"job": job}
        try:
            wait_lines(log, 10 if job == "gpt" else 20)
            row["stop_the_world"] = pos_cmd("checkpoint", str(p.pid), "-D",
                                            str(images / "stw"), "--leave-running")
            subprocess.run(["rm", "-rf", str(images / "stw")])
            time.sleep(random.uniform(0.5, 1.0))
            row["anon_mib_before"] = anon_mib(p.pid)
            for name, env in (("concurrent", {}), ("stack_kept", {"POS_HOIST_STACK": "off"})):
                time.sleep(random.uniform(0.5, 1.0))
                lines = LineTimes(log)
                time.sleep(3.0)            # steps before the checkpoint: the median
                t = time.monotonic()
                row[name] = pos_cmd("checkpoint", str(p.pid), "-D", str(images / "conc"),
                                    "--concurrent", "--leave-running", env=env)
                time.sleep(1.0)
                row[name]["job_saw"] = lines.excess(t, time.monotonic() - 1.0)
                manifest = images / "conc" / names.MANIFEST
                if manifest.exists():
                    row[name]["timings"] = json.loads(manifest.read_text())["timings"]
                subprocess.run(["rm", "-rf", str(images / "conc")])
            n = len(log.read_text().splitlines())
            time.sleep(2)
            row["alive_after"] = p.poll() is None and len(log.read_text().splitlines()) > n
        finally:
            kill(p)
        rows.append(row)
    return {"rows": rows}


def faults(out: Path, images: Path) -> dict[str, Any]:
    rows = []
    for step in ("cut", "hoist", "checkpoint", "dump", "unlock", "copy"):
        p = start([PY, "workloads/fill_job.py", "--buffers", "16", "--mib", "64"],
                  log=out / "faults.log")
        row: dict[str, Any] = {"step": step}
        try:
            pid = wait_ready(p)
            wait_agent(pid)
            time.sleep(0.5)
            before = image_values(Path(concurrent.checkpoint_gpu(pid, images / "f0").path))
            wd = images / f"wd-{step}.log"
            t = time.monotonic()
            r = subprocess.run([*POS, "checkpoint", str(pid), "-D", str(images / "fimg"),
                                "--concurrent", "--leave-running"], cwd=ROOT, capture_output=True,
                               text=True, env={**os.environ, "POS_FAULT_AT": f"{step}=KILL",
                                               "POS_WATCHDOG_LOG": str(wd)})
            row["rc"] = r.returncode
            while time.monotonic() - t < 60 and not (wd.exists() and "undo done" in wd.read_text()):
                time.sleep(0.1)
            row["watchdog"] = wd.read_text()[-600:] if wd.exists() else None
            with Agent(pid) as a:
                row["phase_after"] = a.status().phase
            time.sleep(0.3)
            after = image_values(Path(concurrent.checkpoint_gpu(pid, images / "f1").path))
            row["ok"] = (p.poll() is None and row["phase_after"] == "idle" and not torn(after)
                         and max(after) > max(before))
        except Exception as e:
            row["error"] = repr(e)
        finally:
            kill(p)
            subprocess.run(["rm", "-rf", str(images / "f0"), str(images / "f1"),
                            str(images / "fimg"), str(names.partial(images / "fimg"))])
        rows.append(row)
    return {"rows": rows, "all_ok": all(r.get("ok") for r in rows)}


def predump(out: Path, images: Path) -> dict[str, Any]:
    from pos.process import criu as criu_mod

    log = images / "pre.log"
    p = pos_job(det_argv(log, 0, 2, 0.01))
    res: dict[str, Any] = {}
    try:
        wait_lines(log)
        criu = criu_mod.find().path
        d = images / "pre"
        d.mkdir()
        t = time.monotonic()
        r = subprocess.run([criu, "pre-dump", "-t", str(p.pid), "-D", str(d), "--track-mem",
                            "-o", "pre.log", "-v4"], capture_output=True, text=True)
        res["rc"], res["s"] = r.returncode, time.monotonic() - t
        text = (d / "pre.log").read_text() if (d / "pre.log").exists() else ""
        res["errors"] = [ln for ln in text.splitlines() if "Error" in ln][-8:]
        res["frozen"] = next((ln for ln in text.splitlines() if "freez" in ln.lower()), None)
        res["alive_after"] = p.poll() is None
    finally:
        kill(p)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--images", default="/dev/shm/pos-bench")
    ap.add_argument("--only", default="overhead,consistency,big,stw,hoistfd")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--sizes", default="8,16")
    ap.add_argument("--exact-job", default="gpt", help="gpt, or GiB of train_det ballast")
    ap.add_argument("--full-jobs", default="16,gpt", help="gpt, or GiB of train_det ballast")
    ap.add_argument("--first-gib", type=float, default=2.0, help="restorefirst's ballast")
    ap.add_argument("--no-probe", action="store_true", help="fullexact without the fill probe")
    a = ap.parse_args()
    out, images = Path(a.out), Path(a.images)
    parts: dict[str, Callable[[], dict[str, Any]]] = {
        "overhead": lambda: overhead(out, a.rounds),
        "consistency": lambda: consistency(out, images, 4),
        "big": lambda: big(out, images, [float(s) for s in a.sizes.split(",")]),
        "stw": lambda: stw(out, images),
        "hoistfd": lambda: hoistfd(out, images),
        "fullexact": lambda: fullexact(out, images, a.exact_job, not a.no_probe),
        "fullstall": lambda: fullstall(out, images, a.full_jobs.split(",")),
        "migratehost": lambda: migratehost(out, images, a.exact_job),
        "togpu": lambda: togpu(out, images, a.first_gib),
        "reseat": lambda: reseat(out, images, a.first_gib),
        "faults": lambda: faults(out, images),
        "restorefirst": lambda: restorefirst(out, images, a.first_gib),
        "predump": lambda: predump(out, images),
    }
    run_parts(parts, a.only.split(","), out, images)


def run_parts(parts: dict[str, Callable[[], dict[str, Any]]], names: list[str], out: Path,
              images: Path) -> None:
    """Each named part in turn, its result (or its error) with the machine's facts in
    OUT/<part>.json and summed up on stdout; the images folder emptied after each."""
    out.mkdir(parents=True, exist_ok=True)
    images.mkdir(parents=True, exist_ok=True)
    for name in names:
        t = time.monotonic()
        try:
            res = parts[name]()
        except BaseException as e:      # one part failing must not lose the others' results
            res = {"error": repr(e)}
        res = {"machine": machine(), "seconds": time.monotonic() - t, **res}
        (out / f"{name}.json").write_text(json.dumps(res, indent=1, default=str))
        print(name, json.dumps(res, default=str)[:1500], flush=True)
        subprocess.run(["rm", "-rf", str(images)])
        images.mkdir(parents=True, exist_ok=True)


if __name__ == "__main__":
    main()
