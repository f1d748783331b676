"""When CRIU may skip its network lock: every TCP connection of the tree has its other end in the
tree (pos/process/procs.py tcp_within, criu.Options.fitted)."""

import socket
import subprocess
import sys

from pos.process import procs
from pos.process.criu import Options

# a process holding a connection to PORT (argv[1]; 0: a listener of its own, connected to itself)
HOLD = """
import socket, sys, time
port = int(sys.argv[1])
if port == 0:
    srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1)
    port = srv.getsockname()[1]
c = socket.create_connection(("127.0.0.1", port))
if int(sys.argv[1]) == 0:
    peer, _ = srv.accept()
print("ready", flush=True)
time.sleep(60)
"""


def holding(port: int) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(port)], stdout=subprocess.PIPE,
                         text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    return p


def test_a_connection_with_both_ends_in_the_tree_needs_no_network_lock() -> None:
    p = holding(0)
    try:
        assert procs.tcp_within([p.pid])
        fitted = Options(tcp_established=True).fitted([p.pid])
        assert fitted.network_lock == "skip" and fitted.argv()[:2] == ["--network-lock", "skip"]
        assert Options().fitted([p.pid]).network_lock is None      # no --tcp-established
    finally:
        p.kill()
        p.wait()


def test_a_connection_to_outside_the_tree_keeps_the_lock() -> None:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    p = holding(srv.getsockname()[1])
    try:
        conn, _ = srv.accept()   # the job's end is established already: it said ready
        assert not procs.tcp_within([p.pid])
        assert Options(tcp_established=True).fitted([p.pid]).network_lock is None
        conn.close()
    finally:
        p.kill()
        p.wait()
        srv.close()


def test_no_connection_at_all_keeps_the_default() -> None:
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert not procs.tcp_within([p.pid])
    finally:
        p.kill()
        p.wait()


def test_a_deleted_file_over_criu_s_ghost_limit_raises_the_limit(tmp_path) -> None:
    """NCCL keeps a 34 MB deleted file in /dev/shm mapped; CRIU refuses ghost files over 1 MiB."""
    code = ("import mmap, os, sys, time\n"
            "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)\n"
            "os.ftruncate(fd, 3 << 20)\n"
            "m = mmap.mmap(fd, 3 << 20)\n"
            "os.close(fd); os.unlink(sys.argv[1])\n"
            "print('ready', flush=True); time.sleep(60)\n")
    p = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "seg")],
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        assert procs.largest_deleted_file([p.pid]) == 3 << 20
        fitted = Options().fitted([p.pid])
        assert fitted.ghost_limit == 4 << 20
        assert fitted.argv() == ["--ghost-limit", str(4 << 20)]
    finally:
        p.kill()
        p.wait()
    quiet = subprocess.Popen(["sleep", "60"])       # a process that holds no deleted file
    try:
        assert Options().fitted([quiet.pid]).ghost_limit is None
    finally:
        quiet.kill()
        quiet.wait()
