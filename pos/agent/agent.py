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
   Calls on a stream that is capturing a CUDA graph do not run at the call: they pass
   untouched (their work runs when the graph is launched, which waits for everything).
So each saved buffer holds its bytes at the cut, given that the speculation of every kernel
that ran as validated is right (the validator's table) and the program has no data race.
A call that stays inside the driver across a whole checkpoint cannot leak into the next cut:
the new epoch reuses that call's counter, so the next operation first drains it
(`_drain_leftover`, bounded like the other waits; past the bound it is refused before it holds
anything, and set_phase_locked's own wait for that counter then never blocks).

Why the agent cannot deadlock with a blocked application thread (the review of this design):
- An application thread waits only in an API-*enter* callback. CUPTI calls it on the
  application's thread before the driver function proper runs (the prototype measured a driver
  call made from inside it completing), so the thread holds no driver lock for that call; what
  it may hold are the application's own locks (the GIL, PyTorch's allocator mutex), and the
  agent needs none of them: its threads call only the driver, numba nogil rules and the
  filesystem. The GIL is the one the agent's Python threads do need: the callback drops it for
  the time it waits (native.wait), and the lock order GIL -> state mutex is kept everywhere.
- The state mutex is never held across a driver call: the callback's shadow copies are
  enqueued with it released (the ISSUING flag keeps the buffers out of reach meanwhile), and
  agent threads take it only between driver calls. So no thread that waits for the mutex can be
  one that holds a driver lock another mutex holder needs.
- Exit callbacks and allocation callbacks take the mutex only briefly and never wait.
- Backstops, for what CUPTI does not document (whether any driver-internal lock is held around
  an enter callback): the drain of calls left over from an earlier operation, the cut's drain,
  the cut's cuCtxSynchronize and the copier's progress are each bounded by `stall_s`; past it the checkpoint is abandoned: the phase ends, every held
  call is released, the partial image is discarded and the caller gets one sentence. The
  application is never left frozen by pos.
Frees during a checkpoint wait until their buffer is saved; allocations after the cut are not
in the image (status NONE: the image is the state at the cut) and are never waited for.

On-demand restore (`restore`): the same machinery in PHASE_RESTORE. After the phase flip and
the drain + synchronise of the calls already inside the driver (so that no earlier kernel
writes a buffer after its restored bytes), the application is released at once: a call that may
read or write a buffer not back yet (the analyzer's rule, read and write sides) waits and marks
it URGENT, and a restorer thread takes it next; unvalidated kernels, unknown layouts, graphs
and the calls the agent cannot place wait for everything; other calls pass. Should a restore
fail after the release, the calls held for buffers not back stay held, the error says how many
bytes were back, and the process is ended once the answer is sent (HalfRestored;
pos/agent/server.py): it has already run on, so its old contents cannot be put back, and a mix
of the image's buffers and older ones must not compute on. A failure before the release (a
refused image) leaves it as it was.

