"""The CUPTI driver-API and runtime-API callback, compiled with numba `@cfunc` (no GIL, ~0.25 µs
per call).

It reads CUpti_CallbackData (cupti_callbacks.h: callbackSite int32 at +0, functionParams at
+16, functionReturnValue at +24, correlationData at +56) and the call's parameter struct
(generated_cuda_meta.h: cuLaunchKernel_params f +0, hStream +40, kernelParams +48, extra +56;
cuLaunchKernelEx_params config +0, f +8, kernelParams +16, extra +24, config->hStream +32;
copies and sets: dst +0, size/count +16, hStream +24 for the Async forms; cuGraphLaunch hStream
+8; cuMemAlloc_v2 dptr* +0, size +8; cuMemFree_v2 dptr +0; cuMemMap/Unmap ptr +0, size +8).
The runtime's structs (generated_cuda_runtime_api_meta.h) mostly lie the same way: cudaMalloc
like cuMemAlloc_v2, cudaFree(Async) like cuMemFree(Async), cudaMemcpy like cuMemcpy (its
cudaMemcpyKind at +24, so cudaMemcpyAsync's stream is at +32), cudaMemset(Async) like
cuMemsetD8(Async), cudaGraphLaunch like cuGraphLaunch; cudaLaunchKernel_params func +0, args
+32, stream +48; cudaLaunchKernelExC_params config +0, func +8, args +16, config->stream +32.
A runtime launch names its kernel by the host stub (`func`), not a CUfunction: its key in the
function table is the stub tagged with STUB_TAG, which the agent resolves through the
process's CUDA runtime (pos/agent/runtime.py). Runtime ids index cbkind/cbflag after the
driver's (RUNTIME_BASE).

What it does per call (see state.py for the statuses and pos/agent/agent.py for the cut):
- allocations, maps (exit, on success): insert into the exact live table; frees and unmaps
  (entry): during a checkpoint wait until the allocation is saved, then (exit) remove it.
- calls that may write device memory (entry): speculate the write set with the analyzer's own
  rule (`launch_access`, `_range_access` of pos/analyzer/access.py); during a checkpoint shadow
  each PENDING allocation in it with cuMemcpyDtoDAsync_v2 on the caller's stream (plus an event
  the copier waits on), or wait; kernels not validated, unknown layouts, graphs and the other
  writing calls wait for everything. The shadow copies are enqueued with the state mutex
  *released* (ISSUING marks the buffers meanwhile): no driver call is ever made under it, so a
  thread that waits for the mutex can never be one the driver makes us wait for. The shadow
  copy's own callback (same thread) sees a destination inside the agent's pool and passes.
- with dirty tracking on (idle): the write set is marked DIRTY and appended to the history
  rings (call key, written bases) from which a checkpoint orders its copies (dag.py's rule).
- during an on-demand restore: a call that may read or write (launch: every accessed
  buffer; copies: both sides; device-to-host copies: their source) a buffer not back yet waits
  for it (URGENT: the restorer takes it next); unknown sets wait for everything.
- a waiting call drops the GIL if its thread holds it (native.wait): the agent's Python threads
  must be able to run while PyTorch's launching thread is held.
- every such call is counted, entry to exit, under the current epoch: the cut waits for the
  calls that entered before it to leave the driver (their work is then in a stream).
Calls made by the agent's own threads pass straight through. Runtime calls are acted on until a
driver call is seen inside one (state.py: runtime_open, C_NESTED): CUPTI then reports the
runtime's inner driver calls too, and those alone are acted on from then on.

Not proven on a GPU yet: the whole callback under real CUPTI (the 0.25 µs figure and the
in-callback shadow copy were measured by a prototype, not by this code), in particular that no
driver-internal lock is held around an API-enter callback (the agent's stall backstops turn
such a case into an abandoned checkpoint, not a frozen process).
"""

import ctypes
from typing import Any

import numba as nb
import numpy as np

from pos.agent import native
from pos.agent import state as S
from pos.analyzer.access import COPY_DST, _range_access, launch_access, max_evidence

