"""What `pos analyze` prints: a readable report (rich), the JSON form, and a DOT/SVG picture of
one iteration of the DAG."""

import json
import os
import shutil
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any, Optional, TextIO

import numpy as np
from rich.console import Console
from rich.table import Table

from pos.analyzer.dag import EDGE_NAMES, Analysis
from pos.analyzer.demangle import KIND_NAMES, demangle
from pos.analyzer.ops import OP_LAUNCH, OP_MEMCPY, OP_MEMSET
from pos.errors import BadInput
from pos.tracer.view import human_bytes

DOT_MAX_NODES = 300


def _hex(v: int) -> str:
    return f"0x{int(v):x}"


def short_name(name: Optional[str], width: int = 60) -> str:
    """A kernel's demangled name without its parameter list, cut to `width`."""
    if not name:
        return "(unnamed)"
    text = demangle(name) or name
    if text.endswith(")"):
        depth = 0
        for i in range(len(text) - 1, -1, -1):
            depth += text[i] == ")"
            depth -= text[i] == "("
            if depth == 0:
                text = text[:i]
                break
    return text if len(text) <= width else text[:width - 1] + "…"


def kernel_table(a: Analysis) -> list[dict[str, Any]]:
    """One entry per kernel signature that was launched, most launched first."""
    ops = a.ops
    counts = Counter(ops.sig[ops.kind == OP_LAUNCH].tolist())
    out = []
    for sig, n in counts.most_common():
        kinds = ops.sig_kind[ops.sig_start[sig]:ops.sig_start[sig + 1]]
        out.append({"name": ops.sig_name[sig], "launches": n,
                    "layout_known": ops.sig_layout_known[sig],
                    "types_known": ops.sig_types_known[sig],
                    "params": [KIND_NAMES[int(k)] for k in kinds]})
    return out


