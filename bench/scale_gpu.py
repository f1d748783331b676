"""Concurrent checkpoint/restore of jobs that fill the GPU, beside the stop-the-world engine on
the same job (issue 24's sweep). Root, on an NVIDIA GPU with PyTorch:

    python3 bench/scale_gpu.py --out DIR [--rows 0.3,0.6,0.6@0.92,0.9+shm+nostw] [--no-stw]
                               [--faults 0.9+shm]

Each row is a fraction of the GPU's memory: workloads/train_gpt.py (GPT-2 medium's shape,
AdamW, batch 8x512, deterministic) under `pos run`, filled with seeded ballast in 1 GiB pieces
to that fraction after its first step. `F@H`: another process (not under pos) holds device
memory so that H of the GPU is in use at the cut. `+ring`: at most 8 GiB of page-locked host
memory (POS_PIN_MAX_GIB=8: the copy streams to the image); `+shm`: the images in /dev/shm
(a host whose disk cannot hold them); `+pinall`: an arena as large as the job, locked
before the cut (the baseline of a ring beside what pos cannot shadow); `+behind`: only 8 GiB
of the arena locked before the cut, the rest behind it (POS_PIN_AHEAD_GIB=8); `+bigring`: an
arena as large as the job, locked before the cut only as far as the default says
(POS_PIN_RING_GIB=4096; with `+keep`, a kept arena registered mostly after the cut);
`+shadow8`: pos shadows at most 8 GiB (POS_SHADOW_MAX_BYTES: a job larger than the free device
memory, on a host whose disk holds no such job's image); `+nostw`: no stop-the-world baseline;
`+frozenall`: the copy to host memory takes every buffer while the job is frozen
(POS_FROZEN_COPY=all, the baseline of holding the shadowed ones); `+saverscriu`: the copy's
savers wait only for CRIU's dump, not the driver's calls (POS_SAVERS_HELD=criu, the default
since perf runs 17-18); `+saversfrozen`: they wait through the whole frozen part
(POS_SAVERS_HELD=frozen, the baseline); `+gpuhash`: each chunk hashed and scanned on the GPU,
the savers only writing (POS_HASH_ON=gpu); `+hashcpu`: by the savers on the CPU as they write
(POS_HASH_ON=cpu, the baseline); `+nopause`: the copy to host memory goes on while the driver
checkpoints and restores the job (POS_COPY_PAUSED=never; the default pauses it); `+keep`: the arena
kept for the next checkpoint (POS_PIN_KEEP=1), a first concurrent checkpoint of the job made and
removed before the one measured, which finds its arena's memory there (`warm` in the raw run; the
kept files removed after the row); `+again`: the same first checkpoint without keeping the arena, so
that the one measured is a job's second, as a schedule makes them (the job then holds a descriptor
of each buffer, which its export copies); `+service`: the restore through a `pos restore-service`
started for it once the job was killed (its log DIR/<row>-service.log), which answers `pos
restore` once the job runs and fills the rest of its memory meanwhile; `+expand`: the job started
with PyTorch's expandable segments (all of its memory its own cuMem memory); `+late`: the host
memory that such memory goes into, where the GPU has no room, faulted in while the job is held
(POS_OWN_HOST_AHEAD=0, the baseline of faulting it in before the cut). For each row:
  1. stop-the-world first (`pos checkpoint PID -D DIR --leave-running`: after a concurrent
     image the job's memory is pos's descriptors, which the driver's engine refuses), its
     stall as the job saw it; the image removed;
  2. at a random moment, `pos checkpoint PID -D DIR --concurrent --leave-running --json`, from
     outside: the stall as the job saw it (its longest step gap minus its median step), the
     device memory free at the cut, pinned memory (peak, time to pin), the time until the image
     was sealed;
  3. the job SIGKILLed a few steps later and `pos restore -D DIR` into a new process: the time
     to its next step, then every loss line of the log (the killed process's and the restored
     one's, which recomputes the steps after the cut) equal per step, the first ones equal to
     an uninterrupted run's (no ballast: the loss does not depend on it), and the ballast's
     digest the same throughout.
Writes DIR/scale.json (a list of rows with the issue's keys, and the raw runs under `runs`),
DIR/<row>-job.err (the jobs' standard error).

--faults SPEC: one job of that row, and pos SIGKILLed at each step of a whole-process
concurrent checkpoint in turn (POS_FAULT_AT): after each, the job must run on with its agent
idle, nothing of pos left running, and at the end its ballast digest unchanged and its losses
those of an uninterrupted run. Writes DIR/faults.json.
"""

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from concurrent_gpu import (POS, PY, ROOT, LineTimes, agent_state, kill,  # noqa: E402
                            machine, pos_cmd, processes)