# Kinds of intercepted calls (State.cbkind[cbid]); flags in State.cbflag[cbid].
(K_NONE, K_ALLOC, K_MAP, K_FREE, K_UNMAP, K_LAUNCH, K_LAUNCH_EX, K_COPY, K_SET8, K_SET16,
 K_SET32, K_GRAPH, K_OTHER_WRITE, K_READ, K_OTHER_READ, K_RT_LAUNCH, K_RT_LAUNCH_EX) = range(17)
ASYNC, PER_THREAD, STREAM_AFTER_KIND = 1, 2, 4     # STREAM_AFTER_KIND: the stream at +32
DOMAIN_DRIVER_API, DOMAIN_RUNTIME_API = 1, 2
RUNTIME_BASE = 2048                    # cbkind/cbflag index of runtime cbid 0
STUB_TAG = np.uint64(1 << 62)          # function-table key of a runtime launch: stub | STUB_TAG
API_ENTER, API_EXIT = 0, 1
STREAM_PER_THREAD = 2                  # CU_STREAM_PER_THREAD
LAUNCH_PARAM_BUFFER_POINTER, LAUNCH_PARAM_BUFFER_SIZE = 1, 2
EVERYTHING = -1
# correlationData, from a call's entry to its exit: the epoch it was counted under (1, 2; 0: not
# counted), and whether it opened a runtime call on its thread (state.runtime_open)
TAG_EPOCH, TAG_OPENED = np.uint64(3), np.uint64(4)

SIGNATURE = nb.types.void(nb.types.voidptr, nb.types.int32, nb.types.uint32, nb.types.voidptr)
# cuMemcpyDtoDAsync_v2(dst, src, bytes, stream), cuEventRecord(event, stream)
COPY_PROTO = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint64,
                              ctypes.c_uint64)
RECORD_PROTO = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64)
CAPTURING_PROTO = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64)


@nb.njit(cache=True)
def launch_params(kp: int, extra: int, start: int, count: int, lay_off, lay_size,
                  scratch) -> int:
    """Gather one launch's parameter bytes into scratch at their layout offsets (from the
    kernelParams pointer array, or the packed buffer of `extra`); their length, or -1."""
    plen = 0
    for p in range(count):
        end = lay_off[start + p] + lay_size[start + p]
        if end > plen:
            plen = end
    if plen > scratch.shape[0]:
        return -1
    if kp != 0:
        for p in range(count):
            src = native.bytes_at(np.int64(native.load_u64(kp + 8 * p)), lay_size[start + p])
            off = lay_off[start + p]
            for b in range(lay_size[start + p]):
                scratch[off + b] = src[b]
        return plen
    if extra == 0:
        return -1 if count > 0 else 0
    buf, size_ptr = 0, 0
    i = 0
    while i < 64:
        key = native.load_u64(extra + 8 * i)
        if key == 0:
            break
        if key == LAUNCH_PARAM_BUFFER_POINTER:
            buf = np.int64(native.load_u64(extra + 8 * (i + 1)))
        elif key == LAUNCH_PARAM_BUFFER_SIZE:
            size_ptr = np.int64(native.load_u64(extra + 8 * (i + 1)))
        i += 2
    if buf == 0 or size_ptr == 0:
        return -1
    n = np.int64(native.load_u64(size_ptr))
    if n < plen or n > scratch.shape[0]:
        return -1
    src = native.bytes_at(buf, n)
    for b in range(n):
        scratch[b] = src[b]
    return n


@nb.njit(cache=True)
def launch_writes(ctl, bases, ends, fkey, fstate, fstart, fcount, lay_off, lay_size, lay_kind,
                  newf, f: np.uint64, kp: int, extra: int, scratch, ev_slot, ev_param, ev_word,
                  ev_off, ev_write, slots, all_access: bool) -> int:
    """The slots a launch of f may write (or, `all_access`, read or write), by the analyzer's
    rule; EVERYTHING when f's layout is unknown or its speculation is not validated."""
    i = S.function_seen(ctl, fkey, fstate, newf, f)
    if i < 0 or fstate[i] != S.F_VALIDATED:
        return EVERYTHING
    start, count = fstart[i], fcount[i]
    sizes = lay_size[start:start + count]
    kinds = lay_kind[start:start + count]
    if max_evidence(sizes, kinds) > ev_slot.shape[0]:
        return EVERYTHING
    plen = launch_params(kp, extra, start, count, lay_off, lay_size, scratch)
    if plen < 0:
        return EVERYTHING
    k = launch_access(scratch, 0, plen, lay_off[start:start + count], sizes, kinds, bases, ends,
                      ctl[S.C_N], ev_slot, ev_param, ev_word, ev_off, ev_write, 0)
    n = 0
    for r in range(k):
        if ev_write[r] or all_access:
            slots[n] = ev_slot[r]
            n += 1
    return S.dedupe(slots, n)


