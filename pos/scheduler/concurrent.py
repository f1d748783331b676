"""The client side of the concurrent engine: talks to the agent inside a `pos run` process over
its root-only socket (pos/agent/server.py), which takes the image itself while the application
keeps running (the cut's argument is in pos/agent/agent.py)."""

import json
import os
import socket
from pathlib import Path
from typing import Any, Optional

from pos.agent import socket_path
from pos.errors import BadInput, PosError


def request(pid: int, req: dict[str, Any], timeout: Optional[float] = None) -> dict[str, Any]:
    """Send one request to PID's agent; its reply (PosError when the agent refuses)."""
    if pid <= 0 or not Path(f"/proc/{pid}").exists():
        raise BadInput(f"there is no process {pid}", "give the PID of a running `pos run` job")
    path = socket_path(pid)
    if not os.path.exists(path):
        raise BadInput(f"process {pid} has no pos agent ({path} is missing)",
                       "start the program with `pos run -- CMD`")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(path)
        try:
            s.sendall(json.dumps(req).encode() + b"\n")
        except BrokenPipeError:
            pass          # the agent refused this peer before reading: its reason is below
        line = s.makefile("rb").readline()
    except PermissionError:
        raise BadInput(f"cannot open {path} (the agent answers root only)",
                       "run pos with sudo") from None
    except OSError as e:
        raise PosError(f"the agent of process {pid} did not answer ({e.strerror or e})",
                       "check that the process is still running") from None
    finally:
        s.close()
    if not line:
        raise PosError(f"the agent of process {pid} closed the connection",
                       "check the program's standard error for the agent's message")
    reply = json.loads(line)
    if not reply.get("ok"):
        raise PosError(reply.get("error", "the agent refused").rstrip("."))
    return reply


def _options(**kw: Optional[int]) -> dict[str, int]:
    return {k: v for k, v in kw.items() if v is not None}


def checkpoint_concurrent(pid: int, directory: str, incremental: bool = False,
                          compress: bool = False, predicted: tuple[int, ...] = (),
                          streams: Optional[int] = None, chunk_mb: Optional[int] = None) -> dict:
    """A GPU image of PID consistent at one instant, taken while PID runs; the agent's report
    (bytes, duration, intercepted, copied_on_write, waited, waited_s, fallbacks, throughput,
    d2h_gbps, order_source)."""
    return request(pid, {"op": "checkpoint", "dir": str(Path(directory).absolute()),
                         "incremental": incremental, "compress": compress,
                         "predicted": [f"0x{b:x}" for b in predicted],
                         **_options(streams=streams, chunk_mb=chunk_mb)})


def restore_gpu_only(pid: int, directory: str, streams: Optional[int] = None,
                     chunk_mb: Optional[int] = None, quick_verify: bool = False) -> dict:
    """Put a GPU image back into the running agent process PID, on demand (it runs on; calls
    that touch buffers not back yet wait for them). Returns when every buffer is back: bytes,
    release_s, first_call_s, held, throughput_gbps."""
    return request(pid, {"op": "restore", "dir": str(Path(directory).absolute()),
                         "quick_verify": quick_verify,
                         **_options(streams=streams, chunk_mb=chunk_mb)})


def status(pid: int) -> dict:
    return request(pid, {"op": "status"}, timeout=10)
