"""What a restored process costs beyond its memory, on the GPU (root).

    python3 bench/restart_gpu.py --out DIR [--only ctxmem,firststep,startup] [--gib 2]

Each part writes DIR/<part>.json (device, driver, date, command, commit) and prints a summary:
  ctxmem     bench/probe_job.py ctxmem: the device memory a trained PyTorch context holds
             beyond the allocator's, and for each setting of the stack limit the driver's
             lock/checkpoint/restore/unlock from outside: its seconds and how much the
             process's anonymous memory grew (the context's saved state, which the
             whole-process engine's frozen part copies, CRIU writes and the restore copies back)
  firststep  a restored process's first steps, against the moment it was let go: train_det
             (--gib of ballast, a clock of each part of its steps) and bench/probe_job.py's
             driver loop, each under `pos run`, through the driver's cycle in place, `pos
             checkpoint` + `pos restore` (stop-the-world), and for train_det the whole-process
             concurrent engine; the restore runs in this process, its steps' wall times
             recorded; the restored process's threads sampled from /proc every 5 ms (state,
             wchan, CPU time, page faults)
  startup    how long `pos` takes to start: the CLI, the restore's imports before CRIU, and
             those of the fill (numpy, the C chunk reader), which a restore makes beside CRIU
"""

import argparse
import json
import random
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.concurrent_gpu import (POS, PY, anon_mib, det_argv, kill, pos_cmd,  # noqa: E402
                                  pos_job, run_parts)
from pos.process import cudackpt  # noqa: E402


def ctxmem(out: Path) -> dict[str, Any]:
    p = subprocess.Popen([PY, "bench/probe_job.py", "ctxmem"], cwd=ROOT, text=True,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=open(out / "ctxmem-job.log", "ab"))
    rows = []
    try:
        for line in p.stdout:
            if not line.startswith("{"):
                continue
            row = json.loads(line)
            p.stdout.readline()                       # READY
            row["anon_mib_before"] = anon_mib(p.pid)
            row["driver"] = driver_cycle(p.pid)
            row["anon_mib_checkpointed"] = row["driver"].pop("anon_mib_checkpointed")
            rows.append(row)
            print(json.dumps(row), flush=True)
            p.stdin.write("\n")
            p.stdin.flush()
    finally:
        kill(p)
    return {"rows": rows}


def driver_cycle(pid: int) -> dict[str, Any]:
    """lock, checkpoint, restore, unlock from outside: seconds each, wall times, and the
    process's anonymous memory while checkpointed."""
    res: dict[str, Any] = {}
    steps: list[tuple[str, Callable[[], None]]] = [
        ("lock", lambda: cudackpt.lock(pid, 10000)), ("checkpoint", lambda: cudackpt.checkpoint(pid)),
        ("restore", lambda: cudackpt.restore(pid)), ("unlock", lambda: cudackpt.unlock(pid))]
    for name, fn in steps:
        res[f"{name}_at"] = time.time()
        fn()
        res[f"{name}_s"] = time.time() - res[f"{name}_at"]
        if name == "checkpoint":
            res["anon_mib_checkpointed"] = anon_mib(pid)
    res["released_at"] = time.time()
    return res


class Sampler:
    """The threads of `pid` from /proc every 5 ms: state, wchan and on-CPU time of the main
    thread; on-CPU time and page faults of all of them."""

    def __init__(self, pid: int) -> None:
        self.pid, self.rows, self.stop = pid, [], False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop:
            t = time.time()
            try:
                self.rows.append([round(t, 4), *self._sample()])
            except (OSError, ValueError, IndexError):
                pass                                 # not there yet (CRIU), or gone
            time.sleep(0.005)

    def _sample(self) -> list[Any]:
        task = Path(f"/proc/{self.pid}/task")
        cpu_ns, minflt, majflt, main = 0, 0, 0, ["", "", 0]
        for d in task.iterdir():
            stat = (d / "stat").read_text()
            f = stat[stat.rindex(")") + 2:].split()
            run_ns = int((d / "schedstat").read_text().split()[0])
            cpu_ns += run_ns
            minflt += int(f[7])
            majflt += int(f[9])
            if d.name == str(self.pid):
                main = [f[0], (d / "wchan").read_text(), run_ns]
        return [*main, cpu_ns, minflt, majflt]

    def end(self) -> list[list[Any]]:
        self.stop = True
        self.thread.join()
        return self.rows


@contextmanager
def step_times() -> Iterator[list[tuple[str, float]]]:
    """The wall time at which each step of pos's engine (steps.Guard.step) began."""
    from pos.operation import steps

    marks: list[tuple[str, float]] = []
    plain = steps.Guard.step

    def step(self: Any, name: str, **changes: Any) -> None:
        marks.append((name, time.time()))
        plain(self, name, **changes)

    steps.Guard.step = step     # type: ignore[method-assign]
    try:
        yield marks
    finally:
        steps.Guard.step = plain     # type: ignore[method-assign]


def clock_lines(path: Path, since: float) -> list[list[Any]]:
    rows = []
    for line in path.read_text().splitlines():
        f = line.split()
        if float(f[-1]) >= since:
            rows.append([*f[:-1], float(f[-1])])
    return rows


