"""The main job, end to end (scripts/demo.sh): start a GPU workload, trace it with `pos trace`
as a user would, and export what was recorded; then checkpoint a running job with
`pos checkpoint` (which ends it), bring it back with `pos restore`, and show that it goes on.
On a GPU the job runs under `pos run` and is saved by the concurrent engine, after a
stop-the-world checkpoint of it with --leave-running for comparison.

Where an NVIDIA GPU and a Python with PyTorch are present, the workloads are PyTorch training
jobs on the GPU (workloads/torch_job.py traced, workloads/train_det.py checkpointed). Elsewhere
they are the fake-driver workloads of the tests (tests/fakegpu, and tests/engines/counter.py
holding fake CUDA state): real eBPF, real CRIU, a fake libcuda -- that proves the plumbing, not
GPU behaviour, and the demo says so.
"""

import argparse
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Optional

from workloads.harness import ROOT, Job, PosTrace, q

POS = [sys.executable, "-m", "pos.cli"]
PR_SET_CHILD_SUBREAPER = 36
# What the demo leaves in its folder when it succeeds: the trace, and its two exports.
KEPT = ("demo.db", "trace.jsonl", "trace.perfetto.json")
# What else it makes there (jobs' output, the fake driver's build and state, the image, logs):
# removed when it succeeds, kept for a look when it fails. Nothing else in the folder is touched.
MADE = ("traced-job.log", "job.log", "fakegpu", "fakecuda", "count", "losses", "image",
        "stw-image", "logs", "watchdog.log")


class DemoFailed(Exception):
    """A step of the demo did not do what it shows (one sentence)."""


