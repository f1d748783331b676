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


# ---- checkpoint / restore (pos/scheduler) -------------------------------------------------
EPILOG_CHECKPOINT = """\b
Examples:
  pos checkpoint 4242 -D /var/lib/pos/images/job1                  # save and stop PID 4242
  pos checkpoint 4242 -D /tmp/job1 --leave-running                 # save, keep it running
  pos checkpoint 4242 -D /tmp/job1 --shell-job --tcp-established   # a job of a terminal, with
                                                                   # live TCP connections
  pos checkpoint 4242 -D /tmp/job1 --external 'file[2a:1234]'      # leave a file to the restore
"""

EPILOG_RESTORE = """\b
Examples:
  pos restore -D /var/lib/pos/images/job1       # verify the checksums, restore, resume
  pos restore -D /tmp/job1 --inherit-fd 'fd[1]:pipe:[12345]'
"""

EPILOG_INSPECT = """\b
Examples:
  pos inspect /tmp/job1            # what the image holds and how long each step took
  pos inspect /tmp/job1 --verify   # and check every file's sha256
  pos inspect /tmp/job1 --json     # the manifest itself
"""

EPILOG_MIGRATE = """\b
Examples:
  pos migrate 4242 --to-gpu 1                 # move PID 4242's GPU state onto GPU 1
  pos migrate --listen -D /tmp/in --port 7070 # on the destination host: receive and restore
  pos migrate 4242 --to 10.0.0.2:7070         # on the source: stream PID 4242 there
"""


def criu_options(f: Any) -> Any:
    """The CRIU options a dump may need (recorded in the image; restore reuses them)."""
    for opt in reversed((
        click.option("--shell-job", is_flag=True,
                     help="The process belongs to a terminal session (a shell's job)."),
        click.option("--tcp-established", is_flag=True, help="Save live TCP connections."),
        click.option("--ext-unix-sk", is_flag=True,
                     help="Allow UNIX sockets connected outside the process tree."),
        click.option("--file-locks", is_flag=True, help="Save file locks."),
        click.option("--external", multiple=True, metavar="RES",
                     help="A resource CRIU leaves alone (CRIU's --external), repeatable."),
    )):
        f = opt(f)
    return f


def _options(shell_job: bool, tcp_established: bool, ext_unix_sk: bool, file_locks: bool,
             external: tuple[str, ...]) -> Any:
    from pos.scheduler.criu import Options

    return Options(shell_job, tcp_established, ext_unix_sk, file_locks, tuple(external))


def _report(result: Any) -> None:
    m = result.manifest
    steps = ", ".join(f"{k} {v:.3f} s" for k, v in result.timings.items())
    click.echo(steps)
    if result.restored_pid is None:
        stall = "n/a (stopped)" if m.stall_s is None else f"{m.stall_s:.3f} s"
        click.echo(f"image {result.path}: {m.size_bytes / 2**20:.1f} MiB in {len(m.files)} "
                   f"files; stall {stall}")


@cli.command(epilog=EPILOG_CHECKPOINT)
@click.argument("pid", type=int)
@click.option("-D", "--dir", "directory", required=True, type=click.Path(file_okay=False),
              help="Directory of the new image (must not exist; written as DIR.partial first).")
@click.option("--leave-running", is_flag=True, help="Resume the process after the dump.")
@click.option("--lock-timeout", type=click.FloatRange(0.001, 3600), default=10.0,
              show_default=True, help="Seconds the driver may take to lock the CUDA process.")
@click.option("--concurrent", is_flag=True,
              help="Save the GPU state of a `pos run` process while it keeps running (its agent "
                   "takes the image; not yet proven on a GPU).")
@click.option("--incremental", is_flag=True,
              help="With --concurrent: only the buffers written since the last image "
                   "(needs `pos run --track-dirty`).")
@click.option("--compress", is_flag=True, help="With --concurrent: zstd-compress the chunks.")
@click.option("--streams", type=click.IntRange(1, 64), default=None,
              help="With --concurrent: copy streams (threads) of the copier [default: 4].")
