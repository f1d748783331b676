"""Every error as pos says errors: one sentence naming the cause and the fix, with the exit code
of pos/errors.py; with `--json` on the command line, a JSON object on stdout instead
(`{"error": SENTENCE, "exit": CODE}`).

pos's own errors (PosError) are sentences already. click's own -- an unknown option, an extra
argument, a missing one, a value out of range -- are three lines of usage, hint and message, and
often name no fix: `sentence` rewrites them from the exception's fields. Only click is imported
here (`pos --help` stays light).
"""

import json
import re
from typing import IO, Any, Optional

import click
from click import exceptions as ce

from pos.errors import PosError

NO_SUCH_COMMAND = getattr(ce, "NoSuchCommand", ())   # click >= 8.4
NO_ARGS_IS_HELP = getattr(ce, "NoArgsIsHelpError", ())   # click >= 8.2: a group alone: its help
# what click says of a bad value -> what to do about it
VALUE_FIXES = (
    ("does not exist", "give the path of one that exists"),
    ("is a directory", "give a file, not a folder"),
    ("is a file", "give a folder, not a file"),
    ("is not writable", "give a path this user may write"),
    ("is not readable", "give a path this user may read"),
    ("is not in the range", "give a value in that range"),
    ("is not one of", "give one of those"),
    ("is not a valid integer", "give a whole number"),
    ("is not a valid float", "give a number"),
    ("is not a valid boolean", "give true or false"),
)


class PosBadParameter(click.BadParameter):
    """A bad value whose message already names the fix (pos's own parameter types)."""


class Said(click.ClickException):
    """An error already put as one sentence; shown as pos shows errors."""

    def __init__(self, sentence: str, exit_code: int, as_json: bool) -> None:
        super().__init__(sentence)
        self.exit_code = exit_code  # type: ignore[misc]  # click reads it from the instance
        self.as_json = as_json

    def show(self, file: Optional[IO[Any]] = None) -> None:
        if self.as_json:
            click.echo(json.dumps({"error": self.message, "exit": self.exit_code}), file=file)
        else:
            click.echo(f"Error: {self.message}", file=file, err=file is None)


def wants_json(args: list[str]) -> bool:
    """`--json` among pos's own arguments (not a job's, after `--`)."""
    return "--json" in (args[:args.index("--")] if "--" in args else args)


def _command(e: click.ClickException, where: str) -> str:
    ctx = getattr(e, "ctx", None)
    return ctx.command_path if ctx is not None else where


def _plain(message: str) -> str:
    """click's message as the cause part of a sentence: one line, no closing period, the
    first letter small."""
    text = " ".join(message.split()).rstrip(".")
    return text[:1].lower() + text[1:] if text[1:2].islower() else text


def sentence(e: BaseException, where: str = "pos") -> tuple[str, int]:
    """(the sentence, the exit code) for a PosError or one of click's errors; `where`: the
    command being parsed, for the errors of click's parser, which name none."""
    if isinstance(e, PosError):
        return e.message, e.exit_code
    if not isinstance(e, click.ClickException):
        raise TypeError(e)
    cmd = _command(e, where)
    see = f"`{cmd} --help`"
    code = e.exit_code
    if isinstance(e, ce.NoSuchOption):
        near = f" (did you mean {' or '.join(e.possibilities)}?)" if e.possibilities else ""
        return f"{cmd} has no option {e.option_name}{near}: see {see} for its options.", code
    if NO_SUCH_COMMAND and isinstance(e, NO_SUCH_COMMAND) or \
            e.message.startswith("No such command"):
        name = getattr(e, "command_name", None) or e.message.split("'")[1]
        possible = getattr(e, "possibilities", None)
        hint = f" (did you mean {' or '.join(possible)}?)" if possible else ""
        return f"{cmd} has no command {name!r}{hint}: see {see} for its commands.", code
    if isinstance(e, ce.BadOptionUsage) and "requires an argument" in e.message:
        return (f"the option {e.option_name} of {cmd} needs a value: give one, as the examples "
                f"of {see} do."), code
    if isinstance(e, ce.MissingParameter):
        param = e.param
        what = param.param_type_name if param is not None else "parameter"
        hint = param.get_error_hint(e.ctx) if param is not None and e.ctx else ""
        return f"{cmd} needs the {what} {hint}: give it, as the examples of {see} do.", code
    if isinstance(e, PosBadParameter):
        return f"{_plain(e.format_message())}.", code
    if isinstance(e, click.BadParameter):
        message = _plain(e.format_message())
        fix = next((f for said, f in VALUE_FIXES if said in message), f"see {see}")
        return f"{message}: {fix}.", code
    extra = re.match(r"Got unexpected extra arguments? \((.*)\)", e.message)
    if extra:
        return (f"{cmd} got an unexpected extra argument ({extra.group(1)}): remove it, or "
                f"quote a value that holds spaces; {see} shows what the command takes."), code
    missing = re.match(r"Missing argument '(\w+)'(?: \((.*)\))?", e.message)
    if missing:
        what = f" ({missing.group(2)})" if missing.group(2) else ""
        return (f"{cmd} needs the argument {missing.group(1)}{what}: give it, as the examples "
                f"of {see} do."), code
    if isinstance(e, click.UsageError):
        return f"{cmd}: {_plain(e.message)}: see {see}.", code
    return f"{_plain(e.format_message())}.", code


def said(e: BaseException, as_json: bool, where: str = "pos") -> click.ClickException:
    """`e` as pos says errors; said already (or a group's help, shown as click shows it): as
    it is."""
    if isinstance(e, Said) or NO_ARGS_IS_HELP and isinstance(e, NO_ARGS_IS_HELP):
        return e
    return Said(*sentence(e, where), as_json)
