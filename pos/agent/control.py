"""pos's side of the control socket of a `pos run` job (the agent is pos/agent/hook/;
protocol.md there is the contract).

One `Agent` is one connection, and one connection is one operation: if pos goes away in the
middle of it, the agent releases the job by itself (or, while pos holds the job's memory, keeps
its calls held until the watchdog gives the memory back)."""

import ctypes
import json
import os
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from pos import host
from pos.errors import BadInput, PosError

MAX_FDS = 250   # descriptors per message (the kernel takes up to 253): the agent's, the watchdog's
PROBE_S = 3.0   # a connection pos found gone: how long a new one may take to say why
STALL_S = 60.0  # the agent's default bound on a silent pos (POS_AGENT_STALL_S in the job)
LINE_ROOM = 60000   # bytes of a request line the agent reads whole (control.c: 64 KiB)


@dataclass(frozen=True)
class Buffer:
    """One allocation the agent owns: the job's addresses [va, va+mapped)."""

    va: int
    size: int          # what the job asked for
    mapped: int        # rounded up to the allocation granularity
    device: int
    present: bool      # False while hoisted (the physical memory is pos's)
    # a call the gate let through since the operation began may use it (the job needs it
    # first: a restore fills it first)
    touched: bool = False


@dataclass(frozen=True)
class Status:
    pid: int
    phase: str
    buffers: int
    owned_bytes: int
    foreign_allocs: int    # allocations the agent could not own (pools, managed, pitched)
    foreign_bytes: int     # their bytes, cumulative
    owning: bool
    imported: int          # allocations mapped back from pos's descriptors (a concurrent
                           # whole-process checkpoint or restore): the driver cannot restore
                           # them from a stop-the-world image
    gate: "Gate"           # the calls of the operation running (or the last one) so far
    nccl_launches: int = 0  # NCCL kernels launched since the job started (see `Agent.cut`)
    # Memory of other processes that the job has mapped, which the driver's restore fails on
    # (hook/peer.c): live mappings of imported cuMem memory, their bytes, open legacy IPC
    # mappings. None: the agent (of a job started under an older pos) does not say, which is
    # not "none".
    peer_maps: Optional[int] = None
    peer_bytes: Optional[int] = None
    ipc_maps: Optional[int] = None
    # Of those, the mappings pos took down (peer-down) and has not put back; and the records the
    # agent could not keep (its memory ran short): then it cannot say what the job maps
    peer_down: Optional[int] = None
    peer_lost: Optional[int] = None
    # The job's own cuMem mappings (NCCL's buffers, which its peers import) and their bytes:
    # memory pos does not own, which the driver's checkpoint copies into the job's host memory
    # and CRIU then writes while the job is frozen. None: the agent does not say
    own_maps: Optional[int] = None
    own_bytes: Optional[int] = None
    # Of those, the allocations pos took (own-take, own-down) and has not put back (own-up),
    # and those mapped back from pos's descriptors, which every checkpoint must take again
    # (the driver cannot checkpoint the import that maps them)
    own_down: Optional[int] = None
    own_kept: Optional[int] = None
    # How long the agent waits for a request (POS_AGENT_STALL_S), and how the connection
    # before this one ended, in its words; None: the agent is too old to say (or, last_end,
    # no connection has ended yet)
    stall_s: Optional[float] = None
    last_end: Optional[str] = None
    last_end_said: bool = False    # the agent wrote that end to the job's standard error too
    # the same end as a code, which pos acts on: eof, silent (no request within stall_s),
    # reused (other code of the job closed or took the descriptor), failed, bye; "": an agent
    # too old to say
    last_end_code: str = ""
    # A driver entry point that touches device memory, which the job can call (looked up, or
    # linked to) and the gate does not know (hook/gated.h): no cut of the job is taken. "":
    # none, or an agent too old to say
    ungated: str = ""
    # the job's calls waiting in the gate now (an agent too old to say: 0)
    waiting: int = 0


