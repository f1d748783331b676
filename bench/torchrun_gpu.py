"""DDP and FSDP as users start them (issue 42): `pos run -- torchrun --standalone
--nproc-per-node N workloads/ddp_train.py ...`, checkpointed from outside at a random step with
`pos checkpoint ROOT --concurrent --leave-running --tcp-established`, the whole tree SIGKILLed,
`pos restore`d into new processes, and every rank's every loss compared (float.hex()) with an
uninterrupted run's. One row per case in OUT/multigpu.json, with the keys of
bench/results/2026-11-27-multigpu/multigpu.json plus `launcher`, `nccl_version`, `workload`.

USAGE: python3 bench/torchrun_gpu.py --out DIR [--ranks 2|8,4,2,1] [--cases A,B] [--ballast-gib 2]

Cases (--cases, default all, in this order):
  torchrun-sockets-concurrent       DDP, NCCL over sockets (bench/ddp.py NCCL_ENV): saved,
                                    killed, restored;
  torchrun-defaults-concurrent      DDP, NCCL's defaults (P2P and SHM on cuMem; NVLS off as on
                                    these hosts: NCCL_NVLS_ENABLE=0): saved, killed, restored,
                                    or refused before the job is touched (`refused`; the job
                                    then runs to its end: `job_ran_on`, `bit_exact`);
  torchrun-defaults-leave-running   the same, not killed: the job goes on after the putback in
                                    place, and must end exact; then its image is restored too
                                    (`restored_bit_exact`);
  fsdp-torchrun-defaults-concurrent PyTorch's FSDP2 (fully_shard) instead of DDP, as the second;
  stw-defaults                      NCCL's defaults, the stop-the-world engine (no agent in the
                                    cut): must be refused untouched, the job running on exact;
  llama-fsdp-torchrun-defaults-concurrent
                                    FSDP2 of a Llama2-13B-shaped model (workloads/ddp_train.py
                                    --model llama13b: 5 of its 40 layers a rank, about 10 GB
                                    of state a rank, as in the 8-rank job), saved, killed,
                                    restored;
  llama-fsdp-stw-defaults           the same job, stop-the-world, left running: its stall
                                    beside at one rank (no peers), refused at more;
  llama-fsdp-stw-sockets            the same job with NCCL over sockets (which the driver
                                    restores), stop-the-world, left running: the baseline at
                                    every rank count.

--ranks takes one count or several (8,4,2,1): each count's cases run in turn, in the order
given. Of several, every row of a case gets `one_rank_stall_s`, the stall of that case's
1-rank row of the same run, and every concurrent row `stw_stall_s`, the stall of the
stop-the-world row of its rank count (llama-fsdp-stw-sockets, else -defaults) that was not
refused.

--repeat N runs each case N times (rows and folders CASE, CASE-2, ...).
--pos-env default,NAME=VALUE,...: settings of pos to compare in one run, each case run once
with each in turn (with --repeat, the turns again): `default` as the environment has them,
several settings of one turn joined by `+` (e.g. default,POS_OWN_MEMORY_MAX_GIB=0). Each row
says its turn's (`pos_env`); a row's `one_rank_stall_s` comes from the 1-rank row of its case
and turn.
--warm: a concurrent checkpoint made and removed before the one measured (its to_cut as
warm_to_cut_s): with POS_PIN_KEEP=1 in the environment the measured one finds the ranks'
arenas kept; the kept files are removed after each case. The warm checkpoint is waited for
until its image is sealed (about 70 s for the Llama job at 4 ranks, which runs 200 steps in
about 90 s): give such a job --steps 400.

Examples:
  python3 bench/torchrun_gpu.py --out /tmp/tr                    # 2 ranks, every case (~7 min)
  python3 bench/torchrun_gpu.py --out /tmp/tr --ranks 4 --cases torchrun-defaults-concurrent
  bench/device.sh torchrun                                       # on a GPU machine ($OUT)

stall_s: the longest gap between rank 0's lines around the checkpoint less the median gap before
it (the job's own view); pos_held_s: pos's (its report's release_s). first_step_s: from `pos
restore`'s start to the first new line. Needs root, CRIU, PyTorch with CUDA, N GPUs.
"""

