"""The undo of a half-done checkpoint, restore or GPU move, and the watchdog process that runs it
when pos itself dies.

pos starts `python -m pos.operation.watchdog` (its own session, so a terminal's Ctrl-C or a
killed process group does not take it along) before touching the target, and writes the
current `Plan` to its stdin (a unix socket) as one JSON line per step. A line {"done": true}
ends it quietly. If the socket closes without it, pos died (even SIGKILL closes it) and the
watchdog runs `recover(plan)`. pos runs the very same `recover` on its own failures and on
SIGINT/SIGTERM. While a `pos run` job has given its device memory up to pos (the concurrent
engine's hoist), the watchdog holds descriptors of that memory too (`Watchdog.hold`), so that
the memory outlives pos and goes back to the job.

`recover` runs the undo of the plan's type (`UNDO`, one per type of pos/operation/plan.py). It
decides from what it observes, not from what it was told was done, so it may run twice (pos
died during its own undo) without harm:
  - a dump's CRIU still running is waited for (its parasite is inside the target; killing it
    could corrupt the target); one that never ends is killed and the tree thawed (SIGCONT); a
    restore's is ended, with the tasks it restored, if it never ends or its log runs away;
  - checkpoint: CRIU leaves the tree running or stopped, never ends it; a stopped tree is
    continued (SIGCONT) and every CUDA process that is CHECKPOINTED gets the driver's restore,
    every LOCKED one its unlock; once the image is sealed (step "end") the tree is ended as
    the checkpoint was to, never continued;
  - restore: a tree that CRIU restored stopped beside the image's check runs on only if the
    image is good (killed otherwise); forward, a restored tree is finished (driver restore
    onto the planned GPUs, unlock, the rest of its memory from CRIU's lazy-pages daemon); a
    tree that cannot be finished is killed, never left half-restored; a restore that the user
    stopped (SIGINT/SIGTERM), or one held ready that no one asked for (step "standby"), is
    ended, not finished; the lazy-pages daemon is ended last,
    once the tree it served is gone or has every page;
  - move: every CUDA process restored onto the GPUs it was on, and unlocked;
  - hoisted memory (`ImagePlan.hoisted`) is mapped back into the job, which then runs on.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from pos import host
from pos.agent.control import MAX_FDS
from pos.errors import PosError
from pos.image import names
from pos.operation.plan import (CheckpointPlan, ImagePlan, MovePlan, Plan, RestorePlan,
                                from_json)
from pos.process import procs

LOG_ENV = "POS_WATCHDOG_LOG"
DEFAULT_LOG = "/var/lib/pos/watchdog.log"

Log = Callable[[str], None]


@dataclass
class Memory:
    """The jobs' device memory that pos (or the watchdog) holds while they have given it up:
    each job's descriptors of its hoisted memory, in its agent's table order, and of its own
    cuMem memory that pos took (pos/concurrent/ownmem.py), in its agent's `exports` order."""

    hoisted: dict[int, list[int]] = field(default_factory=dict)
    own: dict[int, list[int]] = field(default_factory=dict)


def _wait_criu(pid: int, plan: ImagePlan, log: Log, runaway: Callable[[], bool]) -> bool:
    """Wait for the plan's running CRIU `pid`, up to the plan's wait or until `runaway()`;
    whether it ended."""
    from pos.process import criu

    limit = plan.criu_wait_s
    log(f"waiting up to {limit:.0f} s for CRIU (PID {pid}) to finish")
    deadline = time.monotonic() + limit
    while procs.alive(pid) and time.monotonic() < deadline:
        if runaway():
            break
        time.sleep(criu.POLL_S)
    return not procs.alive(pid)


def _end_dump(plan: CheckpointPlan, log: Log) -> None:
    """A running dump's CRIU is waited for (its parasite is inside the target); one that never
    ends is killed and the tree thawed."""
    pid = plan.criu_pid
    if not pid or not procs.alive(pid) or _wait_criu(pid, plan, log, lambda: False):
        return
    log(f"CRIU (PID {pid}) did not finish: killing it and thawing the tree")
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    procs.wait_gone(pid, 10)
    procs.thaw([p for p in plan.pids if p not in plan.stopped])


