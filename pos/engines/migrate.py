"""Moving a process: onto another GPU of this host (the driver's restore with the GPU pairs of
pos/operation/gpumap.py, no CRIU needed), or to another host (CRIU's page server streams the
memory, a control connection carries the rest of the image, both over TLS with the key the
hosts share; the receiver verifies and restores it)."""

import os
import shutil
import socket
import ssl
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

from pos import image
from pos.errors import BadInput, PosError
from pos.image import names
from pos.engines import migrate_key
from pos.engines import migrate_protocol as proto
from pos.engines.migrate_key import HANDSHAKE_S, MigrateKey
from pos.operation import restorable
from pos.operation.gpumap import Onto, of_process
from pos.operation.plan import MovePlan
from pos.operation.steps import Echo, Guard, folder_bytes
from pos.process import criu as criu_mod
from pos.process import cudackpt, procs
from pos.process.criu import PageServer
from pos.progress import QUIET, Progress
from pos.settings import Settings

if TYPE_CHECKING:     # the engines call this module, which is handed one
    from pos.operation.engine import Engine, Save


def to_gpu(pid: int, where: Onto, lock_timeout_ms: int, echo: Echo = lambda _: None,
           progress: Progress = QUIET, settings: Optional[Settings] = None) -> dict[str, float]:
    """lock -> checkpoint -> restore onto the GPUs `where` names -> unlock, for every CUDA
    process of the tree; the undo restores onto the original GPUs. The seconds of each step."""
    pids, cuda = restorable.tree(pid, dumped=False)
    if not cuda:
        raise BadInput(f"PID {pid} has no CUDA state", "give the PID of a process that uses a GPU")
    agents = restorable.require(cuda, f"move it with `pos migrate {pid} --to-gpu {where} "
                                "--concurrent`")
    pairs = of_process(cuda, where)

    plan = MovePlan(pids, cuda)
    with Guard(plan, echo, settings or Settings.from_env(), progress) as g:
        for step, fn in (("lock", lambda p: cudackpt.lock(p, lock_timeout_ms)),
                         ("checkpoint", cudackpt.checkpoint),
                         ("restore", lambda p: cudackpt.restore(p, pairs)),
                         ("unlock", cudackpt.unlock)):
            g.each(step, cuda, fn)
            if step == "lock":
                restorable.recheck_locked(cuda, agents)
    moved = ", ".join(f"{a} -> {b}" for a, b in pairs if a != b)
    echo(f"PID {pid} now runs on GPU {where} ({moved})")
    return g.timings


def image_dir(pid: int) -> Path:
    """A migration's temporary image."""
    return Path(f"/tmp/pos-migrate-{pid}-{int(time.time())}")


# ---- to another host ---------------------------------------------------------------------
# The control connection is TLS with the hosts' migration key (migrate_key.py) and carries the
# messages of migrate_protocol.py; files follow their message as raw bytes. CRIU's page server
# listens on the control port + 1, with the same key.

def _send(sock: socket.socket, msg: proto.Message, payload: bytes = b"") -> None:
    sock.sendall(proto.encode(msg) + payload)


class _Reader:
    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.buf = sock, b""

    def _fill(self) -> None:
        chunk = self.sock.recv(1 << 20)
        if not chunk:
            raise PosError("the other side of the migration closed the connection",
                           "see its output for the reason")
        self.buf += chunk

    def message(self) -> proto.Message:
        while b"\n" not in self.buf:
            self._fill()
        line, self.buf = self.buf.split(b"\n", 1)
        return proto.decode(line)

    def exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._fill()
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def into(self, path: Path, n: Any) -> None:
        """The next n bytes into a new file, a piece at a time (a GPU image's data files are
        gigabytes)."""
        if not isinstance(n, int) or n < 0:
            raise PosError(f"the other side of the migration announced {path.name} with size "
                           f"{n!r}", "migrate again with the same version of pos on both hosts")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            while n:
                if not self.buf:
                    self._fill()
                piece, self.buf = self.buf[:n], self.buf[n:]
                f.write(piece)
                n -= len(piece)


def _send_file(sock: socket.socket, image: Path, name: str) -> int:
    """The header and the bytes of the image's file `name`; its size."""
    path = image / name
    size = path.stat().st_size
    _send(sock, proto.File(name, size))
    with open(path, "rb") as f:
        if size and sock.sendfile(f, count=size) != size:
            raise PosError(f"{path} shrank while it was being sent", "migrate again")
    return size


