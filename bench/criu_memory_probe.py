"""What CRIU's restore of a process's host memory costs, and whether transparent huge pages on
that memory cut it: a restored inference server spent 0.93-1.55 s of its 1.8-2.8 s first token
in CRIU's restore of its 1.3-1.4 GiB of host memory (bench/results/2026-11-28.md, serve run1),
which CRIU's restorer reads into new anonymous pages with preadv, one process on one thread.
No GPU needed; root, CRIU:

    python3 bench/criu_memory_probe.py --out DIR [--gib 1.4] [--repeat 3]

Each way is a Python process holding --gib of anonymous memory, written once, then
checkpointed with `pos checkpoint PID -D IMAGE` (stop-the-world) and restored --repeat times
with `pos restore -D IMAGE --json` (the page cache warm after the first; each restored process
killed before the next): the restore's `criu_restore` and its GB/s.
  plain     the memory as malloc leaves it (4 KiB pages where the host's THP setting is
            `madvise`, as on most distributions)
  hugepage  the same memory given MADV_HUGEPAGE before it is written: whether the restored
            memory comes back in huge pages (fewer faults as CRIU reads into it)
Also: the host's THP settings and how many of the job's pages were huge (AnonHugePages).
Writes DIR/criu-memory.json.
"""

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
THP = Path("/sys/kernel/mm/transparent_hugepage")
JOB = """import mmap, sys, time
size = int(float(sys.argv[1]) * 2**30)
m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
if sys.argv[2] == "hugepage":
    m.madvise(mmap.MADV_HUGEPAGE)
step = 4096
for at in range(0, size, step):
    m[at] = (at // step) % 251 + 1
open(sys.argv[3], "w").close()
while True:
    time.sleep(0.2)
"""


def pos(*args: str) -> dict[str, Any]:
    r = subprocess.run([sys.executable, "-m", "pos.cli", *args], cwd=ROOT, capture_output=True,
                       text=True, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"pos {args[0]} failed ({r.returncode}): {r.stderr.strip()[-400:]}")
    return json.loads(r.stdout) if "--json" in args else {}


def huge_kib(pid: int) -> int:
    """The process's anonymous memory in huge pages (smaps_rollup), KiB."""
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def way(name: str, gib: float, repeat: int, work: Path) -> dict[str, Any]:
    ready = work / f"{name}.ready"
    job = subprocess.Popen([sys.executable, "-c", JOB, str(gib), name, str(ready)],
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 120
    while not ready.exists():
        if job.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the {name} job did not start")
        time.sleep(0.05)
    row: dict[str, Any] = {"way": name, "gib": gib, "huge_kib_before": huge_kib(job.pid)}
    image = work / name
    pos("checkpoint", str(job.pid), "-D", str(image))
    job.wait()
    runs = []
    for _ in range(repeat):
        report = pos("restore", "-D", str(image), "--json")
        pid = report["restored_pid"]
        row["huge_kib_after"] = huge_kib(pid)
        os.kill(pid, signal.SIGKILL)
        while Path(f"/proc/{pid}").exists():
            time.sleep(0.01)
        t = report["timings"]
        runs.append({"criu_restore_s": round(t["criu_restore"], 3),
                     "gbps": round(gib * 2**30 / 1e9 / t["criu_restore"], 2)})
    row["runs"] = runs
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--gib", type=float, default=1.4)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    from pos.process import criu
    from pos.settings import Settings

    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    res: dict[str, Any] = {
        "command": " ".join(["bench/criu_memory_probe.py", *sys.argv[1:]]), "commit": commit,
        "criu": criu.find(Settings.from_env()).version_text,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "kernel": platform.release(),
        "cores": os.cpu_count(), "thp": {f: (THP / f).read_text().strip()
                                         for f in ("enabled", "defrag")}, "ways": []}
    with tempfile.TemporaryDirectory(prefix="pos-criu-memory-", dir="/var/tmp") as work:
        for name in ("plain", "hugepage"):
            row = way(name, a.gib, a.repeat, Path(work))
            res["ways"].append(row)
            print(json.dumps(row), flush=True)
    (a.out / "criu-memory.json").write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