import argparse
import contextlib
import ctypes
import datetime
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))
import ddp  # noqa: E402  (bench/ddp.py: its job, its readers, its comparison)
from pos.concurrent import kept  # noqa: E402

CASES = ("torchrun-sockets-concurrent", "torchrun-defaults-concurrent",
         "torchrun-defaults-leave-running", "fsdp-torchrun-defaults-concurrent", "stw-defaults",
         "llama-fsdp-torchrun-defaults-concurrent", "llama-fsdp-stw-defaults",
         "llama-fsdp-stw-sockets")
# of a rank count's rows, the stop-the-world baseline: the first of these that has a stall
STW_BASELINES = ("llama-fsdp-stw-sockets", "llama-fsdp-stw-defaults")
# NCCL's defaults as the GPU hosts run them: NVLink SHARP (multicast) off, which pos refuses
DEFAULTS_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}
PR_SET_CHILD_SUBREAPER = 36


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def torchrun(python: str) -> list[str]:
    """torchrun as users type it (its script), else the module it runs."""
    found = shutil.which("torchrun") or (str(Path(python).parent / "torchrun")
                                         if (Path(python).parent / "torchrun").exists() else None)
    return [found] if found else [python, "-m", "torch.distributed.run"]


class Case:
    """One row's job: its NCCL setting, workload, engine, and whether it is killed."""

    def __init__(self, name: str, run: int = 1, pos_env: str = "default") -> None:
        self.name = name
        self.folder = name if run == 1 else f"{name}-{run}"
        self.pos_env = pos_env      # the settings of pos this run compares (--pos-env)
        words = name.split("-")
        self.nccl = "sockets" if "sockets" in words else "defaults"
        self.model = "llama13b" if words[0] == "llama" else "mlp"
        self.workload = ("llama13b-" if self.model == "llama13b" else "") + (
            "fsdp2" if "fsdp" in words else "ddp")
        self.engine = "stw" if "stw" in words else "concurrent"
        self.kill = name.endswith("concurrent")
        self.restore_after = name.endswith("leave-running")   # its image too, once it ended
        self.ref_key = f"{self.workload}-{self.nccl}"

    def env(self) -> dict[str, str]:
        return {**os.environ, **(ddp.NCCL_ENV if self.nccl == "sockets" else DEFAULTS_ENV)}

    def settings(self) -> dict[str, str]:
        """The environment of pos's commands this run sets (`pos_env`)."""
        if self.pos_env == "default":
            return {}
        return dict(one.split("=", 1) for one in self.pos_env.split("+"))

    def command(self, python: str, outdir: Path, a: argparse.Namespace, pos_run: bool
                ) -> list[str]:
        job = [*torchrun(python), "--standalone", f"--nproc-per-node={a.ranks}", str(ddp.JOB),
               str(outdir), "--steps", str(a.steps), "--sleep", str(a.sleep), "--backend",
               "nccl", "--width", str(a.width), "--ballast-gib", str(a.ballast_gib),
               "--parallel", "fsdp" if self.workload.endswith("fsdp2") else "ddp",
               "--model", self.model]
        return [sys.executable, "-m", "pos.cli", "run", "--", *job] if pos_run else job


def start(cmd: list[str], outdir: Path, env: dict[str, str]) -> subprocess.Popen:
    outdir.mkdir(parents=True)
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                            stdout=open(outdir / "job.log", "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def reference(case: Case, a: argparse.Namespace, work: Path) -> list[list[tuple[int, str]]]:
    """An uninterrupted run (under `pos run` too: the same agent, the same filter)."""
    d = work / f"ref-{case.ref_key}"
    say(f"{case.ref_key}: reference run ({a.steps} steps)")
    job = start(case.command(a.python, d, a, pos_run=True), d, case.env())
    rc = job.wait(timeout=a.steps * a.sleep + 300)
    lines = ddp.read(d)
    if rc != 0 or min(map(len, lines)) != a.steps:
        raise RuntimeError(f"{case.ref_key}: the reference run failed (exit {rc}): "
                           f"{(d / 'job.log').read_text()[-2000:]}")
    return lines


def frozen(pids: list[int]) -> bool:
    return any(Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0] in "tT"
               for p in pids if Path(f"/proc/{p}").exists())


