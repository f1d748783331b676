"""What the CUDA driver cannot restore, refused before a process is touched.

On each of these the driver's checkpoint succeeds; its restore then fails, nothing undoes it,
and the process stays stuck inside the driver for good. So the one safe answer is to refuse
first, in one sentence, and leave the job running:
- a process on several GPUs (cuCheckpointProcessRestore: CUDA_ERROR_INVALID_VALUE, 2x H200,
  driver 580.159.04, 2026-11-27, with and without peer access; cuda-checkpoint issue #27);
- for a stop-the-world image, a `pos run` job whose memory was mapped back from pos's
  descriptors (CUDA_ERROR_NOT_SUPPORTED, H100, 580.159.04, 2026-11-25);
- a process that maps another process's GPU memory (bench/peer_probe.py, 2x H200,
  2026-11-27): a cuMem allocation imported from a peer's file descriptor and mapped, on the
  same GPU or another, fails with CUDA_ERROR_NOT_SUPPORTED, a legacy cuIpcOpenMemHandle with
  CUDA_ERROR_INVALID_VALUE; the owner, and host memory two processes register, restore fine.
  NCCL (2.28.9) does exactly that between the ranks of one host with its defaults: its P2P
  transport (cuMem or legacy IPC) and its SHM transport on cuMem host memory; its SHM on
  /dev/shm (NCCL_CUMEM_ENABLE=0) and its sockets restore fine.

The last is seen exactly by a `pos run` job's agent (it follows the job's imports and maps).
Without an agent pos predicts it from outside, from what NCCL will do: NCCL is loaded, other
ranks are on this host, and the settings the process runs with now (its live environment,
which NCCL's config file joins at its start) leave P2P or cuMem sharing on. The concurrent
engine takes cuMem imports down at its cut and puts them back (pos/agent/peers.py, issue 42):
it refuses only what it cannot take down (legacy IPC, NVLink SHARP's multicast, an agent that
lost track); the stop-the-world engine, with no agent in its cut, refuses them all.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Optional

from pos import nvml
from pos.agent.control import Agent, Status
from pos.errors import BadInput, PosError
from pos.process import cudackpt, procs

NCCL_LIBRARY = "libnccl.so"
WORKING_SETTINGS = ("start the job with NCCL_P2P_DISABLE=1 NCCL_CUMEM_ENABLE=0 in its "
                    "environment (NCCL's SHM transport on /dev/shm; add NCCL_SHM_DISABLE=1 for "
                    "sockets), which the driver restores, and checkpoint it then")


def tree(pid: int, dumped: bool = True) -> tuple[list[int], list[int]]:
    """The tree rooted at `pid` and those of its processes that hold CUDA state, once what pos
    must not touch is refused in one sentence: a process that is not there, init, a kernel
    thread, pos or its parents; with `dumped` (CRIU dumps the tree), a process CRIU cannot
    dump. Every engine's checkpoint and move begins with it."""
    procs.require_checkpointable(pid)
    if dumped:
        procs.require_dumpable(pid)
    pids = procs.tree(pid)
    return pids, cudackpt.gpu_pids(pids)


def agent_status(pid: int) -> Optional[Status]:
    """The `pos run` agent's status of `pid`, None when it has no agent."""
    try:
        agent = Agent(pid, timeout=10)
    except PosError:
        return None
    with agent:
        return agent.status()


def several_gpus(cuda: list[int]) -> None:
    """Refuse a process that uses several GPUs."""
    for p in cuda:
        used = nvml.gpus_of([p])
        if len(used) > 1:
            raise BadInput(f"PID {p} uses {len(used)} GPUs, and the driver cannot restore a "
                           "process on several GPUs (cuCheckpointProcessRestore fails, the "
                           "process is lost)", "run one process per GPU (DDP under torchrun) "
                           "and checkpoint the tree, or keep the job on one GPU "
                           "(CUDA_VISIBLE_DEVICES)")