from serve_gpu import Service, wait_ended  # noqa: E402

from pos.concurrent import kept  # noqa: E402
from pos.image import names  # noqa: E402

GIB = 2**30
REF_STEPS = 30


def job_argv(log: Path, fill_to: float) -> list[str]:
    return [PY, "workloads/train_gpt.py", str(log), "--steps", "0", "--ctx", "512",
            "--fill-to", f"{fill_to:.2f}", "--digest-every", "10"]


def lines_of(log: Path) -> list[list[str]]:
    return [ln.split() for ln in log.read_text().splitlines() if ln.strip()] if log.exists() else []


def steps_in(log: Path) -> int:
    return sum(1 for ln in lines_of(log) if ln[0].isdigit())


def wait_steps(log: Path, n: int, p: Optional[subprocess.Popen] = None,
               timeout: float = 600) -> None:
    t = time.monotonic()
    while steps_in(log) < n:
        if p is not None and p.poll() is not None:
            raise RuntimeError(f"the job ended ({p.returncode}) before step {n}")
        if time.monotonic() - t > timeout:
            raise RuntimeError(f"no step {n} within {timeout:.0f} s")
        time.sleep(0.1)


def exact(log: Path, ref: dict[int, str]) -> dict[str, Any]:
    """Every step's loss lines equal (the killed process's and the restored one's), those of the
    uninterrupted run equal, and one ballast digest throughout (a job too small for ballast has
    none)."""
    losses: dict[int, set[str]] = {}
    digests: set[str] = set()
    for ln in lines_of(log):
        if ln[0] == "ballast":
            digests.add(ln[2])
        else:
            losses.setdefault(int(ln[0]), set()).add(ln[1])
    repeated = sum(1 for v in losses.values() if len(v) == 1) if losses else 0
    differ = sorted(s for s, v in losses.items() if len(v) > 1 or (s in ref and ref[s] not in v))
    return {"steps": max(losses, default=0), "digests": sorted(digests),
            "differ": differ[:10], "steps_checked": len(losses), "equal_steps": repeated,
            "bit_exact": bool(losses) and not differ and len(digests) <= 1}   # none: no ballast


def gpu_used_gib() -> float:
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                          "-i", "0"], capture_output=True, text=True).stdout.split()
    return float(out[0]) / 1024 if out else -1.0


def hog(gib: float, log: Path) -> subprocess.Popen:
    """A process outside pos holding `gib` GiB of device memory."""
    code = ("import sys,time,torch;x=torch.empty(int(float(sys.argv[1])*2**30),dtype=torch.uint8,"
            "device='cuda');torch.cuda.synchronize();print('READY',flush=True);time.sleep(3600)")
    p = subprocess.Popen([PY, "-c", code, f"{gib:.2f}"], stdout=subprocess.PIPE,
                         stderr=open(log, "ab"), text=True, start_new_session=True)
    if not (p.stdout and p.stdout.readline().startswith("READY")):
        raise RuntimeError(f"the hog of {gib:.1f} GiB did not start")
    return p