def restore(row: dict[str, Any], img: Path, outdir: Path, root: int, a: argparse.Namespace,
            ref: list[list[tuple[int, str]]], prefix: str = "") -> None:
    """`pos restore`, the first new line's time (rank 0's, watched while the restore runs: read
    once it had returned, the first step could not come before its end), the job to its end,
    every line compared."""
    before = ddp.read(outdir)
    watch = ddp.Watch(outdir)
    t0 = time.monotonic()
    code, wall, report, err, reported = ddp.pos_timed("restore", "-D", str(img))
    row.update({f"{prefix}restore_exit": code, f"{prefix}restore_wall_s": round(wall, 3),
                f"{prefix}restore_reported_s": reported and round(reported, 3),
                f"{prefix}restore_timings": report.get("timings")})
    if code != 0:
        row[f"{prefix}restore_error"] = err
        row[f"{prefix}bit_exact"] = False
        return
    row[f"{prefix}first_step_s"] = watch.first(t0, 120)
    now = ddp.read(outdir)
    row[f"{prefix}resumed_at_step"] = min(
        (r[len(b)][0] for r, b in zip(now, before) if len(r) > len(b)), default=None)
    row[f"{prefix}job_exit"] = ddp.reap(root, a.steps * a.sleep + 300)
    cmp = ddp.compare(ref, ddp.read(outdir))
    row[f"{prefix}bit_exact"] = cmp["bit_exact"]
    row[f"{prefix}lines"] = cmp["lines"]
    row[f"{prefix}wrong"] = cmp["wrong"]


