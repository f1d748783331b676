"""What `pos checkpoint`, `pos restore` and `pos migrate` print for a person: a few lines (what
was saved or restored and its size, how long the job stood still, where the time went). Every
field stays in the command's `--json` report, and a checkpoint's in `pos inspect`.

Built from the engines' one report (pos.operation.engine.Report) and nothing else.
"""

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pos.operation.timings import split

if TYPE_CHECKING:
    from pos.agent.control import Gate
    from pos.operation.engine import DeviceCopy, Report, WaitedFor

SHOWN_STEPS = 3


def size_text(n: int) -> str:
    """Bytes for a person: MiB below a GiB, GiB above."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def longest_steps(timings: dict[str, float], n: int = SHOWN_STEPS) -> str:
    """The `n` steps that took longest: where the time went (sizes, codes, counts, moments
    and sums over threads are no step: pos/operation/timings.py)."""
    steps = split(timings)[0]
    top = sorted(steps.items(), key=lambda kv: -kv[1])[:n]
    return "longest steps: " + ", ".join(f"{k} {v:.3f} s" for k, v in top)


def longest_wait(gate: "Gate", waited_for: Sequence["WaitedFor"] = ()) -> str:
    """What the job's longest-held call was and what it waited for: why a job stalled."""
    if not gate.waits:
        return ""
    w = max(gate.waits, key=lambda w: w.s)
    on = f"{w.on:#x}" if w.on else "every buffer"
    what = w.what if len(w.what) <= 60 else w.what[:57] + "..."
    why = next((x for x in waited_for if x.va == w.on), None)
    if why is not None:
        on += (f", {size_text(why.bytes)}{', shadowed' if why.shadowed else ''}, whose words "
               f"reach {why.reaches} buffers ({size_text(why.reaches_bytes)})")
        if why.back_s is not None:
            on += f", its addresses known {why.back_s:.3f} s"
        if why.reach_back_s is not None:
            on += f", what they reach saved {why.reach_back_s:.3f} s"
        if why.told_s is not None:
            on += f", the job's {why.told_s:.3f} s after the cut"
    return f"; the longest, {what}, waited for {on}"


def of(r: "Report") -> list[str]:
    """Any engine's checkpoint or restore: what pos copied of the device memory itself, where
    it did (the concurrent engines), else what the driver and CRIU did."""
    if r.device is not None:
        return _device(r, r.device)
    return _restore(r) if r.restoring else _checkpoint(r)


def _checkpoint(result: "Report") -> list[str]:
    """A stop-the-world checkpoint."""
    m = result.manifest
    assert m is not None          # a checkpoint's report holds its image's manifest
    cuda = f", {len(m.gpu_pids)} with CUDA state" if m.gpu_pids else ""
    held = ("it was ended once saved (restore it with `pos restore -D DIR`)" if m.stall_s is None
            else f"the job stood still {m.stall_s:.3f} s")
    return [f"saved PID {m.pid} ({m.comm}) into {result.path}: {size_text(m.size_bytes)} in "
            f"{len(m.files)} files, {len(m.pids)} process(es){cuda}",
            held, longest_steps(result.timings),
            f"every field: pos inspect {result.path} (or --json)"]


def _restore(result: "Report") -> list[str]:
    """A stop-the-world restore."""
    m = result.manifest
    assert m is not None          # a restore's report holds its image's manifest
    return [f"restored PID {result.restored_pid} from {result.path}: "
            f"{size_text(m.size_bytes)} in {len(m.files)} files",
            longest_steps(result.timings), "every field: --json"]


def _device(r: "Report", d: "DeviceCopy") -> list[str]:
    """A concurrent checkpoint or restore: a whole-process restore has a `restored_pid` (a
    GPU-only one rolls the live job back); a checkpoint copies device to host (`d2h_gbps`), a
    restore host to device."""
    restoring = r.restoring
    what = f"{size_text(d.bytes)} of device memory in {d.buffers} buffers"
    if d.ranks:
        what += f" of {len(d.ranks)} processes"
    if not restoring:
        first = f"saved {r.path}: {what}"
    elif r.restored_pid is not None:
        first = f"restored PID {r.restored_pid} from {r.path}: {what}"
    else:
        first = f"rolled the job back to {r.path}: {what}"
    held = (f"the job ran again {d.release_s:.3f} s after the restore began" if restoring
            else f"the job was held {d.release_s:.3f} s")
    if d.gate:
        longest = longest_wait(d.gate, d.waited_for)
        held += (f"; its longest held call waited {d.gate.held_max_s:.3f} s "
                 f"({d.gate.held} held, {d.gate.held_s:.3f} s in all{longest})")
    rate = d.h2d_gbps if restoring else d.d2h_gbps
    if r.filling:
        copy = ("the rest of its device memory comes back while it runs, filled by pos's "
                f"process {r.filler_pid} (its calls wait only for buffers not back yet)")
    else:
        copy = f"device memory {'read back' if restoring else 'copied'} at {rate or 0:.1f} " \
               "GB/s (PCIe limit ~55)"
    if "all_back_at" in r.timings:
        copy += f", all of it back {r.timings['all_back_at']:.3f} s after the restore began"
    out = [first, held, copy, longest_steps(r.timings)]
    if r.manifest is not None and r.manifest.predumped is not None and not restoring:
        out.append(_host_memory(r.manifest.predumped, r.manifest.predump_note))
    if d.foreign_bytes:
        out.append(f"{size_text(d.foreign_bytes)} the agent could not own (stream-ordered pools, "
                   "managed or pitched memory, the job's own VMM mappings) went through the "
                   "driver's checkpoint, inside the frozen part")
    out.append("every field: --json" if restoring else f"every field: pos inspect {r.path} "
               "(or --json)")
    return out


def _host_memory(predumped: bool, note: str) -> str:
    """How CRIU saved the job's host memory in a whole-process concurrent checkpoint."""
    if predumped:
        return ("host memory: CRIU's pre-dump copied it before the freeze, the frozen dump "
                "only what the job wrote since")
    return f"host memory: dumped while the job was frozen; no pre-dump: {note}"


def migration(report: dict[str, Any]) -> list[str]:
    """`pos migrate PID --to-gpu N` or `--to HOST` (the command's report)."""
    where = f"onto GPU {report['gpu']}" if "gpu" in report else f"to {report['host']}"
    there = (f"; it runs there as PID {report['restored_pid']}"
             if report.get("restored_pid") is not None else "")
    return [f"moved PID {report['pid']} {where}{there}", longest_steps(report["timings"]),
            "every field: --json"]
