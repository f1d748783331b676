"""Options shared by the command modules of several packages (pos/*/commands.py), each defined
once; those of the engines' commands alone are in pos/engines/options.py. Only click is
imported here: `pos --help` must stay light.
"""

from typing import Any

import click

from pos.usage import PosPath


def db_option(f: Any) -> Any:
    """`--db FILE` (POS_DB): the store; None means the default path (pos.store.db)."""
    return click.option("--db", "db", type=PosPath(dir_okay=False), envvar="POS_DB",
                        default=None, show_envvar=True,
                        help="SQLite file of the store [default: /var/lib/pos/pos.db].")(f)


def json_option(f: Any) -> Any:
    """`--json`: the final report as one JSON object on stdout, for scripts (the lines of the
    steps go to stderr then, and no progress is drawn)."""
    return click.option("--json", "as_json", is_flag=True,
                        help="Print the final report as one JSON object (for scripts).")(f)
