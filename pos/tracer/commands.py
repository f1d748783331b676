"""`pos trace` and `pos export`: record a process's GPU driver calls into the store, and export
a recorded trace. Heavy modules (bcc, the store) are imported inside the commands."""

import sys
from typing import Optional

import click

from pos.options import db_option
from pos.usage import MissingArgument, PosCommand, PosPath

EPILOG_TRACE = """\b
Examples:
  pos trace 4242                      # trace PID 4242 until Ctrl-C or until it exits
  pos trace 4242 --duration 30 --db /tmp/t.db
  pos trace 4242 --lib /usr/lib/x86_64-linux-gnu/libcuda.so.1
"""

EPILOG_EXPORT = """\b
Examples:
  pos export /tmp/t.db --format jsonl > events.jsonl
  pos export /tmp/t.db --format perfetto -o trace.json   # open in ui.perfetto.dev
"""


@click.command(cls=PosCommand, epilog=EPILOG_TRACE)
@click.argument("pid", type=int, required=False)
@db_option
@click.option("--duration", type=click.FloatRange(min=0, min_open=True),
              help="Stop after this many seconds.")
@click.option("--lib", type=PosPath(dir_okay=False),
              help="Probe this driver library instead of the one found in /proc/PID/maps.")
@click.option("--quiet", "-q", is_flag=True, help="No live view; print the summary only.")
@click.option("--ringbuf-mb", type=click.IntRange(1, 1024), default=64, show_default=True,
              help="Size of the probes' ring buffer (a power of two is used).")
@click.option("--interval", type=click.FloatRange(0.001, 5), default=0.02, show_default=True,
              help="Seconds between drains of the ring buffer.")
@click.option("--ebpf", is_flag=True, hidden=True, help="Print the BPF programs and exit.")
def trace(pid: Optional[int], db: Optional[str], duration: Optional[float], lib: Optional[str],
          quiet: bool, ringbuf_mb: int, interval: float, ebpf: bool) -> None:
    """Trace the GPU driver calls of a running process into the store.

    Attaches uprobes to the libcuda.so (or libamdhip64.so) that PID maps and records every
    allocation, kernel launch (with its parameter bytes), copy, set, synchronisation, module and
    kernel lookup. Stops on Ctrl-C, SIGTERM, --duration, or when PID exits; what was recorded is
    kept. Needs root (or CAP_SYS_ADMIN, CAP_BPF and CAP_PERFMON).
    """
    from pos.tracer.probes import FAMILIES, bpf_text

    pages = 1 << (ringbuf_mb * 256 - 1).bit_length()
    # --ebpf (hidden from --help, as in bcc's tools): the C text as bcc compiles it, placeholders
    # filled; for whoever debugs a probe.
    if ebpf:
        for family in FAMILIES:
            click.echo(f"// ---- {family.name}: {family.source}\n{bpf_text(family, pages)}")
        return
    if pid is None:
        raise MissingArgument("PID", "the process to trace")
    from pos.tracer.record import record

    record(pid, db=db, duration=duration, lib=lib, quiet=quiet, ringbuf_pages=pages,
           interval=interval)


@click.command(cls=PosCommand, epilog=EPILOG_EXPORT)
@click.argument("file", type=PosPath(dir_okay=False))
@click.option("--format", "fmt", type=click.Choice(["jsonl", "perfetto"]), default="jsonl",
              show_default=True)
@click.option("--trace", "trace_id", type=int, help="Trace id [default: the latest].")
@click.option("-o", "--output", type=PosPath(dir_okay=False, writable=True),
              help="Write here instead of standard output.")
def export(file: str, fmt: str, trace_id: Optional[int], output: Optional[str]) -> None:
    """Export a recorded trace: JSON lines (one event each, in time order) or Perfetto."""
    from pos.errors import BadInput
    from pos.store.db import open_db
    from pos.store.export import export_jsonl, export_perfetto

    engine = open_db(file, create=False)
    try:
        out = open(output, "w") if output else sys.stdout
    except OSError as e:
        raise BadInput(f"cannot write {output} ({e.strerror})",
                       "give -o a file in an existing, writable directory") from None
    try:
        (export_jsonl if fmt == "jsonl" else export_perfetto)(engine, out, trace_id)
    finally:
        if output:
            out.close()