def to_json(a: Analysis, trace_id: int, validation: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """The `--json` document (its fields: docs/tracing.md)."""
    ops, ev = a.ops, a.evidence
    base = [_hex(b) for b in ops.alloc_base]
    launches, copies = [], []
    for i in map(int, np.flatnonzero((ops.kind == OP_LAUNCH) | (ops.kind == OP_MEMCPY)
                                     | (ops.kind == OP_MEMSET))):
        reads, writes = ev.sets(i)
        e: dict[str, Any] = {"index": i, "ts_ns": int(ops.ts[i]), "api": ops.api[i],
                             "reads": [base[r] for r in reads], "writes": [base[w] for w in writes]}
        rows = range(int(ev.start[i]), int(ev.start[i + 1]))
        if ops.kind[i] == OP_LAUNCH:
            s = int(ops.sig[i])
            e.update(name=ops.sig_name[s], layout_known=ops.sig_layout_known[s],
                     types_known=ops.sig_types_known[s],
                     evidence=[{"ptr": base[ev.alloc[r]], "param": int(ev.param[r]),
                                "struct_offset": int(ev.word[r]), "offset": int(ev.off[r]),
                                "access": "read-write" if ev.write[r] else "read"} for r in rows])
            launches.append(e)
        else:
            e.update(kind="memcpy" if ops.kind[i] == OP_MEMCPY else "memset",
                     evidence=[{"ptr": base[ev.alloc[r]], "side": "dst" if ev.write[r] else "src",
                                "offset": int(ev.off[r])} for r in rows])
            copies.append(e)
    buffers = [{"ptr": base[b], "size": int(ops.alloc_size[b]),
                "allocated_ns": int(ops.ts[ops.alloc_op[b]]),
                "freed_ns": int(ops.ts[ops.free_op[b]]) if ops.free_op[b] >= 0 else None,
                "writes_per_iteration": float(a.writes_per_iteration[b]),
                "written_share": float(a.written_share[b]),
                "first_write_op": None if np.isnan(a.first_write_pos[b]) else float(a.first_write_pos[b]),
                "first_write_s": None if np.isnan(a.first_write_s[b]) else float(a.first_write_s[b])}
               for b in range(len(ops.alloc_base))]
    it = a.iterations
    return {
        "trace": trace_id,
        "launches": launches,
        "copies": copies,
        "buffers": buffers,
        "kernels": kernel_table(a),
        "edges": {name: int(np.count_nonzero(a.edge_type == t)) for t, name in enumerate(EDGE_NAMES)},
        "iterations": {"detected": it.detected, "first_op": int(a.seq[it.first]) if len(a.seq) else None,
                       "ops_per_iteration": it.period, "count": it.count,
                       "seconds": a.iteration_s},
        "checkpoint": {"at_op": a.checkpoint_op, "copy_order": [base[b] for b in a.copy_order],
                       "dirtied_bytes_per_iteration": a.dirtied_per_iteration, **a.costs},
        "unvalidated": unvalidated(validation),
    }


def unvalidated(validation: Optional[dict[str, Any]]) -> Optional[list[str]]:
    """Kernel names the run-time validator marked unvalidated; None without a table."""
    if validation is None:
        return None
    return sorted(k for k, v in validation.get("kernels", {}).items() if not v.get("validated"))


def print_report(a: Analysis, trace_id: int, out: TextIO, top: int = 10,
                 validation: Optional[dict[str, Any]] = None) -> None:
    """Top buffers by dirtied bytes, kernels by launches, iterations, costs, unvalidated kernels.
    As wide as the terminal (80 columns in a pipe or a file): a line that does not fit wraps
    between words, and the kernel table shortens names, never the parameters' types."""
    con = Console(file=out, highlight=False)
    ops, it, c = a.ops, a.iterations, a.costs
    n_launch = int(np.count_nonzero(ops.kind == OP_LAUNCH))
    n_copy = int(np.count_nonzero((ops.kind == OP_MEMCPY) | (ops.kind == OP_MEMSET)))
    edges = ", ".join(f"{int(np.count_nonzero(a.edge_type == t)):,} {n}" for t, n in enumerate(EDGE_NAMES))
    con.print(f"[bold]trace {trace_id}[/]: {n_launch:,} launches, {n_copy:,} copies/sets, "
              f"{len(ops.alloc_base):,} allocations")
    con.print(f"edges: {edges}")
    if it.detected:
        con.print(f"iterations: {it.count} of {it.period} ops, {a.iteration_s * 1e3:.3f} ms each "
                  f"(from op {int(a.seq[it.first])})")
        con.print(f"dirtied per iteration: {human_bytes(a.dirtied_per_iteration)}")
    else:
        con.print("iterations: no repeating sequence found; the whole trace is taken as one")
    con.print(f"checkpoint after op {a.checkpoint_op}: {human_bytes(c['live_bytes'])} live")
    con.print(f"  stop-the-world: stall {c['stop_the_world_s'] * 1e3:.1f} ms (the driver copies "
              "at 1.8 GB/s)")
    con.print(f"  concurrent: copy {c['concurrent_copy_s'] * 1e3:.1f} ms (53 GB/s), "
              f"{human_bytes(c['concurrent_cow_bytes'])} copied-on-write, stall "
              f"{c['concurrent_stall_s'] * 1e3:.3f} ms")

    t = Table(title="buffers by bytes dirtied per iteration", title_justify="left", box=None)
    for col in ("PTR", "SIZE", "WRITES/IT", "DIRTIED/IT", "FIRST WRITE", "COPY #"):
        t.add_column(col, justify="left" if col == "PTR" else "right", no_wrap=True)
    rank = {int(b): i + 1 for i, b in enumerate(a.copy_order)}
    dirt = ops.alloc_size.astype(np.float64) * a.written_share
    for b in np.argsort(-dirt, kind="stable")[:top]:
        if dirt[b] <= 0:
            break
        fw = a.first_write_pos[b]
        t.add_row(_hex(ops.alloc_base[b]), human_bytes(int(ops.alloc_size[b])),
                  f"{a.writes_per_iteration[b]:.2f}", human_bytes(dirt[b]),
                  "-" if np.isnan(fw) else f"op +{fw:.0f}", str(rank.get(int(b), "-")))
    con.print(t)

    k = Table(title="kernels by launches", title_justify="left", box=None)
    k.add_column("LAUNCHES", justify="right", no_wrap=True)
    k.add_column("KERNEL", no_wrap=True, overflow="ellipsis", ratio=1, min_width=12)
    k.add_column("PARAMETERS", ratio=1, min_width=14)     # whole words, wrapped between them
    for e in kernel_table(a)[:top]:
        note = "" if e["layout_known"] and e["types_known"] else \
            (" (no layout: slots scanned)" if not e["layout_known"] else " (no types: all scanned)")
        k.add_row(f"{e['launches']:,}", short_name(e["name"]), (" ".join(e["params"]) + note).strip())
    con.print(k)
    bad = unvalidated(validation)
    if bad is None:
        con.print("unvalidated kernels: no validation table (give --validation FILE, written by "
                  "the run-time validator)")
    else:
        con.print(f"unvalidated kernels ({len(bad)}): " + (", ".join(short_name(n) for n in bad) or "none"))


def to_dot(a: Analysis, max_nodes: int = DOT_MAX_NODES) -> str:
    """One iteration of the DAG (the first `max_nodes` ops of it) in Graphviz DOT."""
    ops, it = a.ops, a.iterations
    nodes = a.seq[it.first:it.first + min(it.period, max_nodes)]
    inside = set(int(n) for n in nodes)
    lines = ["digraph pos {", "  rankdir=TB; node [shape=box, fontsize=10, fontname=monospace];",
             f'  label="one iteration: {len(nodes)} of {it.period} ops"; labelloc=t;']
    for n in nodes:
        n = int(n)
        if ops.kind[n] == OP_LAUNCH:
            label = short_name(ops.sig_name[int(ops.sig[n])], 40)
        else:
            label = ops.api[n]
        lines.append(f'  n{n} [label="{label.replace(chr(34), chr(39))}\\n#{n}"];')
    kinds: dict[tuple[int, int], set[str]] = {}
    for s, d, t in zip(a.edge_src, a.edge_dst, a.edge_type):
        if int(s) in inside and int(d) in inside:
            kinds.setdefault((int(s), int(d)), set()).add(EDGE_NAMES[int(t)])
    colours = {"RAW": "black", "WAW": "red", "WAR": "blue"}
    for (s, d), ks in sorted(kinds.items()):
        first = sorted(ks)[0]
        lines.append(f'  n{s} -> n{d} [label="{"/".join(sorted(ks))}", color={colours[first]}, '
                     f'fontsize=8];')
    lines.append("}")
    return "\n".join(lines) + "\n"


def check_writable(path: str, option: str) -> None:
    """Refuse, before any work, an output path that cannot be written."""
    p = Path(path)
    folder = p.parent
    if p.is_dir():
        problem = "a folder"
    elif not folder.is_dir():
        problem = f"no folder {folder}"
    elif not os.access(folder, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        problem = "not writable by this user"
    else:
        return
    raise BadInput(f"cannot write {path} ({problem})", f"give a writable path to {option}")


def write_dot(a: Analysis, path: str) -> str:
    """Write the DOT (or, for a .svg path with graphviz installed, the SVG); returns a sentence
    saying what was written."""
    text = to_dot(a)
    p = Path(path)
    try:
        if p.suffix == ".svg":
            dot = shutil.which("dot")
            if dot is None:
                p = p.with_suffix(".dot")
                p.write_text(text)
                return (f"graphviz is not installed, so the DAG went to {p} as DOT "
                        f"(install graphviz for SVG: apt-get install graphviz)")
            subprocess.run([dot, "-Tsvg", "-o", str(p)], input=text, text=True, check=True)
        else:
            p.write_text(text)
    except OSError as e:
        raise BadInput(f"cannot write {path} ({e.strerror})", "give a writable path to --dot") from None
    return f"DAG of one iteration written to {p}"


def dump_json(doc: dict[str, Any], out: TextIO) -> None:
    json.dump(doc, out, separators=(",", ":"))
    out.write("\n")
