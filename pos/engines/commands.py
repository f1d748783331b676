"""`pos checkpoint`, `pos restore`, `pos restore-service`, `pos inspect` and `pos migrate`: the
engines' checkpoint and restore. The engine, CRIU and the store are imported inside the
commands."""

import json
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import click

from pos.engines.options import (SERVICE_SOCKET, SERVICE_SOCKET_ENV, criu_options,
                                 criu_options_from, lock_timeout_option, service_socket,
                                 to_gpu_option)
from pos.errors import BadInput
from pos.options import db_option, json_option
from pos.usage import MissingArgument, PosCommand, PosPath

if TYPE_CHECKING:      # imported inside the commands that use them
    from pathlib import Path

    from pos.engines.service_protocol import Held, Restored, Running
    from pos.operation.engine import Report
    from pos.operation.gpumap import Onto
    from pos.progress import Progress
    from pos.store.ahead import Ahead

EPILOG_CHECKPOINT = """\b
Examples:
  pos checkpoint 4242 -D /var/lib/pos/images/job1                  # save and stop PID 4242
  pos checkpoint 4242 -D /tmp/job1 --leave-running                 # save, keep it running
  pos checkpoint 4242 -D /tmp/job1 --shell-job --tcp-established   # a job of a terminal, with
                                                                   # live TCP connections
  pos checkpoint 4242 -D /tmp/job1 --external 'file[2a:1234]'      # leave a file to the restore
  pos checkpoint 4242 -D /tmp/job1 --concurrent --leave-running    # a `pos run` job, saved
                                                                   # while it runs
  pos checkpoint 4242 -D /tmp/g1 --concurrent --gpu-only           # its GPU state alone
  pos checkpoint 4240 -D /tmp/ddp --concurrent --leave-running --tcp-established
                                  # a DDP job under `pos run`: every rank, cut before one collective
"""

EPILOG_RESTORE = """\b
Examples:
  pos restore -D /var/lib/pos/images/job1       # verify the checksums, restore, resume
  pos restore -D /tmp/job1 --inherit-fd 'fd[1]:pipe:[12345]'
  pos restore -D /tmp/job1 --to-gpu 1           # onto GPU 1 of this host (nvidia-smi's index)
  pos restore -D /tmp/g1 --gpu-only 4242        # roll `pos run` job 4242 back to a GPU image
  pos restore -D /tmp/job1 --no-service         # in this process, even where
                                                # `pos restore-service` runs
  pos restore -D /tmp/srv --standby             # the service holds it ready, not running;
  pos restore -D /tmp/srv                       # this then runs it
"""

EPILOG_RESTORE_SERVICE = """\b
Examples:
  pos restore-service                      # every GPU kept warm; on /run/pos/restore.sock
  pos restore-service --gpus 0,1           # only GPUs 0 and 1 (nvidia-smi's indexes)
  pos restore-service --socket /run/pos/b.sock   # another socket: clients need
                                           # POS_RESTORE_SOCKET=/run/pos/b.sock
  systemctl enable --now pos-restore       # contrib/pos-restore.service
  pos restore -D /var/lib/pos/images/job1  # then restored by the service
"""

EPILOG_INSPECT = """\b
Examples:
  pos inspect /tmp/job1            # what the image holds and how long each step took
  pos inspect /tmp/job1 --verify   # and check every file's checksums
  pos inspect /tmp/job1 --json     # the manifest itself
"""

EPILOG_MIGRATE = """\b
Examples:
  pos migrate 4242 --to-gpu 1                 # move PID 4242's GPU state onto GPU 1
  pos migrate --new-key                       # once: the key both hosts hold (/etc/pos/migrate);
                                              # then scp -rp /etc/pos/migrate HOST:/etc/pos/
  pos migrate --listen -D /tmp/in --address 10.0.0.2   # on the destination host: receive
                                                       # from a holder of the key, and restore
  pos migrate 4242 --to 10.0.0.2:7070         # on the source: stream PID 4242 there
  pos migrate 4242 --to 10.0.0.2:7070 --concurrent   # a `pos run` job, frozen about a second
  pos migrate 4242 --to-gpu 1 --concurrent    # a `pos run` job: its image restored on GPU 1
"""