@click.option("--chunk-mb", type=click.IntRange(1, 1024), default=None,
              help="With --concurrent or --gpu-only: staging chunk size in MiB [default: 64].")
@criu_options
@db_option
def checkpoint(pid: int, directory: str, leave_running: bool, lock_timeout: float,
               concurrent: bool, incremental: bool, compress: bool, streams: Optional[int],
               chunk_mb: Optional[int],
               shell_job: bool, tcp_established: bool, ext_unix_sk: bool, file_locks: bool,
               external: tuple[str, ...], db: Optional[str]) -> None:
    """Save a process tree, its GPU state included, into an image directory.

    GPU processes: the CUDA driver locks and checkpoints them, then CRIU dumps the tree. Without
    --leave-running the processes end once saved; restore them with `pos restore`. Whatever
    fails, the processes are left running (a watchdog undoes even if pos is killed).
    With --concurrent, only the GPU state of a `pos run` process, taken while it runs.
    """
    from pathlib import Path

    from pos.scheduler import engine
    from pos.store import images

    if (incremental or compress) and not concurrent:
        raise click.UsageError("--incremental and --compress go with --concurrent.")
    if (streams or chunk_mb) and not concurrent:
        raise click.UsageError("--streams and --chunk-mb go with --concurrent.")
    if concurrent:
        from pos.scheduler.concurrent import checkpoint_concurrent

        r = checkpoint_concurrent(pid, directory, incremental=incremental,
                                  compress=compress, streams=streams, chunk_mb=chunk_mb)
        click.echo(f"image {r['path']}: {r['bytes'] / 2**30:.2f} GiB in {r['duration_s']:.3f} s "
                   f"({r['throughput_gbps'] or 0:.1f} GB/s; device to host "
                   f"{r.get('d2h_gbps') or 0:.1f} GB/s; order: {r.get('order_source')}); "
                   f"intercepted {r['intercepted']}, "
                   f"copied-on-write {r['copied_on_write']}, waited {r['waited']} "
                   f"({r['waited_s']:.3f} s), fallbacks {r['fallbacks']}")
        return

    result = engine.checkpoint(pid, Path(directory),
                               _options(shell_job, tcp_established, ext_unix_sk, file_locks,
                                        external), leave_running, int(lock_timeout * 1000),
                               echo=click.echo)
    images.record(db, str(result.path), result.manifest)
    _report(result)


@cli.command(epilog=EPILOG_RESTORE)
@click.option("-D", "--dir", "directory", required=True, type=click.Path(file_okay=False),
              help="The image directory that `pos checkpoint` wrote.")
@click.option("--inherit-fd", multiple=True, metavar="fd[N]:RES",
              help="Give the restored tree this file descriptor of pos (CRIU's --inherit-fd).")
@click.option("--gpu-only", "gpu_only_pid", type=int, metavar="PID",
              help="Put a `--concurrent` GPU image back into the running `pos run` process PID, "
                   "on demand: it runs on at once, calls wait only for buffers not back yet.")
@click.option("--streams", type=click.IntRange(1, 64), default=None,
              help="With --gpu-only: restorer streams (threads) [default: 8].")
@click.option("--chunk-mb", type=click.IntRange(1, 1024), default=None,
              help="With --gpu-only: staging chunk size in MiB [default: 64].")
@db_option
def restore(directory: str, inherit_fd: tuple[str, ...], gpu_only_pid: Optional[int],
            streams: Optional[int], chunk_mb: Optional[int], db: Optional[str]) -> None:
    """Restore a process tree from an image and resume it (checksums verified first)."""
    from pathlib import Path

    from pos.scheduler import engine
    from pos.store import images

    if gpu_only_pid is not None:
        from pos.scheduler.concurrent import restore_gpu_only

        r = restore_gpu_only(gpu_only_pid, directory, streams=streams, chunk_mb=chunk_mb)
        first = r.get("first_call_s")
        click.echo(f"restored {r['bytes'] / 2**30:.2f} GiB in {r['duration_s']:.3f} s "
                   f"({r['throughput_gbps'] or 0:.1f} GB/s); application released after "
                   f"{r['release_s']:.3f} s, its first call passed after "
                   + (f"{first:.3f} s" if first is not None else "- (none during the restore)")
                   + f", {r['held']} calls held")
        return
    if streams or chunk_mb:
        raise click.UsageError("--streams and --chunk-mb go with --gpu-only.")

    result = engine.restore(Path(directory), tuple(inherit_fd), echo=click.echo)
    images.mark_restored(db, str(result.path))
    _report(result)
    click.echo(f"restored PID {result.restored_pid}")


