"""The compiled CUPTI callback, invoked by hand with CUpti_CallbackData structs built here, over
the fake libcuda (device memory is host memory, so copies move real bytes). This proves the
callback's logic, the soft copy-on-write copies, the copier and the image round trip; it does
not prove them under real CUPTI on a GPU (tests/gpu/test_concurrent_gpu.py does that)."""

import ctypes
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from pos.agent import HalfRestored
from pos.agent import callbacks as C
from pos.agent import gpuimage
from pos.agent import state as S
from pos.agent.agent import Agent
from pos.agent.copier import Copier, Restorer
from pos.driver import Driver
from pos.errors import PosError
from pos.scheduler import image

SIZE = 256 << 10
IDS = {domain: {name: [i] for i, name in enumerate(sorted(calls), start=1)}  # this test's numbering
       for domain, calls in C.CALLS.items()}


class CallbackData(ctypes.Structure):
    """CUpti_CallbackData (cupti_callbacks.h), 72 bytes."""
    _fields_ = [("callbackSite", ctypes.c_uint32), ("functionName", ctypes.c_void_p),
                ("functionParams", ctypes.c_void_p), ("functionReturnValue", ctypes.c_void_p),
                ("symbolName", ctypes.c_void_p), ("context", ctypes.c_void_p),
                ("contextUid", ctypes.c_uint32), ("correlationData", ctypes.c_void_p),
                ("correlationId", ctypes.c_uint32)]


class LaunchParams(ctypes.Structure):
    """cuLaunchKernel_params (generated_cuda_meta.h)."""
    _fields_ = [("f", ctypes.c_uint64), ("grid", ctypes.c_uint32 * 3),
                ("block", ctypes.c_uint32 * 3), ("sharedMemBytes", ctypes.c_uint32),
                ("hStream", ctypes.c_uint64), ("kernelParams", ctypes.c_void_p),
                ("extra", ctypes.c_void_p)]


assert ctypes.sizeof(CallbackData) == 72 and LaunchParams.hStream.offset == 40
assert LaunchParams.kernelParams.offset == 48


class App:
    """The 'application' side: a context, two buffers, the callback invoked by hand."""

    def __init__(self, agent: Agent, drv: Driver) -> None:
        self.agent, self.drv = agent, drv
        ctx = ctypes.c_void_p()
        drv.init()
        drv.call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), 0)
        drv.call("cuCtxSetCurrent", ctx)
        self.bufs = [self.alloc(SIZE) for _ in range(2)]

    def fire(self, name: str, site: int, params: ctypes.Structure,
             ret: int = 0, corr: "ctypes.c_uint64 | None" = None, hold_gil: bool = False) -> None:
        """Invoke the callback as CUPTI would. hold_gil: keep the GIL across it (PYFUNCTYPE),
        as an application thread launching from Python (PyTorch) does."""
        code = ctypes.c_int(ret)
        data = CallbackData(callbackSite=site, functionParams=ctypes.addressof(params),
                            functionReturnValue=ctypes.addressof(code),
                            correlationData=ctypes.addressof(corr) if corr is not None else None)
        proto = ctypes.PYFUNCTYPE if hold_gil else ctypes.CFUNCTYPE
        fn = proto(None, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32,
                   ctypes.c_void_p)(self.agent.callback.address)
        domain = C.DOMAIN_RUNTIME_API if name.startswith("cuda") else C.DOMAIN_DRIVER_API
        fn(None, domain, IDS[domain][name][0], ctypes.addressof(data))

    def alloc(self, size: int) -> int:
        p = ctypes.c_uint64()
        self.drv.call("cuMemAlloc_v2", ctypes.byref(p), ctypes.c_size_t(size))
        params = (ctypes.c_uint64 * 2)(ctypes.addressof(p), size)
        self.fire("cuMemAlloc_v2", C.API_EXIT, params)
        return p.value

    def fill(self, base: int, value: int) -> None:
        data = np.full(SIZE, value, np.uint8)
        self.drv.call("cuMemcpyHtoD_v2", ctypes.c_uint64(base), ctypes.c_void_p(data.ctypes.data),
                      ctypes.c_size_t(SIZE))

    def read(self, base: int) -> np.ndarray:
        out = np.empty(SIZE, np.uint8)
        self.drv.call("cuMemcpyDtoH_v2", ctypes.c_void_p(out.ctypes.data), ctypes.c_uint64(base),
                      ctypes.c_size_t(SIZE))
        return out

    def launch(self, site: int = C.API_ENTER, corr: "ctypes.c_uint64 | None" = None,
               hold_gil: bool = False, stream: int = 0) -> None:
        """axpy(float const* x = buffer 0, float* y = buffer 1): writes buffer 1."""
        x, y = ctypes.c_uint64(self.bufs[0]), ctypes.c_uint64(self.bufs[1])
        kp = (ctypes.c_void_p * 2)(ctypes.addressof(x), ctypes.addressof(y))
        params = LaunchParams(f=0xF00, hStream=stream,
                              kernelParams=ctypes.cast(kp, ctypes.c_void_p))
        self.fire("cuLaunchKernel", site, params, corr=corr, hold_gil=hold_gil)

    def read_call(self, base: int, hold_gil: bool = False) -> np.ndarray:
        """cuMemcpyDtoH_v2 as the application makes it: the callback first, then the call."""
        ctx = ctypes.c_void_p()
        self.drv.call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), 0)
        self.drv.call("cuCtxSetCurrent", ctx)
        out = np.empty(SIZE, np.uint8)
        params = (ctypes.c_uint64 * 3)(out.ctypes.data, base, SIZE)
        self.fire("cuMemcpyDtoH_v2", C.API_ENTER, params, hold_gil=hold_gil)
        self.drv.call("cuMemcpyDtoH_v2", ctypes.c_void_p(out.ctypes.data), ctypes.c_uint64(base),
                      ctypes.c_size_t(SIZE))
        return out

    def fill_pattern(self, base: int, seed: int) -> np.ndarray:
        data = np.random.default_rng(seed).integers(0, 256, SIZE, np.uint8)
        self.drv.call("cuMemcpyHtoD_v2", ctypes.c_uint64(base), ctypes.c_void_p(data.ctypes.data),
                      ctypes.c_size_t(SIZE))
        return data