def _lines(as_json: bool, progress: Optional["Progress"] = None) -> Callable[[str], None]:
    """Where the lines of the steps go: stdout, or stderr when stdout carries --json; above
    the progress line while one is drawn (pos.progress.Progress.echo)."""
    if progress is None:
        return lambda text: click.echo(text, err=as_json)
    return lambda text: progress.echo(text, err=as_json)


def _summary(lines: list[str]) -> None:
    """The few lines of pos.engines.summary, for a person (--json prints the report)."""
    for line in lines:
        click.echo(line)


def _report(r: "Report", as_json: bool) -> None:
    """An operation's outcome: its summary, or with --json the whole report as one JSON
    object."""
    from pos.engines import summary

    if as_json:
        click.echo(json.dumps(r.to_json()))
        return
    _summary(summary.of(r))


@click.command(cls=PosCommand, epilog=EPILOG_CHECKPOINT)
@click.argument("pid", type=int)
@click.option("-D", "--dir", "directory", required=True, type=PosPath(file_okay=False),
              help="Directory of the new image (must not exist; written as DIR.partial first).")
@click.option("--leave-running", is_flag=True, help="Resume the process after the dump.")
@lock_timeout_option
@click.option("--concurrent", is_flag=True,
              help="A `pos run` job, saved while it runs: held only for the cut and the "
                   "driver's and CRIU's short frozen part; its device memory is copied by pos.")
@click.option("--gpu-only", "gpu_only", is_flag=True,
              help="With --concurrent: only the GPU state (rolls back into the live job with "
                   "`pos restore --gpu-only PID`).")
@click.option("--streams", type=click.IntRange(1, 64), default=None,
              help="With --concurrent: copy streams (threads) [default: 8].")
@click.option("--chunk-mb", type=click.IntRange(1, 1024), default=None,
              help="With --concurrent: chunk size in MiB [default: 64].")
@criu_options
@db_option
@json_option
def checkpoint(pid: int, directory: str, leave_running: bool, lock_timeout: float,
               concurrent: bool, gpu_only: bool, streams: Optional[int],
               chunk_mb: Optional[int],
               shell_job: bool, tcp_established: bool, ext_unix_sk: bool, file_locks: bool,
               external: tuple[str, ...], db: Optional[str], as_json: bool) -> None:
    """Save a process tree, its GPU state included, into an image directory.

    GPU processes: the CUDA driver locks and checkpoints them, then CRIU dumps the tree. Without
    --leave-running the processes end once saved; restore them with `pos restore`. Whatever
    fails, the processes are left running (a watchdog undoes even if pos is killed).
    With --concurrent, a `pos run` job is saved while it runs (a job of several CUDA
    processes, such as DDP's ranks, with every process held just before the same collective).
    """
    from pathlib import Path

    from pos.engines import engines
    from pos.process import procs
    from pos.progress import Progress
    from pos.settings import Settings
    from pos.store import db as store

    if gpu_only and not concurrent:
        raise click.UsageError("--gpu-only goes with --concurrent.")
    if (streams or chunk_mb) and not concurrent:
        raise click.UsageError("--streams and --chunk-mb go with --concurrent.")
    options = criu_options_from(shell_job, tcp_established, ext_unix_sk, file_locks, external)
    settings = Settings.from_env()
    procs.require_checkpointable(pid)   # a bad PID or no privileges is said first,
    job = procs.job_in_namespaces(pid)
    if job is not None:
        _lines(as_json)(f"PID {pid} runs its job in namespaces of its own: checkpointing the "
                        f"job, PID {job}")
        pid = job
    # then a bad --db, before the process is touched (with sqlite3 alone: SQLAlchemy's import
    # and the store's opening would come before the cut); the image is recorded once sealed
    store.check(db or store.default_db_path())
    save = engines.Save(options, leave_running, int(lock_timeout * 1000), streams=streams,
                        chunk_mb=chunk_mb)
    with Progress.on_terminal(f"checkpoint PID {pid}", as_json) as progress:
        engine = engines.for_checkpoint(concurrent, gpu_only, settings,
                                        _lines(as_json, progress), progress)
        r = engine.checkpoint(pid, Path(directory), save)
    from pos.store import images

    images.record(db, r.path, r.manifest.to_json() if r.manifest else "{}")
    _report(r, as_json)