@cli.command(epilog=EPILOG_INSPECT)
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--verify", is_flag=True, help="Also check every file's size and sha256.")
@click.option("--json", "as_json", is_flag=True, help="Print the manifest as JSON.")
def inspect(directory: str, verify: bool, as_json: bool) -> None:
    """Show what an image holds: process, GPUs, driver, files, the time of each step."""
    from pathlib import Path

    from pos.scheduler import image

    m = (image.verify if verify else image.load)(Path(directory))
    if as_json:
        click.echo(m.to_json(), nl=False)
        return
    gpus = ", ".join(f"{g['name']} {g['uuid']}" for g in m.gpus) or "n/a"
    stall = "n/a (stopped after the dump)" if m.stall_s is None else f"{m.stall_s:.3f} s"
    for key, value in (
            ("process", f"PID {m.pid} {m.comm}: {m.cmdline}"),
            ("tree", f"{len(m.pids)} process(es) {m.pids}, CUDA state in {m.gpu_pids or 'none'}"),
            ("taken", f"{m.created_at} on {m.host} (kernel {m.kernel}, CRIU {m.criu_version})"),
            ("driver", f"{m.driver_version or 'n/a'} (CUDA {m.cuda_version or 'n/a'})"),
            ("GPUs", gpus),
            ("options", ", ".join(k for k, v in m.criu_options.items() if v) or "none"),
            ("size", f"{m.size_bytes} bytes in {len(m.files)} files"),
            ("steps", ", ".join(f"{k} {v:.3f} s" for k, v in m.timings.items())),
            ("stall", stall)):
        click.echo(f"{key:8} {value}")
    if verify:
        click.echo("verify   every file matches its sha256")


@cli.command(epilog=EPILOG_MIGRATE)
@click.argument("pid", type=int, required=False)
@click.option("--to-gpu", type=click.IntRange(min=0), help="Move the GPU state onto this GPU "
              "(NVML index) of this host.")
@click.option("--to", "to_host", metavar="HOST[:PORT]",
              help="Stream the process to `pos migrate --listen` on HOST.")
@click.option("--listen", is_flag=True, help="Receive a migrating process and restore it here.")
@click.option("--port", type=click.IntRange(1, 65534), default=7070, show_default=True,
              help="With --listen: the control port (CRIU's page server uses PORT+1).")
@click.option("--address", default="0.0.0.0", show_default=True,
              help="With --listen: the address to listen on.")
@click.option("-D", "--dir", "directory", type=click.Path(file_okay=False),
              help="With --listen: where the received image goes; with --to: the local part "
                   "of the image [default: a temporary folder].")
@click.option("--lock-timeout", type=click.FloatRange(0.001, 3600), default=10.0,
              show_default=True, help="Seconds the driver may take to lock the CUDA process.")
@criu_options
def migrate(pid: Optional[int], to_gpu: Optional[int], to_host: Optional[str], listen: bool,
            port: int, address: str, directory: Optional[str], lock_timeout: float,
            shell_job: bool, tcp_established: bool, ext_unix_sk: bool, file_locks: bool,
            external: tuple[str, ...]) -> None:
    """Move a process onto another GPU of this host, or to another host."""
    from pathlib import Path

    from pos.scheduler import migrate as mig

    modes = sum((to_gpu is not None, to_host is not None, listen))
    if modes != 1:
        raise click.UsageError("give exactly one of --to-gpu N, --to HOST or --listen.")
    if listen:
        if directory is None:
            raise click.UsageError("--listen needs -D DIR (where the image goes).")
        pid_here = mig.listen(address, port, Path(directory), echo=click.echo)
        click.echo(f"restored PID {pid_here}")
        return
    if pid is None:
        raise click.UsageError("Missing argument 'PID' (the process to migrate).")
    timeout_ms = int(lock_timeout * 1000)
    if to_gpu is not None:
        mig.to_gpu(pid, to_gpu, timeout_ms, echo=click.echo)
        return
    mig.to_host(pid, to_host or "", _options(shell_job, tcp_established, ext_unix_sk,
                                            file_locks, external),
                Path(directory) if directory else None, timeout_ms, echo=click.echo)


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


