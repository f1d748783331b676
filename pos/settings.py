"""The engines' settings from the environment (`POS_*`), read once at the start of an
operation, each checked here, and passed in: a bad value is refused in one sentence before
anything is touched, and a long-lived process (the daemon, a restore service) reads them anew
for each operation rather than at import.

Every setting, its variable and its default:
  criu                POS_CRIU              the CRIU to run (a path; default: on PATH, or the
                                            copy that scripts/setup.sh installs)
  log_dir             POS_LOG_DIR           where CRIU's logs of failed runs are kept
  criu_log_max_bytes  POS_CRIU_LOG_MAX_MB   a restore's CRIU is ended when its log passes this
  keep_restore_log    POS_KEEP_RESTORE_LOG  1: CRIU's restore log is kept on success too
  dump_staging        POS_DUMP_STAGING      0: CRIU writes straight into the image's folder
  predump             POS_PREDUMP           0: CRIU never pre-dumps (pos/concurrent/predump.py)
  pin_max_bytes       POS_PIN_MAX_GIB       page-locked host memory a checkpoint takes at most
  pin_ring_bytes      POS_PIN_RING_GIB      of it, what streams what pos shadowed on the device
                                            to the image (beside what it could not shadow;
                                            all of the job, where the image's folder is a
                                            tmpfs); one ring, split among a checkpoint's ranks
  pin_ahead_bytes     POS_PIN_AHEAD_GIB     of it, what is locked before the cut (unset:
                                            what the shadow cannot hold, which the job's
                                            writes wait for, and 1 GiB, the rest once the
                                            job runs again; `all`: all of it; GiB: that much)
  pin_keep            POS_PIN_KEEP          1: the arena's memory is kept for the next
                                            checkpoint, which then locks it sooner
                                            (pos/concurrent/kept.py); 0, the default: freed
  frozen_copy         POS_FROZEN_COPY       what the copy takes while the job is frozen
  savers_held         POS_SAVERS_HELD       when the copy's savers wait while the job is
                                            frozen (see SAVERS_HELD)
  copy_paused         POS_COPY_PAUSED       when the copy to host memory waits while the job
                                            is held (see COPY_PAUSED)
  hash_on             POS_HASH_ON           where a checkpoint's copy hashes and scans each
                                            chunk (see HASH_ONS)
  shadow_max_bytes    POS_SHADOW_MAX_BYTES  device memory the shadow takes at most
  own_memory_max_bytes POS_OWN_MEMORY_MAX_GIB the most of a job's own cuMem memory (NCCL's
                                            buffers) that a concurrent checkpoint takes while
                                            the job is held, in a job whose processes map
                                            each other's memory (pos/concurrent/ownmem.py)
  own_memory_on_gpu   POS_OWN_MEMORY_ON_GPU 1, the default: a job's own cuMem memory beyond
                                            that (all of a job's with PyTorch's expandable
                                            segments) is taken the same way, copied on its
                                            GPU as far as it has room, the rest into host
                                            memory; 0: left to the driver's checkpoint (the
                                            job held while it copies; a job alone then has
                                            an image that can move to other GPUs)
  own_host_ahead      POS_OWN_HOST_AHEAD    1, the default: the host memory that such memory
                                            is copied into, where its GPU has no room, is
                                            faulted in from before the cut until the copy
                                            begins (the copy then faster); 0: as it is
                                            copied, while the job is held
  fill_piece_bytes    POS_FILL_PIECE_KIB    what a fill thread reads and copies at a time
  fill_mapped         POS_FILL_MAPPED       0: the fill reads the data files rather than map them
  fill_from           POS_FILL_FROM         when a restore's fill runs (see FILL_FROMS)
  hoist_stack         POS_HOIST_STACK       the stack a hoisted context keeps (off: as it is)
  trim_heap           POS_TRIM_HEAP         1, the default: a hoisted job's heap gives the
                                            memory it freed back first (smaller dumps and
                                            restores); 0: as it is
  criu_wait_s         POS_CRIU_WAIT_S       how long an undo waits for a CRIU still running,
                                            and a restore for its lazy-pages daemon
  lazy_pages          POS_LAZY_PAGES        1: CRIU restores private anonymous memory on demand
                                            (pos/operation/lazypages.py); 0, the default: all
                                            of it before the job runs
  fault_at            POS_FAULT_AT          STEP=SIGNAL: pos signals itself there (the tests)
"""

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Optional, TypeVar

