"""GPU jobs in podman containers saved while they run, restored exact, and as copies (issue 44).

A PyTorch training job in a container that has pos's agent through CDI is saved while it runs,
killed and restored; then its image is restored as several containers at once on the one GPU.

USAGE: python3 bench/containers_gpu.py --out DIR [--cases checkpoint,copies] [--copies 2]
                                      [--ballast-gib 8] [--steps 500] [--python python3]

Cases (--cases, default both, in this order):
  checkpoint  workloads/train_det.py (one loss line per step, float.hex(); a seeded model and
              --ballast-gib of seeded ballast, whose digest it writes at its end) in a container
              started with `--device pos.dev/agent=hook` (`pos cdi`) and the GPU's device nodes,
              from an image of empty folders with the host's /usr mounted read-only
              (workloads/base_image.py), `--network none`; `pos container checkpoint
              --leave-running` from outside at a random step, the container killed and
              removed, `pos container restore` of the image as a new container; every line of
              both, and the digest, against an uninterrupted run's in a container alike;
  copies      that image restored as --copies containers at once under new names (once the
              GPU's free memory holds them), each one's lines against the uninterrupted run's;
              a copy whose job fails (CUDA not starting in it) keeps its error.

One row per case in DIR/containers.json: case, gpu, driver, runtime ("podman X + runc Y + CRIU
Z"), bit_exact, copies, stall_s (the longest gap between the job's lines around the checkpoint
less the median gap before it), first_step_s (from the restore's start to the job's first new
line, by the job's own clock: the host's), commit (POS_BENCH_COMMIT), date, command, error (one
sentence, where a case failed: then no figure). DIR/raw: each container's lines, clock and
output, and pos's.

Examples:
  python3 bench/containers_gpu.py --out /tmp/c                      # both cases (~4 min)
  python3 bench/containers_gpu.py --out /tmp/c --cases checkpoint --ballast-gib 2
  bench/device.sh containers                                        # on a GPU machine ($OUT)

Needs root, an NVIDIA GPU with PyTorch, pos's agent built (`python3 -m pos.native`), and podman
through runc with a CRIU >= 4 on the PATH (an offline GPU machine: scripts/podman-setup.sh).
"""

import argparse
import ctypes
import glob
import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))
import ddp  # noqa: E402  (bench/ddp.py: its readers, its comparison, its stall)
from concurrent_gpu import machine  # noqa: E402

from pos import nvml  # noqa: E402
from pos.container import cdi, podman  # noqa: E402
from pos.errors import PosError  # noqa: E402
from workloads import base_image  # noqa: E402

CASES = ("checkpoint", "copies")
JOB = ROOT / "workloads" / "train_det.py"
# the job's files in the container's own /tmp: saved and restored with it, one set per copy
OUT_DIR = "/tmp"
LINES, CLOCK = f"{OUT_DIR}/rank-0.txt", f"{OUT_DIR}/clock.txt"   # ddp.read's name for rank 0
PREFIX = "pos-bench"
LIB_DIRS = ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64", "/usr/lib64",
            "/lib", "/usr/lib")            # where the dynamic loader looks without being told
GIB = 2**30
CONTEXT_GIB = 2.0       # a PyTorch job's device memory beyond its ballast, where none was seen
MARGIN_GIB = 1.0        # kept free beside the copies
STOPPED = "the bench was stopped (SIGINT: out of its time) {}"
# Where torch, its Python and libcuda are on this host; CUDA started (which makes the driver
# create /dev/nvidia-uvm where it is not yet).
PROBE = """import json, os, sys, torch
torch.zeros(1, device="cuda")
lib = next(ln.split()[-1] for ln in open("/proc/self/maps") if "/libcuda.so" in ln)
print(json.dumps({"python": os.path.realpath(sys.executable), "prefix": sys.base_prefix,
                  "site": os.path.dirname(os.path.dirname(torch.__file__)),
                  "libcuda": os.path.dirname(os.path.realpath(lib))}))"""


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def last_line(text: str) -> str:
    """A failure's own sentence: its output's last line that says something."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1].removeprefix("Error: ") if lines else "(no output)"


def pos_said(report: dict, err: str) -> str:
    """pos's sentence for its failure (with --json it is in the report on standard output)."""
    return last_line(str(report.get("error") or err))