@pytest.fixture(scope="module")
def rig(fakegpu):  # type: ignore[no-untyped-def]
    drv = Driver(str(fakegpu["libcuda"]))
    agent = Agent(drv, pool_bytes=1 << 20, trust_all=True, capacity=64, shadows=16,
                  functions=64, layout_words=256)
    agent.compile()
    C.install(agent.st, IDS)
    app = App(agent, drv)
    agent.add_function(0xF00, [0, 8], [8, 8], "_Z4axpyPKfPf")
    t = threading.Thread(target=lambda: (agent.register(), agent._ensure_pool(),
                                         agent.unregister()))
    t.start()
    t.join()
    return agent, app


def manual_cut(agent: Agent) -> None:
    st = agent.st
    S.begin_locked(st.mutex, st.ctl, st.bases, st.ends, st.status, st.flags, st.shadow,
                   st.order, np.zeros(0, np.uint64), False)
    S.set_phase_locked(st.mutex, st.cond, st.ctl, S.PHASE_CHECKPOINT)
    S.cut_done_locked(st.mutex, st.cond, st.ctl)


def copy_all(agent: Agent, folder: Path, chunk: int = 1 << 20,
             compress: bool = True) -> dict[int, np.ndarray]:
    """Run the copier in an agent thread; the saved bytes per buffer, read back from disk."""
    w = gpuimage.Writer(folder, compress=compress)
    t = threading.Thread(target=lambda: Copier(agent.drv, agent.st, w, agent.register,
                                               agent.unregister, streams=2, writers=2,
                                               chunk=chunk).run())
    t.start()
    t.join()
    w.close()
    st = agent.st
    S.end_locked(st.mutex, st.cond, st.ctl, st.status, st.flags, st.sh_size)
    out = {}
    for base, chunks in w.chunks.items():
        buf = np.empty(SIZE, np.uint8)
        for c in chunks:
            part = np.empty(c["raw"], np.uint8)
            gpuimage.read_chunk(folder, c, part)
            buf[c["offset"]:c["offset"] + c["raw"]] = part
        out[base] = buf
    return out


