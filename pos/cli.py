"""The `pos` command: thin click front-ends over the packages (tracer, store, ...).

Errors travel as PosError and leave as one sentence with the exit code of pos/errors.py.
"""

import signal
import sys
from typing import Any, Optional

import click

from pos import __version__
from pos.errors import PosError

EPILOG_TRACE = """\b
Examples:
  pos trace 4242                      # trace PID 4242 until Ctrl-C or until it exits
  pos trace 4242 --duration 30 --db /tmp/t.db
  pos trace 4242 --lib /usr/lib/x86_64-linux-gnu/libcuda.so.1
  pos trace --ebpf                    # print the BPF programs and exit
"""

EPILOG_ANALYZE = """\b
Examples:
  pos analyze /tmp/t.db                       # report of the latest trace
  pos analyze /tmp/t.db --trace 3 --top 20    # another trace, longer tables
  pos analyze /tmp/t.db --json > access.json  # every launch's read/write sets, buffers, costs
  pos analyze /tmp/t.db --dot dag.svg         # one iteration of the DAG (DOT without graphviz)
  pos analyze /tmp/t.db --validation val.json # list what the run-time validator caught
"""

EPILOG_EXPORT = """\b
Examples:
  pos export /tmp/t.db --format jsonl > events.jsonl
  pos export /tmp/t.db --format perfetto -o trace.json   # open in ui.perfetto.dev
"""


class PosGroup(click.Group):
    """Turns PosError into click's error output and exit code."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except PosError as e:
            err = click.ClickException(e.message)
            err.exit_code = e.exit_code
            raise err from None


def db_option(f: Any) -> Any:
    return click.option("--db", "db", type=click.Path(dir_okay=False), envvar="POS_DB",
                        default=None, show_envvar=True,
                        help="SQLite file of the store [default: /var/lib/pos/pos.db].")(f)


@click.group(cls=PosGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="pos")
def cli() -> None:
    """pos: transparent, concurrent checkpoint/restore of GPU processes."""


@cli.command(epilog=EPILOG_TRACE)
@click.argument("pid", type=int, required=False)
@db_option
@click.option("--duration", type=click.FloatRange(min=0, min_open=True),
              help="Stop after this many seconds.")
@click.option("--lib", type=click.Path(dir_okay=False),
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
    if ebpf:
        for family in FAMILIES:
            click.echo(f"// ---- {family.name}: {family.source}\n{bpf_text(family, pages)}")
        return
    if pid is None:
        raise click.UsageError("Missing argument 'PID' (the process to trace).")
    from pos.tracer.record import record

    record(pid, db=db, duration=duration, lib=lib, quiet=quiet, ringbuf_pages=pages,
           interval=interval)


@cli.command(epilog=EPILOG_EXPORT)
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--format", "fmt", type=click.Choice(["jsonl", "perfetto"]), default="jsonl",
              show_default=True)
@click.option("--trace", "trace_id", type=int, help="Trace id [default: the latest].")
@click.option("-o", "--output", type=click.Path(dir_okay=False, writable=True),
              help="Write here instead of standard output.")
def export(file: str, fmt: str, trace_id: Optional[int], output: Optional[str]) -> None:
    """Export a recorded trace: JSON lines (one event each, in time order) or Perfetto."""
    from pos.store.db import open_db
    from pos.store.export import export_jsonl, export_perfetto

    engine = open_db(file, create=False)
    out = open(output, "w") if output else sys.stdout
    try:
        (export_jsonl if fmt == "jsonl" else export_perfetto)(engine, out, trace_id)
    finally:
        if output:
            out.close()


@cli.command()
def doctor() -> None:
    """Check every prerequisite of pos on this host and say how to get what is missing."""
    from pos.doctor import run_checks

    if not run_checks(click.echo):
        sys.exit(1)


@cli.command(epilog=EPILOG_ANALYZE)
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--trace", "trace_id", type=int, help="Trace id [default: the latest].")
@click.option("--json", "as_json", is_flag=True, help="Print the analysis as JSON.")
@click.option("--dot", "dot", type=click.Path(dir_okay=False),
              help="Write one iteration of the DAG here (.svg: rendered with graphviz's dot).")
@click.option("--top", type=click.IntRange(1), default=10, show_default=True,
              help="Rows of the report's tables.")
@click.option("--validation", type=click.Path(dir_okay=False),
              help="JSON table of the run-time validator (pos.analyzer.validate).")
def analyze(file: str, trace_id: Optional[int], as_json: bool, dot: Optional[str], top: int,
            validation: Optional[str]) -> None:
    """Speculate every launch's and copy's read and write sets from a recorded trace, build the
    buffer DAG, find the training/serving iteration, and predict a checkpoint's copy order and
    costs (stop-the-world vs concurrent)."""
    from pos.analyzer import analyze_file, load_validation
    from pos.analyzer.report import dump_json, print_report, to_json, write_dot

    table = load_validation(validation) if validation else None
    tid, result = analyze_file(file, trace_id)
    if as_json:
        dump_json(to_json(result, tid, table), sys.stdout)
    else:
        print_report(result, tid, sys.stdout, top=top, validation=table)
    if dot:
        click.echo(write_dot(result, dot), err=True)


def _terminate(_signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt


def main() -> None:
    # SIGTERM unwinds like Ctrl-C, through every command's cleanups (probes detached, ...).
    signal.signal(signal.SIGTERM, _terminate)
    cli(prog_name="pos")


if __name__ == "__main__":
    main()