@dataclass(frozen=True)
class PeerMap:
    """A mapping of another process's memory in the job: [va, va+size) maps the owner's
    allocation from `offset`; `released`: the job released its handle (the mapping holds the
    memory); `down`: pos took it down and has not put it back."""

    va: int
    size: int
    offset: int
    released: bool
    down: bool


@dataclass(frozen=True)
class OwnAlloc:
    """One of the job's own cuMem allocations, mapped at va (its peers may import it);
    `released`: the job released its handle, so it cannot be exported again; `down`: pos took
    it down (own-down) and has not put it back."""

    va: int
    size: int
    released: bool
    down: bool = False


@dataclass(frozen=True)
class OwnExport:
    """The job's own allocations that can be taken (own-export, own-take), in `exports` order:
    their addresses and serials, and descriptors the caller owns. `same`: an own-take given
    the serials of an own-export made before the cut found them unchanged, and sent no
    descriptors: the earlier ones name this memory. `fresh`: where an own-take kept those it
    was given that are still there, the places (in `vas`) of the others, one descriptor each,
    in order (None: one for each, or none where `same`)."""

    vas: list[int]
    serials: list[int]
    fds: list[int]
    same: bool
    fresh: Optional[list[int]] = None


@dataclass(frozen=True)
class Exported:
    """The job's allocations as descriptors (table order; the caller owns them)."""

    fds: list[int]
    reseated: int          # buffers the driver would not export, moved into new exportable
    reseated_bytes: int    # memory at the same addresses first (see hook/export.c: reseat)
    reseat_s: float
    leaked: int            # /dev/nvidiactl descriptors the driver's refusals left, closed
    # where the export's seconds went: the agent's wait for its table's lock and its loop over
    # the buffers (exports, copies of descriptors; as it timed them), the rest of the time to
    # its answer, and the descriptors' passage after it (as pos timed them)
    lock_s: float = 0.0
    loop_s: float = 0.0
    answer_s: float = 0.0
    passage_s: float = 0.0


@dataclass(frozen=True)
class Room:
    """The job's table of descriptors made to hold more before the cut (hook/export.c)."""

    top: int               # its highest open descriptor
    room: int              # the descriptor made and closed there: the table holds more
    made: bool             # False: the limit (RLIMIT_NOFILE) or the kernel refused
    seconds: float


class NoAnswer(PosError):
    """The agent did not answer within the connection's timeout."""


class Refused(PosError):
    """The agent said no; `need`: the device memory it lacked for a reseat (0: not that);
    `past`: a cut at an NCCL launch found the job past it, or not come to it in time: the
    job's count then (-1: not that); `ungated`: a cut refused because the job can call this
    driver entry point, which touches device memory and which the gate does not know
    (hook/gated.h; "": not that)."""

    def __init__(self, pid: int, reply: dict[str, Any]) -> None:
        self.need = int(reply.get("need", 0))
        self.past = int(reply.get("past", -1))
        self.ungated = str(reply.get("ungated", ""))
        if self.ungated:
            super().__init__(
                f"pos cannot checkpoint or restore process {pid} while it runs: it can call "
                f"{self.ungated}, a driver entry point that reads or writes device memory and "
                "that pos's agent cannot gate (the job runs on as it was)", "this driver or "
                "CUDA version is newer than this pos; update pos, or checkpoint the job "
                "stop-the-world (without --concurrent)")
        else:
            super().__init__(f"the agent of process {pid} refused: {reply.get('error')}")


@dataclass(frozen=True)
class Hoist:
    bytes: int         # released: held by pos alone until the remap
    stack: int         # the context's per-thread stack before, kept for the remap (0: unchanged)
    stack_rc: int      # the driver's answer to setting it smaller (-1: not asked, or no need)
    trim_s: float = -1.0   # the job's heap gave its free memory back in this long (-1: not
                           # asked, or an agent or libc without it)
    loop_s: float = 0.0    # the driver's unmap and release of each buffer (0: an older agent)