def mapped_back(pid: int, status: Optional[Status], fix: str) -> None:
    """Refuse a stop-the-world image of a `pos run` job whose device memory was mapped back
    from pos's descriptors (after a whole-process concurrent checkpoint or restore). `fix`:
    what to do instead."""
    if status is not None and status.imported:
        raise BadInput(f"{status.imported} of the device allocations of PID {pid} were mapped "
                       "back from a whole-process concurrent checkpoint or restore, and the "
                       "driver cannot restore such memory from a stop-the-world image", fix)


@dataclass(frozen=True)
class NcclSettings:
    """Which of NCCL's ways of sharing GPU memory between the ranks of one host are on."""

    p2p: bool      # its P2P transport (cuMem imports, or legacy CUDA IPC)
    shm: bool      # its SHM transport, when P2P is off
    cumem: bool    # cuMem buffers: SHM's host memory imported by the peer, NVLink SHARP
    nvls: bool     # NVLink SHARP (multicast)

    @classmethod
    def of(cls, env: Mapping[str, str]) -> "NcclSettings":
        """As NCCL reads its variables: a number, non-zero for yes (NCCL_P2P_LEVEL LOC or 0
        turns P2P off); what is not set is NCCL's default, on."""
        def on(name: str, default: bool) -> bool:
            value = env.get(name, "").strip()
            if not value:
                return default
            try:
                return int(value) != 0
            except ValueError:
                return default

        level = env.get("NCCL_P2P_LEVEL", "").strip().upper()
        return cls(p2p=not on("NCCL_P2P_DISABLE", False) and level not in ("LOC", "0"),
                   shm=not on("NCCL_SHM_DISABLE", False),
                   cumem=on("NCCL_CUMEM_ENABLE", True), nvls=on("NCCL_NVLS_ENABLE", True))

    def sharing(self) -> list[str]:
        """The ways left on by which a rank maps another's GPU memory (none: restorable)."""
        ways = []
        if self.p2p:
            ways.append("its P2P transport")
        if not self.p2p and self.shm and self.cumem:
            ways.append("its SHM transport on cuMem host memory")
        if self.cumem and self.nvls:
            ways.append("NVLink SHARP")
        return ways


def nccl_config(pid: int, env: Mapping[str, str]) -> dict[str, str]:
    """NCCL's variables as the process has them: its environment first, then its config file
    (NCCL_CONF_FILE, else ~/.nccl.conf), then /etc/nccl.conf, as NCCL reads them at its start
    (a variable already set is kept)."""
    merged = dict(env)
    root = Path(f"/proc/{pid}/root")
    files = [env["NCCL_CONF_FILE"]] if env.get("NCCL_CONF_FILE") else \
        ([f"{env['HOME']}/.nccl.conf"] if env.get("HOME") else [])
    for name in files + ["/etc/nccl.conf"]:
        try:
            text = (root / name.lstrip("/")).read_text()
        except OSError:
            continue
        for line in text.splitlines():
            key, eq, value = line.strip().partition("=")
            if eq and not key.startswith("#"):
                merged.setdefault(key.strip(), value.strip())
    return merged


def local_ranks(env: Mapping[str, str]) -> Optional[int]:
    """How many ranks of the job run on this host, as its launcher says (None: not said)."""
    for name in ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE",
                 "WORLD_SIZE"):
        try:
            return int(env[name])
        except (KeyError, ValueError):
            continue
    return None


def nccl_peers(pid: int) -> list[int]:
    """Other processes of this host that hold CUDA state with NCCL loaded."""
    peers = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != pid:
            p = int(entry.name)
            if procs.maps_library(p, NCCL_LIBRARY) and procs.maps_libcuda(p):
                peers.append(p)
    return peers


def nvls_on(pid: int) -> bool:
    """NCCL is loaded in `pid` and its settings, as the process has them now, leave NVLink SHARP
    (multicast) on: NCCL uses it where the GPUs' NVSwitches offer it, which pos cannot tell."""
    if not procs.maps_library(pid, NCCL_LIBRARY):
        return False
    s = NcclSettings.of(nccl_config(pid, procs.environment(pid)))
    return s.cumem and s.nvls