def _end_restorer(plan: RestorePlan, log: Log, stopped: bool) -> None:
    """A running restore's CRIU holds nothing of a live process: it is ended (with what it
    restored) at once when the user stopped the restore, else once its log passes its bound or
    it never ends."""
    from pos.process import criu

    pid = plan.criu_pid
    if not pid or not procs.alive(pid):
        return

    def runaway() -> bool:
        if criu.log_bytes(Path(plan.criu_log)) <= plan.criu_log_max:
            return False
        log(f"CRIU's log {plan.criu_log} passed {plan.criu_log_max >> 20} MiB")
        return True

    if not stopped and _wait_criu(pid, plan, log, runaway):
        return
    log(f"ending CRIU (PID {pid}) and the tasks it restored")
    criu.end_restore(pid)


def _finish_gpu(plan: Plan, pairs: list[tuple[str, str]], log: Log) -> None:
    """Every CUDA process of the plan back to RUNNING (driver restore, unlock)."""
    from pos.process import cudackpt

    for pid in plan.gpu_pids:
        if not procs.alive(pid):
            continue
        state = cudackpt.get_state(pid)
        if state == "checkpointed":
            log(f"PID {pid}: driver restore")
            cudackpt.restore(pid, pairs)
            state = cudackpt.get_state(pid)
        if state == "locked":
            log(f"PID {pid}: unlock")
            cudackpt.unlock(pid)


def _give_back(plan: CheckpointPlan, memory: Memory, log: Log) -> None:
    """Map the hoisted memory back into each job (its calls wait for it), and its own cuMem
    memory that pos took, put back the imports of each other's memory that the checkpoint
    took down (its image's links: each owner exports again, each importer maps), and release
    them. A job whose memory or imports cannot come back is not released: its agent ends it
    once let go (hook/peer.c), never running without them."""
    from pos.agent import peers
    from pos.agent.control import Agent

    if not plan.hoisted:
        return
    agents: list[Agent] = []
    try:
        for pid, fds in memory.hoisted.items():
            if procs.alive(pid):
                log(f"PID {pid}: giving its device memory back ({len(fds)} buffers)")
                agents.append(Agent(pid))
                agents[-1].remap(fds)
        by_pid = {a.pid: a for a in agents}
        for pid, fds in memory.own.items():
            if not procs.alive(pid):
                continue
            try:
                agent = by_pid.get(pid) or Agent(pid)
                if agent.pid not in by_pid:
                    agents.append(agent)
                if any(a.down for a in agent.exports()):
                    log(f"PID {pid}: giving its own cuMem memory back ({len(fds)} allocations)")
                    agent.own_up(fds)
            except PosError as e:
                log(f"PID {pid}'s own memory could not come back ({e.message}): it ends")
        links = peers.read(Path(plan.images)) if plan.images else []
        if links:
            log(f"putting back {len(links)} imports of other processes' memory")
            try:
                peers.put_back(agents, links)
            except PosError as e:
                log(f"the imports could not all come back ({e.message}): the processes that "
                    "lack one end")
        for agent in agents:
            try:
                agent.end()
            except PosError as e:
                log(f"PID {agent.pid} is not released ({e.message})")
    finally:
        for agent in agents:
            agent.close()


def _verified(plan: RestorePlan, log: Log) -> bool:
    """A tree that CRIU restored stopped beside its image's check: resumed once the image is
    known good, killed (never run) when it is not."""
    from pos import image

    tree = procs.tree(plan.pids[0])
    try:
        image.verify(Path(plan.images), plan.verify)
    except PosError as e:
        log(f"the image is not good ({e.message}): killing the restored tree, which never ran")
        procs.kill_tree(tree)
        return False
    procs.resume(tree, settle_s=0.5)   # pos may have continued it already before it died
    return True


def end_tree(plan: CheckpointPlan) -> None:
    """A checkpoint's last step: its tree, which CRIU left stopped, ended. A parent that stopped
    itself when its child stopped is continued: script(1) and sudo do so, to pass the stop on
    to their shell, and wait stopped until they are continued."""
    procs.kill_tree(procs.tree(plan.pids[0]))
    procs.thaw([plan.parent])