@nb.njit(cache=True)
def in_pool(ctl, address: np.uint64) -> bool:
    """Whether `address` lies in the agent's shadow pool (no application buffer does)."""
    pool = np.uint64(ctl[S.C_POOL_BASE])
    return pool != 0 and address >= pool and address < pool + np.uint64(ctl[S.C_POOL_SIZE])


@nb.njit(cache=True)
def range_writes(ctl, bases, ends, ident, lo: np.uint64, size: np.uint64, lo2: np.uint64,
                 size2: np.uint64, ev_slot, ev_param, ev_word, ev_off, ev_write, slots) -> int:
    """The slots that [lo, lo+size) and [lo2, lo2+size2) overlap (a copy's or set's sides, by
    the analyzer's range rule; size2 0 for one side)."""
    if 2 * ctl[S.C_N] + 2 > ev_slot.shape[0]:
        return EVERYTHING
    k = _range_access(lo, size, bases, ends, ctl[S.C_N], ident, COPY_DST, True, ev_slot,
                      ev_param, ev_word, ev_off, ev_write, 0)
    k = _range_access(lo2, size2, bases, ends, ctl[S.C_N], ident, COPY_DST, True, ev_slot,
                      ev_param, ev_word, ev_off, ev_write, k)
    for r in range(k):
        slots[r] = ev_slot[r]
    return S.dedupe(slots, k)


@nb.njit(cache=True)
def launch_target(kind: int, params: int) -> tuple:
    """(function-table key, kernelParams, extra) of a launch's parameter struct; a runtime
    launch has no `extra` and names its kernel by the host stub (tagged)."""
    if kind == K_LAUNCH:
        return (native.load_u64(params), np.int64(native.load_u64(params + 48)),
                np.int64(native.load_u64(params + 56)))
    if kind == K_LAUNCH_EX:
        return (native.load_u64(params + 8), np.int64(native.load_u64(params + 16)),
                np.int64(native.load_u64(params + 24)))
    if kind == K_RT_LAUNCH:
        return (native.load_u64(params) | STUB_TAG, np.int64(native.load_u64(params + 32)),
                np.int64(0))
    return (native.load_u64(params + 8) | STUB_TAG, np.int64(native.load_u64(params + 16)),
            np.int64(0))