def _split(host: str) -> tuple[str, int]:
    """HOST[:PORT] of --to; PORT as --listen's --port takes it (CRIU's page server uses PORT+1)."""
    name, _, port = host.rpartition(":") if ":" in host else (host, "", "7070")
    if name and port.isdigit() and 1 <= int(port) <= 65534:
        return name, int(port)
    raise BadInput(f"--to {host!r} is not HOST or HOST:PORT (a port from 1 to 65534)",
                   "e.g. --to 10.0.0.2:7070")


def _not_trusted(e: Exception) -> str:
    """Why a TLS handshake failed, in a few words (the peer's certificate was refused, or ours)."""
    reason = getattr(e, "reason", None) or getattr(e, "strerror", None) or str(e)
    return str(reason).lower().replace("_", " ")


def to_host(pid: int, host: str, engine: "Engine", save: "Save", local: Optional[Path],
            key_folder: Path, progress: Progress = QUIET) -> tuple[int, dict[str, float]]:
    """Checkpoint PID with `engine` and send its image to HOST, then wait until HOST has
    restored it; the PID it has there, and the seconds of each part (the checkpoint's own steps
    as `checkpoint.*`), to say where a migration's downtime goes. Both hosts prove that they
    hold `key` before anything of the process leaves. Stop-the-world: the pages stream to
    HOST's page server during the dump. Concurrent (a `pos run` job): the whole-process image,
    taken here (the job frozen only for the driver's small checkpoint and CRIU's dump, its
    device memory copied by pos), then sent whole."""
    address, port = _split(host)
    procs.require_checkpointable(pid)
    procs.require_dumpable(pid)
    key = migrate_key.load(key_folder)
    try:
        raw = socket.create_connection((address, port), timeout=30)
    except OSError as e:
        raise BadInput(f"cannot reach {address}:{port} ({e.strerror or e})",
                       "start `pos migrate --listen` there first") from None
    try:
        sock = key.client().wrap_socket(raw)
    except (ssl.SSLError, OSError) as e:
        raw.close()
        raise PosError(f"{address}:{port} did not authenticate as a holder of this host's "
                       f"migration key ({_not_trusted(e)})",
                       "give both hosts the same key folder (`pos migrate --new-key` on one, "
                       "copied to the other), then migrate again") from None
    sock.settimeout(None)
    reader = _Reader(sock)
    with sock:
        whole = not engine.sends_pages    # no page server: the image goes whole
        _send(sock, proto.Hello(procs.tree(pid), whole))
        reply = reader.message()
        if isinstance(reply, proto.Failed):
            raise BadInput(f"{address} refused the migration: {reply.cause}",
                           "fix that there, then migrate again")
        proto.expect(reply, proto.Ready)
        keep = local is not None
        local = local or image_dir(pid)
        t0 = time.monotonic()
        saved = engine.checkpoint(pid, local, replace(
            save, leave_running=False,
            page_server=None if whole else PageServer(address, port + 1, tuple(key.criu_argv()))))
        path, manifest = Path(saved.path), saved.manifest or image.load(Path(saved.path))
        t1 = time.monotonic()
        progress.phase("send", total=manifest.size_bytes)
        for name in sorted(manifest.files):
            progress.advance(_send_file(sock, path, name))
        progress.phase(f"restore on {address}")
        text = manifest.to_json().encode()
        _send(sock, proto.Manifest(len(text)), text)
        t2 = time.monotonic()
        reply = reader.message()
        timings = {"checkpoint": t1 - t0, "send": t2 - t1, "there": time.monotonic() - t2,
                   "sent_bytes": float(manifest.size_bytes),
                   **{f"checkpoint.{k}": v for k, v in manifest.timings.items()}}
    restored = restored_there(reply, address, pid)
    if not keep:     # HOST has the image now
        shutil.rmtree(path, ignore_errors=True)
    engine.echo(f"PID {pid} migrated to {address}: restored there as PID {restored.pid}")
    return restored.pid, timings


def restored_there(reply: proto.Message, address: str, pid: int) -> proto.Restored:
    """The receiver's answer to the image sent: what it restored, or its failure raised as
    this pos's own, with its exit code."""
    if isinstance(reply, proto.Failed):
        raise replace(reply, cause=f"{address} could not restore PID {pid}: {reply.cause}",
                      fix=f"its image stays there for `pos restore` ({reply.path or '?'})"
                      ).error()
    restored = proto.expect(reply, proto.Restored)
    assert isinstance(restored, proto.Restored)
    return restored


