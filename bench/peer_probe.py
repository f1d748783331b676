"""What the CUDA driver's process checkpoint can restore when processes share GPU memory, and
what a process that shares it shows from outside (two GPUs, as root).

  python3 bench/peer_probe.py --out DIR [--only minimal|nccl]

Two parts, each row in DIR/peer-probe.json:
  minimal  two small processes that share memory the ways NCCL does, through the driver API
           alone (pos.driver): a cuMem allocation exported as a file descriptor and mapped by the
           peer (on the other GPU, and on the same GPU), a legacy cuIpcOpenMemHandle, a
           /dev/shm buffer registered with cuMemHostRegister in both; each time one process is
           taken through lock -> checkpoint -> restore -> unlock from outside and asked whether
           it still runs and reads its memory. `takedown`: the importer unmaps and releases the
           peer's memory first, both are checkpointed and restored, then the owner exports it
           again and the importer maps it back at the same address: what pos would do.
  nccl     workloads/ddp_train.py, 2 ranks, with NCCL's defaults and with each transport alone
           (P2P with cuMem, P2P with legacy IPC, SHM, sockets); the same four driver calls on
           both ranks at once.
For every process, before the driver is called: the device files and shared-memory files it
holds open and maps, and the GPUs on which NVML lists it: the signals a refusal can read
from outside.
"""

import argparse
import ctypes
import json
import mmap
import os
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pos.driver import (  # noqa: E402
    CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS, CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    CU_MEM_ALLOCATION_TYPE_PINNED, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
    CU_MEM_LOCATION_TYPE_DEVICE, CU_MEMHOSTREGISTER_DEVICEMAP, CU_MEMHOSTREGISTER_PORTABLE,
    CUdeviceptr, CUipcMemHandle, CUmemAccessDesc, CUmemAllocationProp,
    CUmemGenericAllocationHandle, CUmemLocation, Driver)

SIZE = 64 << 20
PATTERN = 0x5A
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1"}


# --- the child processes: the driver API alone ------------------------------------------------

POSIX_FD = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
HOST_FLAGS = CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP


