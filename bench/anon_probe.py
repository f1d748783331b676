"""Whose is the host memory CRIU writes while a job is frozen: the Llama job's rank had 1.04 GB
of anonymous memory before the cut and 1.48 GB once the driver had checkpointed it, and CRIU's
frozen dump of it took 0.6-1.0 s of the job's 1.3-2.1 s stall (bench/results/2026-11-29.md).
This runs the job as bench/torchrun_gpu.py does (`pos run -- torchrun --standalone ...`, the
Llama2-13B-shaped FSDP2 job, NCCL's defaults), lets it train, and reads every process's
/proc/PID/smaps: its anonymous memory by mapping, the largest first, what is in huge pages,
and what the process's own libraries hold privately (written pages of file mappings, which CRIU
writes too). Root, a GPU, PyTorch:

    python3 bench/anon_probe.py --out DIR [--ranks 1] [--after 20]

Writes DIR/anon.json: per process, the totals and the 20 largest mappings.
"""

import argparse
import json
import os
import re
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))
import ddp  # noqa: E402
import torchrun_gpu  # noqa: E402
from pos.process import procs  # noqa: E402

HEAD = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S+) \S+ \S+ \S+\s*(.*)$")


def mappings(pid: int) -> list[dict[str, Any]]:
    """/proc/PID/smaps: each mapping's name, permissions and its kB fields, as bytes."""
    out: list[dict[str, Any]] = []
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        m = HEAD.match(line)
        if m:
            out.append({"start": m.group(1), "size": int(m.group(2), 16) - int(m.group(1), 16),
                        "perms": m.group(3), "name": m.group(4) or "[anon]"})
        elif out and line.endswith(" kB"):
            key, value = line.split(":", 1)
            out[-1][key] = int(value.split()[0]) << 10
    return out


def summary(pid: int) -> dict[str, Any]:
    maps = mappings(pid)
    anon = sorted(maps, key=lambda m: -m.get("Anonymous", 0))
    by_name: dict[str, int] = {}
    for m in maps:
        name = m["name"] if not m["name"].startswith("/") else "file: " + Path(m["name"]).name
        by_name[name] = by_name.get(name, 0) + m.get("Anonymous", 0)
    return {"pid": pid, "comm": Path(f"/proc/{pid}/comm").read_text().strip(),
            "anonymous": sum(m.get("Anonymous", 0) for m in maps),
            "anon_huge": sum(m.get("AnonHugePages", 0) for m in maps),
            "rss": sum(m.get("Rss", 0) for m in maps),
            "by_name": dict(sorted(((k, v) for k, v in by_name.items() if v),
                                   key=lambda kv: -kv[1])[:20]),
            "largest": [{k: m.get(k) for k in ("start", "size", "perms", "name", "Anonymous",
                                               "AnonHugePages", "Rss")} for m in anon[:20]]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--after", type=int, default=20, help="steps before the reading")
    a = ap.parse_args()
    ddp.RANKS = a.ranks
    job_args = argparse.Namespace(ranks=a.ranks, steps=100000, sleep=0.1, width=4096,
                                  ballast_gib=0.0)
    case = torchrun_gpu.Case("llama-fsdp-torchrun-defaults-concurrent")
    work = Path("/tmp/pos-anon")
    shutil.rmtree(work, ignore_errors=True)
    job = torchrun_gpu.start(case.command(a.python, work, job_args, pos_run=True), work,
                             case.env())
    try:
        t0 = time.monotonic()
        while min(map(len, ddp.read(work))) < a.after:
            if job.poll() is not None or time.monotonic() - t0 > 300:
                print((work / "job.log").read_text()[-3000:])
                return 1
            time.sleep(1)
        rows = [summary(p) for p in procs.tree(job.pid)]
    finally:     # every process of the tree: torchrun starts its workers in sessions of their own
        for p in reversed(procs.tree(job.pid)):
            os.kill(p, signal.SIGKILL)
        job.wait()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "anon.json").write_text(json.dumps(rows, indent=1) + "\n")
    for r in rows:
        print(r["pid"], r["comm"], "anonymous", r["anonymous"], "huge", r["anon_huge"])
        for k, v in list(r["by_name"].items())[:10]:
            print("   ", v, k)
    return 0


if __name__ == "__main__":
    sys.exit(main())
