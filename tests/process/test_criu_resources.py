"""The CRIU options of `pos checkpoint` against real CRIU (root, no GPU): for each resource that
CRIU refuses to dump by default, a counter holding it is (a) refused without the option, in one
sentence naming it, exit 2, and left running; (b) dumped with it, restored, and counts on with
the resource still working (the socket still carries its numbers, the lock is held again)."""

import fcntl
import os
import socket
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import Iterator

import pytest

from pos.image import names
from tests.engines.conftest import Counter, lines, one_sentence, pos, wait_for


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return {"POS_DB": str(tmp_path / "pos.db"), "POS_WATCHDOG_LOG": str(tmp_path / "wd.log")}


def consecutive(values: list[int]) -> None:
    assert values and values == list(range(values[0], values[0] + len(values))), \
        f"{values[:5]}...{values[-5:]}"


def refused_then_restored(c: Counter, img: Path, env: dict[str, str], fragment: str,
                          option: tuple[str, ...], prefix: tuple[str, ...] = (),
                          restore_args: tuple[str, ...] = (),
                          pass_fds: tuple[int, ...] = ()) -> None:
    """(a) refused without `option`, running on; (b) dumped with it, restored, counting on
    from the value it had at the dump, without a gap."""
    r = pos("checkpoint", str(c.pid), "-D", str(img), env=env, prefix=prefix)
    one_sentence(r, 2, fragment)
    assert c.running()
    assert not img.exists() and not names.partial(img).exists()
    r = pos("checkpoint", str(c.pid), "-D", str(img), *option, env=env, prefix=prefix)
    assert r.returncode == 0, r.stderr
    c.reap_original()
    at_dump = len(lines(c.path))
    r = pos("restore", "-D", str(img), *restore_args, env=env, prefix=prefix, pass_fds=pass_fds)
    assert r.returncode == 0, r.stderr
    assert f"restored PID {c.pid}" in r.stdout
    wait_for(lambda: len(lines(c.path)) > at_dump + 20, what="the restored counter")
    consecutive(lines(c.path))
    assert lines(c.path)[0] == 1


def test_file_locks(tmp_path: Path, counters, env) -> None:
    lock = tmp_path / "lock"
    c = Counter(tmp_path / "count", extra=("--lock", str(lock)))
    counters.append(c)
    fd = os.open(lock, os.O_RDWR)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)        # the counter holds it
        r = pos("checkpoint", str(c.pid), "-D", str(tmp_path / "img"), env=env)
        one_sentence(r, 2, "holds file locks", "add --file-locks")
        assert c.running()
        r = pos("checkpoint", str(c.pid), "-D", str(tmp_path / "img"), "--file-locks", env=env)
        assert r.returncode == 0, r.stderr
        c.reap_original()
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)            # free while nobody runs
        fcntl.flock(fd, fcntl.LOCK_UN)
        at_dump = len(lines(c.path))
        r = pos("restore", "-D", str(tmp_path / "img"), env=env)
        assert r.returncode == 0, r.stderr
        wait_for(lambda: len(lines(c.path)) > at_dump + 20, what="the restored counter")
        consecutive(lines(c.path))
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)        # the restored one holds it
    finally:
        os.close(fd)


def _collect(sock: socket.socket, into: list[bytes]) -> None:
    """Everything the peer receives, until its socket is closed."""
    while True:
        try:
            data = sock.recv(65536)
        except OSError:
            return
        if not data:
            return
        into.append(data)


def received(chunks: list[bytes]) -> list[int]:
    return [int(x) for x in b"".join(chunks).split()]


def test_ext_unix_sk_datagram_peer_outside_the_tree(tmp_path: Path, counters, env) -> None:
    peer = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    peer.bind(str(tmp_path / "peer.sock"))
    got: list[bytes] = []
    threading.Thread(target=_collect, args=(peer, got), daemon=True).start()
    try:
        c = Counter(tmp_path / "count", extra=("--unix-dgram", str(tmp_path / "peer.sock")))
        counters.append(c)
        refused_then_restored(c, tmp_path / "img", env, "add --ext-unix-sk", ("--ext-unix-sk",))
        # the restored socket reached the same peer: it received every number, in order
        wait_for(lambda: received(got)[-1:] and received(got)[-1] > lines(c.path)[0] + 20,
                 what="the peer")
        consecutive(received(got))
    finally:
        peer.close()


