"""What a schedule snapshots: a PID, the process whose command line matches a regular
expression (a job that restarts gets a new PID and is still found), or the process started by
`pos run --name NAME` (it carries POS_RUN_NAME=NAME in its environment). Resolved through /proc
at every run.

A job's children inherit its command line and environment, so matches inside one tree count
once, as the tree's root. pos never targets itself, its parents, or the processes it gives
as `exclude` and their children (the daemon's snapshot workers, and their CRIU and watchdog).
"""

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from pos import host
from pos.agent import RUN_NAME_ENV
from pos.errors import BadInput, PosError
from pos.process import procs

KINDS = ("pid", "match", "name")


class NoTarget(PosError):
    """No process is the target right now: recorded by the daemon, not retried in a loop."""


@dataclass(frozen=True)
class Target:
    kind: str     # one of KINDS
    value: str    # the PID, the regular expression, or the name

    def __str__(self) -> str:
        if self.kind == "pid":
            return f"PID {self.value}"
        if self.kind == "match":
            return f"the command line matching '{self.value}'"
        return f"the `pos run --name {self.value}` job"


def from_options(pid: Optional[int], match: Optional[str], name: Optional[str]) -> Target:
    """The one target given on the command line (BadInput unless exactly one, and valid)."""
    given = [(k, v) for k, v in zip(KINDS, (pid, match, name)) if v is not None]
    if len(given) != 1:
        raise BadInput("give exactly one target: --pid PID, --match REGEX or --name NAME",
                       "see `pos schedule add -h`")
    kind, value = given[0]
    if kind == "pid" and int(value) <= 0:
        raise BadInput(f"--pid {value} is not a process ID", "give the PID of a running process")
    if kind == "match":
        try:
            re.compile(str(value))
        except re.error as e:
            raise BadInput(f"--match '{value}' is not a valid regular expression ({e})",
                           "fix the expression (Python's re syntax)") from None
    if kind == "name" and not str(value):
        raise BadInput("--name is empty", "give the name used with `pos run --name`")
    return Target(kind, str(value))


def _environ_has(pid: int, entry: bytes) -> bool:
    try:
        return entry in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False


def _candidates(exclude: frozenset[int]) -> list[int]:
    """Live user processes other than pos itself, its parents, `exclude` and their children."""
    me = os.getpid()
    mine = {me, *procs.ancestors(me), *exclude}
    out = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        if pid in mine or not procs.alive(pid) or procs.is_kernel_thread(pid):
            continue
        if exclude.intersection(procs.ancestors(pid)):
            continue
        out.append(pid)
    return out


def _roots(pids: list[int]) -> list[int]:
    """The matches that have no matching ancestor."""
    found = set(pids)
    return sorted(p for p in pids if not found.intersection(procs.ancestors(p)))


def resolve(target: Target, exclude: frozenset[int] = frozenset()) -> int:
    """The PID of the target now; NoTarget when none, BadInput when several unrelated ones."""
    if target.kind == "pid":
        pid = int(target.value)
        if not procs.alive(pid):
            raise NoTarget(f"no process has PID {pid}", "the job has ended; remove the schedule "
                           "or target it by --match or --name")
        return pid
    if target.kind == "match":
        rx = re.compile(target.value)
        hits = [p for p in _candidates(exclude) if rx.search(host.describe(p)[1])]
    else:
        entry = f"{RUN_NAME_ENV}={target.value}".encode()
        hits = [p for p in _candidates(exclude) if _environ_has(p, entry)]
    roots = _roots(hits)
    if not roots:
        raise NoTarget(f"no process is {target}", "start the job, or change the schedule")
    if len(roots) > 1:
        shown = ", ".join(map(str, roots[:8])) + (", ..." if len(roots) > 8 else "")
        raise BadInput(f"{target} matches {len(roots)} processes (PIDs {shown})",
                       "make it match one job, or target a PID")
    return roots[0]


def agent_present(pid: int) -> bool:
    """The `pos run` agent of `pid` answers on its control socket: the concurrent engine can
    snapshot it."""
    from pos.agent.control import Agent

    try:
        with Agent(pid, timeout=5) as agent:
            return agent.status().owning
    except PosError:
        return False