@click.command(cls=PosCommand, epilog=EPILOG_RESTORE)
@click.option("-D", "--dir", "directory", required=True, type=PosPath(file_okay=False),
              help="The image directory that `pos checkpoint` wrote.")
@click.option("--inherit-fd", multiple=True, metavar="fd[N]:RES",
              help="Give the restored tree this file descriptor of pos (CRIU's --inherit-fd).")
@click.option("--gpu-only", "gpu_only_pid", type=int, metavar="PID",
              help="Put a `--concurrent` GPU image back into the running `pos run` process PID, "
                   "on demand: it runs on at once, calls wait only for buffers not back yet.")
@click.option("--streams", type=click.IntRange(1, 64), default=None,
              help="With --gpu-only: restorer streams (threads) [default: 16].")
@to_gpu_option("Restore")
@click.option("--no-service", is_flag=True,
              help="Restore in this process, and wait for the job's device memory, even "
                   "where `pos restore-service` answers (on "
                   f"{SERVICE_SOCKET}, or ${SERVICE_SOCKET_ENV}).")
@click.option("--standby", is_flag=True,
              help="Have `pos restore-service` restore the job and hold it ready, not running: "
                   "a later `pos restore -D DIR` then only runs it.")
@click.option("--until-filled", is_flag=True,
              help="Return once the job's device memory is all back, with the fill's "
                   "figures, rather than once the job runs (the restore service, or a "
                   "process of pos's own, fills the rest while it runs). A restore in this "
                   "process (--no-service) always waits for it.")
@db_option
@json_option
def restore(directory: str, inherit_fd: tuple[str, ...], gpu_only_pid: Optional[int],
            streams: Optional[int], to_gpu: Optional["Onto"], no_service: bool, standby: bool,
            until_filled: bool, db: Optional[str], as_json: bool) -> None:
    """Restore a process tree from an image and resume it once the image's checksums match.

    Where `pos restore-service` runs, the restore runs there, with its modules, NVML and GPU
    contexts ready, and it returns once the job runs (the service fills the rest of its device
    memory meanwhile; --until-filled waits for it). Elsewhere a concurrent image's restore runs
    in a process of pos's own, detached, which fills the rest the same way (its log in
    POS_LOG_DIR when it fails); --no-service, --inherit-fd and --gpu-only restore in this
    process. With --standby the service holds the job ready (restored, checked, its device
    memory back, not running) until `pos restore -D DIR` asks for it."""
    from pathlib import Path

    from pos import host
    from pos.settings import Settings
    from pos.store import db as store

    host.require_root("restoring an image")
    if gpu_only_pid is not None and to_gpu is not None:
        raise click.UsageError("--to-gpu goes with whole-process images, not --gpu-only.")
    if streams and gpu_only_pid is None:
        raise click.UsageError("--streams goes with --gpu-only.")
    here = no_service or bool(inherit_fd) or gpu_only_pid is not None   # in this process
    if standby and here:
        raise click.UsageError("--standby is the restore service's: it goes with neither "
                               "--no-service, --inherit-fd nor --gpu-only.")
    settings = Settings.from_env()
    if gpu_only_pid is None:
        # a bad --db is refused before anything is restored; the restore is recorded once the
        # job runs, by a process that opened the store meanwhile (pos/store/ahead.py)
        store.check(db or store.default_db_path())

    from contextlib import nullcontext

    from pos.store.ahead import Ahead

    # a job held ready is not recorded (the restore that runs it is)
    with Ahead(db) if gpu_only_pid is None and not standby else nullcontext() as record:
        if not here and _served(directory, to_gpu, record, as_json, standby, until_filled):
            return
        if standby:
            raise BadInput(f"no restore service answers on {service_socket()}",
                           "start `pos restore-service` first: --standby holds the job ready "
                           "there")
        if not here and _detached(directory, to_gpu, record, as_json, settings.log_dir,
                                  until_filled):
            return

        from pos.engines import engines
        from pos.image.opened import open_image
        from pos.operation import steps
        from pos.progress import Progress

        load = engines.Load(tuple(inherit_fd), to_gpu, gpu_only_pid, streams)
        with Progress.on_terminal(f"restore {directory}", as_json) as progress:
            if to_gpu is not None:      # an image or a host that cannot move it: said first
                from pos.concurrent.restore import movable
                from pos.operation import gpumap

                movable(Path(directory), True)
                gpumap.check_host(to_gpu)
            img = open_image(Path(directory))
            engine = (engines.GpuOnly(settings, _lines(as_json, progress), progress)
                      if gpu_only_pid is not None else
                      engines.for_image(img, settings, _lines(as_json, progress), progress))
            r = engine.restore(img, load)
            if record is not None:
                steps.timed(r.timings, "record", lambda: record.restored(str(Path(r.path))))
    _report(r, as_json)