def run(case: Case, a: argparse.Namespace, work: Path, ref: list[list[tuple[int, str]]]
        ) -> dict[str, Any]:
    row: dict[str, Any] = {"case": case.name, "ranks": a.ranks, "gpus": a.ranks,
                           "launcher": "torchrun", "nccl": case.nccl, "workload": case.workload,
                           "engine": case.engine, "ballast_gib_per_rank": a.ballast_gib,
                           "steps": a.steps, "refused": None, "job_ran_on": None,
                           "untouched": None, "stall_s": None, "stw_stall_s": None,
                           "one_rank_stall_s": None, "first_step_s": None}
    outdir = work / case.folder
    job = start(case.command(a.python, outdir, a, pos_run=True), outdir, case.env())
    ddp.wait_lines(outdir, a.at, 240)
    pids = ddp.tree(job.pid)
    row["processes"] = len(pids)
    from pos.process import procs

    row["io_urings"] = {f"{p} ({procs.program(p)})": procs.io_urings(p) for p in pids}
    img = work / f"img-{case.folder}"
    if a.warm and case.engine == "concurrent":
        code, _wall, report, err = ddp.pos("checkpoint", str(job.pid), "-D", str(img),
                                           "--leave-running", "--tcp-established",
                                           "--concurrent")
        row["warm_to_cut_s"] = (report.get("timings") or {}).get("to_cut")
        shutil.rmtree(img, ignore_errors=True)
        if code != 0:
            raise RuntimeError(f"the warm checkpoint failed (exit {code}): {err}")
        done = min(map(len, ddp.read(outdir)))
        if done + 8 > a.steps:       # the measured checkpoint, and the steps around it
            raise RuntimeError(f"the job was at step {done} of {a.steps} once the warm "
                               "checkpoint was sealed: give it more --steps")
        ddp.wait_lines(outdir, done + 3, 120)
    watch = ddp.Watch(outdir)
    watch.timed(5, 240)
    time.sleep(random.uniform(0.5, 1.5))          # a moment the job does not choose
    row["checkpoint_at_step"] = min(map(len, ddp.read(outdir)))
    say(f"{case.name}: pos checkpoint {job.pid} ({len(pids)} processes, {case.engine}) at step "
        f"{row['checkpoint_at_step']}")
    t = time.monotonic()
    code, wall, report, err = ddp.pos(
        "checkpoint", str(job.pid), "-D", str(img), "--leave-running", "--tcp-established",
        *(["--concurrent"] if case.engine == "concurrent" else []))
    row.update(checkpoint_exit=code, checkpoint_wall_s=round(wall, 3))
    err = str(report.get("error") or err)      # --json puts the sentence on stdout
    if code != 0:
        row["refused"] = err.removeprefix("Error: ") if code == 2 else None
        row["error"] = None if code == 2 else err
        row["untouched"] = ddp.tree(job.pid) == pids and not frozen(pids)
        say(f"{case.name}: exit {code}: {err}")
        rc = job.wait(timeout=a.steps * a.sleep + 300)
        cmp = ddp.compare(ref, ddp.read(outdir))
        row.update(job_exit=rc, job_ran_on=rc == 0 and cmp["bit_exact"], lines=cmp["lines"],
                   bit_exact=cmp["bit_exact"] if code == 2 else False, wrong=cmp["wrong"])
        return row
    timings = report.get("timings") or {}
    ddp.wait_lines(outdir, min(row["checkpoint_at_step"] + 5, a.steps), 120)   # it runs on
    row.update(stall_s=watch.stall(t, t + wall), pos_held_s=report.get("release_s"),
               image_mib=round(report.get("size_bytes", 0) / 2**20, 1),
               frozen_s=timings.get("frozen"), criu_written_mib=timings.get("criu_written_mib"),
               criu_memdump_s=timings.get("criu_memdump"),
               driver_checkpoint_s=timings.get("checkpoint"),
               driver_restore_s=timings.get("restore"), cut_s=timings.get("cut"),
               checkpoint_timings=timings, ranks_report=report.get("ranks"))
    if not case.kill:               # on to its end after the putback in place, then the image
        rc = job.wait(timeout=a.steps * a.sleep + 300)
        cmp = ddp.compare(ref, ddp.read(outdir))
        row.update(job_exit=rc, job_ran_on=rc == 0, bit_exact=rc == 0 and cmp["bit_exact"],
                   lines=cmp["lines"], wrong=cmp["wrong"])
        say(f"{case.name}: ran on, exit {rc}, bit-exact {row['bit_exact']}")
        if case.restore_after:
            wait_gone(pids)
            say(f"{case.name}: pos restore of its image")
            restore(row, img, outdir, job.pid, a, ref, prefix="restored_")
        return row
    ddp.kill_all(pids, job)
    row["killed_at_step"] = min(map(len, ddp.read(outdir)))
    say(f"{case.name}: killed at step {row['killed_at_step']}; pos restore")
    restore(row, img, outdir, job.pid, a, ref)
    say(f"{case.name}: restored, exit {row.get('job_exit')}, bit-exact {row['bit_exact']}")
    return row


@contextlib.contextmanager
def settings(env: dict[str, str]) -> Iterator[None]:
    """pos's commands (ddp.pos: this process's environment) run with `env` set."""
    was = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in was.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def same_run(rows: list[dict[str, Any]]) -> None:
    """Each row's `one_rank_stall_s` (its case's 1-rank row) and, for the concurrent rows,
    `stw_stall_s` (the stop-the-world baseline of its rank count), from the rows of this run;
    left as they are where the run has no such row, or it has no stall."""
    one = {(r["case"], r.get("pos_env")): r["stall_s"] for r in rows
           if r.get("ranks") == 1 and r.get("stall_s") is not None}
    stw: dict[int, float] = {}
    for name in reversed(STW_BASELINES):          # the first of STW_BASELINES wins
        stw.update({r["ranks"]: r["stall_s"] for r in rows
                    if r["case"] == name and r.get("stall_s") is not None})
    for r in rows:
        if (r["case"], r.get("pos_env")) in one:
            r["one_rank_stall_s"] = one[(r["case"], r.get("pos_env"))]
        if r.get("engine") == "concurrent" and r.get("ranks") in stw:
            r["stw_stall_s"] = stw[r["ranks"]]


