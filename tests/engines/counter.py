"""A test target: counts 1, 2, 3 ... into FILE, one line every 10 ms, forever.

  counter.py FILE [--children N] [--cuda LIBCUDA] [--ballast-mb M]
             [--tcp PORT] [--unix-fd N] [--unix-dgram PATH] [--lock LOCKFILE]
             [--stdout] [--hold DATAFILE] [--map FILE] [--setenv NAME=VALUE]

--children N forks N children after start, child i counting into FILE.i (a process tree);
--cuda calls cuInit of that library first, so that the process holds (fake) CUDA state.
--ballast-mb M keeps M MiB of touched memory, so that a dump takes a while.
The resources below are what CRIU refuses to dump without an option (tests/process/
test_criu_resources.py); each is used on every count, so a count proves it still works:
--tcp PORT connects to 127.0.0.1:PORT and writes a number only once the peer echoed it back
(an established TCP connection: --tcp-established).
--unix-fd N sends each number over the UNIX stream socket it inherited as descriptor N, whose
other half the launcher holds (--external unix[INODE] on dump, --inherit-fd on restore).
--unix-dgram PATH connects a UNIX datagram socket to the socket bound at PATH by a process
outside the tree and sends each number over it (--ext-unix-sk).
--lock LOCKFILE takes an exclusive flock on LOCKFILE and holds it (--file-locks).
--stdout also writes each number to stdout (a log file or a terminal, tests/process/
test_criu_failures.py); --hold DATAFILE keeps DATAFILE open for reading and writing.
--map FILE maps FILE (a library, as /proc/PID/maps shows it: tests/operation/
test_restorable.py names one libnccl.so.2); --setenv NAME=VALUE sets a variable after the
start, as a program's `os.environ[NAME] = VALUE` does (not in /proc/PID/environ).
The file is opened with O_APPEND: after a restore the counter appends where it left off.
"""

import argparse
import ctypes
import fcntl
import mmap
import os
import socket
import time

args = argparse.ArgumentParser()
args.add_argument("file")
args.add_argument("--children", type=int, default=0)
args.add_argument("--cuda")
args.add_argument("--ballast-mb", type=int, default=0)
args.add_argument("--tcp", type=int)
args.add_argument("--unix-fd", type=int)
args.add_argument("--unix-dgram")
args.add_argument("--lock")
args.add_argument("--stdout", action="store_true")
args.add_argument("--hold")
args.add_argument("--map")
args.add_argument("--setenv", action="append", default=[])
a = args.parse_args()
ballast = b"\1" * (a.ballast_mb << 20)
if a.cuda:
    assert ctypes.CDLL(a.cuda).cuInit(0) == 0
tcp = socket.create_connection(("127.0.0.1", a.tcp)) if a.tcp else None
unix = socket.socket(fileno=a.unix_fd) if a.unix_fd is not None else None
if a.unix_dgram:
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    unix.connect(a.unix_dgram)
held = os.open(a.hold, os.O_RDWR) if a.hold else None
if a.map:
    with open(a.map, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
for pair in a.setenv:
    os.environ[pair.partition("=")[0]] = pair.partition("=")[2]
if a.lock:
    lock_fd = os.open(a.lock, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(lock_fd, fcntl.LOCK_EX)
path = a.file
for i in range(a.children):
    if os.fork() == 0:
        path = f"{a.file}.{i}"
        break
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
n = 0
while True:
    n += 1
    line = b"%d\n" % n
    if tcp is not None:
        tcp.sendall(line)
        echo = b""
        while not echo.endswith(b"\n"):
            got = tcp.recv(64)
            if not got:
                raise SystemExit("the TCP peer closed the connection")
            echo += got
        line = echo
    if unix is not None:
        unix.send(line)
    os.write(fd, line)
    if a.stdout:
        os.write(1, line)
    time.sleep(0.01)