def _wait_listening(port: int, proc: Any) -> None:
    """Until CRIU's page server listens (probing it by connecting would use up its one
    connection, so /proc/self/net/tcp* is read instead)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and proc.poll() is None:
        for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
            with open(table) as f:
                for line in f.readlines()[1:]:
                    local, state = line.split()[1], line.split()[3]
                    if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                        return
        time.sleep(0.02)
    raise PosError(f"CRIU's page server did not listen on port {port}",
                   f"see {names.PAGE_SERVER_LOG} next to the image")


def _authenticated(server: socket.socket, key: MigrateKey,
                   echo: Echo) -> tuple[ssl.SSLSocket, str]:
    """The first connection whose peer proves it holds `key`; every other one is closed at its
    handshake, before a byte of it is read, and said in one line."""
    ctx = key.server()
    while True:
        conn, peer = server.accept()
        conn.settimeout(HANDSHAKE_S)
        try:
            tls = ctx.wrap_socket(conn, server_side=True)
        except (ssl.SSLError, OSError) as e:
            conn.close()
            echo(f"refused a connection from {peer[0]}: it did not authenticate with this "
                 f"host's migration key ({_not_trusted(e)})")
            continue
        tls.settimeout(None)
        return tls, peer[0]


def listen(address: str, port: int, directory: Path, settings: Settings, key: MigrateKey,
           restore: Callable[[Path], Optional[int]], echo: Echo = lambda _: None,
           progress: Progress = QUIET) -> int:
    """Receive one migrating process into `directory` and `restore` it (with the engine its
    image's kind asks for: the caller's choice); its PID. Only a peer that holds `key` is heard:
    nothing is written before one has connected and proved it."""
    criu = criu_mod.find(settings)
    directory = directory.absolute()
    image.check_new(directory)     # before any peer is waited for; made once one is heard
    try:
        server = socket.create_server((address, port))
    except OSError as e:
        raise BadInput(f"cannot listen on {address}:{port} ({e.strerror})",
                       "give another --port or --address") from None
    echo(f"listening on {address}:{port} (page server on {port + 1}), for a host that holds "
         f"the migration key of {key.folder}")
    with server:
        conn, peer = _authenticated(server, key, echo)
    with conn:
        reader = _Reader(conn)
        hello = proto.expect(reader.message(), proto.Hello)
        assert isinstance(hello, proto.Hello)
        partial = image.prepare(directory, 0)
        try:
            # the PIDs are checked at the restore: the dump frees them when both "hosts"
            # share one PID namespace (as in the tests)
            echo(f"PIDs {hello.pids} announced by {peer}")
            work = partial.parent
            # a whole-process concurrent image comes whole; otherwise the pages stream to
            # CRIU's page server during the dump
            page_server = PageServer(address, port + 1, tuple(key.criu_argv()))
            ps = None if hello.concurrent else criu.start(
                criu.page_server_argv(partial, page_server, work))
            if ps is not None:
                _wait_listening(port + 1, ps)
            _send(conn, proto.Ready())
            progress.phase("receive", poll=lambda: folder_bytes(partial))
            manifest_text = b""
            while not manifest_text:
                msg = reader.message()
                if isinstance(msg, proto.File):
                    if not names.is_file_name(msg.name):
                        raise PosError(f"the other side of the migration sent a file named "
                                       f"{msg.name!r}", "migrate again")
                    (partial / msg.name).parent.mkdir(mode=0o700, exist_ok=True)
                    reader.into(partial / msg.name, msg.size)
                else:
                    size = proto.expect(msg, proto.Manifest)
                    assert isinstance(size, proto.Manifest)
                    manifest_text = reader.exactly(size.size)
            if ps is not None:
                criu.finish(ps, "page-server", work / names.PAGE_SERVER_LOG)
            manifest = image.Manifest.from_json(manifest_text.decode())
            if hello.concurrent:     # sent whole: its sender's checksums, checked by the restore
                final = image.adopt(partial, manifest)
            else:               # pages came through CRIU's page server: checksummed here
                progress.phase("checksum", total=folder_bytes(partial))
                final = image.seal(partial, manifest, progress.advance)
            echo(f"received PID {manifest.pid} from {peer} into {final}")
            restored = restore(final)
        except Exception as e:      # the sender learns why, whatever failed here
            image.discard(partial)
            failure = e if isinstance(e, PosError) else PosError(repr(e), "see the receiver")
            _send(conn, replace(proto.Failed.of(failure), path=str(directory)))
            raise
        _send(conn, proto.Restored(restored or 0))
    return restored or 0
