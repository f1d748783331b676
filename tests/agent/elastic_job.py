"""A job shaped as torchrun starts one, against the fake driver, without torch: an elastic agent
that hosts a TCP store on an event loop (io_uring first, as libuv >= 1.45 does, epoll when
io_uring_setup fails with ENOSYS), is a client of its own store, and supervises worker
processes; each worker holds device memory of the fake driver, talks to the store over TCP at
every step, and checks that its memory holds what its last step wrote.

  elastic_job.py agent DIR WORKERS     the agent (CUDA initialised, no device memory, as
                                       torchrun's own): DIR/agent.txt gets "LOOP epoll|io_uring",
                                       "HB N" (its own store round trips, one a 20 ms) and at
                                       its end "DONE" (every worker exited 0) or "FAILED R RC"
  elastic_job.py worker DIR RANK PORT  (started by the agent) DIR/rank-R.txt gets "STEP" lines;
                                       it ends with 0 once DIR/stop exists, with 1 when its
                                       memory does not hold its last step's value ("WRONG")

The fake driver is POS_LIBCUDA's (tests/fakegpu), loaded through ctypes (dlsym: the agent's
wrappers, as a runtime's lookups). What this cannot show is torch's own store and NCCL
(bench/torchrun_gpu.py does, on GPUs)."""

import ctypes
import errno
import os
import selectors
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

NR_IO_URING_SETUP = {"x86_64": 425, "aarch64": 425}
BYTES = 1 << 20
TICK_S = 0.02


def line(path: Path, text: str) -> None:
    """One line appended (O_APPEND: a restored process appends where the file ends)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, f"{text}\n".encode())
    finally:
        os.close(fd)


def event_loop() -> tuple[selectors.BaseSelector, str]:
    """libuv's choice: an io_uring if the kernel gives one, epoll when io_uring_setup says
    ENOSYS (any other failure is fatal, as it is not what pos run makes)."""
    libc = ctypes.CDLL(None, use_errno=True)
    params = ctypes.create_string_buffer(120)            # struct io_uring_params
    fd = libc.syscall(NR_IO_URING_SETUP[os.uname().machine], 8, params)
    if fd < 0 and ctypes.get_errno() != errno.ENOSYS:
        raise OSError(ctypes.get_errno(), "io_uring_setup")
    return selectors.EpollSelector(), ("epoll" if fd < 0 else "io_uring")   # the ring stays open


def store(server: socket.socket, loop: selectors.BaseSelector) -> None:
    """Answers each line "WHO N" with "ok N", on the event loop, forever."""
    server.setblocking(False)
    loop.register(server, selectors.EVENT_READ)
    pending: dict[socket.socket, bytes] = {}
    while True:
        for key, _ in loop.select():
            s = key.fileobj
            if s is server:
                conn, _ = server.accept()
                conn.setblocking(True)
                pending[conn] = b""
                loop.register(conn, selectors.EVENT_READ)
                continue
            data = s.recv(4096)
            if not data:
                loop.unregister(s)
                pending.pop(s)
                s.close()
                continue
            pending[s] += data
            while b"\n" in pending[s]:
                one, _, pending[s] = pending[s].partition(b"\n")
                s.sendall(b"ok " + one.split()[-1] + b"\n")


def ask(conn: socket.socket, who: str, n: int) -> None:
    conn.sendall(f"{who} {n}\n".encode())
    got = b""
    while not got.endswith(b"\n"):
        piece = conn.recv(64)
        if not piece:
            raise SystemExit(f"{who}: the store closed the connection")
        got += piece
    if got.split() != [b"ok", str(n).encode()]:
        raise SystemExit(f"{who}: the store answered {got!r} to {n}")


def agent(folder: Path, workers: int) -> int:
    # torchrun's own process initialises CUDA (it counts the GPUs) and holds no device memory
    check(ctypes.CDLL(os.environ.get("POS_LIBCUDA", "libcuda.so.1")).cuInit(0))
    loop, kind = event_loop()
    out = folder / "agent.txt"
    line(out, f"LOOP {kind}")
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    threading.Thread(target=store, args=(server, loop), daemon=True).start()
    ranks = [subprocess.Popen([sys.executable, __file__, "worker", str(folder), str(r),
                               str(port)]) for r in range(workers)]
    client = socket.create_connection(("127.0.0.1", port))
    for n in range(1, 1 << 62):
        ask(client, "agent", n)
        line(out, f"HB {n}")
        codes = [p.poll() for p in ranks]
        failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            for p in ranks:
                p.kill()
            line(out, f"FAILED {failed[0][0]} {failed[0][1]}")
            return 1
        if all(c == 0 for c in codes):
            line(out, "DONE")
            return 0
        time.sleep(TICK_S)
    return 1


def check(r: int) -> None:
    if r != 0:
        raise SystemExit(f"the fake driver answered {r}")


def worker(folder: Path, rank: int, port: int) -> int:
    cuda = ctypes.CDLL(os.environ.get("POS_LIBCUDA", "libcuda.so.1"))
    ctx, buf = ctypes.c_void_p(), ctypes.c_uint64()
    check(cuda.cuInit(0))
    check(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0))
    check(cuda.cuCtxSetCurrent(ctx))
    check(cuda.cuMemAlloc_v2(ctypes.byref(buf), ctypes.c_size_t(BYTES)))
    check(cuda.cuMemsetD32_v2(buf, 0, ctypes.c_size_t(BYTES // 4)))
    conn = socket.create_connection(("127.0.0.1", port))
    out, seen = folder / f"rank-{rank}.txt", ctypes.c_uint32()
    for step in range(1, 1 << 62):
        if (folder / "stop").exists():
            return 0
        check(cuda.cuMemcpyDtoH_v2(ctypes.byref(seen), ctypes.c_uint64(buf.value + BYTES - 4),
                                   ctypes.c_size_t(4)))
        if seen.value != step - 1:
            line(out, f"WRONG {step} {seen.value}")
            return 1
        check(cuda.cuMemsetD32_v2(buf, step, ctypes.c_size_t(BYTES // 4)))
        ask(conn, f"rank{rank}", step)
        line(out, str(step))
        time.sleep(TICK_S)
    return 1


def main() -> int:
    role, folder = sys.argv[1], Path(sys.argv[2])
    if role == "agent":
        return agent(folder, int(sys.argv[3]))
    return worker(folder, int(sys.argv[3]), int(sys.argv[4]))


if __name__ == "__main__":
    sys.exit(main())
