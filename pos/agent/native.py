"""Raw memory and libc's pthread primitives for numba code (the callback and its helpers).

The CUPTI callback runs on the application's threads without the GIL, so the state it shares
with the agent's Python threads is guarded by a pthread mutex and condition variable that live
in numpy memory and are called through ctypes (numba compiles ctypes calls to direct calls).
The mutex is recursive (a defence: no driver call is made while it is held, see callbacks.py).

Lock order, the rule that keeps the agent free of deadlocks with the GIL: the GIL before the
mutex, never the other way round. An application thread may enter the callback holding the GIL
and take the mutex; so whoever holds the mutex must never wait for the GIL. Python threads take
the mutex only inside numba `nogil` functions (never through a ctypes call, which re-acquires
the GIL before returning, i.e. while holding the mutex), and `wait` (below) drops the GIL of a
blocked application thread for the time it waits and re-takes it with the mutex released.
"""

import ctypes
import ctypes.util

import numba as nb
import numpy as np
from numba.core import cgutils, types
from numba.extending import intrinsic

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_U64 = ctypes.c_uint64


def _proto(name: str, *args: type) -> ctypes._CFuncPtr:
    return ctypes.CFUNCTYPE(ctypes.c_int, *args)((name, _libc))


mutex_lock = _proto("pthread_mutex_lock", _U64)
mutex_unlock = _proto("pthread_mutex_unlock", _U64)
cond_wait = _proto("pthread_cond_wait", _U64, _U64)
cond_broadcast = _proto("pthread_cond_broadcast", _U64)
_self = ctypes.CFUNCTYPE(_U64)(("pthread_self", _libc))
thread_self = _self
PTHREAD_MUTEX_RECURSIVE = 1
SYNC_BYTES = 64                 # >= sizeof(pthread_mutex_t) (40) and pthread_cond_t (48)


@intrinsic
def void_ptr(typingctx, addr):  # type: ignore[no-untyped-def]
    """An integer address as a void* (for numba.carray)."""
    sig = types.voidptr(addr)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.inttoptr(args[0], cgutils.voidptr_t)

    return sig, codegen


@intrinsic
def address(typingctx, ptr):  # type: ignore[no-untyped-def]
    """A void* as an integer address."""
    sig = types.int64(ptr)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.ptrtoint(args[0], cgutils.intp_t)

    return sig, codegen


# The GIL, for application threads that block inside the callback while holding it (PyTorch
# launches kernels with the GIL held): without this the agent's Python threads could not run.
_api = ctypes.pythonapi
gil_check = ctypes.CFUNCTYPE(ctypes.c_int)(
    ctypes.cast(_api.PyGILState_Check, ctypes.c_void_p).value)
save_thread = ctypes.CFUNCTYPE(_U64)(ctypes.cast(_api.PyEval_SaveThread, ctypes.c_void_p).value)
restore_thread = ctypes.CFUNCTYPE(None, _U64)(
    ctypes.cast(_api.PyEval_RestoreThread, ctypes.c_void_p).value)


@nb.njit
def wait(cond: int, mutex: int) -> None:
    """pthread_cond_wait for a caller that may hold the GIL (the callback on an application
    thread). The GIL is dropped while waiting; it is re-taken with the mutex released (GIL
    before mutex), then the mutex is re-taken: the caller must re-check its condition, as
    after any condition wait. The mutex must be held exactly once (not recursively)."""
    if gil_check() != 1:
        cond_wait(cond, mutex)
        return
    ts = save_thread()
    cond_wait(cond, mutex)
    mutex_unlock(mutex)
    restore_thread(ts)
    mutex_lock(mutex)


_clock_gettime = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, _U64)(("clock_gettime", _libc))
CLOCK_MONOTONIC = 1


@nb.njit
def now_ns() -> int:
    """CLOCK_MONOTONIC in nanoseconds, callable without the GIL."""
    ts = np.empty(2, np.int64)
    _clock_gettime(CLOCK_MONOTONIC, ts.ctypes.data)
    return ts[0] * 1_000_000_000 + ts[1]


_cond_timedwait = _proto("pthread_cond_timedwait", _U64, _U64, _U64)
CLOCK_REALTIME = 0


@nb.njit
def timed_wait(cond: int, mutex: int, ns: int) -> None:
    """pthread_cond_wait for at most `ns` nanoseconds (for threads that do not hold the GIL:
    the agent's own, inside numba nogil functions)."""
    ts = np.empty(2, np.int64)
    _clock_gettime(CLOCK_REALTIME, ts.ctypes.data)
    t = ts[0] * 1_000_000_000 + ts[1] + ns
    ts[0] = t // 1_000_000_000
    ts[1] = t % 1_000_000_000
    _cond_timedwait(cond, mutex, ts.ctypes.data)


@nb.njit(inline="always")
def load_u64(addr: int) -> np.uint64:
    return nb.carray(void_ptr(addr), 1, np.uint64)[0]


@nb.njit(inline="always")
def load_u32(addr: int) -> np.uint32:
    return nb.carray(void_ptr(addr), 1, np.uint32)[0]


@nb.njit(inline="always")
def store_u64(addr: int, v: np.uint64) -> None:
    nb.carray(void_ptr(addr), 1, np.uint64)[0] = v


@nb.njit(inline="always")
def bytes_at(addr: int, n: int) -> np.ndarray:
    return nb.carray(void_ptr(addr), n, np.uint8)


def sync_objects() -> tuple[np.ndarray, int, int]:
    """(backing array, address of a recursive mutex, address of a condition variable)."""
    mem = np.zeros(3 * SYNC_BYTES, np.uint8)
    attr = ctypes.create_string_buffer(SYNC_BYTES)
    base = mem.ctypes.data
    if _libc.pthread_mutexattr_init(attr) or \
            _libc.pthread_mutexattr_settype(attr, PTHREAD_MUTEX_RECURSIVE) or \
            _libc.pthread_mutex_init(_U64(base), attr) or \
            _libc.pthread_cond_init(_U64(base + SYNC_BYTES), None):
        raise OSError(ctypes.get_errno(), "pthread mutex/condition initialisation failed")
    _libc.pthread_mutexattr_destroy(attr)
    return mem, base, base + SYNC_BYTES