def test_allocations_enter_the_table(rig) -> None:  # type: ignore[no-untyped-def]
    agent, app = rig
    live = dict(agent.st.live())
    assert all(live.get(b) == SIZE for b in app.bufs)


def test_a_launch_while_idle_queues_its_kernel_for_its_layout(rig) -> None:  # type: ignore[no-untyped-def]
    """Without dirty tracking an idle launch is otherwise let through untouched: its kernel's
    layout is still looked up now, so that the first cut knows what it writes."""
    agent, app = rig
    assert not agent.st.ctl[S.C_TRACK] and agent.st.ctl[S.C_PHASE] == S.PHASE_IDLE
    x = ctypes.c_uint64(app.bufs[0])
    kp = (ctypes.c_void_p * 1)(ctypes.addressof(x))
    app.fire("cuLaunchKernel", C.API_ENTER,
             LaunchParams(f=0xBEEF, hStream=0, kernelParams=ctypes.cast(kp, ctypes.c_void_p)))
    st = agent.st
    out = np.zeros(st.newf.shape[0], np.uint64)
    n = S.take_new_functions_locked(st.mutex, st.ctl, st.newf, out)
    assert 0xBEEF in out[:n].tolist()


def test_write_after_the_cut_is_shadowed_on_the_callers_stream(rig, tmp_path) -> None:  # type: ignore[no-untyped-def]
    agent, app = rig
    x, y = app.bufs
    app.fill(x, 1)
    app.fill(y, 2)
    cow0 = int(agent.st.ctl[S.C_COW])
    manual_cut(agent)
    app.launch()                                   # may write y: y is shadowed first
    assert int(agent.st.ctl[S.C_COW]) == cow0 + 1
    app.fill(y, 7)                                 # the "kernel" writes y
    saved = copy_all(agent, tmp_path)
    assert (saved[x] == 1).all()
    assert (saved[y] == 2).all()                   # the bytes at the cut, from the shadow
    assert (app.read(y) == 7).all()