class Started:
    """Everything the demo starts, ended and reaped when it ends, however it ends (done, a
    failed step, Ctrl-C, SIGTERM, its terminal closed). The demo is a child subreaper, so a
    job that `pos restore` brings back is its child too, and every job leads a process group
    of its own (a restored job keeps it): killing the groups and the children ends it all."""

    def __init__(self) -> None:
        self.groups: list[int] = []
        self.children: list[subprocess.Popen] = []
        ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)

    def job(self, argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
        """A job in a session of its own, stdin /dev/null, stdout and stderr appended to `log`:
        it depends in nothing on where the demo's output goes (a terminal would make it a
        shell job, the demo's own log file would change under its image)."""
        with open(log, "ab") as out:
            p = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                 start_new_session=True)
        self.groups.append(p.pid)
        self.children.append(p)
        return p

    def child(self, p: Any) -> Any:
        """Record a process (a Job, a PosTrace: anything with a Popen `p`) to end at the end."""
        self.children.append(p.p)
        return p

    def end(self) -> None:
        for p in self.children:
            if p.poll() is None:
                p.kill()
        for g in self.groups:
            try:
                os.killpg(g, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if os.waitpid(-1, os.WNOHANG) == (0, 0):
                    time.sleep(0.05)
            except ChildProcessError:    # no child left
                return


def say(text: str) -> None:
    print(f"demo: {text}", flush=True)


def torch_python() -> str | None:
    """A Python that imports torch and sees a CUDA GPU, or None."""
    if shutil.which("nvidia-smi") is None:
        return None
    for py in (sys.executable, "/usr/bin/python3", shutil.which("python3")):
        if py and subprocess.run([py, "-c", "import torch, sys; sys.exit(not torch.cuda.is_available())"],
                                 capture_output=True).returncode == 0:
            return py
    return None


def run_gpu(py: str, db: str, out: Path, started: Started) -> None:
    say(f"tracing a PyTorch training job on the GPU ({py})")
    with open(out / "traced-job.log", "ab") as log:
        job = started.child(Job([py, str(ROOT / "workloads" / "torch_job.py")], stderr=log))
    trace = started.child(PosTrace(job.pid, db))
    say(json.dumps(job.run("init")))
    say(json.dumps(job.run("train 10")))
    job.close()
    print(trace.stop().strip().splitlines()[-1], flush=True)


def run_fake(db: str, built: dict[str, Path], out: Path, started: Started) -> None:
    say("no NVIDIA GPU with PyTorch here: tracing the fake-driver workload of the tests (real "
        "eBPF probes on a fake libcuda.so.1; this proves the plumbing, not GPU behaviour)")
    with open(out / "traced-job.log", "ab") as log:
        job = started.child(Job([str(built["cuda_app"]), "fatbin", str(built["dir"])],
                                stderr=log))
    trace = started.child(PosTrace(job.pid, db))
    looked_up = 0
    for phase in ("load", "lookup", "alloc"):
        looked_up = len(job.run(phase).get("functions", {})) or looked_up
    deadline = time.monotonic() + 20   # the module is parsed in a worker: wait for its layouts
    while time.monotonic() < deadline and q(db, "select count(*) from functions where layout "
                                               "is not null")[0][0] < looked_up:
        time.sleep(0.05)
    for phase in ("launch", "free"):
        job.run(phase)
    job.close()
    print(trace.stop().strip().splitlines()[-1], flush=True)


def pos(*args: str, env: Optional[dict[str, str]] = None) -> None:
    """Run one pos command as a user would; its output is the demo's."""
    print("demo: $ pos " + " ".join(args), flush=True)
    r = subprocess.run(POS + list(args), env=env, stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        raise DemoFailed(f"`pos {' '.join(args)}` exited {r.returncode} (its error is above)")


def checkpoint_restore(argv: list[str], progress: Path, out: Path, env: dict[str, str],
                       unit: str, started: Started, concurrent: bool = False) -> None:
    """Start `argv` (it appends a line to `progress` per unit of work), checkpoint it after a
    few units, restore it, and show that it goes on from where it was saved. `concurrent`: a
    `pos run` job, first checkpointed stop-the-world with --leave-running (its stall shown),
    then saved by the concurrent engine while it runs."""
    progress.unlink(missing_ok=True)
    image = out / "image"
    job = started.job(argv, env, out / "job.log")

    def count() -> int:
        return len(progress.read_text().splitlines()) if progress.exists() else 0

    deadline = time.monotonic() + 300
    while count() < 10:
        if job.poll() is not None or time.monotonic() > deadline:
            raise DemoFailed(f"the job to checkpoint did not start (exit {job.poll()}; its "
                             f"output is in {out / 'job.log'})")
        time.sleep(0.05)
    shutil.rmtree(image, ignore_errors=True)
    if concurrent:
        say("first the stop-the-world engine (driver + CRIU), the job left running: its stall")
        pos("checkpoint", str(job.pid), "-D", str(out / "stw-image"), "--leave-running", env=env)
        shutil.rmtree(out / "stw-image", ignore_errors=True)
        say("now the concurrent engine: the job is held only for the cut and the short frozen "
            "part, its GPU memory copied by pos")
        pos("checkpoint", str(job.pid), "-D", str(image), "--concurrent", env=env)
    else:
        pos("checkpoint", str(job.pid), "-D", str(image), env=env)
    job.wait(timeout=60)
    saved = count()
    say(f"the job was saved after {saved} {unit} and has ended")
    pos("restore", "-D", str(image), env=env)
    deadline = time.monotonic() + 120
    while count() < saved + 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    say(f"the restored job (PID {job.pid}) went on: {count()} {unit} now")
    if count() < saved + 5:
        raise DemoFailed("the restored job did not go on")


def tidy(out: Path) -> None:
    """Remove what the demo made and need not keep (MADE), and say what stays where."""
    for name in MADE:
        p = out / name
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    say(f"kept in {out}: {', '.join(KEPT)} (the trace: `.venv/bin/pos analyze {out / KEPT[0]}`; "
        f"the exports); the rest is removed. When done with them: rm -r {out}")


def run(db: str, out: Path, started: Started) -> None:
    """The demo's steps (see the module docstring)."""
    say(f"its files go to {out} (POS_DEMO_DIR); what it keeps is said at the end")
    py = torch_python()
    built: dict[str, Path] = {}
    # pos's and CRIU's logs, and the checkpoint watchdog's, in the demo's folder too
    os.environ.update(POS_LOG_DIR=str(out / "logs"), POS_WATCHDOG_LOG=str(out / "watchdog.log"))
    if py:
        run_gpu(py, db, out, started)
    else:
        sys.path.insert(0, str(ROOT))
        from tests.fakegpu.build import build

        built = build(out / "fakegpu")
        # the fake driver's state beside the rest, not in its default /tmp/pos-fakecuda
        os.environ["POS_FAKECUDA_STATE_DIR"] = str(out / "fakecuda")
        run_fake(db, built, out, started)
    jsonl, perfetto = out / "trace.jsonl", out / "trace.perfetto.json"
    pos("export", db, "--format", "jsonl", "-o", str(jsonl))
    pos("export", db, "--format", "perfetto", "-o", str(perfetto))
    events = [json.loads(line) for line in jsonl.open()]
    kinds = Counter(e["kind"] for e in events)
    kernels = Counter(e["name"] or e["function"] for e in events if e["kind"] == "launch")
    say(f"{len(events):,} events: " + ", ".join(f"{k} {n:,}" for k, n in kinds.most_common()))
    for name, n in kernels.most_common(5):
        say(f"{n:8,}  {name[:100]}")
    say(f"wrote {jsonl} and {perfetto} (open the latter in ui.perfetto.dev)")
    env = dict(os.environ, POS_DB=db)
    if py:
        say("checkpoint/restore of a PyTorch training job on the GPU, started with `pos run` "
            "(4 GiB of GPU state)")
        checkpoint_restore([*POS, "run", "--", py, str(ROOT / "workloads" / "train_det.py"),
                            str(out / "losses"), "--steps", "600", "--ballast-gib", "4"],
                           out / "losses", out, env, "steps", started, concurrent=True)
    else:
        lib = str(built["libcuda"])
        say("checkpoint/restore of the tests' counter process holding fake CUDA state (real "
            "CRIU; the driver calls go to the fake libcuda: plumbing, not GPU behaviour)")
        env.update(POS_LIBCUDA=lib)
        checkpoint_restore([sys.executable, str(ROOT / "tests" / "engines" / "counter.py"),
                            str(out / "count"), "--cuda", lib], out / "count", out, env,
                           "counts", started)
    say("done; everything the demo started has ended")
    tidy(out)


def _interrupted(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--db", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    for sig in (signal.SIGTERM, signal.SIGHUP):   # end like Ctrl-C: through the cleanup
        signal.signal(sig, _interrupted)
    started = Started()
    try:
        run(args.db, Path(args.out), started)
    except (DemoFailed, RuntimeError) as e:     # RuntimeError: a workload did not start
        sys.exit(f"demo: FAILED: {e} (its files, logs included, are in {args.out})")
    except subprocess.CalledProcessError as e:  # building the fake driver
        sys.exit(f"demo: FAILED: `{' '.join(map(str, e.cmd))}` exited {e.returncode}")
    except KeyboardInterrupt:
        sys.exit(f"demo: interrupted (what it made so far is in {args.out})")
    finally:
        started.end()


if __name__ == "__main__":
    main()