def build(st: S.State, copy_fn: int, record_fn: int, capturing_fn: int) -> Any:
    """The compiled callback for State `st`; copy_fn, record_fn and capturing_fn are the
    addresses of the driver's cuMemcpyDtoDAsync_v2 and cuEventRecord (the shadow copy and its
    event) and cuStreamIsCapturing."""
    memcpy_dtod = COPY_PROTO(copy_fn)
    event_record = RECORD_PROTO(record_fn)
    stream_is_capturing = CAPTURING_PROTO(capturing_fn)
    mutex, cond = st.mutex, st.cond
    a = {name: (arr.ctypes.data, arr.size, arr.dtype) for name, arr in vars(st).items()
         if isinstance(arr, np.ndarray)}

    def arr(name: str) -> tuple:
        return a[name]

    # (address, size) of every array, as compile-time constants
    (ctl_a, ctl_n, _), (bases_a, cap, _) = arr("ctl"), arr("bases")
    ends_a, status_a, flags_a = arr("ends")[0], arr("status")[0], arr("flags")[0]
    shadow_a = arr("shadow")[0]
    sh_off_a, sh_cap, _ = arr("sh_off")
    sh_size_a, sh_event_a = arr("sh_size")[0], arr("sh_event")[0]
    fkey_a, f_cap, _ = arr("fkey")
    fstate_a, fstart_a, fcount_a = arr("fstate")[0], arr("fstart")[0], arr("fcount")[0]
    lay_off_a, lay_cap, _ = arr("lay_off")
    lay_size_a, lay_kind_a = arr("lay_size")[0], arr("lay_kind")[0]
    newf_a, newf_cap, _ = arr("newf")
    agents_a, agents_cap, _ = arr("agents")
    rt_tid_a, rt_cap, _ = arr("rt_tid")
    rt_depth_a = arr("rt_depth")[0]
    cbkind_a, cb_cap, _ = arr("cbkind")
    cbflag_a = arr("cbflag")[0]
    ident_a = arr("ident")[0]
    scratch_a, scratch_cap, _ = arr("scratch")
    ev_slot_a, ev_cap, _ = arr("ev_slot")
    ev_param_a, ev_word_a = arr("ev_param")[0], arr("ev_word")[0]
    ev_off_a, ev_write_a = arr("ev_off")[0], arr("ev_write")[0]
    writes_a = arr("writes")[0]
    copies_a = arr("copies")[0]
    hist_key_a, hist_cap, _ = arr("hist_key")
    hist_op_a, hist_base_a = arr("hist_op")[0], arr("hist_base")[0]

    @nb.njit(inline="always")
    def v(addr, n, dt):  # type: ignore[no-untyped-def]
        return nb.carray(native.void_ptr(addr), n, dt)

    @nb.njit
    def body(domain: int, cbid: int, data: int) -> None:
        runtime = domain == DOMAIN_RUNTIME_API
        if runtime:
            cbid += RUNTIME_BASE
        elif domain != DOMAIN_DRIVER_API:
            return
        if cbid >= cb_cap:
            return
        kind = v(cbkind_a, cb_cap, np.int8)[cbid]
        if kind == K_NONE:
            return
        me = native.thread_self()
        ctl = v(ctl_a, ctl_n, np.int64)
        agents = v(agents_a, agents_cap, np.uint64)
        for t in range(ctl[S.C_AGENT_N]):
            if agents[t] == me:
                return
        site = native.load_u32(data)
        params = np.int64(native.load_u64(data + 16))
        corr = np.int64(native.load_u64(data + 56))
        bases = v(bases_a, cap, np.uint64)
        ends = v(ends_a, cap, np.uint64)
        status = v(status_a, cap, np.int8)
        flags = v(flags_a, cap, np.uint8)
        shadow = v(shadow_a, cap, np.int64)
        rt_tid = v(rt_tid_a, rt_cap, np.uint64)
        rt_depth = v(rt_depth_a, rt_cap, np.int64)
        alloc = kind == K_ALLOC or kind == K_MAP
        if site == API_EXIT:
            ret = np.int64(native.load_u64(data + 24))
            ok = ret != 0 and native.load_u32(ret) == 0
            native.mutex_lock(mutex)
            if corr != 0:
                tag = native.load_u64(corr)
                epoch = np.int64(tag & TAG_EPOCH)
                if epoch == 1 or epoch == 2:
                    ctl[S.C_OUT0 + epoch - 1] -= 1
                    native.cond_broadcast(cond)
                if tag & TAG_OPENED:
                    S.runtime_open(ctl, rt_tid, rt_depth, me, -1)
            # once the runtime's inner driver calls are known to be reported, they alone
            # change the table (a runtime call would repeat its inner call's change)
            if ok and not (runtime and ctl[S.C_NESTED] != 0):
                if kind == K_ALLOC:
                    S.table_insert(ctl, bases, ends, status, flags, shadow,
                                   native.load_u64(np.int64(native.load_u64(params))),
                                   native.load_u64(params + 8))
                elif kind == K_MAP:
                    S.table_insert(ctl, bases, ends, status, flags, shadow,
                                   native.load_u64(params), native.load_u64(params + 8))
                elif kind == K_FREE or kind == K_UNMAP:
                    S.table_remove(ctl, bases, ends, status, flags, shadow,
                                   native.load_u64(params))
            native.mutex_unlock(mutex)
            return
        # ---- entry ----
        # Passing untouched: the agent's own shadow copy (made on this thread, inside a
        # callback), and runtime calls once their inner driver calls are known to be reported.
        passes = (kind == K_COPY and not runtime and in_pool(ctl, native.load_u64(params))) \
            or (runtime and ctl[S.C_NESTED] != 0)
        opened = False
        if not passes and (runtime or ctl[S.C_RT_OPEN] > 0):
            native.mutex_lock(mutex)
            if runtime and ctl[S.C_NESTED] == 0:
                if corr != 0:                  # (its exit closes it through the tag)
                    S.runtime_open(ctl, rt_tid, rt_depth, me, 1)
                    opened = True
            elif not runtime and S.inside_runtime(rt_tid, rt_depth, me):
                # CUPTI reports the driver calls inside runtime calls; this one's runtime
                # call was acted on already (as runtime calls are from now on: not at all)
                ctl[S.C_NESTED] = 1
                passes = True
            native.mutex_unlock(mutex)
            passes = passes or (runtime and not opened and ctl[S.C_NESTED] != 0)  # set meanwhile
        if passes or alloc:                   # (allocations are entered at their exit)
            if corr != 0:
                native.store_u64(corr, TAG_OPENED if opened else np.uint64(0))
            return
        # ---- a call that may write (or, for K_READ, read) device memory ----
        cflag = v(cbflag_a, cb_cap, np.int8)[cbid]
        stream = np.uint64(0)
        launch = kind == K_LAUNCH or kind == K_LAUNCH_EX or kind == K_RT_LAUNCH \
            or kind == K_RT_LAUNCH_EX
        if kind == K_LAUNCH:
            stream = native.load_u64(params + 40)
        elif kind == K_RT_LAUNCH:
            stream = native.load_u64(params + 48)
        elif kind == K_LAUNCH_EX or kind == K_RT_LAUNCH_EX:
            stream = native.load_u64(np.int64(native.load_u64(params)) + 32)
        elif kind == K_GRAPH or (kind == K_FREE and cflag & ASYNC):   # (graph | dptr, hStream)
            stream = native.load_u64(params + 8)
        elif cflag & STREAM_AFTER_KIND:
            stream = native.load_u64(params + 32)
        elif cflag & ASYNC:
            stream = native.load_u64(params + 24)
        if stream == 0 and (cflag & PER_THREAD):
            stream = np.uint64(STREAM_PER_THREAD)
        slots = v(writes_a, cap, np.int64)
        hist_key = v(hist_key_a, hist_cap, np.int64)
        hist_op = v(hist_op_a, 2 * hist_cap, np.int64)
        hist_base = v(hist_base_a, 2 * hist_cap, np.uint64)
        native.mutex_lock(mutex)
        waited = False
        capture_known = False
        t0 = 0
        while True:
            phase = ctl[S.C_PHASE]
            if phase == S.PHASE_IDLE and (kind == K_READ or kind == K_OTHER_READ
                                          or ctl[S.C_TRACK] == 0):
                if launch:                                    # its layout, before any cut
                    S.function_seen(ctl, v(fkey_a, f_cap, np.uint64), v(fstate_a, f_cap, np.int8),
                                    v(newf_a, newf_cap, np.uint64), launch_target(kind, params)[0])
                break
            if phase == S.PHASE_CHECKPOINT and (kind == K_READ or kind == K_OTHER_READ):
                break
            if not capture_known and phase != S.PHASE_IDLE:
                # A call on a capturing stream (CUDA graph capture) does not run now: it must
                # neither wait nor get a shadow copy, which would be captured into the graph
                # and replayed with it. Asked with the mutex released (a driver call), and
                # not while idle: dirty tracking then only over-marks a captured call's buffers.
                native.mutex_unlock(mutex)
                capture = np.zeros(1, np.int32)
                captured = stream_is_capturing(stream, np.uint64(capture.ctypes.data)) == 0 \
                    and capture[0] != 0
                native.mutex_lock(mutex)
                capture_known = True
                if captured:
                    break
                continue                                  # the phase may have moved meanwhile
            restoring = phase == S.PHASE_RESTORE
            if phase == S.PHASE_CHECKPOINT and not waited:
                ctl[S.C_INTERCEPTED] += 1
            n = EVERYTHING
            shadow_ok = True
            key = np.int64(-kind)
            if launch:
                f, kp, extra = launch_target(kind, params)
                key = np.int64(f)
                n = launch_writes(ctl, bases, ends, v(fkey_a, f_cap, np.uint64),
                                  v(fstate_a, f_cap, np.int8), v(fstart_a, f_cap, np.int64),
                                  v(fcount_a, f_cap, np.int64), v(lay_off_a, lay_cap, np.int64),
                                  v(lay_size_a, lay_cap, np.int64),
                                  v(lay_kind_a, lay_cap, np.int8),
                                  v(newf_a, newf_cap, np.uint64), f, kp, extra,
                                  v(scratch_a, scratch_cap, np.uint8),
                                  v(ev_slot_a, ev_cap, np.int64), v(ev_param_a, ev_cap, np.int32),
                                  v(ev_word_a, ev_cap, np.int32), v(ev_off_a, ev_cap, np.uint64),
                                  v(ev_write_a, ev_cap, np.bool_), slots, restoring)
            elif kind == K_COPY or kind == K_SET8 or kind == K_SET16 or kind == K_SET32 \
                    or kind == K_READ:
                count = native.load_u64(params + 16)
                if kind == K_SET16:
                    count *= np.uint64(2)
                elif kind == K_SET32:
                    count *= np.uint64(4)
                lo, lo2, count2 = native.load_u64(params), np.uint64(0), np.uint64(0)
                if kind == K_READ:                       # cuMemcpyDtoH*(host, src, n)
                    lo = native.load_u64(params + 8)
                elif kind == K_COPY and restoring:       # a copy reads its source
                    lo2, count2 = native.load_u64(params + 8), count
                n = range_writes(ctl, bases, ends, v(ident_a, cap, np.int64), lo, count, lo2,
                                 count2, v(ev_slot_a, ev_cap, np.int64),
                                 v(ev_param_a, ev_cap, np.int32), v(ev_word_a, ev_cap, np.int32),
                                 v(ev_off_a, ev_cap, np.uint64), v(ev_write_a, ev_cap, np.bool_),
                                 slots)
            elif kind == K_FREE or kind == K_UNMAP:
                j = S.slot_of(bases, ctl[S.C_N], native.load_u64(params))
                n = 0
                if j >= 0:
                    slots[0] = j
                    n = 1
                shadow_ok = False
            if restoring:                                # on-demand restore
                if not S.plan_restore(ctl, status, flags, slots, max(n, 0), n == EVERYTHING):
                    if ctl[S.C_FIRST_NS] == 0:
                        ctl[S.C_FIRST_NS] = native.now_ns()
                    break
                if not waited:
                    ctl[S.C_HELD] += 1
                    waited = True
                native.wait(cond, mutex)
                continue
            if phase == S.PHASE_IDLE:                     # dirty tracking (and history) only
                S.plan_writes(ctl, bases, ends, status, flags, shadow,
                              v(sh_off_a, sh_cap, np.uint64), v(sh_size_a, sh_cap, np.uint64),
                              slots, max(n, 0), n == EVERYTHING, False,
                              v(copies_a, 4 * cap, np.uint64).reshape((4, cap)))
                S.record_history(ctl, hist_key, hist_op, hist_base, bases, key, slots,
                                 max(n, 0))
                break
            if n == EVERYTHING and not waited:
                ctl[S.C_FALLBACKS] += 1
            copies = v(copies_a, 4 * cap, np.uint64).reshape((4, cap))
            sh_off = v(sh_off_a, sh_cap, np.uint64)
            sh_size = v(sh_size_a, sh_cap, np.uint64)
            n_copies, wait = S.plan_writes(ctl, bases, ends, status, flags, shadow, sh_off,
                                           sh_size, slots, max(n, 0), n == EVERYTHING,
                                           shadow_ok, copies)
            if n_copies > 0:
                # The shadow copies are enqueued with the mutex released: a driver call may
                # wait on driver-internal locks, and no thread that might hold one may be kept
                # waiting for our mutex meanwhile. ISSUING keeps the copier and other writers
                # off these buffers until the copies are in the stream.
                todo = np.empty((4, n_copies), np.uint64)
                for c in range(n_copies):
                    for r in range(4):
                        todo[r, c] = copies[r, c]
                pool = np.uint64(ctl[S.C_POOL_BASE])
                events = v(sh_event_a, sh_cap, np.uint64)
                native.mutex_unlock(mutex)
                rcs = np.zeros(n_copies, np.int32)
                for c in range(n_copies):
                    rc = memcpy_dtod(pool + todo[1, c], todo[0, c], todo[2, c], stream)
                    if rc == 0:
                        rc = event_record(events[np.int64(todo[3, c])], stream)
                    rcs[c] = rc
                native.mutex_lock(mutex)
                for c in range(n_copies):
                    S.shadow_issued(ctl, bases, status, flags, shadow, sh_size, todo[0, c],
                                    rcs[c] == 0)
                    if rcs[c] == 0:
                        ctl[S.C_COW] += 1
                        ctl[S.C_COW_BYTES] += np.int64(todo[2, c])
                    else:
                        wait = True
                native.cond_broadcast(cond)
                if ctl[S.C_PHASE] != phase:
                    continue                              # ended (or aborted) meanwhile
            if not wait:
                break
            if not waited:
                ctl[S.C_WAITED] += 1
                t0 = native.now_ns()
                waited = True
            native.wait(cond, mutex)
        if t0 != 0:
            ctl[S.C_WAIT_NS] += native.now_ns() - t0
        if corr != 0:
            parity = ctl[S.C_EPOCH] & 1
            ctl[S.C_OUT0 + parity] += 1
            native.store_u64(corr, np.uint64(parity + 1) | (TAG_OPENED if opened
                                                             else np.uint64(0)))
        native.mutex_unlock(mutex)

    @nb.cfunc(SIGNATURE)
    def callback(userdata, domain, cbid, data):  # type: ignore[no-untyped-def]
        body(domain, cbid, np.int64(native.address(data)))

    return callback