def wait_gone(pids: list[int], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while any(os.path.exists(f"/proc/{p}") for p in pids) and time.monotonic() < deadline:
        try:
            os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            pass
        time.sleep(0.05)


def nccl_version(python: str) -> Optional[str]:
    r = subprocess.run([python, "-c", "import torch; print('.'.join(map(str, "
                        "torch.cuda.nccl.version())))"], capture_output=True, text=True)
    return r.stdout.strip() or None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__[__doc__.index("Examples:"):])
    ap.add_argument("--out", required=True, help="folder for multigpu.json and the logs")
    ap.add_argument("--python", default=sys.executable, help="a Python with torch (CUDA)")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--ranks", default="2",
                    help="ranks (one GPU each), or several counts: 8,4,2,1")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--sleep", type=float, default=0.1, help="between steps")
    ap.add_argument("--at", type=int, default=20, help="checkpoint once every rank made this "
                    "many steps (then 0.5-1.5 s more)")
    ap.add_argument("--width", type=int, default=4096, help="the model's hidden width")
    ap.add_argument("--ballast-gib", type=float, default=2.0, help="on each rank")
    ap.add_argument("--work", default="/tmp/pos-torchrun", help="scratch folder (emptied)")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each case")
    ap.add_argument("--warm", action="store_true", help="a checkpoint before the one measured")
    ap.add_argument("--pos-env", default="default",
                    help="settings of pos to compare, in turn (see above)")
    a = ap.parse_args()
    turns = a.pos_env.split(",")
    if any(t != "default" and not all("=" in x for x in t.split("+")) for t in turns):
        ap.error(f"--pos-env {a.pos_env}: give `default` or NAME=VALUE settings joined by `+`, "
                 "turns joined by commas")
    cases = [Case(c, k, turns[(k - 1) % len(turns)]) for c in a.cases.split(",")
             for k in range(1, a.repeat * len(turns) + 1)]
    unknown = [c.name for c in cases if c.name not in CASES]
    if unknown:
        ap.error(f"unknown cases {unknown}: choose from {', '.join(CASES)}")
    try:
        counts = [int(n) for n in a.ranks.split(",")]
    except ValueError:
        ap.error(f"--ranks {a.ranks}: give a count of ranks, or counts joined by commas")
    if min(counts) < 1:
        ap.error("--ranks: every count is at least 1")
    if os.geteuid() != 0:
        sys.exit("bench/torchrun_gpu.py: run as root (CRIU)")
    ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)   # restored roots become ours
    out, work = Path(a.out), Path(a.work)
    out.mkdir(parents=True, exist_ok=True)
    subprocess.run(["rm", "-rf", str(work)], check=True)
    work.mkdir(parents=True)
    info = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
            "gpu": ddp.gpu_names(), "driver": ddp.driver(), "nccl_version": nccl_version(a.python),
            "commit": os.environ.get("POS_BENCH_COMMIT") or ddp.git("rev-parse", "--short",
                                                                    "HEAD"),
            "command": " ".join(["bench/torchrun_gpu.py", *sys.argv[1:]])}
    rows: list[dict[str, Any]] = []
    for n in counts:
        at_n = argparse.Namespace(**{**vars(a), "ranks": n})
        ddp.RANKS = n
        refs: dict[str, list[list[tuple[int, str]]]] = {}
        for case in cases:
            t = time.monotonic()
            try:
                if case.ref_key not in refs:
                    refs[case.ref_key] = reference(case, at_n, work / f"r{n}")
                with settings(case.settings()):
                    got = run(case, at_n, work / f"r{n}", refs[case.ref_key])
            except Exception as e:       # keep the other rows
                got = {"case": case.name, "ranks": n, "bit_exact": False, "error": repr(e)}
                say(f"{case.name}, {n} ranks: {e!r}")
            got["pos_env"] = case.pos_env
            for kept_file in kept.ROOT.glob("arena-*"):    # --warm with POS_PIN_KEEP=1
                kept_file.unlink()
            got.update(info, case_s=round(time.monotonic() - t, 1))
            rows.append(got)
            same_run(rows)
            (out / "multigpu.json").write_text(json.dumps(rows, indent=1) + "\n")
            print("row " + json.dumps({k: got.get(k) for k in (
                "case", "ranks", "bit_exact", "refused", "job_ran_on", "stall_s",
                "one_rank_stall_s", "stw_stall_s", "first_step_s", "restored_bit_exact")}),
                flush=True)


if __name__ == "__main__":
    main()