def _end_unnamed(plan: RestorePlan, log: Log) -> None:
    """A tree restored into new namespaces whose PIDs pos had not sent yet (it died between
    CRIU's end and the next step): CRIU's pidfile in the work folder names its root, which
    never ran (it is restored stopped): it is killed."""
    try:
        root = int((Path(plan.work) / names.RESTORE_PIDFILE).read_text())
    except (OSError, ValueError):
        return                      # CRIU had not finished: nothing was restored
    if procs.alive(root):
        log(f"ending the tree of PID {root}, restored into new namespaces, which never ran")
        procs.kill_tree(procs.tree(root))


def _restored_tree(plan: RestorePlan, log: Log, stopped: bool) -> None:
    """A restore's tree finished and running on, or killed."""
    if not plan.pids:
        _end_unnamed(plan, log)
        return
    if not procs.alive(plan.pids[0]):
        return                      # CRIU failed and cleaned up: nothing was restored
    if stopped:
        log(f"the restore was stopped: ending the tree of PID {plan.pids[0]}")
        procs.kill_tree(procs.tree(plan.pids[0]))
        return
    if plan.step == "standby":     # held ready (pos/engines/standby.py), never asked for
        log(f"the restore held ready was not asked for: ending the tree of PID "
            f"{plan.pids[0]}, which never ran")
        procs.kill_tree(procs.tree(plan.pids[0]))
        return
    if plan.step in ("criu-restore", "verify") and not _verified(plan, log):
        return
    try:
        _finish_gpu(plan, [(old, new) for old, new in plan.gpu_pairs], log)
    except PosError as e:
        log(f"cannot finish the restore ({e.message}): killing the restored tree")
        procs.kill_tree(procs.tree(plan.pids[0]))
        raise
    if plan.hoisted:       # its device memory is not all back: it must not run on
        log(f"the device memory of PID {plan.pids[0]} is not back: killing the tree")
        procs.kill_tree(procs.tree(plan.pids[0]))
        return
    if plan.lazy_pid:      # its memory is not all in before the lazy-pages daemon ends
        from pos.operation import lazypages

        log(f"waiting for CRIU's lazy-pages daemon (PID {plan.lazy_pid}) to serve the rest "
            f"of the memory of PID {plan.pids[0]}")
        why = lazypages.settle(plan)
        if why is not None:
            log(f"{why.message}: the restored tree was killed")


def _recover_checkpoint(plan: CheckpointPlan, log: Log, memory: Memory, stopped: bool) -> str:
    """A checkpoint's tree running as before, or, its image sealed, ended as asked."""
    _end_dump(plan, log)
    if plan.step == "end":
        log(f"the image is sealed: ending the tree of PID {plan.pids[0]}, as asked")
        end_tree(plan)
        return "the tree ended, its image sealed"
    procs.thaw([p for p in plan.pids if p not in plan.stopped] + [plan.parent])
    _finish_gpu(plan, [], log)
    _give_back(plan, memory, log)
    return "the processes run"


def _recover_restore(plan: RestorePlan, log: Log, memory: Memory, stopped: bool) -> str:
    """A restore's CRIU ended, its tree finished or killed, then its lazy-pages daemon
    ended."""
    _end_restorer(plan, log, stopped)
    try:
        _restored_tree(plan, log, stopped)
    finally:
        if plan.lazy_pid:    # after the tree, which it served or which is gone
            from pos.operation import lazypages

            lazypages.end(plan.lazy_pid)
    return ""


def _recover_move(plan: MovePlan, log: Log, memory: Memory, stopped: bool) -> str:
    """A move's processes back on the GPUs they were on."""
    procs.thaw(plan.pids)
    _finish_gpu(plan, [], log)
    return "the processes run"


def _discard_image(plan: CheckpointPlan) -> None:
    """An undone checkpoint's unfinished image, and CRIU's files where they were staged."""
    from pos.image import discard

    for d in {plan.images, plan.staging} - {""}:
        discard(Path(d))


def _discard_work(plan: RestorePlan) -> None:
    """An undone restore's work folder."""
    if plan.work:
        shutil.rmtree(plan.work, ignore_errors=True)


@dataclass(frozen=True)
class Undo:
    """One type of plan's undo: `recover` (see `recover`) says what it left the processes
    doing, for the watchdog's log ("" when the undo's own lines said it); `leftovers` removes
    what the undone operation left on disk."""

    recover: Callable[[Any, Log, Memory, bool], str]
    leftovers: Callable[[Any], None] = lambda plan: None