# ---- scheduled snapshots: pos schedule, pos daemon, pos images (pos/scheduler) --------------
EPILOG_SCHEDULE_ADD = """\b
Examples:
  pos schedule add --cron '*/15 * * * *' --match 'train\\.py' -D /var/lib/pos/images \\
      --keep 4 --leave-running        # every 15 min (UTC), the job whatever its PID, last 4
  pos schedule add --cron '0 * * * *' --name job1 -D /data/ckpt --max-age 1d --max-bytes 200G \\
      --leave-running                 # hourly, the `pos run --name job1` job, by age and size
  pos schedule add --cron '* * * * * */10' --pid 4242 -D /tmp/snaps --keep 3 --leave-running
                                      # every 10 seconds (sixth field: seconds), PID 4242
  pos schedule add --cron '*/5 * * * *' --name job1 --engine concurrent -D /data/gpu --keep 6
                                      # GPU state of a `pos run` job while it runs (unproven
                                      # on a GPU); restore: pos restore --gpu-only PID -D DIR
  pos schedule add --cron '0 * * * *' --match 'serve\\.py' --tcp-established --shell-job \\
      -D /data/ckpt --keep 2 --leave-running   # CRIU options, as for `pos checkpoint`
"""

EPILOG_SCHEDULE = """\b
Examples:
  pos schedule add --cron '*/15 * * * *' --match 'train\\.py' -D /var/lib/pos/images --keep 4
  pos schedule ls                     # each schedule with its last outcome and next run
  pos schedule rm 3                   # its images stay on disk
"""

EPILOG_DAEMON = """\b
Examples:
  pos daemon                                   # the default store, metrics on 127.0.0.1:9464
  pos daemon --db /tmp/t.db --metrics-port 0   # no metrics endpoint
  curl -s localhost:9464/metrics | grep ^pos_  # what it reports
  systemctl enable --now pos-daemon            # contrib/pos-daemon.service
"""

EPILOG_IMAGES = """\b
Examples:
  pos images                     # every image in the default store (same as `pos images ls`)
  pos images ls --db /tmp/t.db
  pos images prune --dry-run     # what the schedules' retention would delete now
  pos images prune --schedule 3  # apply schedule 3's retention now
"""


def _open_store(db: Optional[str]) -> Any:
    from pos.store.db import default_db_path, open_db

    return open_db(db or default_db_path())


def _writable_root(root: str) -> str:
    """ROOT, created if missing, after a real write into it (root ignores permission bits, not
    read-only mounts)."""
    import os
    import tempfile
    from pathlib import Path

    from pos.errors import BadInput

    path = Path(root).absolute()
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.close(tempfile.mkstemp(dir=path, prefix=".pos-probe-")[0])
        for probe in path.glob(".pos-probe-*"):
            probe.unlink()
    except OSError as e:
        raise BadInput(f"-D {root} is not a writable directory ({e.strerror})",
                       "give a directory on a writable file system with free space") from None
    return str(path)


@cli.group(epilog=EPILOG_SCHEDULE)
def schedule() -> None:
    """Cron-scheduled snapshots, run by `pos daemon`."""


@schedule.command("add", epilog=EPILOG_SCHEDULE_ADD)
@click.option("--cron", "expr", required=True, metavar="EXPR",
              help="When, in UTC: 5 fields (minute hour day month weekday), 6 with seconds last.")
@click.option("--pid", type=int, help="Target this process.")
@click.option("--match", metavar="REGEX", help="Target the process whose command line matches "
              "(found again after it restarts).")