def test_a_launch_being_captured_into_a_graph_passes_untouched(rig, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A launch on a capturing stream does not run now: a shadow copy would be captured into
    the graph and replayed with it, so it gets none (and does not wait)."""
    agent, app = rig
    drv, ctx, stream, graph = app.drv, ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
    drv.call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), 0)
    drv.call("cuCtxSetCurrent", ctx)
    drv.call("cuStreamCreate", ctypes.byref(stream), 0)
    drv.call("cuStreamBeginCapture_v2", stream, 0)
    cow0 = int(agent.st.ctl[S.C_COW])
    manual_cut(agent)
    app.launch(stream=stream.value)
    assert int(agent.st.ctl[S.C_COW]) == cow0
    drv.call("cuStreamEndCapture", stream, ctypes.byref(graph))
    app.launch(stream=stream.value)               # the same call, no longer captured
    assert int(agent.st.ctl[S.C_COW]) == cow0 + 1
    copy_all(agent, tmp_path)
    drv.call("cuStreamDestroy_v2", stream)


class RtLaunchParams(ctypes.Structure):
    """cudaLaunchKernel_v7000_params (generated_cuda_runtime_api_meta.h)."""
    _fields_ = [("func", ctypes.c_uint64), ("grid", ctypes.c_uint32 * 3),
                ("block", ctypes.c_uint32 * 3), ("args", ctypes.c_void_p),
                ("sharedMem", ctypes.c_uint64), ("stream", ctypes.c_uint64)]


class RtMemcpyAsyncParams(ctypes.Structure):
    """cudaMemcpyAsync_v3020_params: the direction before the stream."""
    _fields_ = [("dst", ctypes.c_uint64), ("src", ctypes.c_uint64), ("count", ctypes.c_uint64),
                ("kind", ctypes.c_int), ("stream", ctypes.c_uint64)]


assert RtLaunchParams.args.offset == 32 and RtLaunchParams.stream.offset == 48
assert RtMemcpyAsyncParams.stream.offset == 32
STUB = 0x7F00_0000_1230                            # a host stub of nvcc's


def test_runtime_calls_are_handled_like_the_driver_calls_inside_them(rig, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A PyTorch job calls the runtime, and CUPTI reports cudaMalloc and cudaLaunchKernel, not
    the driver calls inside them. A runtime launch is known by its host stub (tagged); the
    runtime structs' streams are read where they lie: a call on a capturing stream passes,
    the same call on another stream is shadowed (only what the stub's layout says it writes)."""
    agent, app = rig
    drv, st = app.drv, agent.st
    p = ctypes.c_uint64()
    drv.call("cuMemAlloc_v2", ctypes.byref(p), ctypes.c_size_t(SIZE))   # inside cudaMalloc
    app.fire("cudaMalloc", C.API_EXIT, (ctypes.c_uint64 * 2)(ctypes.addressof(p), SIZE))
    x, y, z = *app.bufs, p.value
    assert dict(st.live()).get(z) == SIZE
    agent.add_function(STUB | int(C.STUB_TAG), [0, 8], [8, 8], "_Z4axpyPKfPf")
    xa, ya = ctypes.c_uint64(x), ctypes.c_uint64(y)
    args = (ctypes.c_void_p * 2)(ctypes.addressof(xa), ctypes.addressof(ya))

    def launch(stream: int, stub: int = STUB) -> None:
        app.fire("cudaLaunchKernel", C.API_ENTER, RtLaunchParams(
            func=stub, args=ctypes.cast(args, ctypes.c_void_p), stream=stream))

    def copy(stream: int) -> None:                 # z <- x, device to device
        app.fire("cudaMemcpyAsync", C.API_ENTER,
                 RtMemcpyAsyncParams(dst=z, src=x, count=SIZE, kind=3, stream=stream))

    ctx, stream, graph = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
    drv.call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), 0)
    drv.call("cuCtxSetCurrent", ctx)
    drv.call("cuStreamCreate", ctypes.byref(stream), 0)
    app.fill(y, 2)
    app.fill(z, 3)
    drv.call("cuStreamBeginCapture_v2", stream, 0)
    cow0 = int(st.ctl[S.C_COW])
    manual_cut(agent)
    launch(stream.value)
    copy(stream.value)
    assert int(st.ctl[S.C_COW]) == cow0            # being captured: untouched
    drv.call("cuStreamEndCapture", stream, ctypes.byref(graph))
    launch(stream.value)
    assert int(st.ctl[S.C_COW]) == cow0 + 1        # y, by the stub's layout (not x too)
    copy(stream.value)
    assert int(st.ctl[S.C_COW]) == cow0 + 2        # z
    app.fill(y, 7)
    app.fill(z, 8)
    saved = copy_all(agent, tmp_path)
    assert (saved[y] == 2).all() and (saved[z] == 3).all()
    app.fire("cudaFree", C.API_ENTER, (ctypes.c_uint64 * 1)(z))
    drv.call("cuMemFree_v2", ctypes.c_uint64(z))
    app.fire("cudaFree", C.API_EXIT, (ctypes.c_uint64 * 1)(z))
    assert z not in dict(st.live())
    launch(0, STUB + 0x40)                         # idle: a new stub is queued for its layout
    out = np.zeros(st.newf.shape[0], np.uint64)
    n = S.take_new_functions_locked(st.mutex, st.ctl, st.newf, out)
    assert (STUB + 0x40) | int(C.STUB_TAG) in out[:n].tolist()
    drv.call("cuStreamDestroy_v2", stream)


