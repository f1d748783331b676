"""`pos`: every command's and subcommand's --help ends with examples (an epilog)."""

import click
from click.testing import CliRunner

from pos.cli import cli


def _commands(group: click.Group, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    found = [path]
    for name, cmd in group.commands.items():
        if isinstance(cmd, click.Group):
            found += _commands(cmd, path + (name,))
        else:
            found.append(path + (name,))
    return found


def test_every_help_ends_with_examples() -> None:
    paths = _commands(cli)
    assert ("schedule", "add") in paths and ("doctor",) in paths
    for path in paths:
        r = CliRunner().invoke(cli, [*path, "--help"])
        assert r.exit_code == 0, (path, r.output)
        assert "\n  Examples:\n    pos " in r.output, f"pos {' '.join(path)} --help has no examples"
