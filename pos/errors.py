"""Errors that reach the user as one sentence naming the cause and the fix.

Exit codes, in one place (click's conventions): 0 ok, 1 the operation failed, 2 bad input or a
missing prerequisite that the user must fix.
"""

import os
from dataclasses import dataclass
from typing import Type, TypeVar

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2


class PosError(Exception):
    """A failure the user can act on: `cause` says what is wrong, `fix` what to do."""

    exit_code = EXIT_FAILED

    def __init__(self, cause: str, fix: str = "") -> None:
        self.cause = cause.rstrip(".")
        self.fix = fix.rstrip(".")
        super().__init__(self.message)

    @property
    def message(self) -> str:
        return f"{self.cause}: {self.fix}." if self.fix else f"{self.cause}."


T = TypeVar("T", bound="Told")


@dataclass(frozen=True)
class Told:
    """A PosError's sentence and exit code, as another pos process (the restore service, the
    store's helper) sends it, for this one to raise as its own."""

    cause: str
    fix: str
    exit_code: int

    @classmethod
    def of(cls: Type[T], e: PosError) -> T:
        return cls(e.cause, e.fix, e.exit_code)

    def error(self) -> PosError:
        e = PosError(self.cause, self.fix)
        e.exit_code = self.exit_code
        return e


class BadInput(PosError):
    """Wrong arguments or a missing prerequisite (exit 2)."""

    exit_code = EXIT_BAD_INPUT


def denied(e: PermissionError) -> BadInput:
    """A file this user may not use, said in one sentence: the last guard of the `pos` group,
    for the commands that did not expect it."""
    what = e.filename or "a file it needs"
    if os.geteuid() != 0:
        return BadInput(f"pos may not use {what} as this user ({e.strerror})",
                        "run pos as root (sudo)")
    return BadInput(f"pos may not use {what}, even as root ({e.strerror})",
                    "check the permissions of that file and of the file system it is on")
