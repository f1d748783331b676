"""Every error as pos says errors: one sentence naming the cause and the fix, with the exit code
of pos/errors.py; with `--json` on the command line, a JSON object on stdout instead
(`{"error": SENTENCE, "exit": CODE}`).

pos's own errors (PosError) are sentences already. click's own -- an unknown option, an extra
argument, a missing one, a value out of range -- are three lines of usage, hint and message, and
often name no fix: `sentence` rewrites them from the exceptions' types and fields (never from
click's English), with pos's own where click has none: the commands are PosCommands, whose
extra arguments are an ExtraArguments, and a path's refusal is a PosPath's, which names the fix.
Only click is imported here (`pos --help` stays light).
"""

import json
import os
from typing import IO, Any, Optional

import click
from click import exceptions as ce

from pos.errors import PosError

# what to do about a bad value, by the type that refused it (the first that matches: a range
# is a number too); a path's fix is told from what is at the path (PosPath)
TYPE_FIXES: tuple[tuple[type, str], ...] = (
    (click.IntRange, "give a value in that range"),
    (click.FloatRange, "give a value in that range"),
    (click.Choice, "give one of those"),
    (click.types.IntParamType, "give a whole number"),
    (click.types.FloatParamType, "give a number"),
    (click.types.BoolParamType, "give true or false"),
)


class PosBadParameter(click.BadParameter):
    """A bad value whose message already names the fix (pos's own parameter types)."""


class PosPath(click.Path):
    """click.Path, whose refusal also names the fix, told from what the file system holds at
    the path and what this type asks of it (not from click's sentence)."""

    def convert(self, value: Any, param: Optional[click.Parameter],
                ctx: Optional[click.Context]) -> Any:
        try:
            return super().convert(value, param, ctx)
        except click.BadParameter as e:
            raise PosBadParameter(f"{e.message.rstrip('.')}: {self.fix(os.fsdecode(value))}",
                                  ctx, param) from None

    def fix(self, path: str) -> str:
        """What to give instead of `path`, which this type refused."""
        if not os.path.exists(path):
            return "give the path of one that exists"
        if os.path.isdir(path) and not self.dir_okay:
            return "give a file, not a folder"
        if not os.path.isdir(path) and not self.file_okay:
            return "give a folder, not a file"
        if self.writable and not os.access(path, os.W_OK):
            return "give a path this user may write"
        return "give a path this user may read"


class MissingArgument(click.UsageError):
    """An argument a command needs in the way it was used, though click's parser lets it out
    (`pos trace --ebpf` takes no PID): its NAME and what it is."""

    def __init__(self, name: str, what: str) -> None:
        super().__init__(f"Missing argument '{name}' ({what}).")
        self.name, self.what = name, what


class ExtraArguments(click.UsageError):
    """Arguments left over once a command took its own."""

    def __init__(self, extra: list[str], ctx: click.Context) -> None:
        super().__init__(f"Got unexpected extra arguments ({' '.join(extra)})", ctx)
        self.extra = extra


class PosCommand(click.Command):
    """A pos command: arguments left over are an ExtraArguments, which names them, rather
    than click's sentence; an error of click's parser, which knows no context, gets the
    command's (what its options are: `_takes_value`)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        allowed, ctx.allow_extra_args = ctx.allow_extra_args, True
        try:
            rest = super().parse_args(ctx, args)
        except click.UsageError as e:
            if e.ctx is None:
                e.ctx = ctx
            raise
        finally:
            ctx.allow_extra_args = allowed
        if rest and not allowed and not ctx.resilient_parsing:
            raise ExtraArguments(rest, ctx)
        return rest


class PosCommands(click.Group):
    """A group of pos commands: each one a PosCommand."""

    command_class = PosCommand


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


def _takes_value(e: ce.BadOptionUsage) -> bool:
    """Whether the option `e` is about takes a value (its misuse: none given) rather than
    being a flag (its misuse: one given), as its command defines it."""
    command = e.ctx.command if e.ctx is not None else None
    option = next((p for p in command.params if isinstance(p, click.Option)
                   and e.option_name in p.opts + p.secondary_opts), None) if command else None
    return option is not None and not option.is_flag and not option.count


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
    if isinstance(e, ce.NoSuchCommand):
        hint = f" (did you mean {' or '.join(e.possibilities)}?)" if e.possibilities else ""
        return (f"{cmd} has no command {e.command_name!r}{hint}: see {see} for its commands.",
                code)
    if isinstance(e, ce.BadOptionUsage) and _takes_value(e):
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
        kind = e.param.type if e.param is not None else None
        fix = next((f for t, f in TYPE_FIXES if isinstance(kind, t)), f"see {see}")
        return f"{_plain(e.format_message())}: {fix}.", code
    if isinstance(e, ExtraArguments):
        return (f"{cmd} got an unexpected extra argument ({' '.join(e.extra)}): remove it, or "
                f"quote a value that holds spaces; {see} shows what the command takes."), code
    if isinstance(e, MissingArgument):
        return (f"{cmd} needs the argument {e.name} ({e.what}): give it, as the examples "
                f"of {see} do."), code
    if isinstance(e, click.UsageError):
        return f"{cmd}: {_plain(e.message)}: see {see}.", code
    return f"{_plain(e.format_message())}.", code


def said(e: BaseException, as_json: bool, where: str = "pos") -> click.ClickException:
    """`e` as pos says errors; said already (or a group's help, shown as click shows it): as
    it is."""
    if isinstance(e, (Said, ce.NoArgsIsHelpError)):
        return e
    return Said(*sentence(e, where), as_json)