@dataclass(frozen=True)
class Remap:
    mapped: int
    stack_s: float     # setting the stack back (local memory allocated again)
    stack_rc: int      # the driver's answer (not fatal: it grows the stack at a launch anyway)
    rx_s: float = 0.0      # from the request to the last descriptor's arrival
    loop_s: float = 0.0    # then the driver's import, map and access of each buffer (0: an
                           # older agent)


@dataclass(frozen=True)
class Cut:
    drain_s: float     # waiting for the calls already inside the driver
    sync_s: float      # synchronising the job's contexts: the GPU work queued before the cut
    buffers: int
    bytes: int


@dataclass(frozen=True)
class Wait:
    """One of the job's calls that waited in the gate."""

    on: Optional[int]      # the address it waited for last (None: every buffer)
    s: float               # how long
    end_s: float           # when it went on, from the operation's start
    what: str              # the kernel's name, or the driver function's


@dataclass(frozen=True)
class Gate:
    """What the job's calls went through during one operation."""

    held: int              # calls that waited
    held_s: float          # their waits, summed
    held_max_s: float      # the longest wait: the job's worst stall
    passed: int            # calls that went through while the operation ran
    first_pass_s: Optional[float]   # from the cut to the first call let through
    held_all: int = 0      # calls that waited for every buffer (what they touch not known)
    waits: list[Wait] = field(default_factory=list)   # the first 16 waits, in order

    @classmethod
    def from_reply(cls, r: dict[str, Any]) -> "Gate":
        first = r.get("first_pass_s", -1.0)
        waits = [Wait(w["on"] or None, w["s"], w["end_s"], w["what"]) for w in r.get("waits", [])]
        return cls(int(r["held"]), float(r["held_s"]), float(r["held_max_s"]), int(r["passed"]),
                   None if first < 0 else float(first), int(r.get("held_all", 0)), waits)


def agent_pid(pid: int) -> int:
    """PID as the job itself sees it (its innermost PID namespace names the socket)."""
    return host.ns_pids(pid)[-1]


def _connect_in_netns(pid: int, address: bytes) -> socket.socket:
    """A socket connected to an abstract address of PID's network namespace."""
    mine, theirs = "/proc/self/ns/net", f"/proc/{pid}/ns/net"
    try:
        same = os.stat(mine).st_ino == os.stat(theirs).st_ino
    except OSError:
        same = True
    if same:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(address)
        return s
    libc = ctypes.CDLL(None, use_errno=True)
    back = os.open(mine, os.O_RDONLY)
    there = os.open(theirs, os.O_RDONLY)
    try:
        if libc.setns(there, 0x40000000) != 0:      # CLONE_NEWNET
            raise PermissionError(ctypes.get_errno(), "setns")
        try:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(address)
        finally:
            libc.setns(back, 0x40000000)
        return s
    finally:
        os.close(back)
        os.close(there)