@click.option("--name", metavar="NAME", help="Target the job started by `pos run --name NAME`.")
@click.option("--keep", type=int, metavar="N", help="Keep the N newest images.")
@click.option("--max-age", metavar="D", help="Delete images older than D (90s, 30m, 12h, 7d).")
@click.option("--max-bytes", metavar="B", help="Keep at most B bytes of images (500M, 50G).")
@click.option("--engine", type=click.Choice(["auto", "driver", "concurrent", "criu"]),
              default="auto", show_default=True,
              help="auto: concurrent for a `pos run` job (its agent answers), driver for other "
                   "GPU processes, CRIU alone for the rest. concurrent: only the GPU state of a "
                   "`pos run` job, taken while it runs (not yet proven on a GPU; restore with "
                   "`pos restore --gpu-only PID -D DIR`).")
@click.option("--leave-running", is_flag=True,
              help="Resume the target after each snapshot (without it the first snapshot "
                   "ends the process, as `pos checkpoint` does; the concurrent engine never "
                   "stops it).")
@click.option("-D", "--dir", "root", required=True, metavar="ROOT",
              help="Images go to ROOT/<schedule id>/<UTC time>.")
@criu_options
@db_option
def schedule_add(expr: str, pid: Optional[int], match: Optional[str], name: Optional[str],
                 keep: Optional[int], max_age: Optional[str], max_bytes: Optional[str],
                 engine: str, leave_running: bool, root: str, shell_job: bool,
                 tcp_established: bool, ext_unix_sk: bool, file_locks: bool,
                 external: tuple[str, ...], db: Optional[str]) -> None:
    """Add a schedule: snapshot a target at the times of a cron expression."""
    import json

    from pos.errors import BadInput
    from pos.scheduler import cron, retention, targets
    from pos.store import schedules

    expr = cron.validate(expr)
    target = targets.from_options(pid, match, name)
    options = _options(shell_job, tcp_established, ext_unix_sk, file_locks, external)
    if engine == "concurrent" and options.argv():
        raise BadInput(f"{' '.join(options.argv())} are CRIU options and the concurrent engine "
                       "does not run CRIU", "drop them, or use --engine auto or driver")
    if keep is not None and keep < 1:
        raise BadInput(f"--keep {keep} would keep no image", "give --keep 1 or more")
    policy = retention.Policy(keep, retention.parse_duration(max_age) if max_age else None,
                              retention.parse_bytes(max_bytes) if max_bytes else None)
    root = _writable_root(root)
    try:
        found: Optional[int] = targets.resolve(target)
    except targets.NoTarget as e:
        if target.kind == "pid":
            raise BadInput(e.cause, "give the PID of a running process") from None
        found = None
    if engine == "concurrent" and found is not None:
        from pos.scheduler import snapshot

        try:
            snapshot.choose(engine, found)
        except BadInput as e:
            if target.kind == "pid":
                raise
            click.echo(f"note: {e.cause}; its runs fail until the job runs under `pos run`")
    from pos.scheduler.cron import SystemClock

    now = SystemClock().now()
    row = schedules.add(_open_store(db), cron=expr, target_kind=target.kind,
                        target=target.value, root=root, engine=engine,
                        leave_running=leave_running,
                        criu_options=json.dumps(options.to_json(), sort_keys=True),
                        keep=policy.keep,
                        max_age_s=policy.max_age_s, max_bytes=policy.max_bytes, created_at=now,
                        next_run_at=cron.next_fire(expr, now))
    click.echo(f"schedule {row.id}: {target} at '{expr}' (UTC) into {root}/{row.id}, {policy}; "
               f"next run {row.next_run_at:%Y-%m-%d %H:%M:%S}Z")
    if found is None:
        click.echo(f"note: no process is {target} now; until one is, its runs are "
                   "recorded as no-target")
    if not leave_running and engine != "concurrent":
        click.echo("note: without --leave-running each snapshot ends the target (restore it "
                   "with `pos restore`)")


