"""Stop-the-world checkpoint/restore of a whole DDP job (2 ranks): on the CPU over gloo, on a
host without a GPU, or on two GPUs over NCCL (`--backend nccl`, one GPU per rank, NCCL over
sockets: NCCL_ENV). torch is not a dependency of pos: give the Python of an environment that has
it (a CPU build is enough for gloo).

Run from the project root, as root, after scripts/setup.sh:
    .venv/bin/python bench/ddp.py --python /tmp/torchcpu/bin/python \\
        --out bench/results/2026-11-27-multigpu/ddp-cpu.json
    python3 bench/ddp.py --python python3 --backend nccl --cases direct-nolibuv   # two GPUs
Each case runs workloads/ddp_train.py (each rank appending `STEP LOSS` with float.hex()) once
uninterrupted for the reference, then again with, at step --at, `pos checkpoint ROOT
--leave-running --tcp-established`, the whole tree SIGKILLed a few steps later and `pos
restore`; every line the ranks wrote (before, after the checkpoint, after the restore) must
equal the reference's line for that step, and the job must end with exit status 0. With
--engines stw,concurrent, each case runs once more under `pos run` (every rank with its agent)
and is checkpointed with `pos checkpoint ROOT --concurrent --leave-running --tcp-established`
(`ddp-concurrent`: every rank cut just before the same collective). Each row has the job's own
view of the stall (the longest gap between rank 0's lines around the checkpoint, less the median
gap before it) beside pos's.
  torchrun           plain torchrun: its launcher holds an io_uring (libuv, for its TCPStore),
                     so pos refuses, and the job must run on untouched, bit-exact;
  torchrun-nouring   torchrun under a seccomp filter that fails io_uring_setup (libuv then runs
                     on epoll alone);
  direct-nolibuv     no torchrun: a parent starts the ranks with USE_LIBUV=0 (rank 0 hosts a
                     TCPStore without libuv).
"""

