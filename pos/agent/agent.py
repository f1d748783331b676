"""The agent inside a `pos run` process: the live table, the cut, the copier, the restore.

Why the image equals the GPU state at one instant, the cut (`checkpoint`):
1. Under the state's mutex every allocation becomes PENDING and the phase becomes CHECKPOINT,
   in a new epoch. Every later entry callback of a call that may write device memory sees the
   phase: it is *intercepted*.
2. Calls that passed their entry callback earlier are counted under the old epoch until their
   exit callback; the agent waits until that count is 0, so all their work is in some stream.
3. The agent's thread synchronises the context: all work launched before the cut is complete.
4. Only now may an intercepted call shadow a buffer (until then it waits): the shadow copy is
   enqueued on the caller's stream right before the call, after every pre-cut write (all
   complete) and before this call's writes, so the shadow holds the buffer's bytes at the cut.
   A buffer neither shadowed nor saved is never written: calls that may write it wait until the
   copier has it in host memory, and the copier starts after step 3. Unvalidated kernels,
   unknown layouts, graphs and copies the agent cannot place wait for everything, and frees
   wait for their buffer to be saved. Allocations made after the cut are not in the image.
So each saved buffer holds its bytes at the cut, given that the speculation of every kernel
that ran as validated is right (the validator's table) and the program has no data race.

Not proven on a GPU yet: this module under real CUPTI and the real driver (the fake driver of
the tests runs the same code without CUPTI; the callback is then invoked by hand).
"""

import ctypes
import json
import os
import platform
import socket
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

import numpy as np

from pos.agent import callbacks, gpuimage, native
from pos.agent import state as S
from pos.agent.copier import CU_EVENT_DISABLE_TIMING, Copier, Staging
from pos.analyzer.demangle import parameter_kinds
from pos.driver import Driver, driver
from pos.errors import BadInput, PosError
from pos.scheduler import image

COUNTERS = {"intercepted": S.C_INTERCEPTED, "copied_on_write": S.C_COW,
            "copied_on_write_bytes": S.C_COW_BYTES, "waited": S.C_WAITED,
            "waited_ns": S.C_WAIT_NS, "fallbacks": S.C_FALLBACKS, "held": S.C_HELD,
            "shadow_copy_errors": S.C_COPY_ERRORS}


