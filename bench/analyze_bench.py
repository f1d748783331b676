#!/usr/bin/env python3
"""analyze_bench: speed of the analyzer's numba passes, and their exact agreement with the
plain-Python reference of the speculation rule, on a synthetic trace shaped like a training job.

The trace: thousands of allocations (log-uniform sizes, 512 B .. 64 MiB, some freed and their
addresses reused between iterations), a few hundred kernels whose layouts mix pointer and
const-pointer parameters, scalars and by-value structs of 24..256 bytes holding pointers
(TensorIterator-like), 5% of launches recorded without a layout (8-byte slots), and an
iteration of a few thousand launches repeated until N launches. Timed: the speculation sweep
alone, and the whole analysis (sweep, per-op sets, DAG edges, iterations, buffer stats, copy
order). Checked: the numba evidence equals the reference's, row for row, on two windows.

USAGE: .venv/bin/python bench/analyze_bench.py [--launches N] [--check N] [--out FILE]
"""

import argparse
import json
import os
import platform
import random
import struct
import subprocess
import sys
import time
from datetime import date, datetime, timezone
from pathlib import Path

import numba
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pos.analyzer.access import speculate  # noqa: E402
from pos.analyzer.dag import analyze  # noqa: E402
from pos.analyzer.load import OpsBuilder  # noqa: E402
from pos.analyzer.ops import Ops  # noqa: E402
from pos.analyzer.reference import reference_evidence  # noqa: E402


def make_kernels(rng: random.Random, n: int) -> list[tuple[str, list[list[int]], list[str]]]:
    """(mangled name, layout, what each parameter holds: p=pointer c=const pointer s=scalar
    S=struct with pointers) for n kernels. Names are real manglings of the shapes."""
    kernels = []
    for k in range(n):
        shape = rng.choice(["ccp", "cp", "pcs", "Ss", "sSS", "cccps", "pS"])
        layout, codes, mangled, off = [], [], [], 0
        for ch in shape:
            if ch in "pc":
                size, align, m = 8, 8, "Pf" if ch == "p" else "PKf"
            elif ch == "s":
                size, align, m = 4, 4, "i"
            else:
                size, align, m = rng.choice([24, 40, 64, 256]), 8, "4Args"
            off = (off + align - 1) // align * align
            layout.append([off, size])
            codes.append(ch)
            mangled.append(m)
            off += size
        name = f"kernel{k}"
        kernels.append((f"_Z{len(name)}{name}{''.join(mangled)}", layout, codes))
    return kernels