def disk_gbps(where: Path, gib: int = 4) -> float:
    """The disk's own write bandwidth where the images go: `gib` GiB written direct."""
    f = where / "dd.bin"
    t = time.monotonic()
    subprocess.run(["dd", "if=/dev/zero", f"of={f}", "bs=64M", f"count={gib * 16}",
                    "oflag=direct", "status=none"], check=True)
    s = time.monotonic() - t
    f.unlink()
    return gib * GIB / s / 1e9


class Spec:
    """One row: FRACTION[@HELD][+ring][+shm][+pinall][+behind][+bigring][+shadow8][+nostw]
    [+frozenall][+saverscriu][+saversfrozen][+gpuhash][+hashcpu][+nopause][+keep][+again]
    [+service][+expand][+late] (see the module's docstring)."""

    def __init__(self, text: str, images: Path, stw: bool) -> None:
        head, *flags = text.split("+")
        frac, _, held = head.partition("@")
        self.text, self.fraction = text, float(frac)
        self.held = float(held) if held else None
        self.images = Path("/dev/shm/pos-scale") if "shm" in flags else images
        self.stw = stw and "nostw" not in flags
        self.keep = "keep" in flags
        self.warm = self.keep or "again" in flags    # a first checkpoint before the one measured
        self.service = "service" in flags
        self.env = {**({"POS_PIN_MAX_GIB": "8"} if "ring" in flags else {}),
                    **({"POS_PIN_AHEAD_GIB": "all", "POS_PIN_RING_GIB": "4096"}
                       if "pinall" in flags else {}),
                    **({"POS_PIN_AHEAD_GIB": "8"} if "behind" in flags else {}),
                    **({"POS_PIN_RING_GIB": "4096"} if "bigring" in flags else {}),
                    **({"POS_SHADOW_MAX_BYTES": str(8 * GIB)} if "shadow8" in flags else {}),
                    **({"POS_FROZEN_COPY": "all"} if "frozenall" in flags else {}),
                    **({"POS_SAVERS_HELD": "criu"} if "saverscriu" in flags else {}),
                    **({"POS_SAVERS_HELD": "frozen"} if "saversfrozen" in flags else {}),
                    **({"POS_HASH_ON": "gpu"} if "gpuhash" in flags else {}),
                    **({"POS_HASH_ON": "cpu"} if "hashcpu" in flags else {}),
                    **({"POS_COPY_PAUSED": "never"} if "nopause" in flags else {}),
                    **({"POS_PIN_KEEP": "1"} if self.keep else {}),
                    **({"POS_OWN_HOST_AHEAD": "0"} if "late" in flags else {}),
                    "POS_KEEP_RESTORE_LOG": "1"}
        self.job_env = ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
                        if "expand" in flags else {})
        self.name = text.replace("@", "-at-").replace("+", "-")


def start_job(spec: Spec, total_gib: float, out: Path) -> tuple[subprocess.Popen, Path]:
    spec.images.mkdir(parents=True, exist_ok=True)
    log = spec.images / f"{spec.name}.log"
    log.unlink(missing_ok=True)          # an earlier job's steps are not this one's
    p = subprocess.Popen([*POS, "run", "--", *job_argv(log, spec.fraction * total_gib)],
                         cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=open(out / f"{spec.name}-job.err", "ab"), start_new_session=True,
                         env={**os.environ, **spec.job_env})
    return p, log


def anon_top(pid: int, n: int = 8) -> list[list[Any]]:
    """The process's biggest anonymous mappings (MiB, start, what): what CRIU's dump writes."""
    maps, cur = [], None
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split()
        if "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
            cur = [0.0, head[0].split("-")[0], head[5] if len(head) > 5 else "[anon]"]
            maps.append(cur)
        elif head[0] == "Anonymous:" and cur is not None:
            cur[0] = round(int(head[1]) / 1024, 1)
    return sorted(maps, key=lambda m: -m[0])[:n]