def test_external_unix_stream_and_inherit_fd(tmp_path: Path, counters, env) -> None:
    """A stream socket's other half is the launcher's: the dump leaves it alone (--external
    unix[INODE]) and the restore hands the launcher's descriptor back (--inherit-fd)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    fd = theirs.fileno()
    got: list[bytes] = []
    threading.Thread(target=_collect, args=(ours, got), daemon=True).start()
    try:
        c = Counter(tmp_path / "count", extra=("--unix-fd", str(fd)), pass_fds=(fd,))
        counters.append(c)
        ino = os.fstat(fd).st_ino
        refused_then_restored(c, tmp_path / "img", env, "for a stream socket add --external "
                              "'unix[INODE]' and restore with --inherit-fd",
                              ("--external", f"unix[{ino}]"),
                              restore_args=("--inherit-fd", f"fd[{fd}]:socket:[{ino}]"),
                              pass_fds=(fd,))
        wait_for(lambda: received(got)[-1:] and received(got)[-1] > lines(c.path)[0] + 20,
                 what="the peer")
        consecutive(received(got))
        assert received(got)[0] == 1
    finally:
        ours.close()
        theirs.close()


def test_inherit_fd_that_pos_was_not_given_is_one_sentence(tmp_path: Path, counters,
                                                          env) -> None:
    c = Counter(tmp_path / "count")
    counters.append(c)
    assert pos("checkpoint", str(c.pid), "-D", str(tmp_path / "img"), env=env).returncode == 0
    c.reap_original()
    r = pos("restore", "-D", str(tmp_path / "img"), "--inherit-fd", "fd[77]:pipe:[1]", env=env)
    one_sentence(r, 2, "names descriptor 77, which pos was not given")
    r = pos("restore", "-D", str(tmp_path / "img"), "--inherit-fd", "pipe:[1]", env=env)
    one_sentence(r, 2, "is not of the form fd[N]:RESOURCE")
    assert not os.path.exists(f"/proc/{c.pid}")


ECHO = """import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1]))); s.listen(1)
print("ready", flush=True)
c, _ = s.accept()
while (d := c.recv(4096)):
    c.sendall(d)
"""


@pytest.fixture
def netns(criu_ready: None) -> Iterator[str]:
    """A network namespace of its own (loopback up): CRIU locks the connection with netfilter
    rules there, and the peer lives there too."""
    from pyroute2 import NetNS, netns as nsmod

    name = f"post{uuid.uuid4().hex[:6]}"
    nsmod.create(name)
    with NetNS(name) as ns:
        ns.link("set", index=ns.link_lookup(ifname="lo")[0], state="up")
    yield name
    nsmod.remove(name)


def test_tcp_established(tmp_path: Path, netns: str, counters, env) -> None:
    prefix = ("nsenter", f"--net=/run/netns/{netns}")
    echo = subprocess.Popen([*prefix, sys.executable, "-c", ECHO, "7011"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert echo.stdout is not None and echo.stdout.readline() == "ready\n"
        c = Counter(tmp_path / "count", extra=("--tcp", "7011"), prefix=prefix)
        counters.append(c)
        img = tmp_path / "img"
        r = pos("checkpoint", str(c.pid), "-D", str(img), env=env, prefix=prefix)
        one_sentence(r, 2, "established TCP connections", "add --tcp-established")
        assert c.running()
        r = pos("checkpoint", str(c.pid), "-D", str(img), "--tcp-established", env=env,
                prefix=prefix)
        if "CRIU issue 2718" in r.stderr:
            # this CRIU cannot dump any INET socket on this kernel: still one sentence, and the
            # counter (its connection included) runs on
            one_sentence(r, 2, "cannot dump INET (TCP/UDP) sockets on this kernel")
            assert c.running()
            pytest.skip(f"CRIU cannot dump TCP sockets on Linux {os.uname().release}: "
                        f"{r.stderr.strip()}")
        assert r.returncode == 0, r.stderr
        c.reap_original()
        at_dump = len(lines(c.path))
        r = pos("restore", "-D", str(img), env=env, prefix=prefix)
        assert r.returncode == 0, r.stderr
        # each number is written only once the peer echoed it: the connection carries on
        wait_for(lambda: len(lines(c.path)) > at_dump + 20, what="the restored counter")
        consecutive(lines(c.path))
    finally:
        echo.kill()
        echo.wait()
