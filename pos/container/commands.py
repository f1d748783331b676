"""`pos cdi` and `pos container checkpoint|restore`: GPU jobs in containers (podman, rootful).
The package's modules are imported inside the commands."""

import json
from typing import Optional

import click

from pos.options import db_option, json_option
from pos.usage import PosCommand, PosCommands, PosPath

EPILOG_CDI = """\b
Examples:
  pos cdi                                   # /etc/cdi/pos.json; then:
  podman run -d --name job1 --device pos.dev/agent=hook IMAGE python train.py
  pos cdi -o /var/run/cdi/pos.json          # where a runtime reads specs written at boot
  pos cdi -o -                              # print the spec
"""

EPILOG_CONTAINER = """\b
Examples:
  pos container checkpoint job1 -D /var/lib/pos/images/job1 --leave-running
  pos container restore -D /var/lib/pos/images/job1 --name job1-copy1
  for i in 1 2 3 4; do                      # one image, four containers at once
    pos container restore -D /var/lib/pos/images/job1 --name copy$i & done; wait
"""


def _root() -> None:
    import os

    from pos.errors import BadInput

    if os.geteuid() != 0:
        raise BadInput("pos saves containers of rootful podman only, as root",
                       "run pos with sudo")


@click.command(cls=PosCommand, epilog=EPILOG_CDI)
@click.option("-o", "--output", default=None, metavar="FILE",
              help="Where the spec goes ('-': standard output) [default: /etc/cdi/pos.json].")
def cdi(output: Optional[str]) -> None:
    """Write the CDI spec of pos's agent: the device pos.dev/agent=hook mounts libposhook.so
    into a container and preloads it, so that a container started with `--device
    pos.dev/agent=hook` can be saved by `pos container checkpoint` while it runs. The library
    is installed in /opt/pos/lib, one file per version, each kept: a container's image
    restores only with the agent it was taken with."""
    from pathlib import Path

    from pos.agent.hook import build
    from pos.container import cdi as spec

    built = Path(build())
    if output == "-":
        click.echo(spec.spec(spec.library_for(built)).to_json(), nl=False)
        return
    _root()
    library = spec.install_library(built)
    path = Path(output) if output else spec.SPEC
    spec.write(path, library)
    click.echo(f"wrote {path}: start containers with --device {spec.QUALIFIED}")


@click.group(cls=PosCommands, epilog=EPILOG_CONTAINER)
def container() -> None:
    """Save a running container whose job has pos's agent (`pos cdi`) while it runs, and
    restore it as new containers (rootful podman, CRIU underneath)."""


@container.command("checkpoint", epilog=EPILOG_CONTAINER)
@click.argument("name")
@click.option("-D", "--dir", "directory", required=True, type=PosPath(file_okay=False),
              help="Directory of the new image (must not exist; written as DIR.partial first).")
@click.option("--leave-running", is_flag=True,
              help="Keep the container running once saved (otherwise it is stopped).")
@db_option
@json_option
def checkpoint(name: str, directory: str, leave_running: bool, db: Optional[str],
               as_json: bool) -> None:
    """Save the container NAME into an image directory while its job runs: its processes and
    files through podman's checkpoint (CRIU), its GPU memory through pos, held about as long
    as the driver's checkpoint of a small context and CRIU's dump take. Whatever fails, the
    container is left running."""
    from pathlib import Path

    from pos.container import checkpoint as save
    from pos.engines import summary
    from pos.settings import Settings
    from pos.store import images
    from pos.store.db import open_store

    _root()
    open_store(db)
    r = save.checkpoint(name, Path(directory), leave_running, Settings.from_env(),
                        lambda text: click.echo(text, err=as_json))
    images.record(db, r.path, r.manifest.to_json() if r.manifest else "{}")
    if as_json:
        click.echo(json.dumps(r.to_json()))
    else:
        for line in summary.of(r):
            click.echo(line)


@container.command("restore", epilog=EPILOG_CONTAINER)
@click.option("-D", "--dir", "directory", required=True,
              type=PosPath(exists=True, file_okay=False),
              help="The image directory that `pos container checkpoint` wrote.")
@click.option("--name", required=True, help="The new container's name.")
@json_option
def restore(directory: str, name: str, as_json: bool) -> None:
    """Start the container of an image again as the new container NAME, once the image's
    checksums match: its job runs at once, its GPU memory filled while it runs. One image
    restores as many times as wanted, at once, each under a name of its own."""
    from pathlib import Path

    from pos.container import restore as load
    from pos.engines import summary
    from pos.settings import Settings

    _root()
    r = load.restore(Path(directory), name, Settings.from_env(),
                     lambda text: click.echo(text, err=as_json))
    if as_json:
        click.echo(json.dumps(r.to_json()))
    else:
        for line in summary.of(r):
            click.echo(line)
