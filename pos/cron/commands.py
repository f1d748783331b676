"""`pos schedule` (add, ls, rm), `pos daemon` and `pos images` (ls, prune): scheduled snapshots
and the images they keep. The engines and the store are imported inside the commands."""

import json
from typing import Any, Optional

import click

from pos.engines.options import criu_options, criu_options_from
from pos.options import db_option, json_option
from pos.usage import PosCommand, PosCommands

EPILOG_SCHEDULE_ADD = """\b
Examples:
  pos schedule add --cron '*/15 * * * *' --match 'train\\.py' -D /var/lib/pos/images \\
      --keep 4 --leave-running        # every 15 min (UTC), the job whatever its PID, last 4
  pos schedule add --cron '0 * * * *' --name job1 -D /data/ckpt --max-age 1d --max-bytes 200G \\
      --leave-running                 # hourly, the `pos run --name job1` job, by age and size
  pos schedule add --cron '* * * * * */10' --pid 4242 -D /tmp/snaps --keep 3 --leave-running
                                      # every 10 seconds (sixth field: seconds), PID 4242
  pos schedule add --cron '*/5 * * * *' --name job1 --engine concurrent -D /data/ckpt \
      --keep 6 --leave-running        # a `pos run` job, the whole process saved while it runs
                                      # (held about a second); restore: pos restore -D DIR
  pos schedule add --cron '0 * * * *' --match 'serve\\.py' --tcp-established --shell-job \\
      -D /data/ckpt --keep 2 --leave-running   # CRIU options, as for `pos checkpoint`
"""

EPILOG_SCHEDULE = """\b
Examples:
  pos schedule add --cron '*/15 * * * *' --match 'train\\.py' -D /var/lib/pos/images --keep 4
  pos schedule ls                     # each schedule with its last outcome and next run
  pos schedule rm 3                   # its images stay on disk
"""

EPILOG_SCHEDULE_LS = """\b
Examples:
  pos schedule ls                     # the default store (POS_DB, else /var/lib/pos/pos.db)
  pos schedule ls --db /tmp/t.db      # another store
  pos schedule ls --json              # one JSON object per schedule, in a list
"""

EPILOG_SCHEDULE_RM = """\b
Examples:
  pos schedule rm 3                   # schedule 3 and its run history; its images stay on disk
  pos images prune --schedule 3       # first, to apply its retention one last time
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

EPILOG_IMAGES_LS = """\b
Examples:
  pos images ls                  # every image in the default store, newest first
  pos images ls --db /tmp/t.db   # another store
  pos images ls --json           # one JSON object per image, in a list
"""

EPILOG_IMAGES_PRUNE = """\b
Examples:
  pos images prune --dry-run     # what every schedule's retention would delete now
  pos images prune --schedule 3  # apply schedule 3's retention now
  pos images prune --dry-run --json   # the same as one JSON object