Not proven on a GPU yet: this module under real CUPTI and the real driver (the fake driver of
the tests runs the same code without CUPTI; the callback is then invoked by hand).
"""

import ctypes
import os
import platform
import socket
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from pos.agent import HalfRestored, callbacks, gpuimage, native
from pos.agent import state as S
from pos.agent.copier import CHUNK, CU_EVENT_DISABLE_TIMING, Copier, Restorer, Staging
from pos.agent.runtime import Runtimes
from pos.analyzer import load_validation
from pos.analyzer.dag import order_from_history
from pos.analyzer.demangle import parameter_kinds
from pos.driver import CUDA_ERROR_INVALID_VALUE, Driver, driver
from pos import nvml
from pos.errors import BadInput, PosError
from pos.scheduler import image

COUNTERS = {"intercepted": S.C_INTERCEPTED, "copied_on_write": S.C_COW,
            "copied_on_write_bytes": S.C_COW_BYTES, "waited": S.C_WAITED,
            "waited_ns": S.C_WAIT_NS, "fallbacks": S.C_FALLBACKS, "held": S.C_HELD,
            "shadow_copy_errors": S.C_COPY_ERRORS}
STALL_S = float(os.environ.get("POS_AGENT_STALL_S", "60"))
CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9
# device memory a process holds that no allocation call made (its context, the driver's own)
UNSEEN_SLACK = 2 << 30
CU_STREAM_CAPTURE_MODE_RELAXED = 2


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
        self.runtimes = Runtimes()
        self.callback: Any = None
        self.cupti: Any = None
        self.last_image: Optional[Path] = None
        self._op = threading.Lock()
        self._staging: Optional[Staging] = None
        self._ctx = ctypes.c_void_p()
        self._pool = ctypes.c_uint64(0)

    # ---- setup ----
    def compile(self) -> None:
        """Compile the callback (numba, ~10 s the first time; cached afterwards)."""
        lib = self.drv.lib
        addr = ctypes.cast(lib.cuMemcpyDtoDAsync_v2, ctypes.c_void_p).value
        rec = ctypes.cast(lib.cuEventRecord, ctypes.c_void_p).value
        capturing = ctypes.cast(lib.cuStreamIsCapturing, ctypes.c_void_p).value
        self.callback = callbacks.build(self.st, addr, rec, capturing)

    def attach_cupti(self) -> None:
        from pos.agent.cupti import Cupti

        self.cupti = Cupti()
        enabled = callbacks.install(self.st, {d: self.cupti.callback_ids(d)
                                              for d in callbacks.CALLS})
        self.cupti.subscribe(self.callback.address)
        for domain, cbids in enabled.items():
            self.cupti.enable(domain, cbids)

    def uses_gpu(self) -> bool:
        """Whether the application has device memory yet (racy read: a hint for polling)."""
        return bool(self.st.ctl[S.C_N])

    def register(self) -> None:
        """Make this thread an agent thread (its driver calls pass through the callback) with
        the application's context current: the primary context of the device its first
        allocation is on. pos neither initialises CUDA nor makes a context before the
        application has (a program that picks its device, or sets CUDA_VISIBLE_DEVICES or
        forks before using CUDA, is not disturbed). The table is taken without the GIL (the
        lock order of native.py)."""
        st = self.st
        if not self._ctx.value:
            self.drv.init()
            self.drv.call("cuDevicePrimaryCtxRetain", ctypes.byref(self._ctx), self._device())
        if not S.agent_add_locked(st.mutex, st.ctl, st.agents, np.uint64(native.thread_self())):
            raise PosError("too many agent threads", "this is a bug in pos")
        self.drv.call("cuCtxSetCurrent", self._ctx)
        # while the application captures a CUDA graph in the global mode (PyTorch's default),
        # the agent's own calls (synchronise, allocate, copy) must not break its capture
        mode = ctypes.c_int(CU_STREAM_CAPTURE_MODE_RELAXED)
        self.drv.call("cuThreadExchangeStreamCaptureMode", ctypes.byref(mode))

    def _device(self) -> int:
        """The application's device: its first allocation's, else the one whose primary
        context it has made (PyTorch's, through cudart)."""
        live = self.st.live()
        if live:
            device = ctypes.c_int()
            self.drv.call("cuPointerGetAttribute", ctypes.byref(device),
                          CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ctypes.c_uint64(live[0][0]))
            return device.value
        count, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
        self.drv.call("cuDeviceGetCount", ctypes.byref(count))
        for device in range(count.value):
            self.drv.call("cuDevicePrimaryCtxGetState", device, ctypes.byref(flags),
                          ctypes.byref(active))
            if active.value:
                return device
        raise BadInput("the process has not set up a GPU context yet",
                       "checkpoint it once it uses the GPU")

    def unregister(self) -> None:
        st = self.st
        S.agent_remove_locked(st.mutex, st.agents, np.uint64(native.thread_self()))

    # ---- function layouts ----
    def layout(self, key: int) -> Optional[tuple[list[int], list[int], str]]:
        """(offsets, sizes, name) of a function-table key from the driver, or None: a
        CUfunction (or CUkernel), or a runtime launch's host stub tagged with STUB_TAG, whose
        CUfunction the process's runtime gives. The parameters are enumerated until
        CUDA_ERROR_INVALID_VALUE (past the last one); any other error means the handle is not
        of that API's kind: the next API is asked, and a handle none of them knows has no
        layout (its launches then wait for every buffer) rather than an empty one (which would
        say it writes nothing)."""
        f: Optional[int] = key
        if key & int(callbacks.STUB_TAG):
            f = self.runtimes.function_of(key & ~int(callbacks.STUB_TAG))
            if f is None:
                return None
        for get, name_of in (("cuFuncGetParamInfo", "cuFuncGetName"),
                             ("cuKernelGetParamInfo", "cuKernelGetName")):
            if not self.drv.has(get):
                continue
            fn = self.drv.function(get)
            offs, sizes = [], []
            o, s = ctypes.c_size_t(), ctypes.c_size_t()
            while (rc := fn(ctypes.c_void_p(f), ctypes.c_size_t(len(offs)), ctypes.byref(o),
                            ctypes.byref(s))) == 0:
                offs.append(o.value)
                sizes.append(s.value)
            if rc != CUDA_ERROR_INVALID_VALUE:
                continue
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
        return S.function_add_locked(st.mutex, st.cond, st.ctl, st.fkey, st.fstate, st.fstart,
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

    def staging(self, count: int, chunk: int) -> Staging:
        """The agent's pinned staging (pinning is slow: allocated once, reused while the
        requested shape fits)."""
        have = self._staging
        if have is not None and have.count >= count and have.size == chunk:
            return have
        if have is not None:
            have.close()
            self._staging = None
        self._staging = Staging(self.drv, count, chunk)
        return self._staging

    def predicted_order(self, predicted: tuple[int, ...] = ()) -> tuple[np.ndarray, str, dict]:
        """(bases to copy first, source, facts): the client's list; else the agent's history of
        tracked writes ordered by the analyzer's rule (pos/analyzer/dag.py); else nothing (the
        state then orders by size; URGENT buffers always go first)."""
        if predicted:
            return np.asarray(predicted, np.uint64), "client", {}
        st = self.st
        if st.ctl[S.C_TRACK] and st.ctl[S.C_HIST_OPS] > 0:
            keys = np.empty(st.hist_key.shape[0], np.int64)
            ops = np.empty(st.hist_op.shape[0], np.int64)
            bases = np.empty(st.hist_op.shape[0], np.uint64)
            _, n, m = S.history_locked(st.mutex, st.ctl, st.hist_key, st.hist_op, st.hist_base,
                                       keys, ops, bases)
            live = st.live()
            lb = np.asarray([b for b, _ in live], np.uint64)
            ls = np.asarray([z for _, z in live], np.int64)
            order, facts = order_from_history(keys[:n], ops[:m], bases[:m], lb, ls)
            if len(order):
                return order, "history", facts
        return np.zeros(0, np.uint64), "size", {}

    def checkpoint(self, directory: str, incremental: bool = False, compress: bool = False,
                   predicted: tuple[int, ...] = (), streams: int = 4, writers: int = 4,
                   chunk_mb: int = CHUNK >> 20, depth: int = 2,
                   stall_s: Optional[float] = None) -> dict:
        """Take a GPU image consistent at the cut while the application runs (see the module
        docstring for why); returns the report."""
        if not self._op.acquire(blocking=False):
            raise BadInput("a checkpoint or restore of this process is already running",
                           "wait for it to finish")
        try:
            return self._checkpoint(Path(directory), incremental, compress, predicted,
                                    streams, writers, chunk_mb << 20, depth,
                                    STALL_S if stall_s is None else stall_s)
        finally:
            self._op.release()

    def _check_the_table_sees(self, live: list[tuple[int, int]]) -> None:
        """Refuse an image that would miss device memory: the table holds what CUPTI reported,
        NVML says what the process holds (skipped where NVML cannot see this process)."""
        used = sum(nvml.gpus_of([os.getpid()]).values())
        seen = sum(size for _, size in live) + (self.pool_bytes if self._pool.value else 0)
        if used - seen > UNSEEN_SLACK:
            raise PosError(f"the agent's table holds {seen / 2**30:.1f} GiB of the "
                           f"{used / 2**30:.1f} GiB of device memory this process uses: CUPTI "
                           "did not report some of its allocations, and an image would miss "
                           "them", "report this with the program and its CUDA and driver "
                           "versions; use the stop-the-world engine (without --concurrent)")

    def _sync(self, stall_s: float, what: str) -> None:
        """cuCtxSynchronize from an agent thread, waited for at most stall_s (a backstop: the
        caller abandons the operation and releases the application past it)."""
        err: list[BaseException] = []

        def run() -> None:
            try:
                self.register()
                self.drv.call("cuCtxSynchronize")
            except BaseException as e:
                err.append(e)
            finally:
                self.unregister()

        t = threading.Thread(target=run, name="pos-sync", daemon=True)
        t.start()
        t.join(stall_s)
        if t.is_alive():
            raise PosError(f"the {what} did not finish synchronising the GPU within {stall_s:g} s",
                           "the application was released; set POS_AGENT_STALL_S higher if its "
                           "kernels run longer")
        if err:
            raise err[0]

    def _drain(self, old: int, stall_s: float, what: str) -> None:
        st = self.st
        if not S.wait_epoch_locked(st.mutex, st.cond, st.ctl, old, int(stall_s * 1e9)):
            raise PosError(f"calls that entered the driver before the {what} did not leave it "
                           f"within {stall_s:g} s", "the application was released; try again")

    def _drain_leftover(self, stall_s: float, what: str) -> None:
        """Wait, at most stall_s, for calls counted under the parity the next epoch reuses:
        calls that entered the driver during an earlier checkpoint or restore and never left.
        Done before the operation changes anything: a call stuck in the driver (a kernel that
        never ends) must refuse this one, not make it wait for ever. No new call counts under
        that parity before the flip and the epoch only moves under self._op, so a drained
        counter stays drained until set_phase_locked."""
        st = self.st
        reused = (int(st.ctl[S.C_EPOCH]) + 1) & 1
        if not S.wait_epoch_locked(st.mutex, st.cond, st.ctl, reused, int(stall_s * 1e9)):
            raise PosError(f"a driver call that entered during an earlier checkpoint or restore "
                           f"has not returned within {stall_s:g} s, so the {what} cannot begin",
                           "nothing was held and the application runs on; try again once that "
                           "call returns, or set POS_AGENT_STALL_S higher")

    def _checkpoint(self, final: Path, incremental: bool, compress: bool,
                    predicted: tuple[int, ...], streams: int, writers: int, chunk: int,
                    depth: int, stall_s: float) -> dict:
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
        if not (1 << 20) <= chunk <= (1 << 30) or streams < 1 or writers < 1 or depth < 1:
            raise BadInput("chunk must be 1-1024 MiB and streams, writers, depth >= 1",
                           "use e.g. chunk 64-256 MiB, 4 streams, 4 writers, depth 2")
        self._drain_leftover(stall_s, "checkpoint")
        live = st.live()
        self._check_the_table_sees(live)
        partial = image.prepare(final, sum(s for _, s in live) + (1 << 20))
        self.register()
        before = {k: int(st.ctl[i]) for k, i in COUNTERS.items()}
        t0 = time.monotonic()
        writer = gpuimage.Writer(partial, compress)
        copier: Optional[Copier] = None
        try:
            order, source, facts = self.predicted_order(predicted)
            t_order = time.monotonic()
            self._ensure_pool()
            staging = self.staging(streams * depth + writers, chunk)
            self.resolve_functions()
            n = S.begin_locked(st.mutex, st.ctl, st.bases, st.ends, st.status, st.flags,
                               st.shadow, st.order, order, incremental)
            cut_bytes = int(st.ctl[S.C_PENDING_BYTES])
            saved_set = [(int(b), int(e - b), int(s)) for b, e, s in
                         zip(st.bases[:st.ctl[S.C_N]], st.ends[:st.ctl[S.C_N]],
                             st.status[:st.ctl[S.C_N]])]
            old = S.set_phase_locked(st.mutex, st.cond, st.ctl, S.PHASE_CHECKPOINT)
            self._drain(old, stall_s, "cut")
            self._sync(stall_s, "cut")
            S.cut_done_locked(st.mutex, st.cond, st.ctl)
            t_cut = time.monotonic()
            copier = Copier(self.drv, st, writer, self.register, self.unregister,
                            streams=streams, writers=writers, staging=staging, depth=depth)
            _watch(copier, copier.start(), lambda: copier.bytes_in + copier.bytes_stored,
                   stall_s, "copier", "the application was released and the image discarded; "
                   "set POS_AGENT_STALL_S higher on a slow disk")
            copier.join()
            t_copied = time.monotonic()
        except BaseException:
            if copier is not None:
                copier.abort.set()
            S.end_locked(st.mutex, st.cond, st.ctl, st.status, st.flags, st.sh_size)
            writer.close()
            image.discard(partial)
            raise
        finally:
            self.unregister()
        S.end_locked(st.mutex, st.cond, st.ctl, st.status, st.flags, st.sh_size)
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
        host_s = (copier.t_host or t_copied) - t_cut
        report = {"buffers": n, "bytes": cut_bytes, "stored_bytes": copier.bytes_stored,
                  "cut_s": t_cut - t0, "order_s": t_order - t0, "copy_s": copy_s,
                  "duration_s": t_copied - t0,
                  "throughput_gbps": cut_bytes / copy_s / 1e9 if copy_s > 0 else None,
                  "d2h_s": host_s,
                  "d2h_gbps": cut_bytes / host_s / 1e9 if host_s > 0 else None,
                  "order_source": source, "order_facts": facts,
                  "nested_driver_calls": bool(st.ctl[S.C_NESTED]),
                  "streams": streams, "writers": writers, "chunk_mb": chunk >> 20,
                  "depth": depth, "pinned_staging": staging.pinned,
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
    def restore(self, directory: str, streams: int = 8, chunk_mb: int = CHUNK >> 20,
                depth: int = 2, stall_s: Optional[float] = None,
                on_release: Optional[Any] = None, quick_verify: bool = False) -> dict:
        """Put a GPU image back into this process, on demand: the application runs on from
        the moment the restore has started (module docstring). Each buffer must be live at
        the same base with the same size (the same process, or a re-run that allocated
        alike). `on_release` (tests) is called once the application is released.
        quick_verify: before the release check the manifest, the image's files and their sizes,
        and the index's checksums only, leaving the data to the per-chunk checksums as it is read (faster
        release; a corrupt chunk is then found midway, and the process ended: HalfRestored).
        By default every file's sha256 is checked first (image.verify)."""
        if not self._op.acquire(blocking=False):
            raise BadInput("a checkpoint or restore of this process is already running",
                           "wait for it to finish")
        try:
            return self._restore(Path(directory), streams, chunk_mb << 20, depth,
                                 STALL_S if stall_s is None else stall_s, on_release,
                                 quick_verify)
        finally:
            self._op.release()

    def _restore(self, folder: Path, streams: int, chunk: int, depth: int, stall_s: float,
                 on_release: Optional[Any], quick_verify: bool) -> dict:
        st = self.st
        t0 = time.monotonic()
        t0_ns = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
        # quick: the data files are checked chunk by chunk as the restore reads them
        image.verify(folder, [gpuimage.INDEX] if quick_verify else None)
        plan = gpuimage.resolve(folder)
        live = dict(st.live())
        for base, (_, size, _) in plan.items():
            if live.get(base) != size:
                raise BadInput(f"buffer 0x{base:x} ({size} bytes) of the image is not a live "
                               "allocation of this process",
                               "restore into the process the image was taken from")
        if streams < 1 or depth < 1:
            raise BadInput("streams and depth must be >= 1", "use e.g. 8 streams, depth 2")
        total = sum(size for _, size, _ in plan.values())
        self._drain_leftover(stall_s, "restore")
        self.register()
        restorer: Optional[Restorer] = None
        held0 = int(st.ctl[S.C_HELD])
        try:
            order, source, facts = self.predicted_order()
            staging = self.staging(streams * depth, chunk)
            t_verified = time.monotonic()
            S.begin_restore_locked(st.mutex, st.ctl, st.bases, st.ends, st.status, st.flags,
                                   st.shadow, st.order, np.asarray(sorted(plan), np.uint64),
                                   order)
            old = S.set_phase_locked(st.mutex, st.cond, st.ctl, S.PHASE_RESTORE)
            self._drain(old, stall_s, "restore")
            self._sync(stall_s, "restore")
            t_released = time.monotonic()
            restorer = Restorer(self.drv, st, plan, self.register, self.unregister,
                                streams=streams, staging=staging, chunk=chunk, depth=depth)
            threads = restorer.start()
            if on_release is not None:
                on_release()
            _watch(restorer, threads, lambda: restorer.bytes, stall_s, "restore",
                   "the application was released")
            restorer.join()
            done = time.monotonic()
        except BaseException as e:
            if restorer is not None:
                restorer.abort.set()
            back = restorer.bytes if restorer is not None else 0
            if restorer is None or isinstance(e, BadInput) and back == 0 and \
                    not restorer.errors:
                S.end_locked(st.mutex, st.cond, st.ctl, st.status, st.flags, st.sh_size)
                raise
            # the calls held for buffers not back stay held: the server ends the process once
            # it has answered, and no call may meanwhile read what was not restored
            msg = e.message if isinstance(e, PosError) else str(e)
            raise HalfRestored(f"the restore failed after {back} of {total} bytes "
                               f"({msg.rstrip('.')}), so pos ended the process rather than leave "
                               "it running half-restored", "start the job again and restore the "
                               "image into it") from e
        finally:
            self.unregister()
        first_ns = int(st.ctl[S.C_FIRST_NS])
        S.end_locked(st.mutex, st.cond, st.ctl, st.status, st.flags, st.sh_size)
        copy_s = done - t_released
        return {"buffers": len(plan), "bytes": total, "on_demand": True,
                "verify_s": t_verified - t0, "release_s": t_released - t0,
                "first_call_s": (first_ns - t0_ns) / 1e9 if first_ns else None,
                "held": int(st.ctl[S.C_HELD]) - held0, "copy_s": copy_s,
                "duration_s": done - t0, "held_s": t_released - t0,
                "throughput_gbps": total / copy_s / 1e9 if copy_s > 0 else None,
                "quick_verify": quick_verify,
                "order_source": source, "order_facts": facts, "streams": streams,
                "chunk_mb": chunk >> 20, "pinned_staging": staging.pinned}

    def status(self) -> dict:
        st = self.st
        live = st.live()
        return {"pid": os.getpid(), "name": os.environ.get("POS_RUN_NAME"),
                "allocations": len(live), "bytes": sum(s for _, s in live),
                "phase": int(st.ctl[S.C_PHASE]), "cut_done": bool(st.ctl[S.C_CUT_DONE]),
                "track_dirty": bool(st.ctl[S.C_TRACK]),
                "cupti": self.cupti is not None, "functions": len(self.names),
                # CUPTI reported a runtime call's inner driver calls (callbacks.py, C_NESTED)
                "nested_driver_calls": bool(st.ctl[S.C_NESTED]),
                "last_image": str(self.last_image) if self.last_image else None,
                "table_overflow": int(st.ctl[S.C_OVERFLOW]),
                **{k: int(st.ctl[i]) for k, i in COUNTERS.items()}}


def _watch(worker: Any, threads: list[threading.Thread], progress: Callable[[], int],
           stall_s: float, what: str, fix: str) -> None:
    """Wait for the threads of `worker` (a Copier or Restorer); past stall_s without
    `progress()` moving, and no error of the worker's own, abort it and raise (a backstop: the
    caller then releases the application)."""
    last, seen = time.monotonic(), -1
    while any(t.is_alive() for t in threads):
        threads[0].join(0.05)
        now = progress()
        if now != seen:
            last, seen = time.monotonic(), now
        elif time.monotonic() - last > stall_s and not worker.errors:
            worker.abort.set()
            raise PosError(f"the {what} made no progress for {stall_s:g} s", fix)


def load_validated(path: Optional[str]) -> set[str]:
    """Kernel names the validator's table (pos.analyzer.validate.Validator.save) validated."""
    if not path:
        return set()
    table = load_validation(path)
    return {n for n, r in table["kernels"].items() if isinstance(r, dict) and r.get("validated")}