@schedule.command("ls")
@db_option
def schedule_ls(db: Optional[str]) -> None:
    """List the schedules with their last outcome and next run (UTC)."""
    from pos.scheduler import retention, targets
    from pos.store import schedules

    store = _open_store(db)
    last = schedules.last_runs(store)
    click.echo(f"{'ID':>3} {'CRON':15} {'TARGET':28} {'ENGINE':6} {'LAST RUN (UTC)':19} "
               f"{'OUTCOME':9} {'NEXT RUN (UTC)':19} RETENTION")
    for s in schedules.all_schedules(store):
        t = str(targets.Target(s.target_kind, s.target)).removeprefix("the ")
        lr = last.get(s.id)
        when = f"{lr.started_at:%Y-%m-%d %H:%M:%S}" if lr else "-"
        policy = retention.Policy(s.keep, s.max_age_s, s.max_bytes)
        click.echo(f"{s.id:>3} {s.cron:15} {t[:28]:28} {s.engine:6} {when:19} "
                   f"{lr.outcome if lr else '-':9} {s.next_run_at:%Y-%m-%d %H:%M:%S} {policy}")
        if lr and lr.error:
            click.echo(f"    last error: {lr.error}")


@schedule.command("rm")
@click.argument("schedule_id", metavar="ID", type=int)
@db_option
def schedule_rm(schedule_id: int, db: Optional[str]) -> None:
    """Remove a schedule and its run history (its images stay on disk)."""
    from pos.store import schedules

    row = schedules.remove(_open_store(db), schedule_id)
    click.echo(f"removed schedule {schedule_id}; its images stay in {row.root}/{schedule_id}")


@cli.command(epilog=EPILOG_DAEMON)
@db_option
@click.option("--metrics-port", type=int, default=9464, show_default=True,
              help="Prometheus endpoint on --metrics-address (0: none).")
@click.option("--metrics-address", default="127.0.0.1", show_default=True)
@click.option("--grace", type=float, default=120.0, show_default=True,
              help="On SIGTERM: seconds a running snapshot may take to finish before it is "
                   "abandoned (the target always runs on).")
@click.option("--poll", type=float, default=1.0, show_default=True, hidden=True,
              help="Seconds between ticks.")
def daemon(db: Optional[str], metrics_port: int, metrics_address: str, grace: float,
           poll: float) -> None:
    """Run the schedules of the store until SIGTERM (see `pos schedule`)."""
    from pos.scheduler.daemon import Daemon, lock
    from pos.store.db import default_db_path

    path = db or default_db_path()
    held = lock(path)
    server = None
    try:
        d = Daemon(path)
        server = d.serve_metrics(metrics_port, metrics_address) if metrics_port else None
        if server:
            click.echo(f"metrics on http://{metrics_address}:{server.server_port}/metrics")
        d.run(poll_s=poll, grace_s=grace)
    finally:
        if server:
            server.shutdown()
        held.close()


@cli.group(epilog=EPILOG_IMAGES, invoke_without_command=True)
@db_option
@click.pass_context
def images(ctx: click.Context, db: Optional[str]) -> None:
    """List the images recorded in the store (`pos images ls`), or prune them."""
    if ctx.invoked_subcommand is None:
        ctx.invoke(images_ls, db=db)


@images.command("ls")
@db_option
def images_ls(db: Optional[str]) -> None:
    """List the images recorded in the store, newest first."""
    from pathlib import Path

    from pos.store.images import list_images

    rows = list_images(db)
    click.echo(f"{'ID':>4} {'CREATED (UTC)':19} {'PID':>7} {'GPU':3} {'SIZE':>10} {'STALL':>8} "
               f"{'STATE':9} PATH")
    for r in rows:
        stall = "-" if r.stall_s is None else f"{r.stall_s:.2f}s"
        state = "restored" if r.restored_at else ("ok" if Path(r.path).is_dir() else "missing")
        click.echo(f"{r.id:>4} {r.created_at:%Y-%m-%d %H:%M:%S} {r.pid:>7} "
                   f"{'yes' if r.gpu else 'no':3} {r.size_bytes / 2**20:>8.1f}Mi {stall:>8} "
                   f"{state:9} {r.path}")


@images.command("prune")
@click.option("--schedule", "schedule_id", type=int, metavar="ID",
              help="Only this schedule's images [default: every schedule's].")