class Agent:
    """A connection to the agent inside process `pid` (root only)."""

    def __init__(self, pid: int, timeout: Optional[float] = 120.0) -> None:
        if pid <= 0 or not os.path.exists(f"/proc/{pid}"):
            raise BadInput(f"there is no process {pid}", "give the PID of a `pos run` job")
        self.pid = pid
        address = b"\0pos-agent-%d" % agent_pid(pid)
        try:
            self.sock = _connect_in_netns(pid, address)
        except ConnectionRefusedError:
            raise _no_agent(pid) from None
        except PermissionError:
            raise BadInput(f"cannot reach the agent of process {pid}",
                           "run pos as root (sudo)") from None
        holder = _listener(self.sock)
        if holder != pid:      # an abstract name can be taken by any process of the namespace
            self.sock.close()
            who = f"process {holder}" if holder else "a process outside this PID namespace"
            raise PosError(f"the socket named for process {pid}'s agent is held by {who}, not "
                           "by the job, so pos does not talk to it",
                           "end that process, then start the job again with `pos run`")
        self.sock.settimeout(timeout)
        self._sending = threading.Lock()    # `done` comes from the copier's threads too
        self._buf = b""
        self._fds: list[int] = []
        self._answered = time.monotonic()   # when the agent last answered (or accepted)
        self._request = "connect"           # the request last sent
        self._probe = False                 # a connection that asks why another one ended

    def __enter__(self) -> "Agent":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []
        self.sock.close()

    # -- the wire ---------------------------------------------------------------------------
    def _gone(self, how: str) -> PosError:
        """The connection ended under pos (`how`: the system call's error, or EOF), said from
        what pos can see: the request, how long the agent had been silent to pos, whether the
        process runs, and the agent's own account of how that connection ended, asked on a new
        one (the job's standard error may be kept nowhere, and the agent writes there only when
        it has something to say: a close it took for pos's own, in phase idle, it does not;
        issue 35)."""
        silent = time.monotonic() - self._answered
        head = (f"the control connection to the agent of process {self.pid} ended ({how}) at "
                f"pos's request '{self._request}', {silent:.1f} s after the agent last answered")
        if self._probe:
            return PosError(head)
        if not _running(self.pid):
            return PosError(f"{head}; the process has ended", "check how the job ended: its "
                            "exit status, its standard error, the kernel log (the OOM killer)")
        said = _ask_again(self.pid)
        if isinstance(said, str):
            return PosError(f"{head}; the process is still running, but {said}",
                            "see what the job's threads are doing (py-spy dump, or gdb); pos "
                            "cannot checkpoint it until its agent answers")
        end = said.last_end
        if end is None:
            return PosError(f"{head}; the process is still running, and its agent answers a new "
                            f"connection (phase {said.phase}) but is too old to say how the "
                            "other ended", "retry; the job runs on as it was")
        cause = (f"{head}; the process is still running, and its agent, asked on a new "
                 f"connection (phase {said.phase}), says that connection ended {end}"
                 + (" (its standard error says so too)" if said.last_end_said else ""))
        if said.last_end_code == "silent":
            limit = said.stall_s or STALL_S    # every agent that says last_end says it
            fix = (f"pos had been silent for {silent:.1f} s, and the agent waits "
                   f"{limit:g} s for a request (POS_AGENT_STALL_S={limit:g} in the job's "
                   "environment): retry (pos's cut now comes on a connection of its own), or "
                   "start the job with a larger POS_AGENT_STALL_S")
        elif said.last_end_code == "eof":
            fix = ("pos had not closed its end: the job's end of the connection ended under "
                   "the agent, shut down or closed by other code of the job (or pos's own "
                   "descriptor by other code of pos); retry, the job runs on as it was")
        elif said.last_end_code == "reused":
            fix = ("other code of the job closed the agent's descriptor (or took its number): "
                   "retry, the job runs on as it was")
        else:
            fix = "retry; the job runs on as it was"
        return PosError(cause, fix)

    def _send(self, data: bytes, fds: list[int] = []) -> None:
        try:
            with self._sending:
                if fds:
                    socket.send_fds(self.sock, [data], fds)
                else:
                    self.sock.sendall(data)
        except socket.timeout:
            raise PosError(f"the agent of process {self.pid} took no request for "
                           f"{self.sock.gettimeout():.0f} s (its socket's buffer stayed full)",
                           "check the job's standard error") from None
        except OSError as e:
            raise self._gone(e.strerror or str(e)) from None

    def _recv(self) -> None:
        try:
            data, fds, _flags, _addr = socket.recv_fds(self.sock, 1 << 20, MAX_FDS)
        except socket.timeout:
            raise
        except OSError as e:
            raise self._gone(e.strerror or str(e)) from None
        self._fds.extend(fds)
        if not data:
            raise self._gone("EOF")
        self._buf += data

    def _line(self) -> dict[str, Any]:
        while b"\n" not in self._buf:
            try:
                self._recv()
            except socket.timeout:
                raise NoAnswer(f"the agent of process {self.pid} did not answer in time",
                               "check the job's standard error") from None
        line, _, self._buf = self._buf.partition(b"\n")
        self._answered = time.monotonic()
        reply = json.loads(line.lstrip(b"+"))
        if not reply.get("ok"):
            raise Refused(self.pid, reply)
        return reply

    def _ask(self, line: str) -> dict[str, Any]:
        self._request = line.split(" ", 1)[0]
        self._send(line.encode() + b"\n")
        return self._line()

    def tell(self, line: str) -> None:
        """A request the agent does not answer (`done`)."""
        self._send(line.encode() + b"\n")

    # -- requests ---------------------------------------------------------------------------
    def status(self) -> Status:
        r = self._ask("status")
        told = {k: int(r[k]) for k in ("peer_maps", "peer_bytes", "ipc_maps", "peer_down",
                                       "peer_lost", "own_maps", "own_bytes", "own_down",
                                       "own_kept")
                if k in r}
        return Status(r["pid"], r["phase"], r["buffers"], r["owned_bytes"], r["foreign_allocs"],
                      r["foreign_bytes"], r["owning"], r["imported"], Gate.from_reply(r),
                      int(r.get("nccl_launches", 0)), **told,
                      stall_s=float(r["stall_s"]) if "stall_s" in r else None,
                      last_end=r.get("last_end"), last_end_said=bool(r.get("last_end_said")),
                      last_end_code=str(r.get("last_end_code", "")),
                      ungated=str(r.get("ungated", "")), waiting=int(r.get("waiting", 0)))

    def cut(self, timeout_s: float, at: Optional[int] = None) -> Cut:
        """Hold the job's calls, drain and synchronise it; `at`: not now, but just before the
        NCCL launch past that many (every rank of a job cut at the same `at` stands before the
        same collective), waiting up to `timeout_s` for it."""
        ms = int(timeout_s * 1000)
        r = self._ask(f"cut {ms}" if at is None else f"cut {ms} {at}")
        return Cut(r["drain_s"], r["sync_s"], r["buffers"], r["bytes"])

    def table(self) -> list[Buffer]:
        r = self._ask("table")
        if int(r.get("version", 1)) >= 2:      # named fields (a later version may add some)
            return [Buffer(int(b["va"]), int(b["size"]), int(b["mapped"]), int(b["device"]),
                           bool(b["present"]), bool(b["touched"])) for b in r["buffers"]]
        # version 1, the agent of a job started under an older pos: positional arrays, five
        # of them from an agent built before `touched`
        return [Buffer(va, size, mapped, dev, bool(present), bool(rest and rest[0]))
                for va, size, mapped, dev, present, *rest in r["buffers"]]

    def wanted(self) -> list[int]:
        """The pending buffers the job's calls wait for now (pos copies them first)."""
        return [int(v) for v in self._ask("wanted")["vas"]]

    def _take_fds(self, n: int) -> list[int]:
        """The next n descriptors the agent sent after its reply; the caller owns them."""
        while len(self._fds) < n:
            self._recv()
        fds, self._fds = self._fds[:n], self._fds[n:]
        self._buf = self._buf.lstrip(b"+")
        return fds

    def export(self) -> Exported:
        """Every owned allocation as a descriptor (table order); the caller owns them."""
        t0 = time.monotonic()
        r = self._ask("export")
        t1 = time.monotonic()
        fds = self._take_fds(r["fds"])
        lock_s, loop_s = float(r.get("lock_s", 0.0)), float(r.get("loop_s", 0.0))
        return Exported(fds, int(r.get("reseated", 0)), int(r.get("reseated_bytes", 0)),
                        float(r.get("reseat_s", 0.0)), int(r.get("leaked", 0)), lock_s, loop_s,
                        max(0.0, t1 - t0 - lock_s - loop_s), time.monotonic() - t1)

    def room(self, n: int) -> Room:
        """Room in the job's table for `n` more descriptors, so that the export and the remap
        do not grow it while the job is held (pos/process/fdroom.py says why)."""
        r = self._ask(f"room {n}")
        return Room(int(r["top"]), int(r["room"]), bool(r["made"]), float(r["room_s"]))

    def hoist(self, stack: Optional[int] = None, trim: bool = False) -> Hoist:
        """The job gives its physical memory up (pos must hold it); `stack`: and its context's
        per-thread stack is set to that many bytes (less local memory for the driver's
        checkpoint to copy); `trim`: and its heap gives back the memory it freed (less for
        CRIU to dump and each restore to read)."""
        words = ["hoist"] + ([str(stack)] if stack is not None else []) + (["trim"] if trim else [])
        r = self._ask(" ".join(words))
        return Hoist(int(r["bytes"]), int(r.get("stack", 0)), int(r.get("stack_rc", -1)),
                     float(r.get("trim_s", -1.0)), float(r.get("loop_s", 0.0)))

    def remap(self, fds: list[int], restore: bool = False) -> "Remap":
        """The job maps these descriptors (table order) at its addresses again, and its
        context's stack goes back to what it was before the hoist; `restore`: and its calls go
        through the restore gate from then on (the memory is being filled)."""
        self._request = "remap"
        self._send(f"remap {len(fds)}{' restore' if restore else ''}\n".encode())
        for at in range(0, len(fds), MAX_FDS):
            self._send(b"+", fds[at:at + MAX_FDS])
        r = self._line()
        return Remap(int(r["mapped"]), float(r.get("stack_s", 0.0)), int(r.get("stack_rc", 0)),
                     float(r.get("rx_s", 0.0)), float(r.get("loop_s", 0.0)))

    def copy(self) -> None:
        self._ask("copy")

    def restore(self) -> None:
        self._ask("restore")

    def done(self, vas: list[int]) -> None:
        """These buffers are saved (checkpoint) or back (restore): their calls may go."""
        self._tell_all("done", vas)

    def saved(self, vas: list[int]) -> None:
        """In a checkpoint's copy, these buffers' own bytes as of the cut are safe, what they
        point into perhaps not yet: a kernel that writes only at its parameters' addresses
        (PyTorch's elementwise kernels, reductions and foreach kernels) may go (hook/gate.c)."""
        self._tell_all("saved", vas)

    def _tell_all(self, what: str, vas: list[int]) -> None:
        for at in range(0, len(vas), 512):
            self.tell(f"{what} " + " ".join(hex(v) for v in vas[at:at + 512]))

    def end(self) -> Gate:
        return Gate.from_reply(self._ask("end"))

    # -- other processes' memory (hook/peer.c; pos/agent/peers.py uses these) ---------------
    def peers(self) -> list["PeerMap"]:
        """The job's live mappings of memory it imported from other processes."""
        return [PeerMap(int(m["va"]), int(m["size"]), int(m["offset"]), bool(m["released"]),
                        bool(m.get("down", False))) for m in self._ask("peers")["maps"]]

    def exports(self) -> list["OwnAlloc"]:
        """The job's own cuMem allocations (those its peers may have imported)."""
        return [OwnAlloc(int(a["va"]), int(a["size"]), bool(a["released"]),
                         bool(a.get("down", False))) for a in self._ask("exports")["allocs"]]

    def stamp(self, va: int, nonce: bytes) -> None:
        """Write a 16-byte nonce at `va` of one of the job's own allocations (bytes kept)."""
        self._ask(f"stamp {va} {nonce.hex()}")

    def unstamp(self) -> None:
        self._ask("unstamp")

    def peek(self, va: int) -> bytes:
        """The 16 bytes at `va` of one of the job's imports."""
        return bytes.fromhex(self._ask(f"peek {va}")["bytes"])

    def peer_down(self) -> int:
        """Every import unmapped and released (addresses kept); the bytes taken down."""
        return int(self._ask("peer-down")["bytes"])

    def peer_export(self, va: int) -> int:
        """A fresh export of the job's own allocation at `va`: a descriptor the caller owns."""
        self._ask(f"peer-export {va}")
        return self._take_fds(1)[0]

    def peer_up(self, fds: list[int]) -> int:
        """The imports that are down mapped back, one descriptor each in `peers` order."""
        return self._up("peer-up", fds)

    def own_export(self) -> OwnExport:
        """What own_take would export, while the job runs; nothing marked for own-down."""
        return self._own(self._ask("own-export"))

    def own_take(self, serials: Optional[list[int]] = None) -> OwnExport:
        """The job's own allocations that can be taken, marked for own-down: a fresh export of
        each, unless `serials` (an own_export's) are still those allocations (`same`), and
        but for those of them still there (`fresh` names the others)."""
        given = ",".join(str(n) for n in serials or [])
        fits = 0 < len(given) < LINE_ROOM       # longer: a fresh export
        return self._own(self._ask(f"own-take {given} keep" if fits else "own-take"))

    def _own(self, r: dict[str, Any]) -> OwnExport:
        # an agent older than own-export (a job started under an older pos) has no serials:
        # its answer is always a fresh export; one older than `keep`, no `fresh`
        fresh = r.get("fresh")
        return OwnExport([int(v) for v in r["vas"]], [int(n) for n in r.get("serials", [])],
                         self._take_fds(int(r["fds"])), bool(r.get("same", False)),
                         None if fresh is None else [int(i) for i in fresh])

    def own_down(self) -> int:
        """The job's own allocations unmapped and its handles released (what own-take gave
        holds the memory); the bytes taken down. The job must not run before own-up."""
        return int(self._ask("own-down")["bytes"])

    def own_up(self, fds: list[int]) -> int:
        """The job's own allocations that are down mapped back at their addresses from these
        descriptors, one each in `exports` order."""
        return self._up("own-up", fds)

    def _up(self, request: str, fds: list[int]) -> int:
        self._request = request
        self._send(f"{request} {len(fds)}\n".encode())
        for at in range(0, len(fds), MAX_FDS):
            self._send(b"+", fds[at:at + MAX_FDS])
        return int(self._line()["up"])