"""


def _when(t: Any) -> Optional[str]:
    return None if t is None else f"{t:%Y-%m-%dT%H:%M:%S}Z"


@click.group(cls=PosCommands, epilog=EPILOG_SCHEDULE)
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
                   "GPU processes, CRIU alone for the rest. concurrent: a whole-process image of "
                   "a `pos run` job, taken while it runs (as `pos checkpoint --concurrent`; "
                   "restore with `pos restore -D DIR`); a run without the agent fails.")
@click.option("--leave-running", is_flag=True,
              help="Resume the target after each snapshot (without it the first snapshot "
                   "ends the process, as `pos checkpoint` does, whatever the engine).")
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
    from pos import image
    from pos.cron import retention, targets, times
    from pos.store import schedules
    from pos.store.db import open_store

    expr = times.validate(expr)
    target = targets.from_options(pid, match, name)
    options = criu_options_from(shell_job, tcp_established, ext_unix_sk, file_locks, external)
    if keep is not None and keep < 1:
        raise BadInput(f"--keep {keep} would keep no image", "give --keep 1 or more")
    policy = retention.Policy(keep, retention.parse_duration(max_age) if max_age else None,
                              retention.parse_bytes(max_bytes) if max_bytes else None)
    root = image.writable_root(root)
    try:
        found: Optional[int] = targets.resolve(target)
    except targets.NoTarget as e:
        if target.kind == "pid":
            raise BadInput(e.cause, "give the PID of a running process") from None
        found = None
    if engine == "concurrent" and found is not None:
        from pos.cron import snapshot

        try:
            snapshot.choose(engine, found)
        except BadInput as e:
            if target.kind == "pid":
                raise
            click.echo(f"note: {e.cause}; its runs fail until the job runs under `pos run`")
    from pos.cron.times import SystemClock

    now = SystemClock().now()
    row = schedules.add(open_store(db), cron=expr, target_kind=target.kind,
                        target=target.value, root=root, engine=engine,
                        leave_running=leave_running,
                        criu_options=json.dumps(options.to_json(), sort_keys=True),
                        keep=policy.keep,
                        max_age_s=policy.max_age_s, max_bytes=policy.max_bytes, created_at=now,
                        next_run_at=times.next_fire(expr, now))
    click.echo(f"schedule {row.id}: {target} at '{expr}' (UTC) into {root}/{row.id}, {policy}; "
               f"next run {row.next_run_at:%Y-%m-%d %H:%M:%S}Z")
    if found is None:
        click.echo(f"note: no process is {target} now; until one is, its runs are "
                   "recorded as no-target")
    if not leave_running:
        click.echo("note: without --leave-running each snapshot ends the target (restore it "
                   "with `pos restore`)")


@schedule.command("ls", epilog=EPILOG_SCHEDULE_LS)
@db_option
@json_option
def schedule_ls(db: Optional[str], as_json: bool) -> None:
    """List the schedules with their last outcome and next run (UTC)."""
    from pos.cron import retention, targets
    from pos.store import schedules
    from pos.store.db import open_existing

    store = open_existing(db)      # none yet: no schedules, and no store made
    last = schedules.last_runs(store) if store else {}
    rows = schedules.all_schedules(store) if store else []
    if as_json:
        click.echo(json.dumps([{
            "id": s.id, "cron": s.cron, "target_kind": s.target_kind, "target": s.target,
            "engine": s.engine, "root": s.root, "leave_running": s.leave_running,
            "keep": s.keep, "max_age_s": s.max_age_s, "max_bytes": s.max_bytes,
            "next_run_at": _when(s.next_run_at),
            "last_run": {"started_at": _when(last[s.id].started_at),
                         "outcome": last[s.id].outcome, "error": last[s.id].error}
            if s.id in last else None} for s in rows]))
        return
    click.echo(f"{'ID':>3} {'CRON':15} {'TARGET':28} {'ENGINE':6} {'LAST RUN (UTC)':19} "
               f"{'OUTCOME':9} {'NEXT RUN (UTC)':19} RETENTION")
    for s in rows:
        t = str(targets.Target(s.target_kind, s.target)).removeprefix("the ")
        lr = last.get(s.id)
        when = f"{lr.started_at:%Y-%m-%d %H:%M:%S}" if lr else "-"
        policy = retention.Policy(s.keep, s.max_age_s, s.max_bytes)
        click.echo(f"{s.id:>3} {s.cron:15} {t[:28]:28} {s.engine:6} {when:19} "
                   f"{lr.outcome if lr else '-':9} {s.next_run_at:%Y-%m-%d %H:%M:%S} {policy}")
        if lr and lr.error:
            click.echo(f"    last error: {lr.error}")


@schedule.command("rm", epilog=EPILOG_SCHEDULE_RM)
@click.argument("schedule_id", metavar="ID", type=int)
@db_option
def schedule_rm(schedule_id: int, db: Optional[str]) -> None:
    """Remove a schedule and its run history (its images stay on disk)."""
    from pos.store import schedules
    from pos.store.db import open_store

    row = schedules.remove(open_store(db), schedule_id)
    click.echo(f"removed schedule {schedule_id}; its images stay in {row.root}/{schedule_id}")


@click.command(cls=PosCommand, epilog=EPILOG_DAEMON)
@db_option
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=9464, show_default=True,
              help="Prometheus endpoint on --metrics-address (0: none).")
@click.option("--metrics-address", default="127.0.0.1", show_default=True)
@click.option("--grace", type=click.FloatRange(min=0), default=120.0, show_default=True,
              help="On SIGTERM: seconds a running snapshot may take to finish before it is "
                   "abandoned (the target always runs on).")
@click.option("--poll", type=click.FloatRange(min=0, min_open=True), default=1.0, show_default=True, hidden=True,
              help="Seconds between ticks.")
def daemon(db: Optional[str], metrics_port: int, metrics_address: str, grace: float,
           poll: float) -> None:
    """Run the schedules of the store until SIGTERM (see `pos schedule`)."""
    from pos import host
    from pos.cron.daemon import Daemon, lock
    from pos.store.db import check, default_db_path

    host.require_root("running the schedules")
    path = db or default_db_path()
    check(path)     # made if missing, so that its lock can be made beside it
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


@click.group(cls=PosCommands, epilog=EPILOG_IMAGES, invoke_without_command=True)
@db_option
@json_option
@click.pass_context
def images(ctx: click.Context, db: Optional[str], as_json: bool) -> None:
    """List the images recorded in the store (`pos images ls`), or prune them."""
    if ctx.invoked_subcommand is None:
        ctx.invoke(images_ls, db=db, as_json=as_json)


@images.command("ls", epilog=EPILOG_IMAGES_LS)
@db_option
@json_option
def images_ls(db: Optional[str], as_json: bool) -> None:
    """List the images recorded in the store, newest first."""
    from pathlib import Path

    from pos.store.images import list_images

    rows = list_images(db)

    def state(r: Any) -> str:
        return "restored" if r.restored_at else ("ok" if Path(r.path).is_dir() else "missing")

    if as_json:
        click.echo(json.dumps([{
            "id": r.id, "created_at": _when(r.created_at), "pid": r.pid, "comm": r.comm,
            "gpu": r.gpu, "size_bytes": r.size_bytes, "stall_s": r.stall_s, "state": state(r),
            "restored_at": _when(r.restored_at), "path": r.path} for r in rows]))
        return
    click.echo(f"{'ID':>4} {'CREATED (UTC)':19} {'PID':>7} {'GPU':3} {'SIZE':>10} {'STALL':>8} "
               f"{'STATE':9} PATH")
    for r in rows:
        stall = "-" if r.stall_s is None else f"{r.stall_s:.2f}s"
        click.echo(f"{r.id:>4} {r.created_at:%Y-%m-%d %H:%M:%S} {r.pid:>7} "
                   f"{'yes' if r.gpu else 'no':3} {r.size_bytes / 2**20:>8.1f}Mi {stall:>8} "
                   f"{state(r):9} {r.path}")


@images.command("prune", epilog=EPILOG_IMAGES_PRUNE)
@click.option("--schedule", "schedule_id", type=int, metavar="ID",
              help="Only this schedule's images [default: every schedule's].")
@click.option("--dry-run", is_flag=True, help="Say what would be deleted; delete nothing.")
@db_option
@json_option
def images_prune(schedule_id: Optional[int], dry_run: bool, db: Optional[str],
                 as_json: bool) -> None:
    """Apply the schedules' retention now (the daemon does after each snapshot)."""
    from pathlib import Path

    from pos.cron import retention
    from pos.cron.times import SystemClock
    from pos.store import images as image_rows
    from pos.store import schedules
    from pos.store.db import open_existing

    store = open_existing(db)      # none yet: no schedules, nothing to prune, no store made
    if store is None:
        if schedule_id is not None:
            raise schedules.no_such(schedule_id)
        rows = []
    elif schedule_id is None:
        rows = list(schedules.all_schedules(store))
    else:
        rows = [schedules.get(store, schedule_id)]
    now = SystemClock().now()
    report = []
    for s in rows:
        assert store is not None       # rows come from it
        policy = retention.Policy(s.keep, s.max_age_s, s.max_bytes)
        gone = retention.prune(Path(s.root) / str(s.id), schedules.made_by(store, s.id),
                               policy, now, dry_run)
        if not dry_run and gone:
            image_rows.forget(db, [str(k.path) for k in gone])
        report.append({"schedule": s.id, "retention": str(policy),
                       "images": [{"path": str(k.path), "bytes": k.size} for k in gone]})
        if as_json:
            continue
        for k in gone:
            click.echo(f"{'would delete' if dry_run else 'deleted'} {k.path} "
                       f"({retention.format_bytes(k.size)})")
        click.echo(f"schedule {s.id}: {len(gone)} image(s) "
                   f"{'to delete' if dry_run else 'deleted'} ({policy})")
    if as_json:
        click.echo(json.dumps({"dry_run": dry_run, "schedules": report}))