def _served(directory: str, to_gpu: Optional["Onto"], record: Optional["Ahead"],
            as_json: bool, standby: bool, until_filled: bool) -> bool:
    """The restore done by `pos restore-service`, recorded (by `record`) and printed as one
    done here is (or with `standby`, the job held ready there, said); False where no service
    answers, or the restore is this process's to do."""
    from pos.engines import service_client    # socket and json: before the engines' imports,
                                                # which the service spares the client
    served = service_client.restore(service_socket(), directory,
                                    None if to_gpu is None else str(to_gpu), _lines(as_json),
                                    standby, until_filled)
    return _done(served, record, as_json)


def _detached(directory: str, to_gpu: Optional["Onto"], record: Optional["Ahead"],
              as_json: bool, log_dir: "Path", until_filled: bool) -> bool:
    """A concurrent image's restore done by a process of its own that fills the job's device
    memory after the command returned (pos/engines/detached.py), recorded and printed as one
    done here is; False for the other kinds, and where the restore is this process's to do."""
    from pathlib import Path

    from pos.engines import detached
    from pos.image.kinds import ImageKind, kind

    if kind(Path(directory)) is not ImageKind.CONCURRENT:
        return False
    return _done(detached.restore(directory, None if to_gpu is None else str(to_gpu),
                                  _lines(as_json), log_dir, until_filled), record, as_json)


def _done(served: Optional[Union["Restored", "Running", "Held"]], record: Optional["Ahead"],
          as_json: bool) -> bool:
    """A restore done in another process, recorded (by `record`) and printed; False where
    there was none."""
    from pos.engines.service_protocol import Held

    if served is None:
        return False
    if isinstance(served, Held):
        if as_json:
            click.echo(json.dumps({"path": served.path, "held": True}))
        else:
            _summary(served.summary)
        return True
    if record is not None:
        record.restored(served.path)
    if as_json:
        click.echo(json.dumps(served.report))
    else:
        _summary(served.summary)
    return True


@click.command("restore-service", cls=PosCommand, epilog=EPILOG_RESTORE_SERVICE)
@click.option("--socket", "socket_path", default=SERVICE_SOCKET, envvar=SERVICE_SOCKET_ENV,
              show_default=True, show_envvar=True, type=PosPath(dir_okay=False),
              help="Where `pos restore` asks for restores (made 0600; its folder 0700).")
@click.option("--gpus", metavar="N,N,...", default=None,
              help="The GPUs to keep a CUDA context on (nvidia-smi's indexes) [default: every "
                   "GPU].")