class Agent:
    """One per process. `attach_cupti` subscribes the callback (skipped by the fake-driver
    tests, which call `callback` by hand)."""

    def __init__(self, drv: Optional[Driver] = None, pool_bytes: int = 1 << 30,
                 validated: Optional[set[str]] = None, trust_all: bool = False,
                 track_dirty: bool = False, **sizes: int) -> None:
        self.drv = drv or driver()
        self.st = S.State(**sizes)
        self.pool_bytes = pool_bytes
        self.validated = validated or set()
        self.trust_all = trust_all
        self.st.ctl[S.C_TRACK] = int(track_dirty)
        self.names: dict[int, str] = {}
        self.callback: Any = None
        self.cupti: Any = None
        self.last_image: Optional[Path] = None
        self._op = threading.Lock()
        self._ctx = ctypes.c_void_p()
        self._pool = ctypes.c_uint64(0)

    # ---- setup ----
    def compile(self) -> None:
        """Compile the callback (numba, ~10 s the first time; cached afterwards)."""
        lib = self.drv.lib
        addr = ctypes.cast(lib.cuMemcpyDtoDAsync_v2, ctypes.c_void_p).value
        rec = ctypes.cast(lib.cuEventRecord, ctypes.c_void_p).value
        self.callback = callbacks.build(self.st, addr, rec)

    def attach_cupti(self) -> None:
        from pos.agent.cupti import Cupti

        self.cupti = Cupti()
        enabled = callbacks.install(self.st, self.cupti.callback_ids())
        self.cupti.subscribe(self.callback.address)
        self.cupti.enable(enabled)

    def register(self) -> None:
        """Make this thread an agent thread (its driver calls pass through the callback) with
        the process's primary context current."""
        st = self.st
        native.mutex_lock(st.mutex)
        try:
            n = int(st.ctl[S.C_AGENT_N])
            if n >= st.agents.shape[0]:
                raise PosError("too many agent threads", "this is a bug in pos")
            st.agents[n] = native.thread_self()
            st.ctl[S.C_AGENT_N] = n + 1
        finally:
            native.mutex_unlock(st.mutex)
        self.drv.init()
        if not self._ctx.value:
            self.drv.call("cuDevicePrimaryCtxRetain", ctypes.byref(self._ctx), 0)
        self.drv.call("cuCtxSetCurrent", self._ctx)

    def unregister(self) -> None:
        st = self.st
        me = native.thread_self()
        native.mutex_lock(st.mutex)
        try:
            n = int(st.ctl[S.C_AGENT_N])
            ids = [int(x) for x in st.agents[:n] if int(x) != me]
            st.agents[: len(ids)] = ids
            st.ctl[S.C_AGENT_N] = len(ids)
        finally:
            native.mutex_unlock(st.mutex)

    # ---- function layouts ----
    def layout(self, f: int) -> Optional[tuple[list[int], list[int], str]]:
        """(offsets, sizes, name) of a CUfunction (or CUkernel) from the driver, or None."""
        for get, name_of in (("cuFuncGetParamInfo", "cuFuncGetName"),
                             ("cuKernelGetParamInfo", "cuKernelGetName")):
            if not self.drv.has(get):
                continue
            fn = self.drv.function(get)
            offs, sizes = [], []
            o, s = ctypes.c_size_t(), ctypes.c_size_t()
            while fn(ctypes.c_void_p(f), ctypes.c_size_t(len(offs)), ctypes.byref(o),
                     ctypes.byref(s)) == 0:
                offs.append(o.value)
                sizes.append(s.value)
            text = ctypes.c_char_p()
            if self.drv.has(name_of) and self.drv.function(name_of)(
                    ctypes.byref(text), ctypes.c_void_p(f)) == 0 and text.value:
                return offs, sizes, text.value.decode()
            if offs:
                return offs, sizes, ""
        return None

    def add_function(self, f: int, offsets: list[int], sizes: list[int], name: str) -> bool:
        """Enter f's layout; validated when its name is in the validator's table (or all are
        trusted); parameter kinds from the demangled name, the analyzer's rule."""
        kinds, _ = parameter_kinds(name or None, len(offsets))
        self.names[f] = name
        ok = self.trust_all or name in self.validated
        st = self.st
        return S.function_add_locked(st.mutex, st.ctl, st.fkey, st.fstate, st.fstart,
                                     st.fcount, st.lay_off, st.lay_size, st.lay_kind,
                                     np.uint64(f), np.asarray(offsets, np.int64),
                                     np.asarray(sizes, np.int64), np.asarray(kinds, np.int8),
                                     ok)

    def resolve_functions(self) -> int:
        """Look up the layouts of the functions the callback has seen launched; how many."""
        st = self.st
        out = np.zeros(st.newf.shape[0], np.uint64)
        n = S.take_new_functions_locked(st.mutex, st.ctl, st.newf, out)
        for f in out[:n]:
            got = self.layout(int(f))
            if got is not None:
                self.add_function(int(f), *got)
        return n

    # ---- checkpoint ----
    def _ensure_pool(self) -> None:
        """The shadow pool and one event per shadow extent (allocated at the first checkpoint,
        from an agent thread so that they are not in the table)."""
        st = self.st
        if self._pool.value or self.pool_bytes == 0:
            return
        self.drv.call("cuMemAlloc_v2", ctypes.byref(self._pool), ctypes.c_size_t(self.pool_bytes),
                      fix="lower the shadow pool (POS_SHADOW_POOL_MB) or free GPU memory")
        ev = ctypes.c_void_p()
        for i in range(st.sh_event.shape[0]):
            self.drv.call("cuEventCreate", ctypes.byref(ev), CU_EVENT_DISABLE_TIMING)
            st.sh_event[i] = ev.value
        st.ctl[S.C_POOL_BASE] = self._pool.value
        st.ctl[S.C_POOL_SIZE] = self.pool_bytes

    def checkpoint(self, directory: str, incremental: bool = False, compress: bool = False,
                   predicted: tuple[int, ...] = (), streams: int = 4, writers: int = 4) -> dict:
        """Take a GPU image consistent at the cut while the application runs (see the module
        docstring for why); returns the report."""
        if not self._op.acquire(blocking=False):
            raise BadInput("a checkpoint or restore of this process is already running",
                           "wait for it to finish")
        try:
            return self._checkpoint(Path(directory), incremental, compress, predicted,
                                    streams, writers)
        finally:
            self._op.release()

    def _checkpoint(self, final: Path, incremental: bool, compress: bool,
                    predicted: tuple[int, ...], streams: int, writers: int) -> dict:
        st = self.st
        parent = None
        if incremental:
            if not st.ctl[S.C_TRACK]:
                raise BadInput("this process runs without dirty tracking",
                               "start it with `pos run --track-dirty` for incremental images")
            if self.last_image is None or not self.last_image.is_dir():
                raise BadInput("this process has no earlier image to build on",
                               "take a full checkpoint first")
            parent = self.last_image
        if st.ctl[S.C_OVERFLOW]:
            raise PosError(f"the agent's allocation table overflowed ({st.bases.shape[0]} "
                           "allocations): an image would miss buffers",
                           "this process allocates too many buffers for the agent")
        live = st.live()
        partial = image.prepare(final, sum(s for _, s in live) + (1 << 20))
        self.register()
        before = {k: int(st.ctl[i]) for k, i in COUNTERS.items()}
        t0 = time.monotonic()
        writer = gpuimage.Writer(partial, compress)
        try:
            self._ensure_pool()
            self.resolve_functions()
            n = S.begin_locked(st.mutex, st.ctl, st.bases, st.ends, st.status, st.flags,
                               st.shadow, st.order, np.asarray(predicted, np.uint64), incremental)
            cut_bytes = int(st.ctl[S.C_PENDING_BYTES])
            saved_set = [(int(b), int(e - b), int(s)) for b, e, s in
                         zip(st.bases[:st.ctl[S.C_N]], st.ends[:st.ctl[S.C_N]],
                             st.status[:st.ctl[S.C_N]])]
            old = S.set_phase_locked(st.mutex, st.cond, st.ctl, S.PHASE_CHECKPOINT)
            S.wait_epoch_locked(st.mutex, st.cond, st.ctl, old)
            self.drv.call("cuCtxSynchronize")
            S.cut_done_locked(st.mutex, st.cond, st.ctl)
            t_cut = time.monotonic()
            copier = Copier(self.drv, st, writer, self.register, self.unregister,
                            streams=streams, writers=writers)
            copier.run()
            t_copied = time.monotonic()
        except BaseException:
            S.end_locked(st.mutex, st.cond, st.ctl, st.status, st.sh_size)
            writer.close()
            image.discard(partial)
            raise
        finally:
            self.unregister()
        S.end_locked(st.mutex, st.cond, st.ctl, st.status, st.sh_size)
        writer.close()
        counters = {k: int(st.ctl[i]) - before[k] for k, i in COUNTERS.items()}
        buffers = []
        for base, size, status in saved_set:
            if status == S.PENDING:
                buffers.append({"base": f"0x{base:x}", "size": size,
                                "chunks": sorted(writer.chunks.get(base, []),
                                                 key=lambda c: c["offset"])})
            elif parent is not None:
                buffers.append({"base": f"0x{base:x}", "size": size, "in_parent": True})
        copy_s = t_copied - t_cut
        report = {"buffers": n, "bytes": cut_bytes, "stored_bytes": copier.bytes_stored,
                  "cut_s": t_cut - t0, "copy_s": copy_s, "duration_s": t_copied - t0,
                  "throughput_gbps": cut_bytes / copy_s / 1e9 if copy_s > 0 else None,
                  "compressed": compress, "incremental": incremental,
                  "parent": str(parent) if parent else None,
                  "shadow_pool_bytes": self.pool_bytes, **counters,
                  "waited_s": counters.pop("waited_ns") / 1e9}
        report.pop("waited_ns", None)
        gpuimage.write_index(partial, {"format": gpuimage.FORMAT, "pid": os.getpid(),
                                       "parent": report["parent"], "buffers": buffers,
                                       "report": report})
        manifest = image.Manifest(
            pid=os.getpid(), pids=[os.getpid()], gpu_pids=[os.getpid()],
            comm=Path("/proc/self/comm").read_text().strip(),
            cmdline=Path("/proc/self/cmdline").read_bytes().replace(b"\0", b" ").decode(
                errors="replace").strip(),
            created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            host=socket.gethostname(), kernel=platform.release(),
            criu_version="none (GPU state only, pos run agent)", criu_options={},
            leave_running=True, cuda_version=self.drv.version(),
            timings={"cut": report["cut_s"], "copy": copy_s}, stall_s=None)
        final = image.seal(partial, manifest)
        self.last_image = final
        report["path"] = str(final)
        return report

    # ---- restore ----
    def restore(self, directory: str, streams: int = 4) -> dict:
        """Put a GPU image back into this process: verify it, hold the application's calls,
        copy every buffer to its address, release. Each buffer must be live at the same base
        with the same size (the same process, or a re-run that allocated alike)."""
        if not self._op.acquire(blocking=False):
            raise BadInput("a checkpoint or restore of this process is already running",
                           "wait for it to finish")
        try:
            return self._restore(Path(directory))
        finally:
            self._op.release()

    def _restore(self, folder: Path) -> dict:
        st = self.st
        image.verify(folder)
        plan = gpuimage.resolve(folder)
        live = dict(st.live())
        for base, (_, size, _) in plan.items():
            if live.get(base) != size:
                raise BadInput(f"buffer 0x{base:x} ({size} bytes) of the image is not a live "
                               "allocation of this process",
                               "restore into the process the image was taken from")
        total = sum(size for _, size, _ in plan.values())
        self.register()
        t0 = time.monotonic()
        staging = Staging(self.drv, 2, 64 << 20)
        stream = ctypes.c_void_p()
        try:
            old = S.set_phase_locked(st.mutex, st.cond, st.ctl, S.PHASE_RESTORE)
            S.wait_epoch_locked(st.mutex, st.cond, st.ctl, old)
            self.drv.call("cuCtxSynchronize")
            t_held = time.monotonic()
            self.drv.call("cuStreamCreate", ctypes.byref(stream), 1)
            for base, (src, _, chunks) in plan.items():
                for c in chunks:
                    buf = staging.free.get()
                    gpuimage.read_chunk(src, c, buf)
                    self.drv.call("cuMemcpyHtoDAsync_v2", ctypes.c_uint64(base + c["offset"]),
                                  ctypes.c_void_p(buf.ctypes.data), ctypes.c_size_t(c["raw"]),
                                  stream)
                    self.drv.call("cuStreamSynchronize", stream)
                    staging.free.put(buf)
        finally:
            if stream.value:
                self.drv.call("cuStreamDestroy_v2", stream)
            S.end_locked(st.mutex, st.cond, st.ctl, st.status, st.sh_size)
            staging.close()
            self.unregister()
        done = time.monotonic()
        return {"buffers": len(plan), "bytes": total, "held_s": done - t0,
                "copy_s": done - t_held,
                "throughput_gbps": total / (done - t_held) / 1e9 if done > t_held else None}

    def status(self) -> dict:
        st = self.st
        live = st.live()
        return {"pid": os.getpid(), "name": os.environ.get("POS_RUN_NAME"),
                "allocations": len(live), "bytes": sum(s for _, s in live),
                "phase": int(st.ctl[S.C_PHASE]), "cut_done": bool(st.ctl[S.C_CUT_DONE]),
                "track_dirty": bool(st.ctl[S.C_TRACK]),
                "cupti": self.cupti is not None, "functions": len(self.names),
                "last_image": str(self.last_image) if self.last_image else None,
                "table_overflow": int(st.ctl[S.C_OVERFLOW]),
                **{k: int(st.ctl[i]) for k, i in COUNTERS.items()}}


def load_validated(path: Optional[str]) -> set[str]:
    """Kernel names the validator's table (pos.analyzer.validate.Validator.save) validated."""
    if not path:
        return set()
    try:
        table = json.loads(Path(path).read_text())
        return {n for n, r in table["kernels"].items() if r.get("validated")}
    except (OSError, ValueError, KeyError, AttributeError):
        raise BadInput(f"{path} is not a validator table",
                       "give the JSON that pos.analyzer.validate.Validator.save wrote") from None