def submounts(tops: set[str]) -> set[str]:
    """This host's mount points beneath `tops`. Each is mounted into the container on its own
    (and each top without what is mounted beneath it): runc names only the mounts a container
    is given as external to CRIU, which refused to dump one brought in beneath another
    (/usr/local/nvidia under /usr on the GPU host: "FS mnt ... unsupported")."""
    points = {ln.split()[4].replace("\\040", " ")
              for ln in Path("/proc/self/mountinfo").read_text().splitlines()}
    return {p for p in points for t in tops if p.startswith(t.rstrip("/") + "/")}


@dataclass(frozen=True)
class Host:
    """What a job's container takes from this host: the Python that has PyTorch, the GPU's
    device nodes, read-only mounts (the host's /usr, what PyTorch needs outside it, and what
    this host mounts beneath them), and the environment that finds them."""

    python: str
    devices: list[str]
    mounts: list[str]
    env: list[str]

    @staticmethod
    def probe(python: str) -> "Host":
        r = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            raise RuntimeError(f"{python} cannot start CUDA with PyTorch here: "
                               f"{last_line(r.stderr)}")
        found = json.loads(r.stdout.strip().splitlines()[-1])
        outside = [d for d in (found["prefix"], found["site"], found["libcuda"])
                   if d != "/usr" and not d.startswith("/usr/")]
        env = ["HOME=/tmp", "PYTHONUNBUFFERED=1"]
        if found["site"] in outside:
            env.append(f"PYTHONPATH={found['site']}")
        if found["libcuda"] not in LIB_DIRS:
            env.append(f"LD_LIBRARY_PATH={found['libcuda']}")
        devices = sorted(glob.glob("/dev/nvidia[0-9]*")) + [
            d for d in ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools",
                        "/dev/nvidia-modeset") if os.path.exists(d)]
        tops = {"/usr", str(ROOT / "workloads"), *outside}
        return Host(found["python"], devices, sorted(tops | submounts(tops)), env)

    def run(self, name: str, a: argparse.Namespace) -> None:
        """train_det in the new container NAME, with pos's agent (its CDI device)."""
        podman.call(
            "run", "-d", "--name", name, "--network", "none", "--device", cdi.QUALIFIED,
            *[x for d in self.devices for x in ("--device", d)], *base_image.ULIMITS,
            *[x for m in self.mounts for x in ("-v", f"{m}:{m}:ro,bind")],
            *[x for e in self.env for x in ("-e", e)], base_image.IMAGE,
            self.python, str(JOB), LINES, "--steps", str(a.steps), "--sleep", str(a.sleep),
            "--ballast-gib", str(a.ballast_gib), "--clock", CLOCK)


@dataclass
class Run:
    """One container's job as its files show it: its loss lines (step, float.hex()), when each
    was written (the job's clock, seconds since the epoch), its ballast digest at the end."""

    lines: list[tuple[int, str]]
    times: dict[int, float]
    digest: Optional[str]

    @staticmethod
    def of(folder: Path) -> "Run":
        clock = folder / Path(CLOCK).name
        marks = (ln.split() for ln in clock.read_text().splitlines()) if clock.exists() else ()
        log = folder / Path(LINES).name
        digests = [ln.split()[1] for ln in (log.read_text().splitlines() if log.exists() else ())
                   if ln.startswith("ballast ")]
        return Run(ddp.read(folder)[0], {int(m[0]): float(m[2]) for m in marks
                                         if len(m) == 3 and m[1] == "item"},
                   digests[-1] if digests else None)

    def first_after(self, t: float) -> Optional[float]:
        """Seconds from `t` to the first line written after it."""
        later = [w for w in self.times.values() if w >= t]
        return round(min(later) - t, 3) if later else None