def _variants(names: str, kind: int, flag: int = 0) -> dict[str, tuple[int, int]]:
    """name, name_ptds (per-thread default stream) and name_ptsz, each with its flags."""
    out: dict[str, tuple[int, int]] = {}
    for n in names.split():
        out[n] = (kind, flag)
        out[n + "_ptds"] = (kind, flag | PER_THREAD)
        out[n + "_ptsz"] = (kind, flag | PER_THREAD)
    return out


# Every driver call the agent intercepts, by name; the ids come from cupti.Cupti.callback_ids.
DRIVER_CALLS: dict[str, tuple[int, int]] = {
    **_variants("cuMemAlloc_v2 cuMemAllocManaged cuMemAllocAsync cuMemAllocFromPoolAsync",
                K_ALLOC),
    **_variants("cuMemMap", K_MAP),
    **_variants("cuMemFree_v2", K_FREE),
    **_variants("cuMemFreeAsync", K_FREE, ASYNC),
    **_variants("cuMemUnmap", K_UNMAP),
    **_variants("cuLaunchKernel", K_LAUNCH),
    **_variants("cuLaunchKernelEx", K_LAUNCH_EX),
    **_variants("cuMemcpy cuMemcpyHtoD_v2 cuMemcpyDtoD_v2", K_COPY),
    **_variants("cuMemcpyAsync cuMemcpyHtoDAsync_v2 cuMemcpyDtoDAsync_v2", K_COPY, ASYNC),
    **_variants("cuMemsetD8_v2", K_SET8), **_variants("cuMemsetD8Async", K_SET8, ASYNC),
    **_variants("cuMemsetD16_v2", K_SET16), **_variants("cuMemsetD16Async", K_SET16, ASYNC),
    **_variants("cuMemsetD32_v2", K_SET32), **_variants("cuMemsetD32Async", K_SET32, ASYNC),
    **_variants("cuGraphLaunch", K_GRAPH),
    # writes whose targets the agent does not work out: they wait for everything
    **_variants("cuLaunchCooperativeKernel cuLaunchCooperativeKernelMultiDevice cuLaunchGrid "
                "cuLaunchGridAsync cuLaunch cuMemcpy2D_v2 cuMemcpy2DAsync_v2 "
                "cuMemcpy2DUnaligned_v2 cuMemcpy3D_v2 cuMemcpy3DAsync_v2 cuMemcpy3DPeer "
                "cuMemcpy3DPeerAsync cuMemcpyPeer cuMemcpyPeerAsync cuMemcpyAtoD_v2 "
                "cuMemcpyBatchAsync cuMemcpy3DBatchAsync cuMemcpyBatchAsync_v2 "
                "cuMemcpy3DBatchAsync_v2 cuMemBatchDecompressAsync cuMemDiscardBatchAsync "
                "cuMemDiscardAndPrefetchBatchAsync cuMemsetD2D8_v2 cuMemsetD2D16_v2 "
                "cuMemsetD2D32_v2 cuMemsetD2D8Async cuMemsetD2D16Async cuMemsetD2D32Async "
                "cuStreamWriteValue32 cuStreamWriteValue64 cuStreamWriteValue32_v2 "
                "cuStreamWriteValue64_v2 cuStreamBatchMemOp cuStreamBatchMemOp_v2",
                K_OTHER_WRITE),
    # reads: during an on-demand restore they wait for the buffers they read
    **_variants("cuMemcpyDtoH_v2", K_READ),
    **_variants("cuMemcpyDtoHAsync_v2", K_READ, ASYNC),
    **_variants("cuMemcpyDtoA_v2", K_OTHER_READ),
}