def test_once_a_driver_call_is_seen_inside_a_runtime_call_the_driver_domain_alone_acts(  # type: ignore[no-untyped-def]
        rig, tmp_path) -> None:
    """Should CUPTI report the driver calls a runtime call makes inside (not documented), the
    first such call says so, and from then on runtime calls pass: their driver calls name the
    CUfunction. The calls in flight are counted once each either way."""
    agent, app = rig
    st = agent.st
    x, y = app.bufs
    xa, ya = ctypes.c_uint64(x), ctypes.c_uint64(y)
    args = (ctypes.c_void_p * 2)(ctypes.addressof(xa), ctypes.addressof(ya))
    agent.add_function(STUB | int(C.STUB_TAG), [0, 8], [8, 8], "_Z4axpyPKfPf")
    out0 = (int(st.ctl[S.C_OUT0]), int(st.ctl[S.C_OUT1]))

    def nested_launch() -> None:                   # cudaLaunchKernel, cuLaunchKernel inside it
        rc, dc = ctypes.c_uint64(0), ctypes.c_uint64(0)
        rt = RtLaunchParams(func=STUB, args=ctypes.cast(args, ctypes.c_void_p))
        app.fire("cudaLaunchKernel", C.API_ENTER, rt, corr=rc)
        app.launch(C.API_ENTER, dc)
        app.launch(C.API_EXIT, dc)
        app.fire("cudaLaunchKernel", C.API_EXIT, rt, corr=rc)

    try:
        assert st.ctl[S.C_NESTED] == 0
        nested_launch()                            # idle: learns that driver calls nest
        assert st.ctl[S.C_NESTED] == 1 and agent.status()["nested_driver_calls"]
        cow0 = int(st.ctl[S.C_COW])
        manual_cut(agent)
        held = int(st.ctl[S.C_INTERCEPTED])
        nested_launch()
        assert int(st.ctl[S.C_COW]) == cow0 + 1    # y, shadowed once, by the driver call
        assert int(st.ctl[S.C_INTERCEPTED]) == held + 1
        (tmp_path / "a").mkdir()
        copy_all(agent, tmp_path / "a")
        assert (int(st.ctl[S.C_OUT0]), int(st.ctl[S.C_OUT1])) == out0
        # learnt during a checkpoint: the runtime call acts, the driver call inside it passes
        st.ctl[S.C_NESTED] = 0
        manual_cut(agent)
        cow0 = int(st.ctl[S.C_COW])
        nested_launch()
        assert st.ctl[S.C_NESTED] == 1 and int(st.ctl[S.C_COW]) == cow0 + 1
        assert st.ctl[S.C_RT_OPEN] == 0
        (tmp_path / "b").mkdir()
        copy_all(agent, tmp_path / "b")
        assert (int(st.ctl[S.C_OUT0]), int(st.ctl[S.C_OUT1])) == out0
    finally:
        st.ctl[S.C_NESTED] = 0                     # for the tests after this one


def test_the_agents_own_shadow_copy_inside_a_runtime_call_is_not_taken_for_nesting(  # type: ignore[no-untyped-def]
        rig) -> None:
    """The shadow copy a runtime call's callback makes on the application's thread is a driver
    call inside a runtime call, but not the runtime's: it passes, and teaches nothing."""
    agent, app = rig
    st = agent.st
    rc, dc = ctypes.c_uint64(0), ctypes.c_uint64(0)
    rt = (ctypes.c_uint64 * 3)(app.bufs[1], 0, SIZE)          # cudaMemset(y, 0, SIZE)
    app.fire("cudaMemset", C.API_ENTER, rt, corr=rc)
    pool = int(st.ctl[S.C_POOL_BASE])
    shadow = (ctypes.c_uint64 * 4)(pool, app.bufs[1], SIZE, 0)
    app.fire("cuMemcpyDtoDAsync_v2", C.API_ENTER, shadow, corr=dc)
    app.fire("cuMemcpyDtoDAsync_v2", C.API_EXIT, shadow, corr=dc)
    app.fire("cudaMemset", C.API_EXIT, rt, corr=rc)
    assert st.ctl[S.C_NESTED] == 0 and st.ctl[S.C_RT_OPEN] == 0


def test_pool_full_makes_the_call_wait_for_the_copier(rig, tmp_path) -> None:  # type: ignore[no-untyped-def]
    agent, app = rig
    st = agent.st
    app.fill(app.bufs[1], 3)
    waited0 = int(st.ctl[S.C_WAITED])
    pool = int(st.ctl[S.C_POOL_SIZE])
    manual_cut(agent)
    st.ctl[S.C_POOL_SIZE] = 0
    t = threading.Thread(target=app_thread_launch, args=(app,))
    t.start()
    time.sleep(0.3)
    assert t.is_alive()                            # held: no room for a shadow
    saved = copy_all(agent, tmp_path)
    t.join(5)
    st.ctl[S.C_POOL_SIZE] = pool
    assert not t.is_alive()
    assert int(st.ctl[S.C_WAITED]) == waited0 + 1 and st.ctl[S.C_WAIT_NS] > 0
    assert (saved[app.bufs[1]] == 3).all()