UNDO: dict[type[Plan], Undo] = {
    CheckpointPlan: Undo(_recover_checkpoint, _discard_image),
    RestorePlan: Undo(_recover_restore, _discard_work),
    MovePlan: Undo(_recover_move),
}


def recover(plan: Plan, log: Log, memory: Optional[Memory] = None, stopped: bool = False
            ) -> str:
    """Bring the plan's processes back to running (see the module docstring), by the undo of
    the plan's type; what it left them doing. `memory`: the descriptors of each job's hoisted
    memory. `stopped`: the user stopped the operation (SIGINT/SIGTERM): a restore is ended
    rather than finished."""
    return UNDO[type(plan)].recover(plan, log, memory or Memory(), stopped)


def discard_leftovers(plan: Plan) -> None:
    """What the undone operation left on disk, removed as the undo of the plan's type does."""
    UNDO[type(plan)].leftovers(plan)


class Watchdog:
    """pos's side of the watchdog process: start it, tell it each step, say done."""

    def __init__(self, plan: Plan) -> None:
        """The plan goes into the socket before the watchdog is started: from the moment it
        exists it knows what to undo, however soon pos dies."""
        self.sock, theirs = socket.socketpair()
        self.send(plan)
        self.proc = host.pos_module("pos.operation.watchdog", stdin=theirs.fileno(),
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                    start_new_session=True)
        theirs.close()

    def send(self, plan: Plan) -> None:
        self.sock.sendall((plan.to_json() + "\n").encode())

    def hold(self, pid: int, fds: list[int], own: bool = False) -> None:
        """The watchdog keeps its own copies of these descriptors (the hoisted memory of the
        job `pid`; `own`: its own cuMem memory that pos took)."""
        self.sock.sendall(json.dumps({"hold": len(fds), "pid": pid, "own": own}).encode()
                          + b"\n")
        for at in range(0, len(fds), MAX_FDS):
            socket.send_fds(self.sock, [b" "], fds[at:at + MAX_FDS])

    def done(self) -> None:
        try:
            self.sock.sendall(b'{"done": true}\n')
        except OSError:
            pass
        self.sock.close()
        self.proc.wait()


def _log_to(path: str) -> Callable[[str], None]:
    def log(line: str) -> None:
        try:
            Path(path).parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            with open(path, "a") as f:
                f.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} watchdog[{os.getpid()}] {line}\n")
        except OSError:
            pass
    return log


def _messages(sock: socket.socket, fds: list[int]) -> Iterator[dict[str, Any]]:
    """pos's JSON lines, collecting the descriptors that come with them into `fds`."""
    buf = b""
    while True:
        try:
            data, got, _flags, _addr = socket.recv_fds(sock, 1 << 16, MAX_FDS)
        except OSError:
            return
        fds.extend(got)
        if not data:
            return
        buf += data
        while b"\n" in buf:
            line, _, buf = buf.partition(b"\n")
            if line.strip():
                yield json.loads(line)


def main() -> int:
    # Only pos's socket ends the watchdog; a terminal's signals are not for it.
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    log = _log_to(os.environ.get(LOG_ENV) or DEFAULT_LOG)
    plan: Optional[Plan] = None
    fds: list[int] = []                     # every descriptor, in the order they came
    holds: list[tuple[int, int, bool]] = []   # (job, how many, its own memory), in that order
    for msg in _messages(socket.socket(fileno=0), fds):
        if msg.get("done"):
            return 0
        if "plan" in msg:
            plan = from_json(msg["plan"])
        if "hold" in msg:
            holds.append((int(msg["pid"]), int(msg["hold"]), bool(msg.get("own"))))
    if plan is None:
        return 0
    memory = Memory()
    at = 0
    for pid, n, own in holds:
        (memory.own if own else memory.hoisted).setdefault(pid, []).extend(fds[at:at + n])
        at += n
    log(f"pos died during {plan.WHAT} of PID {plan.pids[:1]} at step {plan.step}: undoing")
    try:
        left = recover(plan, log, memory)
    except PosError as e:
        log(f"undo failed: {e.message}")
        return 1
    discard_leftovers(plan)
    log(f"undo done: {left}" if left else "undo done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