from pos.errors import BadInput

T = TypeVar("T")
DEFAULT_LOCK_TIMEOUT_MS = 10_000   # how long the driver may take to lock a CUDA process
                                   # (`--lock-timeout`)
DEFAULT_LOG_DIR = "/var/log/pos"
DEFAULT_CRIU_LOG_MAX_MB = 256
FROZEN_COPIES = ("unshadowed", "all")
# the copy's savers (hash, scan and write, on every core) wait while the job is frozen: only while
# CRIU dumps (`criu`, the CPU's part of it), so that the ring they drain has room again when the
# job runs and its writes to what pos could not shadow wait less (the driver's calls are the
# GPU's and the bus's; the copy to the ring is paused for them anyway): a 97 GB job on the H200
# with its page-locked memory bounded to 8 GiB stalled 0.20-0.34 s less; or through the whole
# frozen part (`frozen`), which let the driver's restore take 0.22-0.24 s against 0.28-0.29
# (bench/results/2026-11-29.md, perf runs 17-18)
SAVERS_HELD = ("criu", "frozen")
# the copy to host memory (the streams into the page-locked ring) waits while the driver
# checkpoints and restores the job and while the job gives its memory up and maps it back
# (`driver`: the driver copies the job's context over the same bus), or goes on through them
# (`never`), so that less is left to copy when the job runs again. Going on, it made the
# driver's calls and the remap 0.2-0.6 s slower in all, more than it gained: a 97 GB job on the
# H200 bounded to 8 GiB stalled 1.75-2.20 s against 1.64 s, a 142 GB one 2.08 against 1.81 s,
# though the latter lost 1.0 s less over all its steps (bench/results/2026-11-30.md, last part)
COPY_PAUSED = ("driver", "never")
# where the concurrent copy's checksum and pointer scan of each chunk are made: on the GPU that
# holds the chunk, by pos's kernel (pos/concurrent/gpuhash.py), so that the savers only write
# (`gpu`; a driver that cannot load the kernel is refused), where the driver can load it
# (`auto`: a driver of CUDA 13 or newer), or by the savers on the CPU as they write (`cpu`).
# On the H200 host the copy ran 8-44% faster on the GPU, and a 97 GB job bounded to 8 GiB of
# page-locked memory stalled 0.4-1.2 s less (bench/results/2026-11-29.md, perf runs 19-21)
HASH_ONS = ("auto", "gpu", "cpu")
# a restore's fill starts once pos's new memory exists, beside CRIU, and pauses for the driver's
# restore, which copies the context back to the device and took twice as long beside it (0.39 s
# against 0.18 s at 16 GiB on the H100); start: no pause; release: it starts at the job's release
FILL_FROMS = ("pause", "start", "release")
# 2 MiB beat 1 MiB on the H100 and the H200 once each piece was made in one pass
# (pos/image/chunks.c; bench/results/2026-11-26.md)
DEFAULT_FILL_PIECE_KIB = 2048
# page-locked memory through which what pos shadowed on the device streams to the image (the
# disk paces that copy whatever the arena's size): on the H200 host a 48 GiB job, all of it
# shadowed, was held 1.4 s with 8 GiB against 2.0-4.3 s with an arena as large as the job (the
# host's memory left to CRIU and the driver), and sealed sooner (bench/results/2026-11-28-perf)
DEFAULT_PIN_RING = 8 << 30
# the job's own cuMem memory a concurrent checkpoint takes (NCCL's buffers: 0.5 GB a rank of the
# Llama2-13B-shaped FSDP2 job, 8 ranks' worth); taken, they held its 2 ranks on two H200s 2.79 s
# against 3.39 s left to the driver (bench/results/2026-11-30.md)
DEFAULT_OWN_MEMORY_MAX = 4 << 30
# POS_PIN_AHEAD_GIB=all: the whole arena locked before the cut (as much as any arena)
PIN_AHEAD_ALL = 1 << 62
DEFAULT_HOIST_STACK: Optional[int] = 0
DEFAULT_CRIU_WAIT_S = 3600.0
# off until it is measured against the full restore on the GPU machines
LAZY_PAGES = ("0", "1")