def make_trace(n_launches: int, n_allocs: int = 4000, n_kernels: int = 300,
               per_iteration: int = 2000, seed: int = 1) -> Ops:
    rng = random.Random(seed)
    b = OpsBuilder()
    ts = 0
    bases: list[int] = []
    sizes: list[int] = []
    addr = 0x7f00_0000_0000
    for _ in range(n_allocs):
        size = int(2 ** rng.uniform(9, 26)) // 256 * 256 + 256
        b.alloc(ts, addr, size)
        bases.append(addr)
        sizes.append(size)
        addr += size + rng.choice([0, 512, 1 << 20])
        ts += 100
    kernels = make_kernels(rng, n_kernels)
    # one iteration: per position a kernel and which allocations its pointers use
    plan = []
    for _ in range(per_iteration):
        name, layout, codes = kernels[rng.randrange(n_kernels)]
        plan.append((name, layout, codes, [rng.randrange(n_allocs) for _ in range(64)],
                     rng.random() < 0.05))
    launched = 0
    while launched < n_launches:
        for name, layout, codes, targets, unknown in plan:
            if launched == n_launches:
                break
            blob = bytearray(layout[-1][0] + layout[-1][1])
            t = iter(targets)
            for (off, size), ch in zip(layout, codes):
                if ch in "pc":
                    a = next(t)
                    struct.pack_into("<Q", blob, off, bases[a] + rng.randrange(sizes[a]) // 8 * 8)
                elif ch == "s":
                    struct.pack_into("<i", blob, off, rng.randrange(1 << 20))
                else:
                    for w in range(0, size, 8):   # pointers and counts, as TensorIterator's
                        if w % 16 == 0:
                            a = next(t)
                            struct.pack_into("<Q", blob, off + w, bases[a] + 64 * (w // 16))
                        else:
                            struct.pack_into("<q", blob, off + w, rng.randrange(1 << 16))
            b.launch(ts, name, None if unknown else layout, bytes(blob))
            ts += 1000
            launched += 1
        # between iterations: a batch copied in, and one buffer freed and its address reused
        a = rng.randrange(n_allocs)
        b.memcpy(ts, bases[a], 0x5555_0000_0000, min(sizes[a], 1 << 20), "HtoD")
        r = rng.randrange(n_allocs)
        b.free(ts, bases[r])
        b.alloc(ts, bases[r], sizes[r])
        ts += 1000
    return b.finish()


def rows(ev, first: int, last: int) -> list[list[tuple]]:
    return [[(int(ev.alloc[k]), int(ev.param[k]), int(ev.word[k]), int(ev.off[k]), bool(ev.write[k]))
             for k in range(ev.start[i], ev.start[i + 1])] for i in range(first, last)]


def best_of(f, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return min(times)


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--launches", type=int, default=2_000_000)
    ap.add_argument("--check", type=int, default=20_000, help="ops per reference window")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / str(date.today())
                                            / "analyze-bench.json"))
    args = ap.parse_args()

    warm = make_trace(5000, n_allocs=200, per_iteration=500)
    analyze(warm, speculate(warm))                  # compile (or load the cache) first
    t = time.perf_counter()
    ops = make_trace(args.launches)
    print(f"built a trace of {ops.n_launches:,} launches, {len(ops.alloc_base):,} allocations, "
          f"{len(ops.sig_name)} signatures in {time.perf_counter() - t:.1f} s", flush=True)

    sweep_s = best_of(lambda: speculate(ops), args.repeat)
    full_s = best_of(lambda: analyze(ops, speculate(ops)), args.repeat)
    ev = speculate(ops)
    a = analyze(ops, ev)
    print(f"speculation: {ops.n_launches / sweep_s:,.0f} launches/s ({sweep_s:.3f} s); "
          f"with the DAG and iterations: {ops.n_launches / full_s:,.0f} launches/s "
          f"({full_s:.3f} s); {len(ev.alloc):,} evidence rows, {len(a.edge_src):,} edges, "
          f"iteration {a.iterations.period} ops x {a.iterations.count}", flush=True)

    windows, mismatches, ref_s, ref_ops = [], 0, 0.0, 0
    n = len(ops.kind)
    for first in (0, n // 2):
        last = min(n, first + args.check)
        t = time.perf_counter()
        ref = reference_evidence(ops, first, last)
        ref_s += time.perf_counter() - t
        ref_ops += last - first
        got = rows(ev, first, last)
        bad = sum(1 for x, y in zip(got, ref) if x != y)
        mismatches += bad
        windows.append({"first_op": first, "last_op": last,
                        "evidence_rows": sum(len(r) for r in ref), "ops_differing": bad})
    agree = mismatches == 0
    print(f"reference (plain Python): {ref_ops / ref_s:,.0f} ops/s (it replays the allocations "
          f"before each window too); agreement on {ref_ops:,} ops: "
          f"{'exact' if agree else f'{mismatches} ops differ'}", flush=True)

    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name] + sys.argv),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                 capture_output=True, text=True).stdout.strip(),
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "kernel": platform.release(),
                    "python": platform.python_version(), "numba": numba.__version__,
                    "numpy": np.__version__},
        "trace": {"launches": ops.n_launches, "ops": n, "allocations": len(ops.alloc_base),
                  "signatures": len(ops.sig_name), "param_bytes": int(len(ops.pbytes)),
                  "evidence_rows": int(len(ev.alloc)), "edges": int(len(a.edge_src)),
                  "iteration_ops": a.iterations.period, "iterations": a.iterations.count},
        "speculation_s": sweep_s,
        "speculation_launches_per_s": ops.n_launches / sweep_s,
        "analysis_s": full_s,
        "analysis_launches_per_s": ops.n_launches / full_s,
        "target_launches_per_s": 1_000_000,
        "reference_ops_per_s": ref_ops / ref_s,
        "agreement": {"exact": agree, "windows": windows},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    if not agree:
        print("analyze_bench: the numba passes and the reference DISAGREE", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