def restore_service(socket_path: str, gpus: Optional[str]) -> None:
    """Restore images for `pos restore`, with everything a restore sets up first made once.

    At its start it imports the restore's modules, initialises NVML and retains a CUDA
    context on each GPU, then says `pos restore-service: ready on SOCKET (GPUs ...)`. Each
    request's restore runs on a thread of its own, guarded by its own watchdog: a client that
    goes away does not stop it. `pos restore --standby` has it hold a job ready, not running,
    until `pos restore` asks for it. SIGTERM or SIGINT: the socket goes, running restores
    finish, the jobs held ready end, exit 0."""
    from pathlib import Path

    from pos import host
    from pos.engines import service

    host.require_root("the restore service")
    wanted = service.parse_gpus(gpus) if gpus is not None else None
    service.run(Path(socket_path), wanted, click.echo)


@click.command(cls=PosCommand, epilog=EPILOG_INSPECT)
@click.argument("directory", type=PosPath(file_okay=False))
@click.option("--verify", is_flag=True, help="Also check every file's size and checksums.")
@click.option("--json", "as_json", is_flag=True, help="Print the manifest as JSON.")
def inspect(directory: str, verify: bool, as_json: bool) -> None:
    """Show what an image holds: process, GPUs, driver, files, the time of each step."""
    from pathlib import Path

    from pos import image
    from pos.operation import timings

    m = (image.verify if verify else image.load)(Path(directory))
    if as_json:
        click.echo(m.to_json(), nl=False)
        return
    gpus = ", ".join(f"{g['name']} {g['uuid']}" for g in m.gpus) or "n/a"
    stall = "n/a (stopped after the dump)" if m.stall_s is None else f"{m.stall_s:.3f} s"
    steps, figures = timings.split(m.timings)
    rows = [("process", f"PID {m.pid} {m.comm}: {m.cmdline}"),
            ("tree", f"{len(m.pids)} process(es) {m.pids}, CUDA state in {m.gpu_pids or 'none'}"),
            ("taken", f"{m.created_at} on {m.host} (kernel {m.kernel}, CRIU {m.criu_version})"),
            ("driver", f"{m.driver_version or 'n/a'} (CUDA {m.cuda_version or 'n/a'})"),
            ("GPUs", gpus),
            ("options", ", ".join(k for k, v in m.criu_options.items() if v) or "none"),
            ("size", f"{m.size_bytes} bytes in {len(m.files)} files"),
            ("steps", timings.describe(steps))]
    if figures:     # sizes, counts, the driver's codes, moments: no step's seconds
        rows.append(("figures", timings.describe(figures)))
    rows.append(("stall", stall))
    for key, value in rows:
        click.echo(f"{key:8} {value}")
    if verify:
        click.echo(f"verify   every file matches its checksums ({', '.join(m.hashes())} of "
                   f"each {m.chunk_bytes / 2**20:g} MiB chunk)")


@click.command(cls=PosCommand, epilog=EPILOG_MIGRATE)
@click.argument("pid", type=int, required=False)
@to_gpu_option("Move the job's GPU state")
@click.option("--to", "to_host", metavar="HOST[:PORT]",
              help="Stream the process to `pos migrate --listen` on HOST.")
@click.option("--listen", is_flag=True, help="Receive a migrating process and restore it here.")
@click.option("--port", type=click.IntRange(1, 65534), default=7070, show_default=True,
              help="With --listen: the control port (CRIU's page server uses PORT+1).")
@click.option("--address", default="127.0.0.1", show_default=True,
              help="With --listen: the address to listen on (this host's own by default: give "
                   "the address the other host reaches; only a holder of the key is heard).")
@click.option("--key", "key_dir", type=PosPath(file_okay=False), metavar="DIR",
              help="With --to, --listen or --new-key: the folder of the migration key that "
                   "both hosts hold [default: $POS_MIGRATE_KEY, else /etc/pos/migrate].")
@click.option("--new-key", is_flag=True,
              help="Make a migration key (a certificate and its private key, root's alone) "
                   "for two hosts to share, then copy its folder to the other host.")
@click.option("-D", "--dir", "directory", type=PosPath(file_okay=False),
              help="With --listen: where the received image goes; with --to: the local part "
                   "of the image; with --to-gpu --concurrent: the image, kept [default: a "
                   "temporary folder, removed once the job runs again].")
