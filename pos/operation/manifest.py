"""What an image records of the job and the host when it is taken, by either engine."""

import platform
import socket
from datetime import datetime, timezone

from pos import host, nvml
from pos.image import Manifest
from pos.process import cudackpt, procs
from pos.process.criu import Options

NO_NAME = "n/a"     # the name of a GPU the checkpoint saw used but NVML did not list


def new_manifest(pid: int, pids: list[int], cuda: list[int], criu_version: str,
                 options: Options, leave_running: bool, gpu_use: dict[str, int]) -> Manifest:
    """The manifest of an image about to be taken, by either engine (timings and files come
    later; a GPU-only image has no CRIU version and no CRIU options)."""
    here = {g.uuid: g for g in nvml.gpus()} if gpu_use else {}
    comm, cmdline = host.describe(pid)
    return Manifest(
        pid=pid, pids=pids, gpu_pids=cuda, comm=comm, cmdline=cmdline,
        created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        host=socket.gethostname(), kernel=platform.release(), criu_version=criu_version,
        criu_options=options.to_json(), leave_running=leave_running,
        driver_version=nvml.driver_version() if cuda else None,
        cuda_version=cudackpt.driver_version() if cuda else None,
        tcp_listen=procs.listening_ports(pids) if options.tcp_established else [],
        inner_pids=procs.own_namespaces(pids),
        gpus=[{"uuid": u, "name": here[u].name if u in here else NO_NAME, "memory_used": m,
               **({"index": here[u].index} if u in here else {})}    # `--to-gpu 0=1` names it
              for u, m in gpu_use.items()])