def firststep_one(out: Path, images: Path, job: str, engine: str, gib: float) -> dict[str, Any]:
    clock = images / f"{job}-{engine}.clock"
    if job == "torch":
        argv = [*det_argv(images / f"{job}-{engine}.log", 0, gib, 0.01), "--clock", str(clock)]
    else:
        argv = [PY, "bench/probe_job.py", "driver", str(clock)]
    p = pos_job(argv, out / f"firststep-{job}-{engine}.log")
    res: dict[str, Any] = {}
    try:
        while not clock.exists() or len(clock.read_text().splitlines()) < 300:
            time.sleep(0.05)
        time.sleep(random.uniform(0, 0.3))
        start = time.time()
        if engine == "inplace":
            sampler = Sampler(p.pid)
            res["driver"] = driver_cycle(p.pid)
            released = res["driver"]["released_at"]
        else:
            flags = ("--concurrent",) if engine == "concurrent" else ()
            res["checkpoint"] = pos_cmd("checkpoint", str(p.pid), "-D",
                                        str(images / f"{job}-{engine}"), *flags)
            p.wait(timeout=60)
            start = time.time()
            sampler = Sampler(p.pid)
            released, res["restore"] = restore_here(images / f"{job}-{engine}", engine)
        time.sleep(4)
        samples = sampler.end()
        res["start"], res["released_at"] = start, released
        res["samples"] = samples
        rows = clock_lines(clock, start)
        res["clock_after_start"] = [[*r[:-1], round(r[-1] - released, 4)] for r in rows[:40]]
        first = next((r[-1] for r in rows if r[-1] > released), None)
        res["first_line_after_release_s"] = None if first is None else first - released
        res["summary"] = summary(samples, released)
    finally:
        kill(p)
        subprocess.run(["pkill", "-9", "-f", str(clock)])
    return res


def restore_here(directory: Path, engine: str) -> tuple[float, dict[str, Any]]:
    """The restore run in this process (pos's imports done beforehand): when the job's calls
    were let through, and the engine's steps' wall times and timings."""
    from pos import concurrent
    from pos.image.opened import open_image
    from pos.restore.tree import TreeRequest, restore_tree
    from pos.settings import Settings

    with step_times() as marks:
        t = time.time()
        if engine == "concurrent":
            r = concurrent.restore_full(open_image(directory))
            timings = r.timings
            released = dict(marks).get("fill", time.time())
        else:
            timings = restore_tree(TreeRequest(open_image(directory),
                                               Settings.from_env())).timings
            released = time.time()
    return released, {"start": t, "steps": [(n, round(w - t, 4)) for n, w in marks],
                      "timings": timings, "returned_s": time.time() - t}


def summary(samples: list[list[Any]], released: float) -> list[dict[str, Any]]:
    """Samples in 100 ms bins from 0.5 s before the release: the main thread's states and
    wchans, its CPU ms, all threads' CPU ms and page faults."""
    bins: list[dict[str, Any]] = []
    prev = None
    for row in samples:
        t, state, wchan, main_ns, cpu_ns, minflt, majflt = row
        k = int((t - released + 0.5) // 0.1)
        if k < 0:
            prev = row
            continue
        while len(bins) <= k:
            bins.append({"from_s": round(len(bins) * 0.1 - 0.5, 1), "states": "", "wchan": {},
                         "main_cpu_ms": 0.0, "cpu_ms": 0.0, "minflt": 0, "majflt": 0})
        b = bins[k]
        b["states"] += state
        b["wchan"][wchan] = b["wchan"].get(wchan, 0) + 1
        if prev is not None:
            b["main_cpu_ms"] += max(0, main_ns - prev[3]) / 1e6
            b["cpu_ms"] += max(0, cpu_ns - prev[4]) / 1e6
            b["minflt"] += max(0, minflt - prev[5])
            b["majflt"] += max(0, majflt - prev[6])
        prev = row
    return bins


def firststep(out: Path, images: Path, gib: float) -> dict[str, Any]:
    res: dict[str, Any] = {}
    for job, engines in (("torch", ("inplace", "stw", "concurrent")),
                         ("driver", ("inplace", "stw"))):
        for engine in engines:
            try:
                res[f"{job}-{engine}"] = one = firststep_one(out, images, job, engine, gib)
                print(job, engine, "first line", one["first_line_after_release_s"], flush=True)
            except Exception as e:       # the other cases still run
                res[f"{job}-{engine}"] = {"error": repr(e)}
    return res


def startup() -> dict[str, Any]:
    res: dict[str, Any] = {}
    for name, argv in (("cli_help", [*POS, "--help"]),
                       ("restore_imports", [PY, "-c", "import pos.cli, pos.engines.commands, "
                                            "pos.concurrent, pos.engines.stopworld, "
                                            "pos.process.cudackpt, pos.store.db"]),
                       ("fill_imports", [PY, "-c",
                                         "import pos.image.gpu, pos.concurrent.gpucopy"])):
        times = []
        for _ in range(3):
            t = time.monotonic()
            subprocess.run(argv, cwd=ROOT, capture_output=True)
            times.append(time.monotonic() - t)
        res[name] = times
    r = subprocess.run([PY, "-X", "importtime", *argv[1:]], cwd=ROOT, capture_output=True,
                       text=True)
    rows = [ln.split("|") for ln in r.stderr.splitlines()[1:] if ln.count("|") == 2]
    res["fill_imports_slowest"] = sorted(((int(c), m.rstrip()) for _s, c, m in rows),
                                         reverse=True)[:15]
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--images", default="/dev/shm/pos-restart")
    ap.add_argument("--only", default="ctxmem,firststep,startup")
    ap.add_argument("--gib", type=float, default=2.0)
    a = ap.parse_args()
    out, images = Path(a.out), Path(a.images)
    parts: dict[str, Callable[[], dict[str, Any]]] = {
        "ctxmem": lambda: ctxmem(out), "firststep": lambda: firststep(out, images, a.gib),
        "startup": startup}
    run_parts(parts, a.only.split(","), out, images)


if __name__ == "__main__":
    main()
