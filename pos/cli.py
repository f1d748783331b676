"""The `pos` command: one click group; the commands live beside the packages they front.

    pos/tracer/commands.py               trace, export
    pos/analyzer/commands.py             analyze
    pos/agent/commands.py                run
    pos/engines/commands.py              checkpoint, restore, restore-service, inspect,
                                         migrate (their options: pos/engines/options.py)
    pos/cron/commands.py                 schedule (add, ls, rm), daemon, images (ls, prune)
    pos/cli.py                           doctor (its checks: pos/doctor.py)
    pos/options.py                       options shared by several packages (--db, --json)

Command modules import only click at the top and their packages' modules inside the commands,
so that `pos --help` stays fast. Errors travel as PosError and leave as one sentence with the
exit code of pos/errors.py.
"""

import json
import signal
import sys
from typing import Any, Optional

import click

from pos import __version__
from pos.agent.commands import run
from pos.analyzer.commands import analyze
from pos.container.commands import cdi, container
from pos.cron.commands import daemon, images, schedule
from pos.engines.commands import checkpoint, inspect, migrate, restore, restore_service
from pos.errors import PosError, denied
from pos.options import json_option
from pos.tracer.commands import export, trace
from pos.usage import PosCommands, said, wants_json


EPILOG_POS = """\b
Examples:
  pos doctor                               # what this host has and lacks
  pos trace 4242 --db /tmp/t.db            # record PID 4242's GPU driver calls
  pos analyze /tmp/t.db                    # its read/write sets, iterations, copy order
  pos checkpoint 4242 -D /tmp/job1         # save it (and end it); pos restore -D /tmp/job1
  pos COMMAND --help                       # each command's options and examples
"""

EPILOG_DOCTOR = """\b
Examples:
  pos doctor                               # one line per prerequisite: ok, n/a or what to do
  sudo .venv/bin/pos doctor                # as root, as pos runs
  pos doctor --json                        # the same as one JSON object (exit 1 if unhealthy)
"""


class PosGroup(PosCommands):
    """Says every error as one sentence with its exit code (pos/usage.py), or as a JSON object
    when the command line has --json: pos's own (PosError, a file this user may not use) and
    click's (parsing the command line happens in `make_context`, the subcommands' in
    `invoke`)."""

    as_json = False

    def make_context(self, info_name: Optional[str], args: list[str],
                     parent: Optional[click.Context] = None, **extra: Any) -> click.Context:
        self.as_json = wants_json(list(args))
        try:
            return super().make_context(info_name, args, parent, **extra)
        except click.ClickException as e:
            raise self._said(e) from None

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except PermissionError as e:
            raise self._said(denied(e)) from None
        except (PosError, click.ClickException) as e:
            raise self._said(e, ctx) from None

    def _said(self, e: Exception, ctx: Optional[click.Context] = None) -> click.ClickException:
        where = "pos"
        if ctx is not None:
            where = " ".join(filter(None, (ctx.command_path, ctx.invoked_subcommand)))
        return said(e, self.as_json, where)


@click.group(name="pos", cls=PosGroup, epilog=EPILOG_POS,
             context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="pos")
def cli() -> None:
    """pos: transparent, concurrent checkpoint/restore of GPU processes."""


@cli.command(epilog=EPILOG_DOCTOR)
@json_option
def doctor(as_json: bool) -> None:
    """Check every prerequisite of pos on this host and say how to get what is missing."""
    from dataclasses import asdict

    from pos.doctor import healthy, results, run_checks

    if as_json:
        found = results()
        ok = healthy(found)
        click.echo(json.dumps({"ok": ok, "checks": [asdict(r) for r in found]}))
    else:
        ok = run_checks(click.echo)
    if not ok:
        sys.exit(1)


cli.add_command(trace)
cli.add_command(export)
cli.add_command(analyze)
cli.add_command(run)
cli.add_command(checkpoint)
cli.add_command(restore)
cli.add_command(restore_service)
cli.add_command(inspect)
cli.add_command(migrate)
cli.add_command(schedule)
cli.add_command(daemon)
cli.add_command(images)
cli.add_command(cdi)
cli.add_command(container)


def _terminate(_signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt


def main() -> None:
    # SIGTERM unwinds like Ctrl-C, through every command's cleanups (probes detached, ...).
    signal.signal(signal.SIGTERM, _terminate)
    cli(prog_name="pos")


if __name__ == "__main__":
    main()