import argparse
import ctypes
import datetime
import json
import os
import platform
import random
import signal
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "workloads" / "ddp_train.py"
CASES = ("torchrun", "torchrun-nouring", "direct-nolibuv")
PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP = 36, 38, 22
SECCOMP_MODE_FILTER, SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO = 2, 0x7FFF0000, 0x00050000
NR_IO_URING_SETUP, ENOSYS = 425, 38
AUDIT_ARCH_X86_64 = 0xC000003E
# NCCL between the ranks over TCP on this host: no CUDA IPC (P2P), no shared memory, no NVLink
# SHARP, no cuMem buffers, which the driver's checkpoint and CRIU could not save
NCCL_ENV = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_NVLS_ENABLE": "0",
            "NCCL_CUMEM_ENABLE": "0", "NCCL_IB_DISABLE": "1", "NCCL_SOCKET_IFNAME": "lo"}


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def exec_without_io_uring(argv: list[str]) -> None:
    """Exec `argv` with io_uring_setup failing (ENOSYS) for it and its children: a seccomp
    filter, what Docker's default profile does for io_uring (x86_64 only)."""
    def ins(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
        return struct.pack("HBBI", code, jt, jf, k)
    ld_w_abs, jeq_k, ret_k = 0x20, 0x15, 0x06
    prog = b"".join([
        ins(ld_w_abs, 4), ins(jeq_k, AUDIT_ARCH_X86_64, 1, 0), ins(ret_k, SECCOMP_RET_ALLOW),
        ins(ld_w_abs, 0), ins(jeq_k, NR_IO_URING_SETUP, 0, 1),
        ins(ret_k, SECCOMP_RET_ERRNO | ENOSYS), ins(ret_k, SECCOMP_RET_ALLOW)])
    buf = ctypes.create_string_buffer(prog)
    fprog = struct.pack("HxxxxxxQ", len(prog) // 8, ctypes.addressof(buf))
    libc = ctypes.CDLL(None, use_errno=True)
    if (libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0
            or libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.c_char_p(fprog)) != 0):
        sys.exit(f"seccomp: {os.strerror(ctypes.get_errno())}")
    os.execvp(argv[0], argv)


def launch_direct(python: str, outdir: str, port: int, n: int, args: list[str]) -> None:
    """The parent of the ranks without torchrun (env:// rendezvous): exit 0 when all did."""
    ranks = [subprocess.Popen([python, str(JOB), outdir, *args],
                              env={**os.environ, "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": str(port), "RANK": str(r),
                                   "LOCAL_RANK": str(r), "WORLD_SIZE": str(n), "USE_LIBUV": "0"})
             for r in range(n)]
    sys.exit(max(p.wait() for p in ranks))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


RANKS = 2      # ranks of every job (--ranks)


def command(case: str, python: str, outdir: Path, steps: int, sleep: float,
            job_args: list[str]) -> list[str]:
    args = ["--steps", str(steps), "--sleep", str(sleep), *job_args]
    port = free_port()
    torchrun = [python, str(Path(python).parent / "torchrun"), f"--nproc_per_node={RANKS}",
                f"--master_port={port}", str(JOB), str(outdir), *args]
    if case == "torchrun":
        return torchrun
    if case == "torchrun-nouring":
        return [sys.executable, __file__, "exec-without-io-uring", *torchrun]
    return [sys.executable, __file__, "launch-direct", python, str(outdir), str(port),
            str(RANKS), *args]


def read(outdir: Path) -> list[list[tuple[int, str]]]:
    out = []
    for r in range(RANKS):
        p = outdir / f"rank-{r}.txt"
        text = p.read_text() if p.exists() else ""
        fields = (ln.split() for ln in text.splitlines())   # a line being written: skipped,
        out.append([(int(f[0]), f[1]) for f in fields       # and one not of a step (a digest)
                    if len(f) == 2 and f[0].isdigit()])
    return out


def start(cmd: list[str], outdir: Path) -> subprocess.Popen:
    outdir.mkdir(parents=True)
    return subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.DEVNULL,
                            stdout=open(outdir / "job.log", "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def steps_by(outdir: Path, n: int, timeout: float, count: Callable[[], int]) -> None:
    """Until `count()` (of the job in `outdir`) reaches `n` steps; RuntimeError after
    `timeout` s."""
    deadline = time.monotonic() + timeout
    while count() < n:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{outdir}: fewer than {n} steps after {timeout:.0f} s")
        time.sleep(0.02)


def wait_lines(outdir: Path, n: int, timeout: float) -> None:
    steps_by(outdir, n, timeout, lambda: min(len(r) for r in read(outdir)))


def tree(root: int) -> list[int]:
    sys.path.insert(0, str(ROOT))
    from pos.process import procs

    return procs.tree(root)


def pos(*args: str) -> tuple[int, float, dict[str, Any], str]:
    code, wall, report, err, _ = pos_timed(*args)
    return code, wall, report, err


def pos_timed(*args: str) -> tuple[int, float, dict[str, Any], str, Optional[float]]:
    """`pos ARGS --json`: its exit code, when it exited (from its start), its report, its
    stderr, and when its report's line came (None: it printed none): what it did after."""
    t = time.monotonic()
    p = subprocess.Popen([sys.executable, "-m", "pos.cli", *args, "--json"], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[tuple[float, str]] = []
    err: list[str] = []

    def read() -> None:
        assert p.stdout is not None
        for line in p.stdout:
            lines.append((time.monotonic() - t, line))

    readers = [threading.Thread(target=read),
               threading.Thread(target=lambda: err.extend(p.stderr or ()))]
    for r in readers:
        r.start()
    stuck = threading.Timer(600, p.kill)
    stuck.start()
    os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOWAIT)     # the moment it exits
    wall = time.monotonic() - t
    stuck.cancel()
    code = p.wait()
    for r in readers:
        r.join()
    try:
        reported, last = [x for x in lines if x[1].strip()][-1]
        report = json.loads(last)
    except (ValueError, IndexError):
        reported, report = None, {}
    return code, wall, report, "".join(err).strip(), reported


def kill_all(pids: list[int], job: subprocess.Popen) -> None:
    """The whole tree SIGKILLed, children first, and every process of it gone."""
    for p in reversed(pids):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    job.wait()
    for p in pids:
        while os.path.exists(f"/proc/{p}"):      # reaped by their parents or by us
            try:
                os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                pass
            time.sleep(0.01)


def reap(pid: int, timeout: float = 120) -> Optional[int]:
    """The exit status of `pid`, a child of ours (the restored root is one: we are a subreaper)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    return None


def compare(ref: list[list[tuple[int, str]]], got: list[list[tuple[int, str]]]) -> dict:
    """Every line equal to the reference's for its step, every step there."""
    want = [dict(r) for r in ref]
    wrong = [(r, s, v) for r in range(RANKS) for s, v in got[r] if want[r].get(s) != v]
    missing = [(r, s) for r in range(RANKS) for s in want[r]
               if s not in {x for x, _ in got[r]}]
    return {"bit_exact": not wrong and not missing, "lines": sum(map(len, got)),
            "wrong": wrong[:5], "missing": missing[:5]}


class Watch:
    """When each of rank 0's lines appeared (polled every 2 ms on a thread of its own)."""

    def __init__(self, outdir: Path) -> None:
        self.outdir, self.times, self.stop = outdir, [], False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        seen = len(read(self.outdir)[0])      # lines before the watch are not timed
        while not self.stop:
            n = len(read(self.outdir)[0])
            if n > seen:
                self.times.extend([time.monotonic()] * (n - seen))
                seen = n
            time.sleep(0.002)

    def timed(self, n: int, timeout: float) -> None:
        """Wait until `n` lines have been timed: stall() needs the gaps before the command (a
        slow step, as at 4 ranks of a large model, left fewer than 3 in a random second)."""
        steps_by(self.outdir, n, timeout, lambda: len(self.times))

    def first(self, since: float, timeout: float) -> Optional[float]:
        """Seconds from `since` to the first line seen (waited for up to `timeout` from
        `since`; None: none came); the watch ends."""
        while not self.times and time.monotonic() - since < timeout:
            time.sleep(0.005)
        self.stop = True
        return round(self.times[0] - since, 3) if self.times else None

    def stall(self, start: float, end: float) -> Optional[float]:
        """stall() of the lines seen."""
        self.stop = True
        self.thread.join()
        return stall(self.times, start, end)


def stall(times: list[float], start: float, end: float) -> Optional[float]:
    """The job's own view of a checkpoint from `start` to `end`: the longest gap between its
    lines (written at `times`, in order) around it, less the median gap before it."""
    t = times
    before = [b - a for a, b in zip(t, t[1:]) if b < start]
    around = [b - a for a, b in zip(t, t[1:]) if b >= start and a <= end]
    if len(before) < 3 or not around:
        return None
    return round(max(around) - statistics.median(before), 3)


def reference(case: str, python: str, work: Path, steps: int, sleep: float,
              job_args: list[str]) -> list[list[tuple[int, str]]]:
    say(f"{case}: reference run ({steps} steps)")
    ref_dir = work / case / "ref"
    ref = start(command(case, python, ref_dir, steps, sleep, job_args), ref_dir)
    rc = ref.wait(timeout=steps * sleep + 300)
    lines = read(ref_dir)
    if rc != 0 or min(map(len, lines)) != steps:
        raise RuntimeError(f"{case}: the reference run failed (exit {rc}), see {ref_dir}")
    return lines


def run_case(case: str, python: str, work: Path, steps: int, sleep: float, at: int,
             job_args: list[str], ref: list[list[tuple[int, str]]],
             concurrent: bool = False) -> dict:
    gpus = RANKS if "nccl" in job_args else 0
    engine = "concurrent" if concurrent else "stw"
    row: dict[str, Any] = {"case": f"ddp-{engine}", "variant": case, "gpus": gpus,
                           "ranks": RANKS,
                           "steps": steps, "checkpoint_at_step": at, "refused": None}
    cr_dir = work / case / f"cr-{engine}"
    cmd = command(case, python, cr_dir, steps, sleep, job_args)
    job = start([sys.executable, "-m", "pos.cli", "run", "--", *cmd] if concurrent else cmd,
                cr_dir)
    wait_lines(cr_dir, at, 120)
    pids = tree(job.pid)
    from pos.process import procs

    row["io_urings"] = {f"{p} ({procs.program(p)})": procs.io_urings(p) for p in pids}
    row["tcp_within"] = procs.tcp_within(pids)
    row["odd_maps"] = {str(p): [ln for ln in Path(f"/proc/{p}/maps").read_text().splitlines()
                                if "anon_inode" in ln or "/dev/" in ln][:20] for p in pids}
    row["host_memory"] = {f"{p} ({procs.program(p)})": host_memory(p) for p in pids}
    img = work / case / f"img-{engine}"
    say(f"{case}: pos checkpoint {job.pid} ({len(pids)} processes, {engine}) at step "
        f"{min(map(len, read(cr_dir)))}")
    watch = Watch(cr_dir)
    watch.timed(5, 120)
    time.sleep(random.uniform(0.5, 1.5))      # a moment the job does not choose
    t = time.monotonic()
    code, wall, report, err = pos("checkpoint", str(job.pid), "-D", str(img), "--leave-running",
                                  "--tcp-established", *(["--concurrent"] if concurrent else []))
    row.update(checkpoint_exit=code, checkpoint_wall_s=round(wall, 3))
    if code != 0:
        row["refused"] = err.removeprefix("Error: ")
        row["untouched"] = (tree(job.pid) == pids and not any(
            (Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0] in "tT")
            for p in pids))
        say(f"{case}: refused (exit {code}): {err}")
        rc = job.wait(timeout=steps * sleep + 300)
        row.update(job_exit=rc, **compare(ref, read(cr_dir)))
        return row
    wait_lines(cr_dir, min(min(map(len, read(cr_dir))) + 5, steps), 60)   # it runs on
    row.update(stall_s=watch.stall(t, t + wall), pos_held_s=report.get(
                   "release_s" if concurrent else "stall_s"),
               image_mib=round(report.get("size_bytes", 0) / 2**20, 1),
               checkpoint_timings=report.get("timings"), ranks_report=report.get("ranks"))
    kill_all(pids, job)     # (a job that ran to its end while pos sealed the image: the
                            # restore brings it back from the image all the same)
    killed = read(cr_dir)
    row["killed_at_step"] = min(len(r) for r in killed)
    say(f"{case}: killed at step {row['killed_at_step']}; pos restore")
    back = Watch(cr_dir)       # while the restore runs: a line read once it has returned
    t0 = time.monotonic()      # could not come before its end
    code, wall, report, err = pos("restore", "-D", str(img))
    row.update(restore_exit=code, restore_wall_s=round(wall, 3),
               restore_timings=report.get("timings"))
    if code != 0:
        raise RuntimeError(f"{case}: pos restore failed: {err}")
    row["first_step_s"] = back.first(t0, 60)    # from `pos restore` to rank 0's first new line
    now = read(cr_dir)
    row["resumed_at_step"] = min(r[len(k)][0] for r, k in zip(now, killed) if len(r) > len(k))
    row["job_exit"] = reap(job.pid, steps * sleep + 300)
    row.update(compare(ref, read(cr_dir)))
    say(f"{case}: restored, exit {row['job_exit']}, bit-exact {row['bit_exact']}")
    return row


def host_memory(pid: int, top: int = 12) -> dict[str, Any]:
    """What a process's resident memory is made of (what CRIU will write): MiB resident by
    kind (anonymous, file-backed, shared), and the largest mappings by resident MiB."""
    kinds: dict[str, float] = {}
    maps: list[tuple[float, str]] = []
    name, rss = "", 0.0
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and not head[0].endswith(":"):
            if rss:
                maps.append((rss, name))
            name, rss = (head[5] if len(head) > 5 else "[anon]"), 0.0
        elif head[:1] == ["Rss:"]:
            rss = int(head[1]) / 1024
        elif head[:1] in (["Anonymous:"], ["Shared_Clean:"], ["Shared_Dirty:"],
                          ["Private_Clean:"], ["Private_Dirty:"]):
            kinds[head[0][:-1]] = kinds.get(head[0][:-1], 0.0) + int(head[1]) / 1024
    if rss:
        maps.append((rss, name))
    by_name: dict[str, float] = {}
    for r, n in maps:
        by_name[n] = by_name.get(n, 0.0) + r
    largest = sorted(by_name.items(), key=lambda kv: -kv[1])[:top]
    return {"mib": {k: round(v, 1) for k, v in kinds.items()},
            "largest_mib": {n: round(r, 1) for n, r in largest}}


def gpu_names() -> str:
    sys.path.insert(0, str(ROOT))
    from pos import nvml

    return ", ".join(f"{g.index}: {g.name}" for g in nvml.gpus())


def driver() -> Optional[str]:
    from pos import nvml

    return nvml.driver_version()


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "exec-without-io-uring":
        exec_without_io_uring(sys.argv[2:])
    if len(sys.argv) > 1 and sys.argv[1] == "launch-direct":
        launch_direct(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]),
                      sys.argv[6:])
    a = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a.add_argument("--python", required=True, help="a Python with torch (a CPU build will do)")
    a.add_argument("--cases", default=",".join(CASES))
    a.add_argument("--steps", type=int, default=40)
    a.add_argument("--sleep", type=float, default=0.1)
    a.add_argument("--at", type=int, default=10, help="checkpoint once every rank wrote this many")
    a.add_argument("--work", default="/tmp/pos-ddp", help="scratch folder (emptied)")
    a.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    a.add_argument("--width", type=int, default=64, help="the model's hidden width")
    a.add_argument("--ballast-gib", type=float, default=0.0, help="on each rank (nccl)")
    a.add_argument("--nccl-env", choices=("sockets", "default"),
                   default=os.environ.get("POS_DDP_NCCL_ENV", "sockets"),
                   help="NCCL over sockets (NCCL_ENV), or NCCL as it sets itself up")
    a.add_argument("--engines", default="stw", help="stw, concurrent or both (stw,concurrent)")
    a.add_argument("--ranks", type=int, default=2, help="ranks of the job (one GPU each)")
    a.add_argument("--out")
    args = a.parse_args()
    global RANKS
    RANKS = args.ranks
    if args.backend == "nccl" and args.nccl_env == "sockets":
        os.environ.update(NCCL_ENV)
    if os.geteuid() != 0:
        sys.exit("bench/ddp.py: run as root (CRIU)")
    ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)   # restored roots become ours
    work = Path(args.work)
    subprocess.run(["rm", "-rf", str(work)], check=True)
    torch_version = subprocess.run([args.python, "-c", "import torch; print(torch.__version__)"],
                                   capture_output=True, text=True).stdout.strip()
    job_args = ["--backend", args.backend, "--width", str(args.width),
                "--ballast-gib", str(args.ballast_gib)]
    rows = []
    for c in args.cases.split(","):
        ref = reference(c, args.python, work, args.steps, args.sleep, job_args)
        for engine in args.engines.split(","):
            try:
                rows.append(run_case(c, args.python, work, args.steps, args.sleep, args.at,
                                     job_args, ref, engine == "concurrent"))
            except Exception as e:       # keep the other rows
                rows.append({"case": f"ddp-{engine}", "variant": c, "error": repr(e)})
                say(f"{c} {engine}: {e!r}")
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "device": (gpu_names() if args.backend == "nccl"
                   else "development VM, no GPU (CPU DDP over gloo)"),
        "driver": driver() if args.backend == "nccl" else None,
        "nccl_env": (NCCL_ENV if args.nccl_env == "sockets" else "NCCL's defaults")
        if args.backend == "nccl" else None,
        "host": {"kernel": platform.release(), "cores": os.cpu_count()},
        "torch": torch_version,
        "criu": subprocess.run([sys.executable, "-c", "from pos.process import criu; "
                                "print(criu.find().version_text)"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip(),
        "commit": os.environ.get("POS_BENCH_COMMIT") or (
            git("rev-parse", "HEAD") + ("-dirty" if git("status", "--porcelain") else "")),
        "command": " ".join(["bench/ddp.py", *sys.argv[1:]]),
        "rows": rows,
    }
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
