"""`pos run`: start a program with pos's agent preloaded into it."""

import signal
from typing import Optional

import click

from pos.usage import PosCommand

EPILOG_RUN = """\b
Examples:
  pos run -- python train.py --epochs 3        # any program: Python, a C++ server, a script
  pos run --name job1 -- ./serve.sh            # the scheduler finds it by --name job1
  POS_OWN=0 pos run -- python train.py         # the agent without owning memory (a baseline)
  pos run --clonable -- python serve.py        # one image of it restores many times at once
  pos run -- torchrun --standalone --nproc-per-node 2 train.py   # DDP as users start it
  pos run --allow-io-uring -- ./server         # the job keeps io_uring (not checkpointable)
"""


@click.command(cls=PosCommand, epilog=EPILOG_RUN, context_settings={"ignore_unknown_options": True})
@click.option("--name", help="A name for the job (POS_RUN_NAME; the scheduler finds it by it).")
@click.option("--clonable", is_flag=True,
              help="Run COMMAND in PID and network namespaces of its own, as a container's "
                   "process is, so that one image of it can be restored many times at once, "
                   "each copy in new namespaces (COMMAND is PID 1 there). CUDA did not start "
                   "in them with driver 580 (docs/warm-starts.md).")
@click.option("--allow-io-uring", is_flag=True,
              help="Leave io_uring to COMMAND. By default io_uring_setup fails with ENOSYS in "
                   "COMMAND and every process it starts (a seccomp filter), so that libuv "
                   "(torchrun's TCPStore) runs on epoll and CRIU can dump the tree; with this "
                   "flag `pos checkpoint` refuses a job that opened an io_uring.")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def run(name: Optional[str], clonable: bool, allow_io_uring: bool,
        command: tuple[str, ...]) -> None:
    """Run COMMAND with pos's agent preloaded (LD_PRELOAD), so that `pos checkpoint
    --concurrent` can save it while it runs, and the driver's engines can checkpoint it. Every
    process of COMMAND that uses CUDA gets its own agent, and none can open an io_uring (CRIU
    cannot dump one) unless --allow-io-uring. Exits with COMMAND's exit status."""
    import os
    import shutil

    from pos.agent import IO_URING_ENV, RUN_NAME_ENV
    from pos.agent.hook import build

    prog = shutil.which(command[0])
    if prog is None:
        raise click.UsageError(f"{command[0]}: command not found.")
    lib = str(build())
    env = dict(os.environ)
    env["LD_PRELOAD"] = " ".join(p for p in (lib, env.get("LD_PRELOAD")) if p)
    if name:
        env[RUN_NAME_ENV] = name
    env[IO_URING_ENV] = "allowed" if allow_io_uring else "refused"
    if clonable:
        from pos.agent import namespaces

        namespaces.enter()          # returns in the job's new namespaces
    if not allow_io_uring:
        from pos.agent.seccomp import refuse_io_uring

        refuse_io_uring(root=os.geteuid() == 0)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.execvpe(prog, list(command), env)
