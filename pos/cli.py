"""The `pos` command: one click group; the commands live beside the packages they front.

    pos/tracer/commands.py               trace, export
    pos/analyzer/commands.py             analyze
    pos/agent/commands.py                run
    pos/scheduler/commands.py            checkpoint, restore, inspect, migrate
    pos/cron/commands.py   schedule (add, ls, rm), daemon, images (ls, prune)
    pos/cli.py                           doctor (its checks: pos/doctor.py)
    pos/options.py                       options shared by several commands (--db, CRIU's)

Command modules import only click at the top and their packages' modules inside the commands,
so that `pos --help` stays fast. Errors travel as PosError and leave as one sentence with the
exit code of pos/errors.py.
"""

import signal
import sys
from typing import Any

import click

from pos import __version__
from pos.agent.commands import run
from pos.analyzer.commands import analyze
from pos.errors import PosError, denied
from pos.scheduler.commands import checkpoint, inspect, migrate, restore
from pos.cron.commands import daemon, images, schedule
from pos.tracer.commands import export, trace


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
"""


class PosGroup(click.Group):
    """Turns PosError (and a file this user may not use) into click's error output and exit
    code."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except PermissionError as e:
            raise _click_error(denied(e)) from None
        except PosError as e:
            raise _click_error(e) from None


def _click_error(e: PosError) -> click.ClickException:
    err = click.ClickException(e.message)
    err.exit_code = e.exit_code
    return err


@click.group(cls=PosGroup, epilog=EPILOG_POS,
             context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="pos")
def cli() -> None:
    """pos: transparent, concurrent checkpoint/restore of GPU processes."""


@cli.command(epilog=EPILOG_DOCTOR)
def doctor() -> None:
    """Check every prerequisite of pos on this host and say how to get what is missing."""
    from pos.doctor import run_checks

    if not run_checks(click.echo):
        sys.exit(1)


cli.add_command(trace)
cli.add_command(export)
cli.add_command(analyze)
cli.add_command(run)
cli.add_command(checkpoint)
cli.add_command(restore)
cli.add_command(inspect)
cli.add_command(migrate)
cli.add_command(schedule)
cli.add_command(daemon)
cli.add_command(images)


def _terminate(_signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt


def main() -> None:
    # SIGTERM unwinds like Ctrl-C, through every command's cleanups (probes detached, ...).
    signal.signal(signal.SIGTERM, _terminate)
    cli(prog_name="pos")


if __name__ == "__main__":
    main()
