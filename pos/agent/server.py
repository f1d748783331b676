"""The agent's control socket: JSON lines over a root-only Unix socket at socket_path(pid).

Requests, one JSON object per line: {"op": "status"}, {"op": "checkpoint", "dir": DIR,
"incremental": bool, "compress": bool, "predicted": ["0x...", ...], optional "streams",
"writers", "chunk_mb", "depth"}, {"op": "restore", "dir": DIR, optional "streams", "chunk_mb",
"depth"}. Each gets one line back: {"ok": true, ...} or {"ok": false, "error": SENTENCE}; with
"ended": true the process ends once that line is sent (a restore that failed after the release:
HalfRestored).
/run/pos is 0700 and the socket 0600; peers other than root (SO_PEERCRED) are refused.
"""

import json
import os
import signal
import socket
import struct
import sys
import threading
from typing import Any, Callable

from pos.agent import SOCKET_DIR, HalfRestored, socket_path
from pos.errors import PosError

MAX_REQUEST = 1 << 20


def handle(agent: Any, line: bytes) -> dict[str, Any]:
    """One request to one reply; every failure is one sentence, never a traceback."""
    try:
        req = json.loads(line)
        if not isinstance(req, dict):
            raise ValueError
    except ValueError:
        return {"ok": False, "error": "the request is not a JSON object: send one per line, "
                                      "e.g. {\"op\": \"status\"}."}
    op = req.get("op")
    try:
        if op == "status":
            return {"ok": True, **agent.status()}
        if op in ("checkpoint", "restore"):
            if not isinstance(req.get("dir"), str) or not req["dir"]:
                return {"ok": False, "error": f"{op} needs \"dir\": the image directory."}
            opts = {k: int(req[k]) for k in ("streams", "chunk_mb", "writers", "depth")
                    if req.get(k) is not None}
            if op == "restore":
                opts.pop("writers", None)
                if req.get("quick_verify"):
                    opts["quick_verify"] = True
                return {"ok": True, **agent.restore(req["dir"], **opts)}
            predicted = tuple(int(x, 16) for x in req.get("predicted", ()))
            return {"ok": True, **agent.checkpoint(req["dir"], bool(req.get("incremental")),
                                                   bool(req.get("compress")), predicted,
                                                   **opts)}
    except HalfRestored as e:
        return {"ok": False, "error": e.message, "ended": True}
    except PosError as e:
        return {"ok": False, "error": e.message}
    except (TypeError, ValueError) as e:
        return {"ok": False, "error": f"bad {op} request ({e})."}
    return {"ok": False, "error": f"unknown op {op!r}: use status, checkpoint or restore."}


def _peer_uid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


class Server:
    """Listens on socket_path(os.getpid()) in a daemon thread; `close` removes the socket.
    `end` ends the process after an "ended" answer (SIGKILL: a handler the job installed for
    SIGTERM could save the half-restored state)."""

    def __init__(self, agent: Any, path: str = "", allowed_uid: int = 0,
                 on_thread: Callable[[], None] = lambda: None,
                 end: Callable[[], None] = lambda: os.kill(os.getpid(), signal.SIGKILL)) -> None:
        self.agent, self.allowed_uid, self.on_thread, self.end = agent, allowed_uid, on_thread, end
        self.path = path or socket_path(os.getpid())
        os.makedirs(os.path.dirname(self.path), mode=0o700, exist_ok=True)
        if os.path.dirname(self.path) == SOCKET_DIR:
            os.chmod(SOCKET_DIR, 0o700)
        try:
            os.unlink(self.path)                  # left by an earlier process with this PID
        except FileNotFoundError:
            pass
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            self.sock.bind(self.path)
        finally:
            os.umask(old)
        os.chmod(self.path, 0o600)
        self.sock.listen(4)
        self.thread = threading.Thread(target=self._serve, name="pos-agent", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        """One thread per connection: a `status` must be answered while a checkpoint or
        restore of another connection runs (the job polls for the cut and the release)."""
        self.on_thread()
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._connection, args=(conn,), name="pos-agent-conn",
                             daemon=True).start()

    def _connection(self, conn: socket.socket) -> None:
        with conn:
            try:
                self._session(conn)
            except OSError:
                pass

    def _session(self, conn: socket.socket) -> None:
        if _peer_uid(conn) != self.allowed_uid:
            conn.sendall(json.dumps({"ok": False, "error": "the pos agent answers root only: "
                                     "run pos with sudo."}).encode() + b"\n")
            return
        f = conn.makefile("rb")
        while line := f.readline(MAX_REQUEST):
            if not line.strip():
                continue
            reply = handle(self.agent, line)
            try:
                conn.sendall(json.dumps(reply).encode() + b"\n")
            finally:
                if reply.get("ended"):
                    self.end()

    def close(self) -> None:
        self.sock.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def start() -> None:
    """Start the agent in this process (the sitecustomize calls this when POS_AGENT=1): the
    table and callbacks first, so that no allocation is missed, then the socket. A failure is
    one line on stderr and the program runs without the agent."""
    from pos.agent.agent import Agent, load_validated

    try:
        agent = Agent(pool_bytes=int(os.environ.get("POS_SHADOW_POOL_MB", "1024")) << 20,
                      validated=load_validated(os.environ.get("POS_VALIDATION")),
                      trust_all=os.environ.get("POS_TRUST_SPECULATION") == "1",
                      track_dirty=os.environ.get("POS_TRACK_DIRTY") == "1")
        agent.compile()
        agent.attach_cupti()
        server = Server(agent)
    except (PosError, OSError) as e:
        msg = e.message if isinstance(e, PosError) else str(e)
        print(f"pos agent: not started: {msg}", file=sys.stderr)
        return
    import atexit

    atexit.register(server.close)
    threading.Thread(target=_resolver, args=(agent,), name="pos-resolver", daemon=True).start()


def _resolver(agent: Any) -> None:
    """Looks up the layouts of newly launched functions every 20 ms."""
    import time

    while not agent.uses_gpu():      # the application sets CUDA up first (Agent.register)
        time.sleep(0.02)
    agent.register()
    while True:
        agent.resolve_functions()
        time.sleep(0.02)
