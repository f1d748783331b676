"""`pos run`: start a Python program with the pos agent inside it."""

import signal
from typing import Optional

import click

EPILOG_RUN = """\b
Examples:
  pos run -- python train.py --epochs 3        # the agent starts inside the program
  pos run --name job1 --track-dirty -- python train.py
  pos run --validation val.json -- python serve.py   # kernels the validator validated
"""


@click.command(epilog=EPILOG_RUN, context_settings={"ignore_unknown_options": True})
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
    from pos.analyzer import load_validation

    if validation:
        load_validation(validation)      # a bad table is refused here, not ignored by the agent
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
    boot = str(Path(__file__).resolve().parent / "boot")
    root = str(Path(__file__).resolve().parent.parent.parent)
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