@dataclass(frozen=True)
class Settings:
    criu: str = ""
    log_dir: Path = Path(DEFAULT_LOG_DIR)
    criu_log_max_bytes: int = DEFAULT_CRIU_LOG_MAX_MB << 20
    keep_restore_log: bool = False
    dump_staging: bool = True
    predump: bool = True
    pin_max_bytes: Optional[int] = None
    pin_ring_bytes: int = DEFAULT_PIN_RING
    pin_ahead_bytes: Optional[int] = None      # None: what the shadow cannot hold, and a part
    pin_keep: bool = False
    frozen_copy: str = FROZEN_COPIES[0]
    savers_held: str = SAVERS_HELD[0]
    copy_paused: str = COPY_PAUSED[0]
    hash_on: str = HASH_ONS[0]
    shadow_max_bytes: Optional[int] = None
    own_memory_max_bytes: int = DEFAULT_OWN_MEMORY_MAX
    own_memory_on_gpu: bool = True
    own_host_ahead: bool = True
    fill_piece_bytes: int = DEFAULT_FILL_PIECE_KIB << 10
    fill_mapped: bool = True
    fill_from: str = FILL_FROMS[0]
    hoist_stack: Optional[int] = DEFAULT_HOIST_STACK
    trim_heap: bool = True
    criu_wait_s: float = DEFAULT_CRIU_WAIT_S
    lazy_pages: bool = False
    fault_at: str = ""

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "Settings":
        """Every setting from `env`, checked: BadInput names the variable and the fix."""
        def get(name: str, parse: Callable[[str], T], default: T, what: str, fix: str) -> T:
            raw = env.get(name, "")
            if raw == "":
                return default
            try:
                return parse(raw)
            except (ValueError, OverflowError):    # OverflowError: inf, a size in GiB
                raise BadInput(f"{name}={raw} is not {what}", fix) from None

        def positive_int(raw: str) -> int:
            value = int(raw)
            if value < 1:
                raise ValueError(raw)
            return value

        def one_of(choices: tuple[str, ...]) -> Callable[[str], str]:
            def parse(raw: str) -> str:
                if raw not in choices:
                    raise ValueError(raw)
                return raw
            return parse

        def choice(name: str, choices: tuple[str, ...], fix: str) -> str:
            """One of `choices` (the first when unset)."""
            return get(name, one_of(choices), choices[0], f"one of {', '.join(choices)}", fix)

        def piece(raw: str) -> int:
            kib = int(raw)
            if not 256 <= kib <= 4096 or kib & (kib - 1):
                raise ValueError(raw)
            return kib << 10

        def seconds(raw: str) -> float:
            value = float(raw)
            if value <= 0:
                raise ValueError(raw)
            return value

        def stack(raw: str) -> Optional[int]:
            return None if raw == "off" else int(raw)

        def gib(raw: str, zero: bool = False) -> int:
            value = float(raw)
            if value < 0 or (value == 0 and not zero):
                raise ValueError(raw)
            return int(value * 2**30)

        ring = get("POS_PIN_RING_GIB", gib, DEFAULT_PIN_RING, "a number of GiB above 0",
                   f"unset it (the ring is then {DEFAULT_PIN_RING >> 30} GiB)")
        return cls(
            criu=env.get("POS_CRIU", ""),
            log_dir=Path(env.get("POS_LOG_DIR") or DEFAULT_LOG_DIR),
            criu_log_max_bytes=get("POS_CRIU_LOG_MAX_MB", positive_int, DEFAULT_CRIU_LOG_MAX_MB,
                                   "a whole number of MiB >= 1", "unset it (CRIU's log is then "
                                   f"bounded at {DEFAULT_CRIU_LOG_MAX_MB} MiB)") << 20,
            keep_restore_log=env.get("POS_KEEP_RESTORE_LOG") == "1",
            dump_staging=env.get("POS_DUMP_STAGING") != "0",
            predump=env.get("POS_PREDUMP") != "0",
            pin_max_bytes=get("POS_PIN_MAX_GIB", gib, None, "a number of GiB above 0",
                              "unset it, or give a number such as 8"),
            pin_ring_bytes=ring,
            pin_ahead_bytes=get("POS_PIN_AHEAD_GIB", lambda raw: PIN_AHEAD_ALL if raw == "all"
                                else gib(raw), None, "a number of GiB above 0, or all",
                                "unset it (pos then locks before the cut what the job may "
                                "wait for)"),
            pin_keep=get("POS_PIN_KEEP", one_of(("0", "1")), "0", "0 or 1",
                         "unset it (the arena's memory is then freed after each checkpoint)")
            == "1",
            frozen_copy=choice("POS_FROZEN_COPY", FROZEN_COPIES, "unset it (the frozen part then "
                               "copies only what pos could not shadow)"),
            savers_held=choice("POS_SAVERS_HELD", SAVERS_HELD, "unset it (the copy's savers then "
                               "wait only for CRIU's dump)"),
            copy_paused=choice("POS_COPY_PAUSED", COPY_PAUSED, "unset it (the copy to host "
                               "memory then waits for the driver's calls)"),
            hash_on=choice("POS_HASH_ON", HASH_ONS, "unset it (each chunk is then hashed on the "
                           "GPU where the driver can)"),
            shadow_max_bytes=get("POS_SHADOW_MAX_BYTES", int, None, "a number of bytes",
                                 "unset it (the shadow then takes what the device has free)"),
            own_memory_max_bytes=get("POS_OWN_MEMORY_MAX_GIB",
                                     lambda raw: gib(raw, zero=True), DEFAULT_OWN_MEMORY_MAX,
                                     "a number of GiB, 0 or more",
                                     f"unset it (up to {DEFAULT_OWN_MEMORY_MAX >> 30} GiB is "
                                     "then taken wherever the GPU has room or not), or give 0"),
            own_memory_on_gpu=get("POS_OWN_MEMORY_ON_GPU", one_of(("0", "1")), "1", "0 or 1",
                                  "unset it (a job's own cuMem memory is then taken where its "
                                  "GPU has room to copy it)") == "1",
            own_host_ahead=get("POS_OWN_HOST_AHEAD", one_of(("0", "1")), "1", "0 or 1",
                               "unset it (the host memory is then faulted in from before "
                               "the cut)") == "1",
            fill_piece_bytes=get("POS_FILL_PIECE_KIB", piece, DEFAULT_FILL_PIECE_KIB << 10,
                                 "a power of two from 256 to 4096", "unset it (pieces are then "
                                 f"{DEFAULT_FILL_PIECE_KIB} KiB)"),
            fill_mapped=env.get("POS_FILL_MAPPED") != "0",
            fill_from=choice("POS_FILL_FROM", FILL_FROMS,
                             "unset it (the fill then pauses for the driver's restore)"),
            hoist_stack=get("POS_HOIST_STACK", stack, DEFAULT_HOIST_STACK,
                            "a number of bytes or off",
                            "unset it (the hoisted context then keeps no stack)"),
            trim_heap=get("POS_TRIM_HEAP", one_of(("0", "1")), "1", "0 or 1",
                          "unset it (a hoisted job's heap then gives its free memory back)")
            == "1",
            criu_wait_s=get("POS_CRIU_WAIT_S", seconds, DEFAULT_CRIU_WAIT_S,
                            "a number of seconds above 0", "unset it (an undo then waits up "
                            f"to {DEFAULT_CRIU_WAIT_S:.0f} s for CRIU)"),
            lazy_pages=get("POS_LAZY_PAGES", one_of(LAZY_PAGES), LAZY_PAGES[0], "0 or 1",
                           "unset it (CRIU then restores all of the memory before the job "
                           "runs)") == "1",
            fault_at=env.get("POS_FAULT_AT", ""),
        )