@click.option("--dry-run", is_flag=True, help="Say what would be deleted; delete nothing.")
@db_option
def images_prune(schedule_id: Optional[int], dry_run: bool, db: Optional[str]) -> None:
    """Apply the schedules' retention now (the daemon does after each snapshot)."""
    from pathlib import Path

    from pos.scheduler import retention
    from pos.scheduler.cron import SystemClock
    from pos.store import images as image_rows
    from pos.store import schedules

    store = _open_store(db)
    rows = ([schedules.get(store, schedule_id)] if schedule_id is not None
            else schedules.all_schedules(store))
    now = SystemClock().now()
    for s in rows:
        policy = retention.Policy(s.keep, s.max_age_s, s.max_bytes)
        gone = retention.prune(Path(s.root) / str(s.id), policy, now, dry_run)
        if not dry_run and gone:
            image_rows.forget(db, [str(k.path) for k in gone])
        for k in gone:
            click.echo(f"{'would delete' if dry_run else 'deleted'} {k.path} "
                       f"({retention.format_bytes(k.size)})")
        click.echo(f"schedule {s.id}: {len(gone)} image(s) "
                   f"{'to delete' if dry_run else 'deleted'} ({policy})")
# ---- pos run: start a program with the pos agent inside it (pos/agent) --------------------
EPILOG_RUN = """\b
Examples:
  pos run -- python train.py --epochs 3        # the agent starts inside the program
  pos run --name job1 --track-dirty -- python train.py
  pos run --validation val.json -- python serve.py   # kernels the validator validated
"""


@cli.command(epilog=EPILOG_RUN, context_settings={"ignore_unknown_options": True})
@click.option("--name", help="A name for the job (POS_RUN_NAME; the scheduler finds it by it).")
@click.option("--track-dirty", is_flag=True,
              help="Track the buffers written since the last checkpoint (incremental images).")
@click.option("--validation", type=click.Path(exists=True, dir_okay=False),
              help="The run-time validator's table: kernels it validated are speculated, "
                   "the others wait for the whole image.")
@click.option("--shadow-pool-mb", type=click.IntRange(0), default=1024, show_default=True,
              help="GPU memory for copy-on-write shadows during a checkpoint.")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def run(name: Optional[str], track_dirty: bool, validation: Optional[str], shadow_pool_mb: int,
        command: tuple[str, ...]) -> None:
    """Run COMMAND with the pos agent inside it (Python programs), so that `pos checkpoint
    --concurrent` can save its GPU state while it runs. Exits with COMMAND's exit status."""
    import os
    import shutil
    from pathlib import Path

    from pos.agent import ENABLE_ENV, RUN_NAME_ENV

    prog = shutil.which(command[0])
    if prog is None:
        raise click.UsageError(f"{command[0]}: command not found.")
    with open(prog, "rb") as f:
        head = f.read(256)
    python = Path(prog).name.startswith("python") or (head.startswith(b"#!") and b"python" in
                                                       head.split(b"\n")[0])
    if not python:
        raise click.UsageError(f"{command[0]} is not a Python program: pos run starts its agent "
                               "through Python's sitecustomize, so only Python programs (python "
                               "SCRIPT, or a script with a python #! line) are supported.")
    boot = str(Path(__file__).resolve().parent / "agent" / "boot")
    root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (boot, root, env.get("PYTHONPATH")) if p)
    env[ENABLE_ENV] = "1"
    env["POS_SHADOW_POOL_MB"] = str(shadow_pool_mb)
    if name:
        env[RUN_NAME_ENV] = name
    if track_dirty:
        env["POS_TRACK_DIRTY"] = "1"
    if validation:
        env["POS_VALIDATION"] = str(Path(validation).absolute())
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.execvpe(prog, list(command), env)


def _terminate(_signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt


def main() -> None:
    # SIGTERM unwinds like Ctrl-C, through every command's cleanups (probes detached, ...).
    signal.signal(signal.SIGTERM, _terminate)
    cli(prog_name="pos")


if __name__ == "__main__":
    main()