def _map(cu: Driver, handle: CUmemGenericAllocationHandle, dev: int, at: int = 0) -> int:
    ptr = CUdeviceptr(at)
    if not at:
        cu.cuMemAddressReserve(ctypes.byref(ptr), SIZE, 0, 0, 0)
    cu.cuMemMap(ptr, SIZE, 0, handle, 0)
    desc = CUmemAccessDesc(CUmemLocation(CU_MEM_LOCATION_TYPE_DEVICE, dev),
                           CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
    cu.cuMemSetAccess(ptr, SIZE, ctypes.byref(desc), 1)
    return ptr.value


def _reads(cu: Driver, ptr: int) -> bool:
    buf = (ctypes.c_ubyte * 4096)()
    cu.cuMemcpyDtoH_v2(buf, ptr, 4096)
    return all(b == PATTERN for b in buf)


def _send_fd(conn: socket.socket, fd: int, data: bytes = b"x") -> None:
    conn.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", fd))])


def _recv_fd(conn: socket.socket) -> tuple[int, bytes]:
    fds = []
    msg, anc, _, _ = conn.recvmsg(64, socket.CMSG_LEN(4))
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.append(struct.unpack("i", data[:4])[0])
    return (fds[0] if fds else -1), msg


def child(role: str, kind: str, dev: int, sock: str, state: str) -> None:
    """owner: makes the memory and hands it out; importer: maps the owner's. Both then say
    every 0.1 s in STATE whether they can still read it; files named in STATE's folder drive
    the takedown."""
    cu = Driver()
    cu.primary_context(dev)
    folder = Path(state).parent
    ptr, handle = 0, CUmemGenericAllocationHandle()
    shm: Optional[mmap.mmap] = None
    if role == "owner":
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(sock)
        srv.listen(4)
        if kind in ("import", "takedown"):
            prop = CUmemAllocationProp(CU_MEM_ALLOCATION_TYPE_PINNED, POSIX_FD,
                                       CUmemLocation(CU_MEM_LOCATION_TYPE_DEVICE, dev))
            cu.cuMemCreate(ctypes.byref(handle), SIZE, ctypes.byref(prop), 0)
            ptr = _map(cu, handle, dev)
        elif kind == "ipc":
            p = CUdeviceptr()
            cu.cuMemAlloc_v2(ctypes.byref(p), SIZE)
            ptr = p.value
        if kind == "shm":
            fd = os.open(f"/dev/shm/pos-probe-{os.getpid()}", os.O_CREAT | os.O_RDWR, 0o600)
            os.ftruncate(fd, SIZE)
            shm = mmap.mmap(fd, SIZE)
            shm.write(bytes([PATTERN]) * 4096)
            addr = ctypes.addressof(ctypes.c_char.from_buffer(shm))
            cu.cuMemHostRegister_v2(addr, SIZE, HOST_FLAGS)
        else:
            cu.cuMemsetD8_v2(ptr, PATTERN, SIZE)
            cu.cuCtxSynchronize()
        Path(folder, "owner-ready").write_text(str(os.getpid()))
        srv.settimeout(0.1)

        def serve() -> None:
            try:
                conn, _ = srv.accept()
            except socket.timeout:
                return
            with conn:
                if kind in ("import", "takedown"):
                    fd = ctypes.c_int()
                    cu.cuMemExportToShareableHandle(ctypes.byref(fd), handle, POSIX_FD, 0)
                    _send_fd(conn, fd.value)
                    os.close(fd.value)
                elif kind == "ipc":
                    h = CUipcMemHandle()
                    cu.cuIpcGetMemHandle(ctypes.byref(h), ptr)
                    conn.sendall(bytes(h))
                elif kind == "shm":
                    shm_fd = os.open(f"/dev/shm/pos-probe-{os.getpid()}", os.O_RDWR)
                    _send_fd(conn, shm_fd)
                    os.close(shm_fd)
        tick = 0
        while True:
            serve()
            tick += 1
            ok = shm[0] == PATTERN if shm is not None else _reads(cu, ptr)
            Path(state).write_text(f"{tick} {int(ok)}")
    # importer
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(sock)
    if kind in ("import", "takedown"):
        fd, _ = _recv_fd(conn)
        cu.cuMemImportFromShareableHandle(ctypes.byref(handle), fd, POSIX_FD)
        os.close(fd)
        ptr = _map(cu, handle, dev)
    elif kind == "ipc":
        raw = b""
        while len(raw) < 64:
            raw += conn.recv(64 - len(raw))
        h = CUipcMemHandle.from_buffer_copy(raw)
        p = CUdeviceptr()
        cu.cuIpcOpenMemHandle_v2(ctypes.byref(p), h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
        ptr = p.value
    elif kind == "shm":
        fd, _ = _recv_fd(conn)
        shm = mmap.mmap(fd, SIZE)
        os.close(fd)
        addr = ctypes.addressof(ctypes.c_char.from_buffer(shm))
        cu.cuMemHostRegister_v2(addr, SIZE, HOST_FLAGS)
    conn.close()
    Path(folder, "importer-ready").write_text(str(os.getpid()))
    tick = 0
    mapped = True
    while True:
        tick += 1
        if kind == "takedown" and mapped and Path(folder, "down").exists():
            cu.cuMemUnmap(ptr, SIZE)
            cu.cuMemRelease(handle)
            mapped = False
            Path(folder, "down-ok").write_text("1")
        if kind == "takedown" and not mapped and Path(folder, "up").exists():
            c2 = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            c2.connect(sock)
            fd, _ = _recv_fd(c2)
            c2.close()
            cu.cuMemImportFromShareableHandle(ctypes.byref(handle), fd, POSIX_FD)
            os.close(fd)
            _map(cu, handle, dev, at=ptr)
            mapped = True
            Path(folder, "up-ok").write_text("1")
        if shm is not None:
            ok = shm[0] == PATTERN
        else:
            ok = _reads(cu, ptr) if mapped else True
        Path(state).write_text(f"{tick} {int(ok)}")
        time.sleep(0.1)


# --- what a process shows from outside ------------------------------------------------------

def outside(pid: int) -> dict[str, Any]:
    """The device and shared-memory files `pid` holds open and maps, and NVML's GPUs for it."""
    fds: dict[str, int] = {}
    try:
        for e in os.scandir(f"/proc/{pid}/fd"):
            try:
                t = os.readlink(e.path)
            except OSError:
                continue
            if any(k in t for k in ("nvidia", "/dev/shm", "memfd", "anon_inode")):
                fds[t] = fds.get(t, 0) + 1
    except OSError:
        pass
    maps: dict[str, int] = {}
    try:
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
            parts = line.split(None, 5)
            path = parts[5] if len(parts) > 5 else ""
            if any(k in path for k in ("nvidia", "/dev/shm", "memfd", "(deleted)")):
                maps[path] = maps.get(path, 0) + 1
    except OSError:
        pass
    from pos import nvml
    gpus: dict[str, int] = {}
    for g in nvml.gpus():
        used = nvml.gpus_of([pid])
        if g.uuid in used:
            gpus[str(g.index)] = used[g.uuid]
    return {"fds": fds, "maps": maps, "nvml_gpus": gpus}


def driver_cycle(pids: list[int]) -> dict[str, str]:
    """lock -> checkpoint -> restore -> unlock on every pid at once; each step's outcome."""
    from pos.process import cudackpt

    out: dict[str, str] = {}
    steps = [("lock", lambda p: cudackpt.lock(p, 10_000)), ("checkpoint", cudackpt.checkpoint),
             ("restore", cudackpt.restore), ("unlock", cudackpt.unlock)]
    for name, call in steps:
        t0 = time.monotonic()
        try:
            cudackpt.each(pids, call)
            out[name] = f"ok {time.monotonic() - t0:.2f}s"
        except Exception as e:  # noqa: BLE001  (a probe: every outcome is the finding)
            out[name] = f"FAILED {e}"
            states = {}
            for p in pids:
                try:
                    states[p] = cudackpt.get_state(p)
                except Exception as e2:  # noqa: BLE001
                    states[p] = f"? {e2}"
            out["states"] = str(states)
            break
    return out


def _wait(path: Path, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if path.exists():
            return True
        time.sleep(0.05)
    return False


def _progress(state: Path, seconds: float = 1.5) -> str:
    """Whether the process's loop moves on and still reads its memory."""
    try:
        before = state.read_text().split()
        time.sleep(seconds)
        after = state.read_text().split()
    except (OSError, IndexError):
        return "no state"
    moved = int(after[0]) > int(before[0])
    return f"{'runs' if moved else 'STUCK'}, reads {'ok' if after[1] == '1' else 'WRONG'}"


def minimal_case(kind: str, owner_dev: int, importer_dev: int, target: str,
                 work: Path) -> dict[str, Any]:
    folder = work / f"{kind}-{owner_dev}{importer_dev}-{target}"
    folder.mkdir(parents=True)
    sock = str(folder / "s")
    me = [sys.executable, __file__, "--child"]
    ow = subprocess.Popen(me + ["owner", kind, str(owner_dev), sock, str(folder / "owner.state")],
                          stderr=open(folder / "owner.err", "w"))
    row: dict[str, Any] = {"part": "minimal", "kind": kind, "owner_gpu": owner_dev,
                           "importer_gpu": importer_dev, "target": target}
    im = None
    try:
        if not _wait(folder / "owner-ready", 30):
            row["error"] = "owner not ready: " + (folder / "owner.err").read_text()[-400:]
            return row
        im = subprocess.Popen(me + ["importer", kind, str(importer_dev), sock,
                                    str(folder / "importer.state")],
                              stderr=open(folder / "importer.err", "w"))
        if not _wait(folder / "importer-ready", 30):
            row["error"] = "importer not ready: " + (folder / "importer.err").read_text()[-400:]
            return row
        time.sleep(0.5)
        row["owner_outside"] = outside(ow.pid)
        row["importer_outside"] = outside(im.pid)
        if kind == "takedown":
            (folder / "down").write_text("1")
            row["down"] = _wait(folder / "down-ok", 10)
            row["driver"] = driver_cycle([ow.pid, im.pid])
            (folder / "up").write_text("1")
            row["up"] = _wait(folder / "up-ok", 10)
            if not row["up"]:
                row["importer_err"] = (folder / "importer.err").read_text()[-600:]
        else:
            pids = {"importer": [im.pid], "owner": [ow.pid], "both": [ow.pid, im.pid]}[target]
            row["driver"] = driver_cycle(pids)
        row["owner_after"] = _progress(folder / "owner.state")
        row["importer_after"] = _progress(folder / "importer.state")
        return row
    finally:
        for p in (ow, im):
            if p is not None:
                p.kill()
                p.wait()
        for f in Path("/dev/shm").glob(f"pos-probe-{ow.pid}"):
            f.unlink()


def minimal(work: Path) -> list[dict[str, Any]]:
    cases = [("import", 0, 1, "importer"), ("import", 0, 1, "owner"),
             ("import", 0, 0, "importer"), ("ipc", 0, 1, "importer"), ("ipc", 0, 1, "owner"),
             ("shm", 0, 1, "importer"), ("shm", 0, 1, "both"), ("takedown", 0, 1, "both")]
    rows = []
    for kind, a, b, target in cases:
        t0 = time.monotonic()
        try:
            row = minimal_case(kind, a, b, target, work)
        except Exception as e:  # noqa: BLE001
            row = {"part": "minimal", "kind": kind, "target": target, "error": repr(e)}
        row["seconds"] = round(time.monotonic() - t0, 1)
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


NCCL_VARIANTS = {
    "defaults": {},
    "p2p-cumem": {"NCCL_SHM_DISABLE": "1"},
    "p2p-ipc": {"NCCL_SHM_DISABLE": "1", "NCCL_CUMEM_ENABLE": "0"},
    "shm": {"NCCL_P2P_DISABLE": "1"},
    "shm-nocumem": {"NCCL_P2P_DISABLE": "1", "NCCL_CUMEM_ENABLE": "0"},
    "sockets": {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_CUMEM_ENABLE": "0",
                "NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1"},
}


def _lines(path: Path) -> int:
    try:
        return len(path.read_text().splitlines())
    except OSError:
        return 0


def nccl_case(name: str, env_extra: dict[str, str], work: Path, port: int) -> dict[str, Any]:
    folder = work / f"nccl-{name}"
    folder.mkdir(parents=True)
    procs = []
    for rank in range(2):
        env = dict(os.environ, **SAFE_ENV, **env_extra, RANK=str(rank), LOCAL_RANK=str(rank),
                   WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   USE_LIBUV="0", NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,P2P,SHM,NET,ALLOC")
        procs.append(subprocess.Popen(
            [sys.executable, str(ROOT / "workloads" / "ddp_train.py"), str(folder), "--backend",
             "nccl", "--steps", "100000", "--sleep", "0.05", "--width", "1024"],
            env=env, stdout=open(folder / f"out-{rank}.log", "w"), stderr=subprocess.STDOUT))
    row: dict[str, Any] = {"part": "nccl", "variant": name, "env": env_extra}
    try:
        end = time.monotonic() + 90
        while time.monotonic() < end and _lines(folder / "rank-0.txt") < 30:
            if any(p.poll() is not None for p in procs):
                break
            time.sleep(0.2)
        if _lines(folder / "rank-0.txt") < 30:
            row["error"] = "job did not reach step 30: " + \
                (folder / "out-0.log").read_text()[-800:]
            return row
        log = (folder / "out-0.log").read_text()
        row["nccl_version"] = next((ln.split("NCCL version")[1].strip()[:20]
                                    for ln in log.splitlines() if "NCCL version" in ln), "?")
        row["transports"] = sorted({ln.split("NCCL INFO ")[1][:140] for ln in log.splitlines()
                                    if "NCCL INFO Channel" in ln and " via " in ln})[:6]
        for rank, p in enumerate(procs):
            row[f"rank{rank}_outside"] = outside(p.pid)
        row["driver"] = driver_cycle([p.pid for p in procs])
        n0 = _lines(folder / "rank-0.txt")
        time.sleep(3)
        row["ran_on"] = _lines(folder / "rank-0.txt") > n0
        return row
    finally:
        for p in procs:
            p.kill()
            p.wait()


def nccl(work: Path) -> list[dict[str, Any]]:
    rows = []
    for i, (name, env) in enumerate(NCCL_VARIANTS.items()):
        t0 = time.monotonic()
        try:
            row = nccl_case(name, env, work, 29600 + i)
        except Exception as e:  # noqa: BLE001
            row = {"part": "nccl", "variant": name, "error": repr(e)}
        row["seconds"] = round(time.monotonic() - t0, 1)
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        role, kind, dev, sock, state = sys.argv[2:7]
        child(role, kind, int(dev), sock, state)
        return
    a = argparse.ArgumentParser()
    a.add_argument("--out", type=Path, required=True)
    a.add_argument("--only", choices=("minimal", "nccl"))
    a.add_argument("--work", type=Path, default=Path("/tmp/pos-peer-probe"))
    args = a.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    if args.only in (None, "minimal"):
        rows += minimal(args.work)
    if args.only in (None, "nccl"):
        rows += nccl(args.work)
    from pos import nvml
    meta = {"date": time.strftime("%Y-%m-%d"), "driver": nvml.driver_version(),
            "gpus": [g.name for g in nvml.gpus()],
            "commit": subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"],
                                     capture_output=True, text=True).stdout.strip(),
            "command": " ".join(sys.argv)}
    (args.out / "peer-probe.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