def one_row(spec: Spec, total_gib: float, out: Path, ref: dict[int, str]) -> dict[str, Any]:
    images = spec.images
    run: dict[str, Any] = {"spec": spec.text}
    p, log = start_job(spec, total_gib, out)
    other: Optional[subprocess.Popen] = None
    service: Optional[Service] = None
    try:
        wait_steps(log, 12, p)
        run["gpu_used_gib"] = gpu_used_gib()
        run["anon_top_mib"] = anon_top(p.pid)
        if spec.stw:
            lines = LineTimes(log)
            time.sleep(3)
            t = time.monotonic()
            run["stw"] = pos_cmd("checkpoint", str(p.pid), "-D", str(images / "stw"),
                                 "--leave-running", "--json", timeout=1200)
            time.sleep(2)
            run["stw"]["job_saw"] = lines.excess(t, time.monotonic() - 2)
            shutil.rmtree(images / "stw", ignore_errors=True)
        if spec.held:
            want = spec.held * total_gib - gpu_used_gib() - 0.6
            other = hog(want, out / f"{spec.name}-hog.err")
            run["hog_gib"] = round(want, 2)
        if spec.warm:         # the checkpoint before (with +keep, it leaves its arena kept)
            run["warm"] = pos_cmd("checkpoint", str(p.pid), "-D", str(images / "warm"),
                                  "--concurrent", "--leave-running", "--json", timeout=1200,
                                  env=spec.env)
            shutil.rmtree(images / "warm", ignore_errors=True)
            wait_steps(log, steps_in(log) + 3, p)
        time.sleep(random.uniform(0, 1.0))
        lines = LineTimes(log)
        time.sleep(3)
        t = time.monotonic()
        img = images / "img"
        run["concurrent"] = pos_cmd("checkpoint", str(p.pid), "-D", str(img), "--concurrent",
                                    "--leave-running", "--json", timeout=1200, env=spec.env)
        end = time.monotonic()
        if run["concurrent"]["rc"] != 0:
            run["failed"] = {"ps": processes(), "free": subprocess.run(
                ["free", "-g"], capture_output=True, text=True).stdout,
                "dmesg": subprocess.run(["dmesg"], capture_output=True, text=True).stdout[-3000:],
                "job_alive": p.poll() is None}
            time.sleep(2)
            run["job_saw"] = lines.excess(t, end)
            return run
        shutil.copy(img / names.DUMP_LOG, out / f"{spec.name}-{names.DUMP_LOG}")
        shutil.copy(img / names.INDEX, out / f"{spec.name}-{names.INDEX}")  # the gate's `on`s
        at_kill = steps_in(log) + 8
        wait_steps(log, at_kill, p)
        run["job_saw"] = lines.excess(t, end)
        kill(p)
        run["steps_at_kill"] = steps_in(log)
        env = spec.env
        if spec.service:      # started now: the killed job's device memory is free for its contexts
            sock = images / "restore.sock"
            service = Service(sock, out / f"{spec.name}-service.log", spec.env)
            env = {**spec.env, "POS_RESTORE_SOCKET": str(sock)}
        lines = LineTimes(log)
        began = time.monotonic()
        run["restore"] = pos_cmd("restore", "-D", str(img), "--json", timeout=600, env=env)
        # where pos restore returned with the job's memory still coming back: when the
        # process that fills it ended, from the restore's start (the next case waits for it)
        filler = (run["restore"].get("report") or {}).get("filler_pid")
        watch = None
        if filler is not None and not spec.service:
            def ended() -> None:
                wait_ended(filler)
                run["filler_ended_s"] = time.monotonic() - began
            watch = threading.Thread(target=ended, daemon=True)
            watch.start()
        run["first_step_s"] = lines.first(timeout=120)
        if run["restore"]["rc"] == 0 and run["first_step_s"] is not None:
            wait_steps(log, run["steps_at_kill"] + 12, timeout=300)
        if watch is not None:
            watch.join()
        lines.stop = True
        run["exact"] = exact(log, ref)
        return run
    except Exception as e:
        run["error"] = repr(e)
        return run
    finally:
        if service is not None:      # its fill finished first
            service.stop()
        for q in (p, other):
            if q is not None:
                kill(q)
        subprocess.run(["pkill", "-9", "-f", str(log)])
        shutil.rmtree(images / "img", ignore_errors=True)
        shutil.rmtree(names.partial(images / "img"), ignore_errors=True)
        if spec.keep:
            for f in kept.ROOT.glob("arena-*"):
                f.unlink()


