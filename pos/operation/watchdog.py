"""The undo of a half-done checkpoint or restore, and the watchdog process that runs it when pos
itself dies.

pos starts `python -m pos.operation.watchdog` (its own session, so a terminal's Ctrl-C or a
killed process group does not take it along) before touching the target, and writes the
current `Plan` to its stdin (a unix socket) as one JSON line per step. A line {"done": true}
ends it quietly. If the socket closes without it, pos died (even SIGKILL closes it) and the
watchdog runs `recover(plan)`. pos runs the very same `recover` on its own failures and on
SIGINT/SIGTERM. While a `pos run` job has given its device memory up to pos (the concurrent
engine's hoist), the watchdog holds descriptors of that memory too (`Watchdog.hold`), so that
the memory outlives pos and goes back to the job.

`recover` decides from what it observes, not from what it was told was done, so it may run
twice (pos died during its own undo) without harm:
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
    stopped (SIGINT/SIGTERM) is ended, not finished; the lazy-pages daemon is ended last,
    once the tree it served is gone or has every page;
  - hoisted memory (`Plan.hoisted`) is mapped back into the job, which then runs on.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from pos.agent.control import MAX_FDS
from pos.errors import PosError
from pos.image import names
from pos.operation.plan import Plan
from pos.process import procs

LOG_ENV = "POS_WATCHDOG_LOG"
DEFAULT_LOG = "/var/lib/pos/watchdog.log"


def discard_leftovers(plan: Plan) -> None:
    """After an undone checkpoint: its unfinished image, and CRIU's files where they were
    staged; after a restore: its work folder."""
    from pos.image import discard

    if plan.op == "checkpoint":
        for d in {plan.images, plan.staging} - {""}:
            discard(Path(d))
    elif plan.work:
        shutil.rmtree(plan.work, ignore_errors=True)


def _wait_criu(plan: Plan, log: Callable[[str], None], stopped: bool) -> None:
    """Wait for a running CRIU. A dump's is waited for (its parasite is inside the target), and
    one that never ends is killed and the tree thawed; a restore's holds nothing of a live
    process and is ended (with what it restored) at once when the user stopped the restore,
    else once its log passes its bound or it never ends."""
    from pos.process import criu

    pid = plan.criu_pid
    if not pid or not procs.alive(pid):
        return
    endable = plan.op == "restore"
    bound = plan.criu_log_max if endable else 0
    if not (endable and stopped):
        limit = plan.criu_wait_s
        log(f"waiting up to {limit:.0f} s for CRIU (PID {pid}) to finish")
        deadline = time.monotonic() + limit
        while procs.alive(pid) and time.monotonic() < deadline:
            if endable and criu.log_bytes(Path(plan.criu_log)) > bound:
                log(f"CRIU's log {plan.criu_log} passed {bound >> 20} MiB")
                break
            time.sleep(criu.POLL_S)
        if not procs.alive(pid):
            return
    if endable:
        log(f"ending CRIU (PID {pid}) and the tasks it restored")
        criu.end_restore(pid)
        return
    log(f"CRIU (PID {pid}) did not finish: killing it and thawing the tree")
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    procs.wait_gone(pid, 10)
    procs.thaw([p for p in plan.pids if p not in plan.stopped])


def _finish_gpu(plan: Plan, pairs: list[tuple[str, str]], log: Callable[[str], None]) -> None:
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


def _give_back(plan: Plan, memory: dict[int, list[int]], log: Callable[[str], None]) -> None:
    """Map the hoisted memory back into each job (its calls wait for it), put back the imports
    of each other's memory that the checkpoint took down (its image's links: each owner
    exports again, each importer maps), and release them (`memory`: each job's descriptors,
    in its agent's table order). An importer whose imports cannot come back is not released:
    its agent ends it once let go (hook/peer.c), never running without them."""
    from pos.agent import peers
    from pos.agent.control import Agent

    if not plan.hoisted:
        return
    agents: list[Agent] = []
    try:
        for pid, fds in memory.items():
            if procs.alive(pid):
                log(f"PID {pid}: giving its device memory back ({len(fds)} buffers)")
                agents.append(Agent(pid))
                agents[-1].remap(fds)
        links = peers.read(Path(plan.images)) if plan.op == "checkpoint" and plan.images else []
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


def _verified(plan: Plan, log: Callable[[str], None]) -> bool:
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


def end_tree(plan: Plan) -> None:
    """A checkpoint's last step: its tree, which CRIU left stopped, ended. A parent that stopped
    itself when its child stopped is continued: script(1) and sudo do so, to pass the stop on
    to their shell, and wait stopped until they are continued."""
    procs.kill_tree(procs.tree(plan.pids[0]))
    procs.thaw([plan.parent])


def _end_unnamed(plan: Plan, log: Callable[[str], None]) -> None:
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


def _recover_restore(plan: Plan, log: Callable[[str], None], stopped: bool) -> None:
    """`recover` of a restore: its tree finished and running on, or killed."""
    if not plan.pids:
        _end_unnamed(plan, log)
        return
    if not procs.alive(plan.pids[0]):
        return                      # CRIU failed and cleaned up: nothing was restored
    if stopped:
        log(f"the restore was stopped: ending the tree of PID {plan.pids[0]}")
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


def recover(plan: Plan, log: Callable[[str], None],
            memory: Optional[dict[int, list[int]]] = None, stopped: bool = False) -> None:
    """Bring the plan's processes back to running (see the module docstring); `memory`: the
    descriptors of each job's hoisted memory, in its agent's table order. `stopped`: the user
    stopped the operation (SIGINT/SIGTERM): a restore is ended rather than finished."""
    _wait_criu(plan, log, stopped)
    if plan.op == "restore":
        try:
            _recover_restore(plan, log, stopped)
        finally:
            if plan.lazy_pid:    # after the tree, which it served or which is gone
                from pos.operation import lazypages

                lazypages.end(plan.lazy_pid)
        return
    if plan.op == "checkpoint" and plan.step == "end":
        log(f"the image is sealed: ending the tree of PID {plan.pids[0]}, as asked")
        end_tree(plan)
        return
    procs.thaw([p for p in plan.pids if p not in plan.stopped] + [plan.parent])
    _finish_gpu(plan, [], log)
    _give_back(plan, memory or {}, log)


class Watchdog:
    """pos's side of the watchdog process: start it, tell it each step, say done."""

    def __init__(self, plan: Plan) -> None:
        """The plan goes into the socket before the watchdog is started: from the moment it
        exists it knows what to undo, however soon pos dies."""
        self.sock, theirs = socket.socketpair()
        self.send(plan)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pos.operation.watchdog"], stdin=theirs.fileno(),
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
            env={**os.environ, "PYTHONPATH": _import_path()})
        theirs.close()

    def send(self, plan: Plan) -> None:
        self.sock.sendall((plan.to_json() + "\n").encode())

    def hold(self, pid: int, fds: list[int]) -> None:
        """The watchdog keeps its own copies of these descriptors (the hoisted memory of the
        job `pid`)."""
        self.sock.sendall(json.dumps({"hold": len(fds), "pid": pid}).encode() + b"\n")
        for at in range(0, len(fds), MAX_FDS):
            socket.send_fds(self.sock, [b" "], fds[at:at + MAX_FDS])

    def done(self) -> None:
        try:
            self.sock.sendall(b'{"done": true}\n')
        except OSError:
            pass
        self.sock.close()
        self.proc.wait()


def _import_path() -> str:
    """PYTHONPATH for the watchdog: wherever this pos was imported from comes first."""
    here = str(Path(__file__).resolve().parent.parent.parent)
    rest = os.environ.get("PYTHONPATH")
    return f"{here}:{rest}" if rest else here


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
    holds: list[tuple[int, int]] = []       # (job, how many of them), in the same order
    for msg in _messages(socket.socket(fileno=0), fds):
        if msg.get("done"):
            return 0
        if "plan" in msg:
            plan = Plan.from_json(msg["plan"])
        if "hold" in msg:
            holds.append((int(msg["pid"]), int(msg["hold"])))
    if plan is None:
        return 0
    memory: dict[int, list[int]] = {}
    at = 0
    for pid, n in holds:
        memory.setdefault(pid, []).extend(fds[at:at + n])
        at += n
    log(f"pos died during {plan.op} of PID {plan.pids[:1]} at step {plan.step}: undoing")
    try:
        recover(plan, log, memory)
    except PosError as e:
        log(f"undo failed: {e.message}")
        return 1
    discard_leftovers(plan)
    if plan.op == "restore":
        log("undo done")
    elif plan.step == "end":
        log("undo done: the tree ended, its image sealed")
    else:
        log("undo done: the processes run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