# Every runtime call the agent intercepts, by name without its version suffix (offsets checked
# against CUDA 12.6's generated_cuda_runtime_api_meta.h).
RUNTIME_CALLS: dict[str, tuple[int, int]] = {
    **_variants("cudaMalloc cudaMallocManaged cudaMallocAsync cudaMallocFromPoolAsync", K_ALLOC),
    **_variants("cudaFree", K_FREE),
    **_variants("cudaFreeAsync", K_FREE, ASYNC),
    **_variants("cudaLaunchKernel", K_RT_LAUNCH),
    **_variants("cudaLaunchKernelExC", K_RT_LAUNCH_EX),
    **_variants("cudaMemcpy", K_COPY),           # any direction: writes dst, reads src
    **_variants("cudaMemcpyAsync", K_COPY, STREAM_AFTER_KIND),
    **_variants("cudaMemset", K_SET8), **_variants("cudaMemsetAsync", K_SET8, ASYNC),
    **_variants("cudaGraphLaunch", K_GRAPH),
    **_variants("cudaLaunchCooperativeKernel cudaLaunchCooperativeKernelMultiDevice "
                "cudaMemcpy2D cudaMemcpy2DAsync cudaMemcpy3D cudaMemcpy3DAsync cudaMemcpy3DPeer "
                "cudaMemcpy3DPeerAsync cudaMemcpyPeer cudaMemcpyPeerAsync cudaMemcpyToSymbol "
                "cudaMemcpyToSymbolAsync cudaMemcpyFromArray cudaMemcpyFromArrayAsync "
                "cudaMemcpy2DFromArray cudaMemcpy2DFromArrayAsync cudaMemcpyBatchAsync "
                "cudaMemcpy3DBatchAsync cudaMemset2D cudaMemset2DAsync cudaMemset3D "
                "cudaMemset3DAsync", K_OTHER_WRITE),
    # the <<<>>> launch of CUDA 13 runtimes (its parameter struct is not one pos has checked)
    **_variants("__cudaLaunchKernel", K_OTHER_WRITE),
}
CALLS = {DOMAIN_DRIVER_API: DRIVER_CALLS, DOMAIN_RUNTIME_API: RUNTIME_CALLS}


def install(st: S.State, ids: dict[int, dict[str, list[int]]]) -> dict[int, list[int]]:
    """Fill st.cbkind/cbflag for the calls this CUPTI knows (`ids`: domain -> name -> cbids);
    the callback ids to enable, by domain."""
    enabled: dict[int, list[int]] = {}
    for domain, calls in CALLS.items():
        base = RUNTIME_BASE if domain == DOMAIN_RUNTIME_API else 0
        on = enabled.setdefault(domain, [])
        for name, (kind, flag) in calls.items():
            for cbid in ids.get(domain, {}).get(name, []):
                if cbid < RUNTIME_BASE and base + cbid < st.cbkind.shape[0]:
                    st.cbkind[base + cbid] = kind
                    st.cbflag[base + cbid] = flag
                    on.append(cbid)
        on.sort()
    return enabled