FAULT_STEPS = ("cut", "hoist", "lock", "checkpoint", "dump", "restore", "unlock", "copy", "seal")


def faults(spec: Spec, total_gib: float, out: Path, ref: dict[int, str]) -> dict[str, Any]:
    """pos SIGKILLed at each step of a whole-process concurrent checkpoint of one job."""
    p, log = start_job(spec, total_gib, out)
    rows: list[dict[str, Any]] = []
    res: dict[str, Any] = {"spec": spec.text, "rows": rows}
    try:
        wait_steps(log, 12, p)
        for step in FAULT_STEPS:
            wd = out / f"wd-{step}.log"
            before = steps_in(log)
            r = pos_cmd("checkpoint", str(p.pid), "-D", str(spec.images / "fimg"),
                        "--concurrent", "--leave-running", timeout=600,
                        env={**spec.env, "POS_FAULT_AT": f"{step}=KILL",
                             "POS_WATCHDOG_LOG": str(wd)})
            t = time.monotonic()
            while time.monotonic() - t < 120 and not (wd.exists() and "undo done" in
                                                        wd.read_text()):
                time.sleep(0.2)
            time.sleep(1)
            row: dict[str, Any] = {"step": step, "rc": r["rc"],
                                   "watchdog": wd.read_text()[-800:] if wd.exists() else None}
            try:
                wait_steps(log, steps_in(log) + 3, p, timeout=60)
                row["runs_on"] = True
            except RuntimeError as e:
                row["runs_on"] = False
                row["why"] = str(e)
            row["agent"] = repr(agent_state(p.pid))
            row["left_running"] = subprocess.run(
                ["pgrep", "-af", "pos.operation.watchdog|pos.cli checkpoint|criu"],
                capture_output=True, text=True).stdout.strip()
            row["ok"] = bool(row["runs_on"] and "phase='idle'" in row["agent"]
                             and not row["left_running"] and steps_in(log) > before)
            rows.append(row)
            print("fault", json.dumps(row)[:600], flush=True)
            shutil.rmtree(spec.images / "fimg", ignore_errors=True)
            shutil.rmtree(names.partial(spec.images / "fimg"), ignore_errors=True)
        wait_steps(log, steps_in(log) + 12, p)
        res["exact"] = exact(log, ref)
        res["all_ok"] = all(r["ok"] for r in rows) and res["exact"]["bit_exact"]
    except Exception as e:
        res["error"] = repr(e)
    finally:
        kill(p)
        subprocess.run(["pkill", "-9", "-f", str(log)])
    return res


def stall(saw: dict[str, Any]) -> Optional[float]:
    """The stall as the job saw it (LineTimes.excess): its longest step less its median one."""
    return round(saw["worst_step_s"] - saw["median_step_s"], 3) if "worst_step_s" in saw \
        else None