def app_thread_launch(app: App, hold_gil: bool = False) -> None:
    ctx = ctypes.c_void_p()
    app.drv.call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), 0)
    app.drv.call("cuCtxSetCurrent", ctx)
    app.launch(hold_gil=hold_gil)


@pytest.fixture
def deadlock_guard():  # type: ignore[no-untyped-def]
    """A deadlock here would hang the whole run: dump the stacks and exit after 120 s."""
    import faulthandler

    faulthandler.dump_traceback_later(120, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def test_a_call_waiting_with_the_gil_held_lets_the_copier_run(rig, tmp_path,  # type: ignore[no-untyped-def]
                                                               deadlock_guard) -> None:
    """The deadlock of review item (a): PyTorch launches with the GIL held; the callback must
    drop it while it waits, or the copier's Python threads could never release it."""
    agent, app = rig
    st = agent.st
    app.fill(app.bufs[1], 5)
    pool = int(st.ctl[S.C_POOL_SIZE])
    manual_cut(agent)
    st.ctl[S.C_POOL_SIZE] = 0                      # no shadow possible: the call must wait
    t = threading.Thread(target=app_thread_launch, args=(app, True))
    t.start()
    time.sleep(0.3)                                # this thread runs: the GIL is free
    assert t.is_alive()
    saved = copy_all(agent, tmp_path)              # Python copier threads need the GIL
    t.join(10)
    st.ctl[S.C_POOL_SIZE] = pool
    assert not t.is_alive()
    assert (saved[app.bufs[1]] == 5).all()


def test_chunks_in_flight_on_several_streams_land_in_place(rig, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Chunk 64 KiB: each 256 KiB buffer is 4 chunks, 2 in flight per stream, 2 streams and 2
    writers: chunks complete and are written in any order; the index puts them back."""
    agent, app = rig
    want = {b: app.fill_pattern(b, i) for i, b in enumerate(app.bufs)}
    manual_cut(agent)
    saved = copy_all(agent, tmp_path, chunk=64 << 10, compress=False)
    for b, data in want.items():
        assert (saved[b] == data).all()


def test_on_demand_restore_holds_only_the_calls_that_need_missing_buffers(  # type: ignore[no-untyped-def]
        rig, tmp_path, deadlock_guard) -> None:
    agent, app = rig
    st = agent.st
    x, y = app.bufs
    want = {x: app.fill_pattern(x, 7), y: app.fill_pattern(y, 8)}
    agent.checkpoint(str(tmp_path / "img"))
    z = app.alloc(SIZE)                            # after the image: not part of it
    app.fill(x, 0)
    app.fill(y, 0)
    plan = gpuimage.resolve(tmp_path / "img")
    held0 = int(st.ctl[S.C_HELD])
    S.begin_restore_locked(st.mutex, st.ctl, st.bases, st.ends, st.status, st.flags, st.shadow,
                           st.order, np.asarray(sorted(plan), np.uint64), np.zeros(0, np.uint64))
    S.set_phase_locked(st.mutex, st.cond, st.ctl, S.PHASE_RESTORE)
    got: dict[str, np.ndarray] = {}
    t = threading.Thread(target=lambda: got.update(x=app.read_call(x, hold_gil=True)))
    t.start()
    time.sleep(0.3)
    assert t.is_alive() and int(st.ctl[S.C_HELD]) == held0 + 1   # x is not back: held
    app.read_call(z)                               # z is not in the image: passes at once
    r = Restorer(agent.drv, st, plan, agent.register, agent.unregister, streams=1,
                 chunk=SIZE)
    rt = threading.Thread(target=lambda: (r.start(), r.join()))
    rt.start()
    rt.join(30)
    t.join(10)
    first = int(st.ctl[S.C_FIRST_NS])
    S.end_locked(st.mutex, st.cond, st.ctl, st.status, st.flags, st.sh_size)
    assert not t.is_alive() and not rt.is_alive() and not r.errors
    assert (got["x"] == want[x]).all()             # the held call saw the restored bytes
    assert (app.read(y) == want[y]).all() and first > 0
    app.fire("cuMemFree_v2", C.API_EXIT, (ctypes.c_uint64 * 1)(z))


def test_history_gives_the_copy_order(rig, tmp_path) -> None:  # type: ignore[no-untyped-def]
    agent, app = rig
    st = agent.st
    st.ctl[S.C_TRACK] = 1
    try:
        calls0 = int(st.ctl[S.C_HIST_OPS])
        for _ in range(8):
            app.launch()                           # writes y
        assert int(st.ctl[S.C_HIST_OPS]) == calls0 + 8
        order, source, facts = agent.predicted_order()
        assert source == "history" and list(order) == [app.bufs[1]]
        report = agent.checkpoint(str(tmp_path / "img"))
        assert report["order_source"] == "history"
    finally:
        st.ctl[S.C_TRACK] = 0
    assert agent.predicted_order((0x1234,))[1] == "client"


def test_the_cut_waits_for_calls_already_inside_the_driver(rig, tmp_path) -> None:  # type: ignore[no-untyped-def]
    agent, app = rig
    corr = ctypes.c_uint64(0)
    app.launch(C.API_ENTER, corr)                  # entered before the cut, not yet left
    assert corr.value in (1, 2)
    result = {}
    t = threading.Thread(target=lambda: result.update(agent.checkpoint(str(tmp_path / "img"))))
    t.start()
    time.sleep(0.3)
    assert t.is_alive() and not (tmp_path / "img").exists()
    app.launch(C.API_EXIT, corr)
    t.join(20)
    assert not t.is_alive() and result["buffers"] >= 2
    image.verify(tmp_path / "img")


def test_a_call_left_inside_the_driver_by_an_earlier_checkpoint_refuses_the_next(  # type: ignore[no-untyped-def]
        rig, tmp_path) -> None:
    """A launch that entered during a checkpoint and never returned is counted under the parity
    the next epoch reuses: the next checkpoint is refused after stall_s, holding nothing."""
    agent, app = rig
    st = agent.st
    manual_cut(agent)
    corr = ctypes.c_uint64(0)
    app.launch(C.API_ENTER, corr)                  # entered during the checkpoint, still inside
    try:
        (tmp_path / "first").mkdir()
        copy_all(agent, tmp_path / "first")        # that checkpoint ends (a new epoch)
        t = time.monotonic()
        with pytest.raises(PosError) as e:
            agent.checkpoint(str(tmp_path / "img"), stall_s=0.5)
        assert 0.5 <= time.monotonic() - t < 5
        assert e.value.message == (
            "a driver call that entered during an earlier checkpoint or restore has not returned "
            "within 0.5 s, so the checkpoint cannot begin: nothing was held and the application "
            "runs on; try again once that call returns, or set POS_AGENT_STALL_S higher.")
        assert st.ctl[S.C_PHASE] == S.PHASE_IDLE
        assert not (tmp_path / "img").exists() and not (tmp_path / "img.partial").exists()
        waited = int(st.ctl[S.C_WAITED])
        other = ctypes.c_uint64(0)
        app.launch(C.API_ENTER, other)             # the application is not held
        app.launch(C.API_EXIT, other)
        assert int(st.ctl[S.C_WAITED]) == waited
    finally:
        app.launch(C.API_EXIT, corr)               # the stuck call returns at last
    assert agent.checkpoint(str(tmp_path / "img"))["buffers"] >= 2
    image.verify(tmp_path / "img")


def test_a_table_missing_device_memory_refuses_the_image(rig, tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Should CUPTI not report allocations, NVML's count of the process's device memory shows
    it: no image that would miss them, nothing held."""
    agent, _ = rig
    monkeypatch.setattr("pos.agent.agent.nvml.gpus_of", lambda pids: {"GPU-0": 40 << 30})
    with pytest.raises(PosError, match=r"holds \d+\.\d GiB of the 40\.0 GiB .* CUPTI did not"):
        agent.checkpoint(str(tmp_path / "img"))
    assert not (tmp_path / "img").exists() and not (tmp_path / "img.partial").exists()
    assert agent.st.ctl[S.C_PHASE] == S.PHASE_IDLE


def test_checkpoint_restore_round_trip_and_incremental(rig, tmp_path) -> None:  # type: ignore[no-untyped-def]
    agent, app = rig
    x, y = app.bufs
    app.fill(x, 11)
    app.fill(y, 12)
    report = agent.checkpoint(str(tmp_path / "full"))
    for key in ("bytes", "duration_s", "intercepted", "copied_on_write", "waited", "waited_s",
                "fallbacks", "throughput_gbps"):
        assert key in report
    assert report["bytes"] >= 2 * SIZE
    app.fill(x, 0)
    app.fill(y, 0)
    back = agent.restore(str(tmp_path / "full"))
    assert back["bytes"] >= 2 * SIZE and back["on_demand"]
    for key in ("release_s", "first_call_s", "held", "throughput_gbps", "copy_s"):
        assert key in back
    assert (app.read(x) == 11).all() and (app.read(y) == 12).all()
    app.fill(x, 0)
    quick = agent.restore(str(tmp_path / "full"), quick_verify=True)
    assert quick["quick_verify"] and (app.read(x) == 11).all()
    index = tmp_path / "full" / gpuimage.INDEX
    text = index.read_text()
    index.chmod(0o600)
    index.write_text(text.replace('"format": 1', '"format":  1'))
    with pytest.raises(Exception, match="corrupt|does not match its manifest"):
        agent.restore(str(tmp_path / "full"), quick_verify=True)
    index.write_text(text)
    with pytest.raises(Exception, match="dirty tracking"):
        agent.checkpoint(str(tmp_path / "inc"), incremental=True)
    agent.st.ctl[S.C_TRACK] = 1
    try:
        agent.checkpoint(str(tmp_path / "base"))
        app.fill(y, 13)
        app.launch()                               # tracked write to y
        app.fill(y, 13)
        inc = agent.checkpoint(str(tmp_path / "inc"), incremental=True)
    finally:
        agent.st.ctl[S.C_TRACK] = 0
    assert inc["buffers"] == 1 and inc["bytes"] == SIZE
    app.fill(x, 0)
    app.fill(y, 0)
    agent.restore(str(tmp_path / "inc"))          # y from inc, x from its parent
    assert (app.read(x) == 11).all() and (app.read(y) == 13).all()


def test_a_restore_failing_after_the_release_says_the_process_must_end(rig, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Quick verification leaves the data to the chunks' checksums: a corrupt chunk is found
    after the release, when other buffers are back already. The error is HalfRestored, which
    the server answers and then ends the process with; until then the calls that need a buffer
    not back stay held."""
    agent, app = rig
    x, y = app.bufs
    app.fill(x, 21)
    app.fill(y, 22)
    agent.checkpoint(str(tmp_path / "img"), chunk_mb=1)
    data = sorted((tmp_path / "img").glob("gpu-data-*.bin"))
    assert data
    data[-1].chmod(0o600)
    with data[-1].open("r+b") as f:         # one byte of the last chunk written
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 0xFF]))
    app.fill(x, 0)
    app.fill(y, 0)
    with pytest.raises(HalfRestored, match=r"the restore failed after \d+ of \d+ bytes .*so pos "
                       r"ended the process rather than leave it running half-restored: start the "
                       r"job again and restore the image into it\.$"):
        agent.restore(str(tmp_path / "img"), streams=1, quick_verify=True)
    st = agent.st
    assert st.ctl[S.C_PHASE] == S.PHASE_RESTORE    # held until the process ends
    S.end_locked(st.mutex, st.cond, st.ctl, st.status, st.flags, st.sh_size)   # (the test's)


def test_restore_refuses_an_image_of_other_buffers(rig, tmp_path) -> None:  # type: ignore[no-untyped-def]
    agent, app = rig
    agent.checkpoint(str(tmp_path / "img"))
    index = gpuimage.read_index(tmp_path / "img")
    assert index["buffers"]
    extra = app.alloc(SIZE)
    bad = tmp_path / "img"
    # free one buffer of the image: the image no longer fits this process
    params = (ctypes.c_uint64 * 1)(app.bufs[0])
    app.fire("cuMemFree_v2", C.API_EXIT, params)
    try:
        with pytest.raises(Exception, match="not a live allocation"):
            agent.restore(str(bad))
    finally:
        app.fire("cuMemAlloc_v2", C.API_EXIT,
                 (ctypes.c_uint64 * 2)(ctypes.addressof(ctypes.c_uint64(app.bufs[0])), SIZE))
    assert extra