@lock_timeout_option
@click.option("--concurrent", is_flag=True,
              help="A `pos run` job, frozen only for the driver's small checkpoint and CRIU's "
                   "dump (its device memory copied by pos): with --to, its image is sent "
                   "whole; with --to-gpu, restored onto that GPU in a new process.")
@criu_options
@json_option
def migrate(pid: Optional[int], to_gpu: Optional["Onto"], to_host: Optional[str], listen: bool,
            port: int, address: str, key_dir: Optional[str], new_key: bool,
            directory: Optional[str], lock_timeout: float, concurrent: bool,
            shell_job: bool, tcp_established: bool, ext_unix_sk: bool, file_locks: bool,
            external: tuple[str, ...], as_json: bool) -> None:
    """Move a process onto another GPU of this host, or to another host."""
    from pathlib import Path

    from pos.engines import engines
    from pos.engines import migrate as mig
    from pos.progress import Progress
    from pos.engines import migrate_key
    from pos.settings import Settings

    modes = sum((to_gpu is not None, to_host is not None, listen, new_key))
    if modes != 1:
        raise click.UsageError("give exactly one of --to-gpu N, --to HOST, --listen or "
                               "--new-key.")
    if key_dir is not None and to_gpu is not None:
        raise click.UsageError("--key goes with --to HOST, --listen or --new-key.")
    folder = Path(key_dir) if key_dir else migrate_key.default_dir()
    if new_key:
        made = migrate_key.create(folder)
        click.echo(json.dumps({"key": str(made.folder)}) if as_json else
                   f"made the migration key {made.folder}; copy it to the other host as root, "
                   f"e.g. scp -rp {made.folder} HOST:{made.folder}")
        return
    if concurrent and listen:
        raise click.UsageError("--concurrent goes with --to HOST or --to-gpu N.")
    if directory is not None and to_gpu is not None and not concurrent:
        raise click.UsageError("-D goes with --to-gpu only with --concurrent (the driver's own "
                               "move writes no image).")
    settings = Settings.from_env()
    if listen:
        if directory is None:
            raise click.UsageError("--listen needs -D DIR (where the image goes).")
        from pos import host

        host.require_root("receiving a migration")
        with Progress.on_terminal(f"migrate to {directory}", as_json) as progress:
            def restore(folder: Path) -> Optional[int]:
                """The received image back, by the engine its kind asks for."""
                from pos.image.opened import open_image

                img = open_image(folder)
                return engines.for_image(img, settings, _lines(as_json, progress),
                                         progress).restore(img, engines.Load()).restored_pid

            pid_here = mig.listen(address, port, Path(directory), settings,
                                  migrate_key.load(folder), restore,
                                  echo=_lines(as_json, progress), progress=progress)
        click.echo(json.dumps({"restored_pid": pid_here}) if as_json
                   else f"restored PID {pid_here}")
        return
    if pid is None:
        raise MissingArgument("PID", "the process to migrate")
    save = engines.Save(criu_options_from(shell_job, tcp_established, ext_unix_sk, file_locks,
                                          external), False, int(lock_timeout * 1000))
    with Progress.on_terminal(f"migrate PID {pid}", as_json) as progress:
        engine = engines.for_checkpoint(concurrent, False, settings, _lines(as_json, progress),
                                        progress)
        if to_gpu is not None:
            moved = engine.move(pid, to_gpu, save, Path(directory) if directory else None)
            report: dict[str, Any] = {"pid": pid, "gpu": str(to_gpu),
                                      "restored_pid": moved.restored_pid,
                                      "timings": moved.timings}
        else:
            there, timings = mig.to_host(pid, to_host or "", engine, save,
                                         Path(directory) if directory else None, folder,
                                         progress)
            report = {"pid": pid, "host": to_host, "restored_pid": there, "timings": timings}
    if as_json:
        click.echo(json.dumps(report))
        return
    from pos.engines import summary

    _summary(summary.migration(report))