def _listener(sock: socket.socket) -> int:
    """The PID (in pos's namespace; 0 where it has none) of the process that listens at the
    other end of a connected unix socket: SO_PEERCRED, the kernel's word, not the peer's."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", creds)[0])


def _preloaded(pid: int) -> bool:
    """Whether process `pid` was started with the agent preloaded (`pos run`)."""
    try:
        environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    except OSError:
        return False
    return any(v.startswith(b"LD_PRELOAD=") and b"libposhook" in v for v in environ)


def _no_agent(pid: int) -> PosError:
    """Why no agent answers in process `pid`: it ended, it has not used CUDA yet (the agent
    starts with the first CUDA call of a `pos run` job), or it was not started with `pos run`."""
    if not _running(pid):
        return PosError(f"process {pid} ended before pos could reach its agent",
                        "see how the job ended (its exit status, its standard error)")
    if _preloaded(pid):
        return BadInput(f"process {pid} was started with `pos run`, but has not used CUDA yet "
                        "(its agent starts with its first CUDA call)",
                        "checkpoint it once it uses the GPU, or, until then, without "
                        "--concurrent")
    return BadInput(f"process {pid} has no pos agent", "start the job with `pos run -- CMD` "
                    "(the agent starts with its first CUDA call)")


def _running(pid: int) -> bool:
    """The process exists and has not ended (a zombie has)."""
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in "ZX"


def _ask_again(pid: int) -> "Status | str":
    """The agent's status on a new connection (with its account of how the last one ended), or
    why there is none, in words."""
    try:
        a = Agent(pid, timeout=PROBE_S)
    except BadInput as e:
        return f"its agent accepts no new connection ({e.cause})"
    except OSError as e:
        return f"its agent accepts no new connection ({e.strerror or e})"
    a._probe = True
    try:
        return a.status()
    except NoAnswer:
        return (f"its agent did not answer a new connection within {PROBE_S:.0f} s (its "
                "control thread is stuck: on the old connection, or inside the driver)")
    except PosError as e:
        return f"a new connection to its agent failed too ({e.cause})"
    finally:
        a.close()