class Container:
    """A bench container: its files read on this host through `podman mount` (running or
    not), its output and files kept in the raw folder when it goes."""

    def __init__(self, name: str, raw: Path) -> None:
        self.name, self.raw = name, raw
        self._folder: Optional[Path] = None

    def folder(self) -> Path:
        if self._folder is None:
            self._folder = Path(podman.call("mount", self.name).strip()) / OUT_DIR.lstrip("/")
        return self._folder

    def run(self) -> Run:
        return Run.of(self.folder())

    def running(self) -> bool:
        return podman.inspect(self.name).running

    def exit_code(self) -> int:
        return int(podman.call("container", "inspect", "--format", "{{.State.ExitCode}}",
                               self.name).strip())

    def output(self) -> str:
        return subprocess.run(["podman", "logs", self.name], capture_output=True,
                              text=True).stdout

    def wait_lines(self, n: int, timeout: float) -> Run:
        """Once the job wrote `n` lines; RuntimeError when it ends or `timeout` passes first."""
        deadline = time.monotonic() + timeout
        while len(run := self.run().lines) < n:
            if not self.running():
                raise RuntimeError(f"the job in {self.name} ended (exit {self.exit_code()}) "
                                   f"after {len(run)} steps: {last_line(self.output())}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the job in {self.name} wrote {len(run)} of {n} lines in "
                                   f"{timeout:.0f} s")
            time.sleep(0.05)
        return self.run()

    def wait_end(self, timeout: float) -> Optional[int]:
        """The job's exit status once it ended (None: still running after `timeout`)."""
        deadline = time.monotonic() + timeout
        while self.running():
            if time.monotonic() > deadline:
                return None
            time.sleep(0.2)
        return self.exit_code()

    def remove(self) -> None:
        """Its files, output and CRIU's logs (podman's dump.log, restore.log) into the raw
        folder, then the container gone."""
        if podman.exists(self.name):
            userdata = Path(podman.call("container", "inspect", "--format", "{{.StaticDir}}",
                                        self.name).strip())
            for src in (*(self.folder() / Path(f).name for f in (LINES, CLOCK)),
                        userdata / "dump.log", userdata / "restore.log"):
                if src.exists():
                    shutil.copy(src, self.raw / f"{self.name}-{src.name}")
            (self.raw / f"{self.name}.out").write_text(self.output())
            subprocess.run(["podman", "umount", self.name], capture_output=True)
        podman.remove(self.name)


@dataclass
class Copy:
    """One container restored from the image, and how its job went."""

    name: str
    restore_exit: Optional[int] = None
    restore_wall_s: Optional[float] = None
    first_step_s: Optional[float] = None
    job_exit: Optional[int] = None
    lines: int = 0
    bit_exact: bool = False
    digest_equal: Optional[bool] = None
    wrong: list = field(default_factory=list)
    missing: list = field(default_factory=list)
    error: Optional[str] = None


@dataclass
class Row:
    """One case: the keys of bench/results/<date>-containers/containers.json."""

    case: str
    gpu: str
    driver: Optional[str]
    runtime: str
    commit: str
    date: str
    command: str
    ballast_gib: float
    steps: int
    bit_exact: bool = False
    copies: int = 1
    stall_s: Optional[float] = None
    first_step_s: Optional[float] = None
    checkpoint_at_step: Optional[int] = None
    killed_at_step: Optional[int] = None
    pos_held_s: Optional[float] = None
    checkpoint_wall_s: Optional[float] = None
    image_gib: Optional[float] = None
    job_gpu_gib: Optional[float] = None
    gpu_free_gib: Optional[float] = None
    checkpoint_timings: Optional[dict] = None
    restored: list[Copy] = field(default_factory=list)
    error: Optional[str] = None
    case_s: Optional[float] = None


def runtime() -> str:
    """podman, runc and the CRIU that runc runs (the first `criu` on the PATH)."""
    def version(program: str) -> str:
        if shutil.which(program) is None:
            return "(none on the PATH)"
        r = subprocess.run([program, "--version"], capture_output=True, text=True)
        return (r.stdout.strip().splitlines() or ["?"])[0].split()[-1]
    return f"podman {version('podman')} + runc {version('runc')} + CRIU {version('criu')}"


def restore(img: Path, name: str, ref: Run, raw: Path, a: argparse.Namespace) -> Copy:
    """`pos container restore` of `img` as NAME, its job to its end, every line compared."""
    c = Copy(name)
    t = time.time()
    code, wall, report, err = ddp.pos("container", "restore", "-D", str(img), "--name", name)
    (raw / f"{name}-restore.err").write_text(err)
    c.restore_exit, c.restore_wall_s = code, round(wall, 3)
    if code != 0:
        c.error = f"pos container restore failed: {pos_said(report, err)}"
        return c
    box = Container(name, raw)
    try:
        c.job_exit = box.wait_end(a.steps * (a.sleep + 0.5) + 120)
        got = box.run()
        c.first_step_s = got.first_after(t)
        cmp = ddp.compare([ref.lines], [got.lines])
        c.lines, c.wrong, c.missing = cmp["lines"], cmp["wrong"], cmp["missing"]
        c.digest_equal = got.digest == ref.digest
        c.bit_exact = bool(cmp["bit_exact"] and c.digest_equal and c.job_exit == 0)
        if c.job_exit is None:
            c.error = f"the job in {name} had not ended after its steps' time"
        elif c.job_exit != 0:
            c.error = f"the job in {name} failed (exit {c.job_exit}): {last_line(box.output())}"
    finally:
        box.remove()
    return c