def row_of(run: dict[str, Any], gpu: str, total_gib: float, facts: dict[str, Any]
           ) -> dict[str, Any]:
    """The issue's keys, from one raw run (None where that step did not happen)."""
    rep = (run.get("concurrent") or {}).get("report") or {}
    tim = rep.get("timings") or {}
    saw = run.get("job_saw") or {}
    stw_saw = (run.get("stw") or {}).get("job_saw") or {}
    job_gib = rep.get("bytes", 0) / GIB if rep else None

    return {"gpu": gpu, "gpu_mem_gib": round(total_gib, 1), "spec": run["spec"],
            "job_gib": round(job_gib, 2) if job_gib else None,
            "fraction": round(job_gib / total_gib, 3) if job_gib else None,
            "free_gib_at_cut": round(tim["free_at_cut_bytes"] / GIB, 2)
            if "free_at_cut_bytes" in tim else None,
            "bit_exact": (run.get("exact") or {}).get("bit_exact", False),
            "stall_s": stall(saw), "stw_stall_s": stall(stw_saw),
            "first_step_s": round(run["first_step_s"], 3) if run.get("first_step_s") else None,
            "pinned_peak_gib": round(tim["pinned_peak_bytes"] / GIB, 2)
            if "pinned_peak_bytes" in tim else None,
            "pin_s": round(tim["pin"], 3) if "pin" in tim else None,
            "sealed_s": round(tim["sealed_s"], 2) if "sealed_s" in tim else None,
            "disk_write_gbps": facts["disk_write_gbps"],
            "error": run.get("error") or (run.get("concurrent") or {}).get("err", "")[-400:]
            if not (run.get("exact") or {}).get("bit_exact") else None,
            "date": facts["date"], "driver": facts["driver"], "commit": facts["commit"]}


def gpu_total_gib() -> float:
    """GPU 0's memory in GiB, as nvidia-smi tells it."""
    out = subprocess.run(["nvidia-smi", "-i", "0", "--query-gpu=memory.total",
                          "--format=csv,noheader,nounits"], capture_output=True, text=True)
    return float(out.stdout.strip()) / 1024 if out.returncode == 0 else 0.0


def setting(out: Path, images: Path) -> tuple[float, dict[str, Any], dict[int, str]]:
    """The folders made; the GPU's memory in GiB, the machine's facts (the disk's write
    bandwidth among them), and an uninterrupted run's first losses (no ballast)."""
    out.mkdir(parents=True, exist_ok=True)
    images.mkdir(parents=True, exist_ok=True)
    total = gpu_total_gib()
    facts = {**machine(), "disk_write_gbps": round(disk_gbps(images), 2),
             "disk": shutil.disk_usage(images)._asdict(),
             "ram_gib": os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / GIB}
    print("machine", json.dumps(facts), flush=True)
    ref_log = images / "ref.log"
    subprocess.run([*POS, "run", "--", PY, "workloads/train_gpt.py", str(ref_log), "--steps",
                    str(REF_STEPS), "--ctx", "512"], cwd=ROOT, timeout=600, capture_output=True)
    return total, facts, {int(ln[0]): ln[1] for ln in lines_of(ref_log)}


def runs_of(specs: str, images: Path, stw: bool, total_gib: float, out: Path,
            ref: dict[int, str]) -> Iterator[dict[str, Any]]:
    """one_row of each spec of `specs` (comma-separated), with the seconds it took."""
    for spec in filter(None, specs.split(",")):
        t = time.monotonic()
        run = one_row(Spec(spec, images, stw), total_gib, out, ref)
        run["seconds"] = round(time.monotonic() - t, 1)
        yield run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--images", default="/var/tmp/pos-scale")
    ap.add_argument("--rows", default="0.3,0.6,0.6@0.92,0.9")
    ap.add_argument("--no-stw", action="store_true")
    ap.add_argument("--faults", help="a row's spec: pos killed at each step of its checkpoint")
    a = ap.parse_args()
    out, images = Path(a.out), Path(a.images)
    total, facts, ref = setting(out, images)
    rows, runs = [], []
    if a.faults:
        res = {"machine": facts, **faults(Spec(a.faults, images, False), total, out, ref)}
        (out / "faults.json").write_text(json.dumps(res, indent=1, default=str))
        print("faults", res.get("all_ok"), res.get("exact"), res.get("error"), flush=True)
    for run in runs_of(a.rows, images, not a.no_stw, total, out, ref):
        runs.append(run)
        rows.append(row_of(run, facts["gpu"], total, facts))
        print("row", json.dumps(rows[-1]), flush=True)
        (out / "scale.json").write_text(json.dumps({"machine": facts, "rows": rows,
                                                    "runs": runs}, indent=1, default=str))


if __name__ == "__main__":
    main()
