"""What a restoring process's end costs once the job runs: `pos restore` lets go of its fill's
context and memory (`let_go`, 0.07-0.18 s on the H200 hosts) and then exits (0.08-0.13 s after
its report). This asks which part is whose, in a child shaped as that process: pos's modules
imported, a context on the GPU, device memory and the fill's page-locked rings:

    python3 bench/exit_probe.py --out DIR [--gib 4] [--repeat 3]

Ways (each child ends its own way; the parent times from the child's last line to its exit):
  let-go      context and memory let go, then the interpreter's exit (pos restore today)
  let-go-os   let go, then os._exit (no interpreter teardown, no libraries' exit handlers)
  held-os     nothing let go, os._exit: the kernel tears the context down as the process ends
  held-sys    nothing let go, the interpreter's exit
Writes DIR/exit.json, one row per child.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
WAYS = ("let-go", "let-go-os", "held-os", "held-sys")


def child(way: str, gib: float) -> None:
    sys.path.insert(0, str(ROOT))
    import pos.cli  # noqa: F401  (what `pos restore` has imported by its end)
    from pos.concurrent import gpucopy
    from pos.concurrent.fill import FILL_DEPTH, FILL_STREAMS
    from pos.concurrent.restore import restore_full  # noqa: F401
    from pos.settings import Settings

    context = gpucopy.Context(0)
    drv = context.drv
    shadow = gpucopy.Shadow(drv, int(gib * 2**30))
    rings = gpucopy.Rings(drv, FILL_STREAMS, Settings().fill_piece_bytes, FILL_DEPTH)
    let_go = 0.0
    if way.startswith("let-go"):
        t = time.monotonic()
        rings.close()
        shadow.close()
        context.close()
        let_go = time.monotonic() - t
    print(json.dumps({"done_at": time.monotonic(), "let_go_s": let_go}), flush=True)
    sys.stderr.flush()
    if way.endswith("-os"):
        os._exit(0)
    sys.exit(0)


def one(way: str, gib: float) -> dict[str, Any]:
    p = subprocess.Popen([sys.executable, __file__, "--child", way, "--gib", str(gib)],
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    line = p.stdout.readline()
    os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOWAIT)
    ended = time.monotonic()
    rc = p.wait()
    said = json.loads(line) if line.strip() else {}
    return {"way": way, "rc": rc, "let_go_s": said.get("let_go_s"),
            "exit_s": round(ended - said["done_at"], 4) if said else None}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--gib", type=float, default=4.0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--child")
    a = ap.parse_args()
    if a.child:
        child(a.child, a.gib)
        return 0
    rows = []
    for k in range(a.repeat):
        for way in WAYS:
            rows.append({**one(way, a.gib), "try": k, "gib": a.gib})
            print("row", json.dumps(rows[-1]), flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "exit.json").write_text(json.dumps(rows, indent=1) + "\n")
    return 0 if all(r["rc"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