def reference(h: Host, a: argparse.Namespace, raw: Path) -> Run:
    """An uninterrupted run, in a container with the agent alike."""
    box = Container(f"{PREFIX}-ref", raw)
    say(f"reference run ({a.steps} steps)")
    h.run(box.name, a)
    try:
        code = box.wait_end(a.steps * (a.sleep + 0.5) + 180)
        got = box.run()
        if code != 0 or len(got.lines) != a.steps or got.digest is None:
            raise RuntimeError(f"the uninterrupted run failed (exit {code}, {len(got.lines)} "
                               f"lines): {last_line(box.output())}")
        return got
    finally:
        box.remove()


def checkpoint(row: Row, h: Host, a: argparse.Namespace, img: Path, ref: Run, raw: Path
               ) -> None:
    """Case checkpoint (see the module's docstring)."""
    box = Container(f"{PREFIX}-job", raw)
    h.run(box.name, a)
    try:
        box.wait_lines(a.at, 300)
        used = nvml.gpus_of([podman.inspect(box.name).pid]) if nvml.available() else {}
        row.job_gpu_gib = round(sum(used.values()) / GIB, 2) if used else None
        time.sleep(random.uniform(0.5, 1.5))          # a moment the job does not choose
        row.checkpoint_at_step = len(box.run().lines)
        say(f"checkpoint: pos container checkpoint {box.name} at step {row.checkpoint_at_step}")
        t = time.time()
        code, wall, report, err = ddp.pos("container", "checkpoint", box.name, "-D", str(img),
                                          "--leave-running")
        (raw / "checkpoint.err").write_text(err)
        row.checkpoint_wall_s = round(wall, 3)
        if code != 0:
            row.error = f"pos container checkpoint failed: {pos_said(report, err)}"
            return
        row.pos_held_s = report.get("release_s")
        row.image_gib = round(report.get("size_bytes", 0) / GIB, 2)
        row.checkpoint_timings = report.get("timings")
        ran_on = box.wait_lines(min(row.checkpoint_at_step + 5, a.steps), 120)
        row.stall_s = ddp.stall([ran_on.times[s] for s in sorted(ran_on.times)], t, t + wall)
        if box.running():      # (a job that ended while pos sealed the image: restored all
            podman.call("kill", "--signal", "KILL", box.name)   # the same, from the image)
        before = box.run()
        row.killed_at_step = len(before.lines)
        wrong_before = ddp.compare([ref.lines], [before.lines])["wrong"]
    finally:
        box.remove()
    say(f"checkpoint: killed at step {row.killed_at_step}; pos container restore")
    c = restore(img, f"{PREFIX}-restored", ref, raw, a)
    row.restored = [c]
    row.first_step_s, row.error = c.first_step_s, c.error
    row.bit_exact = c.bit_exact and not wrong_before