def predicted_sharing(pid: int) -> list[str]:
    """Without an agent: the ways by which `pid` maps another rank's GPU memory, as NCCL will
    share it (none when NCCL is not loaded, or the process has no other rank on this host)."""
    if not procs.maps_library(pid, NCCL_LIBRARY):
        return []
    env = nccl_config(pid, procs.environment(pid))
    ranks = local_ranks(env)
    if ranks == 1 or (ranks is None and not nccl_peers(pid)):
        return []
    return NcclSettings.of(env).sharing()


def peer_memory(cuda: list[int], statuses: Mapping[int, Optional[Status]],
                taken_down: bool = False, nvls: Callable[[int], bool] = nvls_on) -> None:
    """Refuse a process that maps another process's GPU memory: seen by its agent where it has
    one that can say, predicted from NCCL's settings otherwise. `taken_down`: the concurrent
    engine takes cuMem imports down at its cut and puts them back (pos/agent/peers.py), so
    only what it cannot take down is refused: legacy IPC, and an agent that lost track.
    `nvls`: nvls_on, or an answer of it kept from before the cut (it reads the process's
    maps and environment: 0.09 s a rank of the Llama job, the ranks held)."""
    for p in cuda:
        s = statuses.get(p)
        if s is not None and s.peer_lost:
            raise BadInput(f"the agent of PID {p} lost track of {s.peer_lost} of the job's "
                           "mappings of other processes' GPU memory (its memory ran short), so "
                           "pos cannot tell what the driver would fail to restore",
                           "restart the job with more memory free, or " + WORKING_SETTINGS)
        if s is not None and s.peer_maps is not None:
            if taken_down and s.ipc_maps:
                raise BadInput(f"PID {p} has {s.ipc_maps} legacy CUDA IPC mappings of another "
                               "process's GPU memory (NCCL's P2P without cuMem), which pos "
                               "cannot take down before the driver's checkpoint (its restore "
                               "fails and the job is lost)", "start the job without "
                               "NCCL_CUMEM_ENABLE=0 (cuMem imports pos takes down), or with "
                               + WORKING_SETTINGS.removeprefix("start the job with "))
            if taken_down and s.peer_maps and nvls(p):
                raise BadInput(f"PID {p} maps another process's GPU memory and is a rank of an "
                               "NCCL job whose settings leave NVLink SHARP on (NCCL_NVLS_ENABLE "
                               "not 0), whose multicast memory pos cannot take down before the "
                               "driver's checkpoint", "start the job with NCCL_NVLS_ENABLE=0 "
                               "(P2P and SHM on cuMem stay on: pos takes those down)")
            if taken_down:
                continue
            if s.peer_maps or s.ipc_maps:
                raise BadInput(f"PID {p} maps another process's GPU memory ("
                               f"{s.peer_maps + (s.ipc_maps or 0)} mappings, "
                               f"{(s.peer_bytes or 0) / 2**20:.0f} MiB: NCCL's P2P or SHM on "
                               "cuMem between the ranks of this host), and the CUDA driver "
                               "cannot restore such a process (its restore fails and the job "
                               "is lost)", WORKING_SETTINGS)
            continue
        ways = predicted_sharing(p)
        if ways:
            raise BadInput(f"PID {p} is a rank of an NCCL job whose settings let the ranks of "
                           f"this host map each other's GPU memory ({', '.join(ways)}), and "
                           "the CUDA driver cannot restore such a process (its restore fails "
                           "and the job is lost)", WORKING_SETTINGS)


def require(cuda: list[int], mapped_back_fix: str) -> dict[int, Optional[Status]]:
    """Every refusal of the driver's path for a stop-the-world checkpoint or move of `cuda`;
    the agents' statuses (None: no agent), for `recheck_locked`."""
    statuses = {p: agent_status(p) for p in cuda}
    for p in cuda:
        mapped_back(p, statuses[p], mapped_back_fix)
    several_gpus(cuda)
    peer_memory(cuda, statuses)
    return statuses


def recheck_locked(cuda: list[int], before: Mapping[int, Optional[Status]]) -> None:
    """Once the driver holds the processes nothing new can be mapped: ask the agents again
    (a job that was still setting NCCL up may have mapped its peers since `require`)."""
    with_agents = [p for p in cuda if before.get(p) is not None]
    peer_memory(with_agents, {p: agent_status(p) for p in with_agents})
