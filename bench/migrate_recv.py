"""The receiving side of `pos migrate --listen` alone, over loopback: how fast a data file goes
from the socket to disk, without a GPU.

    python3 bench/migrate_recv.py [--gib 2] [--dir /dev/shm] [--out FILE]

The sender is pos's own (`migrate._send_file`: sendfile, no copy through Python). Receivers:
  into      pos's `_Reader.into`: one reused buffer filled by recv_into, written out
  bytes     the loop before it (the baseline): 1 MiB recv calls joined and sliced as bytes
  discard   recv_into with nothing written: what loopback TCP and the sender give (the floor)
GB/s, best of three, each way in turn."""

import argparse
import json
import os
import platform
import socket
import threading
import time
from pathlib import Path
from typing import Callable

from pos.scheduler.migrate import _Reader, _send_file


def bytes_loop(reader: _Reader, path: Path, n: int) -> None:
    with open(path, "wb") as f:
        while n:
            if not reader.buf:
                reader._fill()
            piece, reader.buf = reader.buf[:n], reader.buf[n:]
            f.write(piece)
            n -= len(piece)


def discard(reader: _Reader, _path: Path, n: int) -> None:
    n -= len(reader.buf)
    reader.buf = b""
    view = memoryview(reader.piece)
    while n:
        n -= reader.sock.recv_into(view[:min(n, len(view))])


WAYS: dict[str, Callable[[_Reader, Path, int], None]] = {
    "into": lambda r, p, n: r.into(p, n), "bytes": bytes_loop, "discard": discard}


def once(way: str, src: Path, dst: Path) -> float:
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def send() -> None:
        with socket.create_connection(("127.0.0.1", port)) as s:
            _send_file(s, src)

    t = time.perf_counter()
    sender = threading.Thread(target=send)
    sender.start()
    conn, _ = server.accept()
    with conn, server:
        reader = _Reader(conn)
        n = reader.message()["size"]
        WAYS[way](reader, dst, n)
    sender.join()
    seconds = time.perf_counter() - t
    dst.unlink(missing_ok=True)
    return n / seconds / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--dir", type=Path, default=Path("/dev/shm"))
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    src, dst = a.dir / f"pos-recv-src-{os.getpid()}", a.dir / f"pos-recv-dst-{os.getpid()}"
    n = int(a.gib * 2**30)
    try:
        with open(src, "wb") as f:
            for at in range(0, n, 1 << 26):
                f.write(os.urandom(min(1 << 26, n - at)))
        best = {w: 0.0 for w in WAYS}
        for _ in range(3):
            for way in WAYS:
                best[way] = max(best[way], once(way, src, a.dir / dst))
    finally:
        src.unlink(missing_ok=True)
    res = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "host": platform.node(),
           "cores": os.cpu_count(), "bytes": n, "dir": str(a.dir),
           **{f"{w}_gbps": round(v, 2) for w, v in best.items()},
           "into_over_bytes": round(best["into"] / best["bytes"], 2)}
    print(json.dumps(res))
    if a.out:
        a.out.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
