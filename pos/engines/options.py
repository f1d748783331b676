"""Options of the engines' commands (pos/engines/commands.py) and the schedules that run them
(pos/cron/commands.py): CRIU's options and `--to-gpu`, each defined once, and where the restore
service listens (`pos restore-service --socket` and `pos restore`, through POS_RESTORE_SOCKET,
name the same socket).

Only click and pos's settings are imported here: `pos --help` must stay light, so what the
options turn into is built when a command runs (`criu_options_from` imports CRIU's module then).
"""

import os
from typing import Any

import click

from pos.settings import DEFAULT_LOCK_TIMEOUT_MS

SERVICE_SOCKET = "/run/pos/restore.sock"
SERVICE_SOCKET_ENV = "POS_RESTORE_SOCKET"


def service_socket() -> str:
    """Where `pos restore` looks for `pos restore-service`: POS_RESTORE_SOCKET, else the
    service's default socket."""
    return os.environ.get(SERVICE_SOCKET_ENV) or SERVICE_SOCKET


def lock_timeout_option(f: Any) -> Any:
    """`--lock-timeout S`: how long the driver may take to lock the CUDA processes."""
    return click.option("--lock-timeout", type=click.FloatRange(0.001, 3600),
                        default=DEFAULT_LOCK_TIMEOUT_MS / 1000, show_default=True,
                        help="Seconds the driver may take to lock the CUDA process.")(f)


def criu_options(f: Any) -> Any:
    """The CRIU options a dump may need (recorded in the image; restore reuses them)."""
    for opt in reversed((
        click.option("--shell-job", is_flag=True,
                     help="The process does not lead its session: a job started by a shell "
                          "or a script, with or without a terminal."),
        click.option("--tcp-established", is_flag=True, help="Save live TCP connections."),
        click.option("--ext-unix-sk", is_flag=True,
                     help="Allow UNIX sockets connected outside the process tree."),
        click.option("--file-locks", is_flag=True, help="Save file locks."),
        click.option("--external", multiple=True, metavar="RES",
                     help="A resource CRIU leaves alone (CRIU's --external), repeatable."),
    )):
        f = opt(f)
    return f


def criu_options_from(shell_job: bool, tcp_established: bool, ext_unix_sk: bool,
                      file_locks: bool, external: tuple[str, ...]) -> Any:
    """The values of `criu_options` as a pos.process.criu.Options."""
    from pos.process.criu import Options

    return Options(shell_job, tcp_established, ext_unix_sk, file_locks, tuple(external))


class _GpuTarget(click.ParamType):
    """`--to-gpu`'s value: N, or OLD=NEW,... (pos.operation.gpumap.Onto)."""

    name = "N|OLD=NEW,..."

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        from pos.errors import BadInput
        from pos.operation.gpumap import Onto
        from pos.usage import PosBadParameter

        if isinstance(value, Onto):
            return value
        try:
            return Onto.parse(str(value))
        except BadInput as e:    # its message names the fix already
            raise PosBadParameter(f"{e.cause}: {e.fix}", ctx, param) from None


def to_gpu_option(what: str) -> Any:
    """`--to-gpu N` or `--to-gpu 0=1,1=0` (NVML's indices, as nvidia-smi shows them)."""
    return click.option("--to-gpu", type=_GpuTarget(), default=None,
                        help=f"{what} onto GPU N (NVML index) of this host; a job on several "
                             "GPUs takes a map of each, such as 0=1,1=0.")