def copies(row: Row, a: argparse.Namespace, img: Path, ref: Run, raw: Path,
           job_gpu_gib: Optional[float]) -> None:
    """Case copies (see the module's docstring)."""
    row.copies = a.copies
    if not img.is_dir():
        row.error = "there is no image to restore: the case checkpoint did not make one"
        return
    gpus = nvml.gpus()
    free = nvml.memory_free().get(gpus[0].uuid) if gpus else None
    row.gpu_free_gib = round(free / GIB, 1) if free else None
    job = job_gpu_gib or a.ballast_gib + CONTEXT_GIB       # each copy as the job was
    if row.gpu_free_gib is not None and a.copies * (job + MARGIN_GIB) > row.gpu_free_gib:
        row.error = (f"{a.copies} copies of a job of {job:.1f} GiB do not fit in the "
                     f"{row.gpu_free_gib} GiB free on the GPU: ask for fewer (--copies)")
        return
    names = [f"{PREFIX}-copy{i + 1}" for i in range(a.copies)]
    got: dict[str, Copy] = {}
    say(f"copies: {a.copies} x pos container restore at once")
    threads = [threading.Thread(target=lambda n=n: got.update({n: restore(img, n, ref, raw, a)}),
                                daemon=True) for n in names]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    row.restored = [got[n] if n in got else Copy(n, error="its restore raised (see the log)")
                    for n in names]
    row.bit_exact = all(c.bit_exact for c in row.restored)
    firsts = [c.first_step_s for c in row.restored if c.first_step_s is not None]
    row.first_step_s = max(firsts) if len(firsts) == len(names) else None
    failed = [c for c in row.restored if c.error]
    if failed:
        row.error = f"{len(failed)} of {len(names)} copies failed; {failed[0].error}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__[__doc__.index("Examples:"):])
    ap.add_argument("--out", required=True, help="folder for containers.json and raw/")
    ap.add_argument("--python", default="python3", help="the host's Python with PyTorch (CUDA), "
                    "run in the containers from the host's /usr")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--copies", type=int, default=2, help="containers restored at once")
    ap.add_argument("--steps", type=int, default=500, help="of each job: it must still run "
                    "when pos has sealed the image")
    ap.add_argument("--sleep", type=float, default=0.05, help="between steps")
    ap.add_argument("--at", type=int, default=30, help="checkpoint once the job made this many "
                    "steps (then 0.5-1.5 s more)")
    ap.add_argument("--ballast-gib", type=float, default=8.0, help="seeded device memory")
    ap.add_argument("--images", default="/var/tmp/pos-containers",
                    help="scratch folder for the image (emptied)")
    a = ap.parse_args()
    cases = a.cases.split(",")
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        ap.error(f"unknown cases {unknown}: choose from {', '.join(CASES)}")
    if os.geteuid() != 0:
        sys.exit("bench/containers_gpu.py: run as root (rootful podman, CRIU)")
    ddp.RANKS = 1
    ctypes.CDLL(None).prctl(ddp.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    out, images = Path(a.out), Path(a.images)
    raw = out / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(images, ignore_errors=True)
    images.mkdir(parents=True)
    img = images / "img"
    facts = machine()
    base = dict(gpu=facts["gpu"], driver=facts["driver"], runtime=runtime(),
                commit=facts["commit"], date=facts["date"],
                command=" ".join(["bench/containers_gpu.py", *sys.argv[1:]]),
                ballast_gib=a.ballast_gib, steps=a.steps)
    say(f"{base['gpu']}, driver {base['driver']}, {base['runtime']}")
    # each case's row says why it has no figures until it has them
    rows = [Row(case=c, error=STOPPED.format("before this case"), **base) for c in cases]

    def write() -> None:
        (out / "containers.json").write_text(
            json.dumps([asdict(r) for r in rows], indent=1) + "\n")

    write()
    try:
        h, ref = prepare(a, images, raw)
        for row in rows:
            t = time.monotonic()
            row.error = None
            try:
                if row.case == "checkpoint":
                    checkpoint(row, h, a, img, ref, raw)
                else:
                    copies(row, a, img, ref, raw, next(
                        (r.job_gpu_gib for r in rows if r.case == "checkpoint"), None))
            except Exception as e:       # keep the other rows: the cause, never a figure
                row.error = f"{type(e).__name__}: {e}"
            except KeyboardInterrupt:    # bench/device.sh's time limit
                row.error = STOPPED.format("during this case")
                raise
            finally:
                row.case_s = round(time.monotonic() - t, 1)
                write()
            print("row " + json.dumps({k: asdict(row)[k] for k in (
                "case", "copies", "bit_exact", "stall_s", "first_step_s", "error")}), flush=True)
    except (RuntimeError, PosError, subprocess.SubprocessError) as e:   # before any case
        for row in rows:
            row.error = f"no case could run: {e}"
        sys.exit(f"bench/containers_gpu.py: {e}")
    finally:
        write()
        if shutil.which("podman"):      # no container of the bench's left behind
            for left in podman.call("ps", "-a", "--format", "{{.Names}}").split():
                if left.startswith(PREFIX):
                    podman.remove(left)


def prepare(a: argparse.Namespace, images: Path, raw: Path) -> tuple[Host, Run]:
    """pos's agent as a CDI device, the image, what the containers take from this host, and
    the uninterrupted run's lines."""
    if shutil.which("podman") is None:
        raise RuntimeError("podman is not on the PATH: install it (scripts/setup.sh), or unpack "
                           "the bundle (scripts/podman-setup.sh)")
    r = subprocess.run([sys.executable, "-m", "pos.cli", "cdi"], cwd=ROOT, capture_output=True,
                       text=True)
    if r.returncode != 0:
        raise RuntimeError(f"pos cdi failed: {last_line(r.stderr)}")
    base_image.make(images)
    h = Host.probe(a.python)
    (raw / "host.json").write_text(json.dumps(asdict(h), indent=1) + "\n")
    return h, reference(h, a, raw)


if __name__ == "__main__":
    main()
