/* libposhook.so: the part of pos that lives inside a `pos run` job (LD_PRELOAD).
 *
 * It does four things and nothing more (the copying happens outside the job, in pos):
 *  1. owns the job's device memory: cuMemAlloc becomes exportable VMM memory (POSIX fd handles)
 *     in address ranges that pos reserves, so that pos can import it from outside, and so that
 *     the job can give the physical memory up (keeping the addresses) while the driver
 *     checkpoints it and take it back afterwards;
 *  2. the cut: hold every call that may enqueue GPU work, drain the calls already inside the
 *     driver, synchronise the contexts;
 *  3. the checkpoint gate: while pos copies, a call that may write a buffer not yet saved waits
 *     for it (a kernel launch waits while any buffer is unsaved: pos's device-to-device shadow
 *     at the cut usually saves them all);
 *  4. the on-demand restore gate: a call that may read or write a buffer not back yet waits; a
 *     kernel launch, for the buffers its parameters point into (launch_words).
 *
 * Calls reach the driver three ways, all interposed: direct linking (this library's exported
 * symbols come first), dlsym on libcuda (ours replaces the libc one) and cuGetProcAddress
 * (runtimes and frameworks: the pointer it returns is named with dladdr and swapped for ours).
 * No CUPTI: a process that subscribed CUPTI cannot be checkpointed by the driver.
 *
 * Control: a thread listens on the abstract unix socket "\0pos-agent-<pid>" (root peers only);
 * protocol.md beside this file is the contract with pos/agent/control.py.
 */
#define _GNU_SOURCE
#include <ctype.h>
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

/* ---- the driver ABI this library needs (no CUDA headers at build time) ------------------- */
typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef int CUdevice;
typedef void *CUcontext, *CUstream, *CUfunction, *CUgraphExec, *CUevent;
typedef struct {
    int type, id;
} CUmemLocation;
typedef struct {
    int type, requestedHandleTypes;
    CUmemLocation location;
    void *win32HandleMetaData;
    unsigned long long allocFlags;
} CUmemAllocationProp;
typedef struct {
    CUmemLocation location;
    int flags;
} CUmemAccessDesc;
typedef struct {
    unsigned int gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes;
    CUstream hStream;
    void *attrs;
    unsigned int numAttrs;
} CUlaunchConfig;

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_OPERATING_SYSTEM = 304,
    CUDA_ERROR_NOT_FOUND = 500
};
enum { MEM_PINNED = 1, HANDLE_POSIX_FD = 1, LOCATION_DEVICE = 1, ACCESS_RW = 3, LIMIT_STACK = 0 };
#define LAUNCH_PARAM_END ((void *)0x00)
#define LAUNCH_PARAM_BUFFER_POINTER ((void *)0x01)
#define LAUNCH_PARAM_BUFFER_SIZE ((void *)0x02)

#define EXPORT __attribute__((visibility("default")))

/* ---- resolving the real driver ------------------------------------------------------------ */
static void *(*real_dlsym)(void *, const char *);
static void *libcuda;

static void find_real_dlsym(void) {
    if (!real_dlsym)
        real_dlsym = dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
    if (!real_dlsym)
        real_dlsym = dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5");
}

/* The driver's own `name`, for a call that reached our exported symbol directly. */
static void *driver_symbol(const char *name) {
    find_real_dlsym();
    if (!libcuda) {
        const char *path = getenv("POS_LIBCUDA");
        libcuda = dlopen(path && *path ? path : "libcuda.so.1", RTLD_LAZY);
    }
    return libcuda && real_dlsym ? real_dlsym(libcuda, name) : NULL;
}

static void *real_of(void *volatile *slot, const char *name) {
    void *p = *slot;
    if (!p) {
        p = driver_symbol(name);
        *slot = p;
    }
    return p;
}

static uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

static void note(const char *fmt, ...) {
    if (!getenv("POS_HOOK_DEBUG"))
        return;
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "poshook[%d]: ", getpid());
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
}

/* ---- the table of owned allocations ------------------------------------------------------- */
enum { ST_NONE = 0, ST_PENDING = 1, ST_DONE = 2 }; /* per buffer, during one operation */
struct owned {
    CUdeviceptr va;
    size_t size;                    /* what the job asked for */
    size_t mapped;                  /* rounded to the granularity: reserved, created, mapped */
    CUmemGenericAllocationHandle h; /* 0 while hoisted */
    int fd;                         /* the descriptor it was mapped from, or -1: the driver
                                       exports only handles it created, not imported ones */
    int device;
    int status;
    int wanted; /* a call waits for it now (pos copies or fills it first) */
    int touched; /* a call let through a gate since the operation began may use it: the
                    buffers the job needs first, which a restore of its image fills first */
};

enum { P_IDLE, P_HOLD, P_COPY, P_RESTORE, P_HOISTED };
static const char *phase_name[] = {"idle", "hold", "copy", "restore", "hoisted"};

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER; /* table, phase changes, stats */
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;   /* phase or a status changed */
static struct owned *tab;
static size_t ntab, captab;
static size_t owned_bytes;
static uint64_t foreign_allocs, foreign_bytes; /* live allocations pos could not own */
static _Atomic int phase = P_IDLE;
static _Atomic long inflight; /* calls past the gate, not yet out */
static long waiting;          /* calls waiting in the gate (mu) */
static size_t npending;       /* buffers ST_PENDING (mu) */
static CUcontext ctxs[16];
static int nctx;
static size_t granularity[16];

/* One call that waited: the address it waited for last (a parameter word of a launch, or a
 * copy's address; 0: every buffer), how long, when it went on (from the operation's start),
 * and what it was (the kernel's name, or the driver function's). */
#define MAX_WAITS 16
struct wait {
    CUdeviceptr on;
    uint64_t ns, end_ns;
    char what[121]; /* a copy (the driver's goes with its module), JSON-safe */
};
struct stats {
    uint64_t held, held_ns, held_max_ns, passed, first_pass_ns, started_ns;
    uint64_t held_all; /* calls that waited for every buffer (what they touch not known) */
    int nwaits;        /* the operation's first MAX_WAITS waits */
    struct wait waits[MAX_WAITS];
};
static struct stats st;

/* Index of the entry containing p, or -1. Caller holds mu. */
static long find(CUdeviceptr p) {
    size_t lo = 0, hi = ntab;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (tab[mid].va <= p)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (lo == 0)
        return -1;
    struct owned *o = &tab[lo - 1];
    return p < o->va + o->mapped ? (long)(lo - 1) : -1;
}

static int insert(const struct owned *o) {
    if (ntab == captab) {
        size_t cap = captab ? captab * 2 : 256;
        struct owned *t = realloc(tab, cap * sizeof(*t));
        if (!t)
            return -1;
        tab = t, captab = cap;
    }
    size_t i = 0;
    while (i < ntab && tab[i].va < o->va)
        i++;
    memmove(&tab[i + 1], &tab[i], (ntab - i) * sizeof(*tab));
    tab[i] = *o;
    ntab++;
    owned_bytes += o->size;
    return 0;
}

static void drop(long i) {
    owned_bytes -= tab[i].size;
    if (tab[i].status == ST_PENDING)
        npending--;
    memmove(&tab[i], &tab[i + 1], (ntab - (size_t)i - 1) * sizeof(*tab));
    ntab--;
}

static void remember_ctx(CUcontext c) {
    for (int i = 0; i < nctx; i++)
        if (ctxs[i] == c)
            return;
    if (nctx < 16)
        ctxs[nctx++] = c;
}

/* Live allocations pos does not own (pools, managed, pitched, the job's own VMM mappings),
 * by address: their bytes are not in a GPU-only image, so pos must know whether there are
 * any. Open addressing; a freed slot keeps its place (tombstone) until the table grows. */
struct foreign {
    CUdeviceptr p; /* 0: empty, 1: freed */
    size_t n;
};
static struct foreign *ftab;
static size_t fcap, fused;

static struct foreign *foreign_slot(CUdeviceptr p, int for_insert) {
    for (size_t i = (size_t)(p >> 12) * 0x9E3779B97F4A7C15ull & (fcap - 1);;
         i = (i + 1) & (fcap - 1)) {
        if (ftab[i].p == p || (for_insert && ftab[i].p <= 1))
            return &ftab[i];
        if (ftab[i].p == 0)
            return NULL;
    }
}

static void foreign_add(CUdeviceptr p, size_t n) { /* caller holds mu */
    if (!p)
        return;
    if (2 * (fused + 1) > fcap) {
        size_t cap = fcap ? 2 * fcap : 256;
        struct foreign *old = ftab, *t = calloc(cap, sizeof(*t));
        if (!t)
            return;
        size_t oldcap = fcap;
        ftab = t, fcap = cap, fused = 0;
        for (size_t i = 0; i < oldcap; i++)
            if (old[i].p > 1) {
                *foreign_slot(old[i].p, 1) = old[i];
                fused++;
            }
        free(old);
    }
    struct foreign *f = foreign_slot(p, 1);
    if (f->p <= 1)
        fused += f->p == 0;
    *f = (struct foreign){p, n};
    foreign_allocs++;
    foreign_bytes += n;
}

static void foreign_remove(CUdeviceptr p) { /* caller holds mu */
    struct foreign *f = fcap && p > 1 ? foreign_slot(p, 0) : NULL;
    if (f) {
        foreign_allocs--;
        foreign_bytes -= f->n;
        f->p = 1;
    }
}

/* ---- the gate ---------------------------------------------------------------------------- */
/* What one call may touch: buffers it may write, buffers it may read, or everything; a kernel
 * launch, whatever its parameters point into (see launch_words). */
struct touch {
    CUdeviceptr w[2], r[2];
    int nw, nr, all;
    CUfunction f; /* a launch: its kernel and parameters */
    void **kp, **ex;
    int launch;
    const char *call; /* the driver function called */
};
#define T_NONE ((struct touch){.nw = 0})
#define T_ALL ((struct touch){.all = 1})
#define T_LAUNCH(fn, k, x) ((struct touch){.f = (fn), .kp = (k), .ex = (x), .launch = 1})
#define T_W(a) ((struct touch){.w = {(a)}, .nw = 1})
#define T_R(a) ((struct touch){.r = {(a)}, .nr = 1})
#define T_WR(a, b) ((struct touch){.w = {(a)}, .nw = 1, .r = {(b)}, .nr = 1})

static int pending(CUdeviceptr p) {
    long i = find(p);
    return i >= 0 && tab[i].status == ST_PENDING;
}

/* A launch's parameters as 8-byte words, the values its kernel may use as addresses: the
 * restore gate lets it through once every buffer they point into is back (pos reports a buffer
 * back only when the buffers its own bytes point into are back too, so that pointers kept in
 * device memory count). The parameter sizes come from the driver (cuFuncGetParamInfo, or
 * cuKernelGetParamInfo for a CUkernel handle), or from the `extra` buffer. -1 when they cannot
 * be known, or are more than MAX_WORDS words: the launch then waits for every buffer. */
#define MAX_WORDS 1024
typedef CUresult (*param_info_fn)(void *, size_t, size_t *, size_t *);
static void *volatile real_cuFuncGetParamInfo, *volatile real_cuKernelGetParamInfo;

static int add_words(CUdeviceptr *words, int n, const void *p, size_t size) {
    for (size_t at = 0; at + sizeof(CUdeviceptr) <= size; at += sizeof(CUdeviceptr)) {
        if (n == MAX_WORDS)
            return -1;
        memcpy(&words[n++], (const char *)p + at, sizeof(CUdeviceptr));
    }
    return n;
}

static int launch_words(const struct touch *t, CUdeviceptr *words) {
    if (!t->kp) { /* CU_LAUNCH_PARAM_BUFFER_POINTER (1) and _SIZE (2) in `extra`, or none */
        const void *buf = NULL;
        size_t size = 0;
        for (int i = 0; t->ex && i < 64 && t->ex[i]; i += 2) {
            if (t->ex[i] == (void *)1)
                buf = t->ex[i + 1];
            else if (t->ex[i] == (void *)2 && t->ex[i + 1])
                size = *(const size_t *)t->ex[i + 1];
        }
        return buf ? add_words(words, 0, buf, size) : t->ex ? -1 : 0;
    }
    param_info_fn info = (param_info_fn)real_of(&real_cuFuncGetParamInfo, "cuFuncGetParamInfo");
    size_t off, size;
    CUresult r = info ? info(t->f, 0, &off, &size) : CUDA_ERROR_NOT_FOUND;
    if (r != CUDA_SUCCESS) {
        param_info_fn k =
            (param_info_fn)real_of(&real_cuKernelGetParamInfo, "cuKernelGetParamInfo");
        CUresult rk = k ? k(t->f, 0, &off, &size) : CUDA_ERROR_NOT_FOUND;
        if (rk == CUDA_SUCCESS)
            info = k, r = rk;
        else /* both say "no parameter 0": a kernel without parameters */
            return r == CUDA_ERROR_INVALID_VALUE && rk == CUDA_ERROR_INVALID_VALUE ? 0 : -1;
    }
    int n = 0;
    for (size_t i = 0; r == CUDA_SUCCESS && n >= 0; r = info(t->f, ++i, &off, &size))
        n = add_words(words, n, t->kp[i], size);
    return n >= 0 && r == CUDA_ERROR_INVALID_VALUE ? n : -1;
}

/* A pending buffer among `p`, or 0. Caller holds mu. */
static CUdeviceptr first_pending(const CUdeviceptr *p, int n) {
    for (int i = 0; i < n; i++)
        if (pending(p[i]))
            return p[i];
    return 0;
}

/* Whether a call touching `t` must wait in the current phase; `words`: a launch's (nwords < 0:
 * unknown). `*on`: the pending buffer it waits for (0: every buffer, or the phase holds all).
 * Caller holds mu. */
static int must_wait(const struct touch *t, const CUdeviceptr *words, int nwords,
                     CUdeviceptr *on) {
    *on = 0;
    switch (atomic_load(&phase)) {
    case P_IDLE:
        return 0;
    case P_COPY: /* writes wait for their buffer to be saved; reads pass; a launch may write
                    any buffer its parameter words point into (pos reports a buffer saved only
                    once the buffers its own bytes point into are saved too), and one whose
                    parameters cannot be known waits for every buffer */
        if (t->all || (t->launch && nwords < 0))
            return npending > 0;
        return (*on = first_pending(t->w, t->nw)) ||
               (t->launch && (*on = first_pending(words, nwords)));
    case P_RESTORE: /* reads and writes wait for their buffer to be back */
        if (t->all || (t->launch && nwords < 0))
            return npending > 0;
        return (*on = first_pending(t->w, t->nw)) || (*on = first_pending(t->r, t->nr)) ||
               (*on = first_pending(words, nwords));
    default: /* the cut and the hoist hold everything */
        return 1;
    }
}

/* Mark the buffers a call let through a gate may use. Caller holds mu. */
static void mark_touched(const struct touch *t, const CUdeviceptr *words, int nwords) {
    const CUdeviceptr *lists[] = {t->w, t->r, words};
    int counts[] = {t->nw, t->nr, nwords};
    for (int k = 0; k < 3; k++)
        for (int j = 0; j < counts[k]; j++) {
            long i = find(lists[k][j]);
            if (i >= 0)
                tab[i].touched = 1;
        }
}

static __thread int in_agent; /* the control thread's own driver calls pass untouched */

/* The phases whose gate reads a launch's parameter words (the checkpoint's and the
 * restore's); the cut and the hoist hold every call. */
static int gated(int ph) { return ph == P_COPY || ph == P_RESTORE; }

/* What a waiting call was, for the gate's account: a launch's kernel by name (cuFuncGetName,
 * or cuKernelGetName for a CUkernel handle), else the driver function. */
typedef CUresult (*name_fn)(const char **, void *);
static void *volatile real_cuFuncGetName, *volatile real_cuKernelGetName;
static const char *call_name(const struct touch *t) {
    const char *n = NULL;
    if (t->launch) {
        name_fn f = (name_fn)real_of(&real_cuFuncGetName, "cuFuncGetName");
        name_fn k = (name_fn)real_of(&real_cuKernelGetName, "cuKernelGetName");
        if (!(f && f(&n, t->f) == CUDA_SUCCESS && n) && !(k && k(&n, t->f) == CUDA_SUCCESS && n))
            n = NULL;
    }
    return n ? n : t->call ? t->call : "?";
}

/* ---- the collective cut: ranks held before the same NCCL launch ---------------------------
 * A job of several processes (DDP's ranks) is cut consistently only where every rank stands
 * before the same collective: a rank held after launching collective k while its peer is held
 * before it would wait for that peer forever. Every rank launches the same collectives in the
 * same order (NCCL requires it), so the agent counts its NCCL kernel launches from the start,
 * and a cut given AT holds the job just before the launch that would make the count AT+1. */
static void set_phase(int p);
static long nccl_launches; /* NCCL kernels launched (mu) */
static long hold_at = -1;  /* a cut waits for the launch past this count (mu); -1: none */

/* Whether a kernel is NCCL's, remembered per function: a launch asks the driver for a name
 * once per kernel (NCCL's are ncclDevKernel_* or, before 2.19, ncclKernel_*, mangled or not). */
#define KINDS 4096
static struct {
    _Atomic(uintptr_t) f;
    _Atomic int nccl; /* 0: being learnt, 1: not NCCL's, 2: NCCL's */
} kinds[KINDS];

static int named_nccl(const struct touch *t) {
    const char *n = call_name(t);
    return strstr(n, "ncclDevKernel") || strstr(n, "ncclKernel");
}

static int is_nccl(const struct touch *t) {
    uintptr_t f = (uintptr_t)t->f;
    size_t h = (size_t)((f >> 4) * 0x9E3779B97F4A7C15ull) % KINDS;
    for (int probe = 0; f && probe < 64; probe++, h = (h + 1) % KINDS) {
        uintptr_t seen = atomic_load(&kinds[h].f);
        if (!seen && atomic_compare_exchange_strong(&kinds[h].f, &seen, f)) {
            int yes = named_nccl(t);
            atomic_store(&kinds[h].nccl, yes ? 2 : 1);
            return yes;
        }
        if (seen == f) {
            int k = atomic_load(&kinds[h].nccl);
            if (k)
                return k == 2;
            break; /* being learnt by another thread: ask the driver here too */
        }
    }
    return named_nccl(t);
}

static void begin_hold(void) { /* caller holds mu; the phase is idle */
    memset(&st, 0, sizeof(st));
    st.started_ns = now_ns();
    set_phase(P_HOLD);
}

/* An NCCL launch arrives: counted, and the hold a cut armed for this point begins (this
 * launch then waits in the gate with every other call). */
static void nccl_arrive(void) {
    pthread_mutex_lock(&mu);
    if (hold_at >= 0 && nccl_launches >= hold_at && atomic_load(&phase) == P_IDLE) {
        hold_at = -1;
        begin_hold();
    }
    nccl_launches++;
    pthread_mutex_unlock(&mu);
}

/* Enter the driver for a call touching `t`: at once when idle (one atomic add), else after
 * waiting for what the phase requires. The add and the phase read are sequentially
 * consistent, as the cut's store and drain: either the cut sees this call in flight and
 * waits for it, or this call sees the cut and waits. */
static void gate_enter(const struct touch *t) {
    if (in_agent)
        return;
    if (t->launch && is_nccl(t))
        nccl_arrive();
    atomic_fetch_add(&inflight, 1);
    if (atomic_load(&phase) == P_IDLE)
        return;
    atomic_fetch_sub(&inflight, 1);
    /* a launch's parameter words, asked of the driver once a gate is open (a call held since
     * before, as in a job that CRIU restored, asks when it opens) */
    CUdeviceptr words[MAX_WORDS];
    int asked = t->launch && gated(atomic_load(&phase));
    int nwords = asked ? launch_words(t, words) : -1;
    CUdeviceptr on, last = 0;
    pthread_mutex_lock(&mu);
    if (must_wait(t, words, nwords, &on)) {
        uint64_t t0 = now_ns();
        waiting++;
        do {
            last = on;
            long w = on ? find(on) : -1;
            if (w >= 0)
                tab[w].wanted = 1;
            pthread_cond_wait(&cv, &mu);
            if (t->launch && !asked && gated(atomic_load(&phase)))
                asked = 1, nwords = launch_words(t, words);
        } while (must_wait(t, words, nwords, &on));
        waiting--;
        pthread_cond_broadcast(&cv);
        /* a wait begun before this operation (a job restored by CRIU while its calls were
         * held) counts from the operation's start */
        uint64_t waited = now_ns() - (t0 > st.started_ns ? t0 : st.started_ns);
        st.held++;
        st.held_ns += waited;
        st.held_all += last == 0;
        if (waited > st.held_max_ns)
            st.held_max_ns = waited;
        if (st.nwaits < MAX_WAITS) {
            struct wait *w = &st.waits[st.nwaits++];
            *w = (struct wait){.on = last, .ns = waited, .end_ns = now_ns() - st.started_ns};
            /* names are C identifiers, mangled: anything else becomes '?' */
            size_t k = 0;
            for (const char *c = call_name(t); *c && k < sizeof(w->what) - 1; c++)
                w->what[k++] = isalnum((unsigned char)*c) || *c == '_' ? *c : '?';
        }
    }
    if (asked || gated(atomic_load(&phase))) /* what it may use (unknown words: nothing) */
        mark_touched(t, words, nwords);
    st.passed++;
    if (!st.first_pass_ns && atomic_load(&phase) != P_IDLE)
        st.first_pass_ns = now_ns();
    atomic_fetch_add(&inflight, 1);
    pthread_mutex_unlock(&mu);
}

static void gate_exit(void) {
    if (!in_agent)
        atomic_fetch_sub(&inflight, 1);
}

/* ---- the wrappers ------------------------------------------------------------------------- */
/* HOOKS(X): X(name, params, args, touch, after). Each becomes an exported wrapper that enters
 * the gate with `touch`, calls the driver's own function, runs `after` (with its result r)
 * and leaves the gate. */
#define HOOKS(X)                                                                                   \
    X(cuMemcpy, (CUdeviceptr d, CUdeviceptr s, size_t n), (d, s, n), T_WR(d, s), NOAFTER)          \
    X(cuMemcpy_ptds, (CUdeviceptr d, CUdeviceptr s, size_t n), (d, s, n), T_WR(d, s), NOAFTER)     \
    X(cuMemcpyAsync, (CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st), (d, s, n, st),         \
      T_WR(d, s), NOAFTER)                                                                         \
    X(cuMemcpyAsync_ptsz, (CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st), (d, s, n, st),    \
      T_WR(d, s), NOAFTER)                                                                         \
    X(cuMemcpyHtoD_v2, (CUdeviceptr d, const void *h, size_t n), (d, h, n), T_W(d), NOAFTER)       \
    X(cuMemcpyHtoD_v2_ptds, (CUdeviceptr d, const void *h, size_t n), (d, h, n), T_W(d), NOAFTER)  \
    X(cuMemcpyHtoDAsync_v2, (CUdeviceptr d, const void *h, size_t n, CUstream s), (d, h, n, s),    \
      T_W(d), NOAFTER)                                                                             \
    X(cuMemcpyHtoDAsync_v2_ptsz, (CUdeviceptr d, const void *h, size_t n, CUstream s),             \
      (d, h, n, s), T_W(d), NOAFTER)                                                               \
    X(cuMemcpyDtoH_v2, (void *h, CUdeviceptr s, size_t n), (h, s, n), T_R(s), NOAFTER)             \
    X(cuMemcpyDtoH_v2_ptds, (void *h, CUdeviceptr s, size_t n), (h, s, n), T_R(s), NOAFTER)        \
    X(cuMemcpyDtoHAsync_v2, (void *h, CUdeviceptr s, size_t n, CUstream st), (h, s, n, st),        \
      T_R(s), NOAFTER)                                                                             \
    X(cuMemcpyDtoHAsync_v2_ptsz, (void *h, CUdeviceptr s, size_t n, CUstream st), (h, s, n, st),   \
      T_R(s), NOAFTER)                                                                             \
    X(cuMemcpyDtoD_v2, (CUdeviceptr d, CUdeviceptr s, size_t n), (d, s, n), T_WR(d, s), NOAFTER)   \
    X(cuMemcpyDtoD_v2_ptds, (CUdeviceptr d, CUdeviceptr s, size_t n), (d, s, n), T_WR(d, s),       \
      NOAFTER)                                                                                     \
    X(cuMemcpyDtoDAsync_v2, (CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st), (d, s, n, st),  \
      T_WR(d, s), NOAFTER)                                                                         \
    X(cuMemcpyDtoDAsync_v2_ptsz, (CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st),            \
      (d, s, n, st), T_WR(d, s), NOAFTER)                                                          \
    X(cuMemcpyPeer, (CUdeviceptr d, CUcontext dc, CUdeviceptr s, CUcontext sc, size_t n),          \
      (d, dc, s, sc, n), T_WR(d, s), NOAFTER)                                                      \
    X(cuMemcpyPeerAsync,                                                                           \
      (CUdeviceptr d, CUcontext dc, CUdeviceptr s, CUcontext sc, size_t n, CUstream st),           \
      (d, dc, s, sc, n, st), T_WR(d, s), NOAFTER)                                                  \
    X(cuMemcpy2D_v2, (const void *p), (p), T_ALL, NOAFTER)                                         \
    X(cuMemcpy2DUnaligned_v2, (const void *p), (p), T_ALL, NOAFTER)                                \
    X(cuMemcpy2DAsync_v2, (const void *p, CUstream s), (p, s), T_ALL, NOAFTER)                     \
    X(cuMemcpy2DAsync_v2_ptsz, (const void *p, CUstream s), (p, s), T_ALL, NOAFTER)                \
    X(cuMemcpy3D_v2, (const void *p), (p), T_ALL, NOAFTER)                                         \
    X(cuMemcpy3DAsync_v2, (const void *p, CUstream s), (p, s), T_ALL, NOAFTER)                     \
    X(cuMemcpy3DAsync_v2_ptsz, (const void *p, CUstream s), (p, s), T_ALL, NOAFTER)                \
    X(cuMemcpy3DPeer, (const void *p), (p), T_ALL, NOAFTER)                                        \
    X(cuMemcpy3DPeerAsync, (const void *p, CUstream s), (p, s), T_ALL, NOAFTER)                    \
    X(cuMemcpyBatchAsync,                                                                          \
      (void *d, void *s, void *n, size_t c, void *a, void *ai, size_t na, size_t *f, CUstream st), \
      (d, s, n, c, a, ai, na, f, st), T_ALL, NOAFTER)                                              \
    X(cuMemsetD8_v2, (CUdeviceptr d, unsigned char v, size_t n), (d, v, n), T_W(d), NOAFTER)       \
    X(cuMemsetD16_v2, (CUdeviceptr d, unsigned short v, size_t n), (d, v, n), T_W(d), NOAFTER)     \
    X(cuMemsetD32_v2, (CUdeviceptr d, unsigned int v, size_t n), (d, v, n), T_W(d), NOAFTER)       \
    X(cuMemsetD8_v2_ptds, (CUdeviceptr d, unsigned char v, size_t n), (d, v, n), T_W(d), NOAFTER)  \
    X(cuMemsetD16_v2_ptds, (CUdeviceptr d, unsigned short v, size_t n), (d, v, n), T_W(d),         \
      NOAFTER)                                                                                     \
    X(cuMemsetD32_v2_ptds, (CUdeviceptr d, unsigned int v, size_t n), (d, v, n), T_W(d), NOAFTER)  \
    X(cuMemsetD8Async, (CUdeviceptr d, unsigned char v, size_t n, CUstream s), (d, v, n, s),       \
      T_W(d), NOAFTER)                                                                             \
    X(cuMemsetD16Async, (CUdeviceptr d, unsigned short v, size_t n, CUstream s), (d, v, n, s),     \
      T_W(d), NOAFTER)                                                                             \
    X(cuMemsetD32Async, (CUdeviceptr d, unsigned int v, size_t n, CUstream s), (d, v, n, s),       \
      T_W(d), NOAFTER)                                                                             \
    X(cuMemsetD8Async_ptsz, (CUdeviceptr d, unsigned char v, size_t n, CUstream s), (d, v, n, s),  \
      T_W(d), NOAFTER)                                                                             \
    X(cuMemsetD16Async_ptsz, (CUdeviceptr d, unsigned short v, size_t n, CUstream s),              \
      (d, v, n, s), T_W(d), NOAFTER)                                                               \
    X(cuMemsetD32Async_ptsz, (CUdeviceptr d, unsigned int v, size_t n, CUstream s), (d, v, n, s),  \
      T_W(d), NOAFTER)                                                                             \
    X(cuMemsetD2D8_v2, (CUdeviceptr d, size_t p, unsigned char v, size_t w, size_t h),             \
      (d, p, v, w, h), T_W(d), NOAFTER)                                                            \
    X(cuMemsetD2D16_v2, (CUdeviceptr d, size_t p, unsigned short v, size_t w, size_t h),           \
      (d, p, v, w, h), T_W(d), NOAFTER)                                                            \
    X(cuMemsetD2D32_v2, (CUdeviceptr d, size_t p, unsigned int v, size_t w, size_t h),             \
      (d, p, v, w, h), T_W(d), NOAFTER)                                                            \
    X(cuMemsetD2D8Async,                                                                           \
      (CUdeviceptr d, size_t p, unsigned char v, size_t w, size_t h, CUstream s),                  \
      (d, p, v, w, h, s), T_W(d), NOAFTER)                                                         \
    X(cuMemsetD2D16Async,                                                                          \
      (CUdeviceptr d, size_t p, unsigned short v, size_t w, size_t h, CUstream s),                 \
      (d, p, v, w, h, s), T_W(d), NOAFTER)                                                         \
    X(cuMemsetD2D32Async,                                                                          \
      (CUdeviceptr d, size_t p, unsigned int v, size_t w, size_t h, CUstream s),                   \
      (d, p, v, w, h, s), T_W(d), NOAFTER)                                                         \
    X(cuLaunchKernel,                                                                              \
      (CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, \
       unsigned sm, CUstream s, void **kp, void **ex),                                             \
      (f, gx, gy, gz, bx, by, bz, sm, s, kp, ex), T_LAUNCH(f, kp, ex), NOAFTER)                     \
    X(cuLaunchKernel_ptsz,                                                                         \
      (CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, \
       unsigned sm, CUstream s, void **kp, void **ex),                                             \
      (f, gx, gy, gz, bx, by, bz, sm, s, kp, ex), T_LAUNCH(f, kp, ex), NOAFTER)                     \
    X(cuLaunchKernelEx, (const CUlaunchConfig *c, CUfunction f, void **kp, void **ex),             \
      (c, f, kp, ex), T_LAUNCH(f, kp, ex), NOAFTER)                                                 \
    X(cuLaunchKernelEx_ptsz, (const CUlaunchConfig *c, CUfunction f, void **kp, void **ex),        \
      (c, f, kp, ex), T_LAUNCH(f, kp, ex), NOAFTER)                                                 \
    X(cuLaunchCooperativeKernel,                                                                   \
      (CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, \
       unsigned sm, CUstream s, void **kp),                                                        \
      (f, gx, gy, gz, bx, by, bz, sm, s, kp), T_LAUNCH(f, kp, NULL), NOAFTER)                       \
    X(cuLaunchCooperativeKernel_ptsz,                                                              \
      (CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, \
       unsigned sm, CUstream s, void **kp),                                                        \
      (f, gx, gy, gz, bx, by, bz, sm, s, kp), T_LAUNCH(f, kp, NULL), NOAFTER)                       \
    X(cuGraphLaunch, (CUgraphExec g, CUstream s), (g, s), T_ALL, NOAFTER)                          \
    X(cuGraphLaunch_ptsz, (CUgraphExec g, CUstream s), (g, s), T_ALL, NOAFTER)                     \
    X(cuStreamWriteValue32_v2, (CUstream s, CUdeviceptr a, unsigned v, unsigned f), (s, a, v, f),  \
      T_W(a), NOAFTER)                                                                             \
    X(cuStreamWriteValue64_v2, (CUstream s, CUdeviceptr a, unsigned long long v, unsigned f),      \
      (s, a, v, f), T_W(a), NOAFTER)                                                               \
    X(cuStreamBatchMemOp_v2, (CUstream s, unsigned c, void *p, unsigned f), (s, c, p, f), T_ALL,   \
      NOAFTER)                                                                                     \
    X(cuMemAllocAsync, (CUdeviceptr * p, size_t n, CUstream s), (p, n, s), T_NONE, FOREIGN(p, n))  \
    X(cuMemAllocAsync_ptsz, (CUdeviceptr * p, size_t n, CUstream s), (p, n, s), T_NONE,            \
      FOREIGN(p, n))                                                                               \
    X(cuMemAllocFromPoolAsync, (CUdeviceptr * p, size_t n, void *pool, CUstream s),                \
      (p, n, pool, s), T_NONE, FOREIGN(p, n))                                                      \
    X(cuMemAllocFromPoolAsync_ptsz, (CUdeviceptr * p, size_t n, void *pool, CUstream s),           \
      (p, n, pool, s), T_NONE, FOREIGN(p, n))                                                      \
    X(cuMemAllocManaged, (CUdeviceptr * p, size_t n, unsigned f), (p, n, f), T_NONE,               \
      FOREIGN(p, n))                                                                               \
    X(cuMemAllocPitch_v2, (CUdeviceptr * p, size_t * pitch, size_t w, size_t h, unsigned e),       \
      (p, pitch, w, h, e), T_NONE, FOREIGN(p, pitch ? *pitch *h : 0))                              \
    X(cuMemCreate,                                                                                 \
      (CUmemGenericAllocationHandle * h, size_t n, const void *prop, unsigned long long f),        \
      (h, n, prop, f), T_NONE, NOAFTER)                                                            \
    X(cuMemMap,                                                                                    \
      (CUdeviceptr p, size_t n, size_t o, CUmemGenericAllocationHandle h, unsigned long long f),   \
      (p, n, o, h, f), T_NONE, FOREIGN(&p, n))                                                     \
    X(cuMemUnmap, (CUdeviceptr p, size_t n), (p, n), T_W(p), FOREIGN_GONE(p))

#define NOAFTER ((void)0)
#define FOREIGN(p, n)                                                                              \
    do {                                                                                           \
        if (r == CUDA_SUCCESS) {                                                                   \
            pthread_mutex_lock(&mu);                                                               \
            foreign_add(*(p), (n));                                                                \
            pthread_mutex_unlock(&mu);                                                             \
        }                                                                                          \
    } while (0)
#define FOREIGN_GONE(p)                                                                            \
    do {                                                                                           \
        if (r == CUDA_SUCCESS) {                                                                   \
            pthread_mutex_lock(&mu);                                                               \
            foreign_remove(p);                                                                     \
            pthread_mutex_unlock(&mu);                                                             \
        }                                                                                          \
    } while (0)

#define DECLARE(name, params, args, tch, after) static void *volatile real_##name;
HOOKS(DECLARE)

/* The driver functions with wrappers of their own below, or that the control thread calls. */
#define OWN(X)                                                                                     \
    X(cuInit)                                                                                      \
    X(cuMemAlloc_v2)                                                                               \
    X(cuMemFree_v2)                                                                                \
    X(cuMemFreeAsync)                                                                              \
    X(cuMemFreeAsync_ptsz)                                                                         \
    X(cuGetProcAddress) X(cuGetProcAddress_v2) X(cuCtxGetCurrent) X(cuCtxSetCurrent)               \
        X(cuCtxGetDevice) X(cuCtxSynchronize) X(cuMemGetAllocationGranularity)                     \
            X(cuMemAddressReserve) X(cuMemAddressFree) X(cuMemRelease) X(cuMemSetAccess)           \
                X(cuMemExportToShareableHandle) X(cuMemImportFromShareableHandle)                  \
                    X(cuStreamSynchronize) X(cuCtxGetLimit) X(cuCtxSetLimit)               \
                        X(cuDeviceGetCount) X(cuDeviceCanAccessPeer)
#define DECLARE_OWN(name) static void *volatile real_##name;
OWN(DECLARE_OWN)

CUresult cuInit(unsigned flags);
CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n);
CUresult cuMemFree_v2(CUdeviceptr p);
CUresult cuMemFreeAsync(CUdeviceptr p, CUstream s);
CUresult cuMemFreeAsync_ptsz(CUdeviceptr p, CUstream s);
CUresult cuGetProcAddress(const char *sym, void **pfn, int ver, unsigned long long flags);
CUresult cuGetProcAddress_v2(const char *sym, void **pfn, int ver, unsigned long long flags,
                             int *status);
CUresult cuCtxGetCurrent(CUcontext *c);
CUresult cuCtxSetCurrent(CUcontext c);
CUresult cuCtxGetDevice(CUdevice *d);
CUresult cuCtxSynchronize(void);
CUresult cuMemGetAllocationGranularity(size_t *g, const CUmemAllocationProp *p, int option);
CUresult cuMemAddressReserve(CUdeviceptr *p, size_t n, size_t align, CUdeviceptr addr,
                             unsigned long long flags);
CUresult cuMemAddressFree(CUdeviceptr p, size_t n);
CUresult cuMemRelease(CUmemGenericAllocationHandle h);
CUresult cuMemSetAccess(CUdeviceptr p, size_t n, const CUmemAccessDesc *d, size_t count);
CUresult cuMemExportToShareableHandle(void *fd, CUmemGenericAllocationHandle h, int type,
                                      unsigned long long flags);
CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *h, void *fd, int type);
CUresult cuStreamSynchronize(CUstream s);
CUresult cuCtxGetLimit(size_t *value, int limit);
CUresult cuCtxSetLimit(int limit, size_t value);
/* cuMemCreate and cuMemMap/cuMemUnmap are wrappers too (the gate holds them during a cut);
 * the library's own uses call the driver's through these. */
#define DRV(name) ((__typeof__(&name))real_of(&real_##name, #name))

#define WRAP(name, params, args, tch, after)                                                       \
    EXPORT CUresult name params {                                                                  \
        CUresult(*fn) params = (CUresult(*) params)real_of(&real_##name, #name);                   \
        if (!fn)                                                                                   \
            return CUDA_ERROR_NOT_FOUND;                                                           \
        struct touch t = tch;                                                                      \
        t.call = #name;                                                                            \
        gate_enter(&t);                                                                            \
        CUresult r = fn args;                                                                      \
        after;                                                                                     \
        gate_exit();                                                                               \
        return r;                                                                                  \
    }
HOOKS(WRAP)

/* ---- owned memory ------------------------------------------------------------------------- */
static CUmemAllocationProp prop_for(int device) {
    CUmemAllocationProp p = {.type = MEM_PINNED,
                             .requestedHandleTypes = HANDLE_POSIX_FD,
                             .location = {LOCATION_DEVICE, device}};
    return p;
}

/* Who may reach memory on `device`: itself, then every GPU the driver says can reach it as a
 * peer. cudaMalloc's memory is open to peers, so a job on several GPUs copies between them
 * (PyTorch's tensor.to("cuda:1")); VMM memory is open only to the devices given access, and
 * such a copy failed (CUDA_ERROR_INVALID_VALUE, two H200s, 2026-11-27) before this. */
static CUmemAccessDesc reach[16][16];
static int nreach[16];
static pthread_mutex_t rmu = PTHREAD_MUTEX_INITIALIZER;

static int reach_of(int device) {
    pthread_mutex_lock(&rmu);
    if (!nreach[device]) {
        reach[device][nreach[device]++] =
            (CUmemAccessDesc){.location = {LOCATION_DEVICE, device}, .flags = ACCESS_RW};
        CUresult (*count)(int *) = real_of(&real_cuDeviceGetCount, "cuDeviceGetCount");
        CUresult (*can)(int *, CUdevice, CUdevice) =
            real_of(&real_cuDeviceCanAccessPeer, "cuDeviceCanAccessPeer");
        int n = 0;
        if (count && can && count(&n) == CUDA_SUCCESS)
            for (int d = 0; d < n && d < 16; d++) {
                int ok = 0;
                if (d != device && can(&ok, d, device) == CUDA_SUCCESS && ok)
                    reach[device][nreach[device]++] = (CUmemAccessDesc){
                        .location = {LOCATION_DEVICE, d}, .flags = ACCESS_RW};
            }
    }
    int n = nreach[device];
    pthread_mutex_unlock(&rmu);
    return n;
}

static int map_rw(CUdeviceptr va, size_t n, CUmemGenericAllocationHandle h, int device) {
    CUresult r =
        ((CUresult(*)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
                      unsigned long long))real_of(&real_cuMemMap, "cuMemMap"))(va, n, 0, h, 0);
    if (r == CUDA_SUCCESS &&
        (r = DRV(cuMemSetAccess)(va, n, reach[device], reach_of(device))) != CUDA_SUCCESS)
        ((CUresult(*)(CUdeviceptr, size_t))real_of(&real_cuMemUnmap, "cuMemUnmap"))(va, n);
    return r;
}

static CUresult unmap(CUdeviceptr va, size_t n) {
    return ((CUresult(*)(CUdeviceptr, size_t))real_of(&real_cuMemUnmap, "cuMemUnmap"))(va, n);
}

static int owning = -1; /* POS_OWN=0 turns ownership off (a measurement baseline) */

/* Where the agent asks the driver to place its allocations: from 0x7000'0000'0000 up (16 TiB
 * below the top of user space, above where the driver puts large ranges by itself), a granule
 * apart. A value the gates must read as a pointer is one inside a buffer; a buffer at
 * 0x3'0200'0000 (where the driver put a 16 GiB one on the H100) takes in every pair of 32-bit
 * integers (n, 3..6), and a launch of PyTorch's optimizer waited for it at a restore. Up here
 * only a 32-bit value of about 28,700 or more, or a denormal float, reads as one; and a
 * buffer's one-past-the-end address lies in no other buffer. The driver takes a hint as a
 * wish: where the range is in use it chooses itself (and where it refuses one, pos asks again
 * without). Past VA_END the hints start again from VA_BASE, into the ranges freed since. */
#define VA_BASE 0x700000000000ull
#define VA_END 0x7e0000000000ull
static _Atomic CUdeviceptr va_next = VA_BASE;

static CUresult reserve(CUdeviceptr *va, size_t n, size_t g) {
    CUdeviceptr hint = atomic_fetch_add(&va_next, n + g);
    if (hint + n > VA_END) {
        atomic_store(&va_next, VA_BASE);
        hint = 0;
    }
    CUresult r = DRV(cuMemAddressReserve)(va, n, 0, hint, 0);
    return r != CUDA_SUCCESS && hint ? DRV(cuMemAddressReserve)(va, n, 0, 0, 0) : r;
}

/* Allocate `size` bytes as exportable VMM memory at addresses of our own; CUDA_ERROR_* else. */
/* `whole`: the allocation is all of its granules (a slab), not the `size` the job asked for. */
static CUresult own_alloc(CUdeviceptr *out, size_t size, int whole) {
    CUdevice dev;
    CUcontext ctx;
    CUresult r = DRV(cuCtxGetDevice)(&dev);
    if (r != CUDA_SUCCESS || (r = DRV(cuCtxGetCurrent)(&ctx)) != CUDA_SUCCESS)
        return r;
    if (dev < 0 || dev >= 16)
        return CUDA_ERROR_INVALID_VALUE;
    CUmemAllocationProp prop = prop_for(dev);
    if (!granularity[dev] &&
        (r = DRV(cuMemGetAllocationGranularity)(&granularity[dev], &prop, 0)) != CUDA_SUCCESS)
        return r;
    size_t g = granularity[dev], n = (size + g - 1) / g * g;
    CUdeviceptr va = 0;
    CUmemGenericAllocationHandle h = 0;
    if ((r = reserve(&va, n, g)) != CUDA_SUCCESS)
        return r;
    r = DRV(cuMemCreate)(&h, n, &prop, 0);
    if (r == CUDA_SUCCESS && (r = map_rw(va, n, h, dev)) != CUDA_SUCCESS)
        DRV(cuMemRelease)(h);
    if (r != CUDA_SUCCESS) {
        DRV(cuMemAddressFree)(va, n);
        return r;
    }
    struct owned o = {
        .va = va, .size = whole ? n : size, .mapped = n, .h = h, .fd = -1, .device = dev};
    pthread_mutex_lock(&mu);
    remember_ctx(ctx);
    int bad = insert(&o);
    pthread_mutex_unlock(&mu);
    if (bad) {
        unmap(va, n);
        DRV(cuMemRelease)(h);
        DRV(cuMemAddressFree)(va, n);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *out = va;
    return CUDA_SUCCESS;
}

/* Small allocations share owned slabs of one granularity (2 MiB), in 512-byte units, first
 * fit: a 512-byte cudaMalloc must not cost 2 MiB of device memory and a VMM mapping. A slab
 * is one owned allocation like any other (exported, hoisted and copied whole). */
enum { UNIT = 512, SLAB_MAX = 1 << 20 };
struct slab {
    CUdeviceptr va;
    size_t units;
    int device;
    size_t used;    /* units taken */
    uint64_t *bits; /* one bit a unit: taken */
    uint16_t *len;  /* at the first unit of each allocation: its units */
};
static pthread_mutex_t smu = PTHREAD_MUTEX_INITIALIZER; /* the slabs (never held with mu) */
static struct slab *slabs;
static size_t nslabs, capslabs;

static int bit(const struct slab *b, size_t u) { return (b->bits[u / 64] >> (u % 64)) & 1; }
static void set_bits(struct slab *b, size_t u, size_t k, int on) {
    for (size_t i = u; i < u + k; i++) {
        if (on)
            b->bits[i / 64] |= 1ull << (i % 64);
        else
            b->bits[i / 64] &= ~(1ull << (i % 64));
    }
}

/* First unit of a free run of k units in b, or (size_t)-1. Caller holds smu. */
static size_t first_fit(const struct slab *b, size_t k) {
    for (size_t u = 0, run = 0; u < b->units; u++) {
        run = bit(b, u) ? 0 : run + 1;
        if (run == k)
            return u + 1 - k;
    }
    return (size_t)-1;
}

static CUresult take(struct slab *b, size_t u, size_t k, CUdeviceptr *out) {
    set_bits(b, u, k, 1);
    b->len[u] = (uint16_t)k;
    b->used += k;
    *out = b->va + u * UNIT;
    return CUDA_SUCCESS;
}

static CUresult small_alloc(CUdeviceptr *out, size_t size) {
    CUdevice dev;
    CUresult r = DRV(cuCtxGetDevice)(&dev);
    if (r != CUDA_SUCCESS)
        return r;
    size_t k = (size + UNIT - 1) / UNIT;
    pthread_mutex_lock(&smu);
    for (size_t i = 0; i < nslabs; i++) {
        size_t u = slabs[i].device == dev ? first_fit(&slabs[i], k) : (size_t)-1;
        if (u != (size_t)-1) {
            r = take(&slabs[i], u, k, out);
            pthread_mutex_unlock(&smu);
            return r;
        }
    }
    pthread_mutex_unlock(&smu);
    CUdeviceptr va;
    if ((r = own_alloc(&va, 1, 1)) != CUDA_SUCCESS) /* one granule */
        return r;
    pthread_mutex_lock(&mu);
    size_t units = tab[find(va)].mapped / UNIT;
    pthread_mutex_unlock(&mu);
    struct slab b = {.va = va,
                     .units = units,
                     .device = dev,
                     .bits = calloc((units + 63) / 64, sizeof(uint64_t)),
                     .len = calloc(units, sizeof(uint16_t))};
    pthread_mutex_lock(&smu);
    if (b.bits && b.len && nslabs == capslabs) {
        size_t cap = capslabs ? 2 * capslabs : 16;
        struct slab *t = realloc(slabs, cap * sizeof(*t));
        if (t)
            slabs = t, capslabs = cap;
    }
    if (!b.bits || !b.len || nslabs == capslabs) {
        pthread_mutex_unlock(&smu);
        free(b.bits), free(b.len);
        return 2; /* CUDA_ERROR_OUT_OF_MEMORY (the slab stays owned, unused) */
    }
    slabs[nslabs++] = b;
    r = take(&slabs[nslabs - 1], 0, k, out);
    pthread_mutex_unlock(&smu);
    return r;
}

/* Give back a small allocation: 1 if p lies in no slab, else 0 with *r set. A slab left empty
 * is kept (the next small allocation takes it). */
static int small_free(CUdeviceptr p, CUresult *r) {
    pthread_mutex_lock(&smu);
    for (size_t i = 0; i < nslabs; i++) {
        struct slab *b = &slabs[i];
        if (p < b->va || p >= b->va + b->units * UNIT)
            continue;
        size_t u = (p - b->va) / UNIT;
        if ((p - b->va) % UNIT || !b->len[u]) {
            *r = CUDA_ERROR_INVALID_VALUE;
        } else {
            set_bits(b, u, b->len[u], 0);
            b->used -= b->len[u];
            b->len[u] = 0;
            *r = CUDA_SUCCESS;
        }
        pthread_mutex_unlock(&smu);
        return 0;
    }
    pthread_mutex_unlock(&smu);
    return 1;
}

static int in_slab(CUdeviceptr p) {
    pthread_mutex_lock(&smu);
    int yes = 0;
    for (size_t i = 0; i < nslabs && !yes; i++)
        yes = p >= slabs[i].va && p < slabs[i].va + slabs[i].units * UNIT;
    pthread_mutex_unlock(&smu);
    return yes;
}

/* Free an owned allocation; 1 if `p` was not ours. */
static int own_free(CUdeviceptr p, CUresult *r) {
    pthread_mutex_lock(&mu);
    long i = find(p);
    if (i < 0 || tab[i].va != p) {
        pthread_mutex_unlock(&mu);
        return 1;
    }
    struct owned o = tab[i];
    drop(i);
    pthread_mutex_unlock(&mu);
    if (o.fd >= 0)
        close(o.fd);
    *r = unmap(o.va, o.mapped);
    if (*r == CUDA_SUCCESS)
        *r = DRV(cuMemRelease)(o.h);
    if (*r == CUDA_SUCCESS)
        *r = DRV(cuMemAddressFree)(o.va, o.mapped);
    return 0;
}

static void start_control(void);

EXPORT CUresult cuInit(unsigned flags) {
    CUresult r = DRV(cuInit)(flags);
    if (r == CUDA_SUCCESS)
        start_control();
    return r;
}

EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n) {
    if (!p || !n)
        return DRV(cuMemAlloc_v2)(p, n);
    struct touch t = T_NONE;
    t.call = "cuMemAlloc_v2";
    gate_enter(&t);
    CUresult r = !owning        ? DRV(cuMemAlloc_v2)(p, n)
                 : n < SLAB_MAX ? small_alloc(p, n)
                                : own_alloc(p, n, 0);
    gate_exit();
    return r;
}

static int is_owned(CUdeviceptr p) {
    pthread_mutex_lock(&mu);
    long i = find(p);
    int yes = i >= 0 && tab[i].va == p;
    pthread_mutex_unlock(&mu);
    return yes;
}

static CUresult free_via(CUdeviceptr p, CUstream s,
                         CUresult (*driver_free)(CUdeviceptr, CUstream)) {
    struct touch t = T_W(p);
    t.call = "cuMemFree";
    gate_enter(&t);
    CUresult r;
    int small = p && in_slab(p); /* a slab's base is owned too: small first */
    if (p && (small || is_owned(p))) {
        /* unmapping (or handing the units out again) does not wait for the work queued before
         * the free, as cuMemFree does */
        if (!s || DRV(cuStreamSynchronize)(s) != CUDA_SUCCESS)
            DRV(cuCtxSynchronize)();
        if (small ? small_free(p, &r) : own_free(p, &r))
            r = driver_free(p, s);
    } else {
        r = driver_free(p, s);
        FOREIGN_GONE(p);
    }
    gate_exit();
    return r;
}
static CUresult sync_free(CUdeviceptr p, CUstream s) {
    (void)s;
    return DRV(cuMemFree_v2)(p);
}
EXPORT CUresult cuMemFree_v2(CUdeviceptr p) { return free_via(p, 0, sync_free); }
EXPORT CUresult cuMemFreeAsync(CUdeviceptr p, CUstream s) {
    return free_via(p, s, DRV(cuMemFreeAsync));
}
EXPORT CUresult cuMemFreeAsync_ptsz(CUdeviceptr p, CUstream s) {
    return free_via(p, s, DRV(cuMemFreeAsync_ptsz));
}

/* ---- interposing the lookups -------------------------------------------------------------- */
struct entry {
    const char *name;
    void *wrapper;
    void *volatile *real;
};
#define ENTRY(name, params, args, tch, after) {#name, (void *)name, &real_##name},
#define ENTRY_OWN(name) {#name, (void *)name, &real_##name},
static const struct entry entries[] = {
    HOOKS(ENTRY) ENTRY_OWN(cuInit) ENTRY_OWN(cuMemAlloc_v2) ENTRY_OWN(cuMemFree_v2)
        ENTRY_OWN(cuMemFreeAsync) ENTRY_OWN(cuMemFreeAsync_ptsz) ENTRY_OWN(cuGetProcAddress)
            ENTRY_OWN(cuGetProcAddress_v2)};

/* `p`, a function of the driver, or our wrapper of it (whose real slot is filled). */
static void *swap(void *p) {
    Dl_info info;
    if (!p || !dladdr(p, &info) || !info.dli_sname || info.dli_saddr != p || !info.dli_fname ||
        !strstr(info.dli_fname, "libcuda"))
        return p;
    for (size_t i = 0; i < sizeof(entries) / sizeof(*entries); i++)
        if (!strcmp(entries[i].name, info.dli_sname)) {
            if (!*entries[i].real)
                *entries[i].real = p;
            return entries[i].wrapper;
        }
    return p;
}

EXPORT void *dlsym(void *handle, const char *name) {
    find_real_dlsym();
    if (!real_dlsym)
        return NULL;
    void *p = real_dlsym(handle, name);
    return name[0] == 'c' && name[1] == 'u' ? swap(p) : p;
}

EXPORT CUresult cuGetProcAddress_v2(const char *sym, void **pfn, int ver, unsigned long long flags,
                                    int *status) {
    CUresult r = DRV(cuGetProcAddress_v2)(sym, pfn, ver, flags, status);
    if (r == CUDA_SUCCESS && pfn)
        *pfn = swap(*pfn);
    return r;
}

EXPORT CUresult cuGetProcAddress(const char *sym, void **pfn, int ver, unsigned long long flags) {
    CUresult r = DRV(cuGetProcAddress)(sym, pfn, ver, flags);
    if (r == CUDA_SUCCESS && pfn)
        *pfn = swap(*pfn);
    return r;
}

/* ---- the control thread -------------------------------------------------------------------- */
enum { MAX_FDS = 250 }; /* file descriptors per message (SCM_MAX_FD is 253) */

struct conn {
    int fd;
    char buf[65536];
    size_t len;
    int fds[4096]; /* received descriptors not yet consumed, in order */
    size_t nfds;
};

static double secs(uint64_t ns) { return (double)ns / 1e9; }

/* Read more bytes (and any descriptors sent with them); 0 at EOF, -1 on error/timeout. */
static int rx(struct conn *c, int timeout_ms) {
    struct pollfd p = {.fd = c->fd, .events = POLLIN};
    int n = poll(&p, 1, timeout_ms);
    if (n <= 0)
        return n == 0 ? -2 : -1;
    char cbuf[CMSG_SPACE(MAX_FDS * sizeof(int))];
    struct iovec iov = {.iov_base = c->buf + c->len, .iov_len = sizeof(c->buf) - c->len - 1};
    struct msghdr m = {
        .msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf, .msg_controllen = sizeof(cbuf)};
    ssize_t got = recvmsg(c->fd, &m, MSG_CMSG_CLOEXEC);
    if (got <= 0)
        return got == 0 ? 0 : -1;
    for (struct cmsghdr *h = CMSG_FIRSTHDR(&m); h; h = CMSG_NXTHDR(&m, h))
        if (h->cmsg_level == SOL_SOCKET && h->cmsg_type == SCM_RIGHTS) {
            size_t k = (h->cmsg_len - CMSG_LEN(0)) / sizeof(int);
            int *f = (int *)CMSG_DATA(h);
            for (size_t i = 0; i < k; i++) {
                if (c->nfds < sizeof(c->fds) / sizeof(*c->fds))
                    c->fds[c->nfds++] = f[i];
                else
                    close(f[i]);
            }
        }
    c->len += (size_t)got;
    return 1;
}

/* The next line (without its newline) into `line`; 0 at EOF, -1 on error, -2 on timeout. */
static int next_line(struct conn *c, char *line, size_t cap, int timeout_ms) {
    for (;;) {
        char *nl = memchr(c->buf, '\n', c->len);
        if (nl) {
            size_t n = (size_t)(nl - c->buf);
            if (n >= cap)
                n = cap - 1;
            memcpy(line, c->buf, n);
            line[n] = 0;
            c->len -= (size_t)(nl - c->buf) + 1;
            memmove(c->buf, nl + 1, c->len);
            return 1;
        }
        if (c->len >= sizeof(c->buf) - 1) {
            errno = EMSGSIZE;
            return -1;
        }
        int r = rx(c, timeout_ms);
        if (r <= 0)
            return r;
    }
}

static int send_all(int fd, const char *s, size_t n) {
    while (n) {
        ssize_t k = send(fd, s, n, MSG_NOSIGNAL);
        if (k <= 0)
            return -1;
        s += k, n -= (size_t)k;
    }
    return 0;
}

static int reply(struct conn *c, const char *fmt, ...) {
    char *s = NULL;
    size_t n = 0;
    FILE *f = open_memstream(&s, &n);
    if (!f)
        return -1;
    va_list ap;
    va_start(ap, fmt);
    vfprintf(f, fmt, ap);
    va_end(ap);
    fputc('\n', f);
    fclose(f);
    int r = send_all(c->fd, s, n);
    free(s);
    return r;
}

static int fail(struct conn *c, const char *what) {
    return reply(c, "{\"ok\":false,\"error\":\"%s\"}", what);
}

/* Send `n` descriptors after a reply line, MAX_FDS per message. */
static int send_fds(struct conn *c, const int *fds, size_t n) {
    for (size_t at = 0; at < n; at += MAX_FDS) {
        size_t k = n - at < MAX_FDS ? n - at : MAX_FDS;
        char cbuf[CMSG_SPACE(MAX_FDS * sizeof(int))];
        memset(cbuf, 0, sizeof(cbuf));
        char byte = '+';
        struct iovec iov = {.iov_base = &byte, .iov_len = 1};
        struct msghdr m = {.msg_iov = &iov,
                           .msg_iovlen = 1,
                           .msg_control = cbuf,
                           .msg_controllen = CMSG_SPACE(k * sizeof(int))};
        struct cmsghdr *h = CMSG_FIRSTHDR(&m);
        h->cmsg_level = SOL_SOCKET, h->cmsg_type = SCM_RIGHTS;
        h->cmsg_len = CMSG_LEN(k * sizeof(int));
        memcpy(CMSG_DATA(h), fds + at, k * sizeof(int));
        if (sendmsg(c->fd, &m, MSG_NOSIGNAL) != 1)
            return -1;
    }
    return 0;
}

static void set_phase(int p) { /* caller holds mu */
    if (p == P_IDLE) {
        for (size_t i = 0; i < ntab; i++)
            tab[i].status = ST_NONE, tab[i].wanted = 0;
        npending = 0;
    }
    if (p == P_HOLD || p == P_RESTORE) /* an operation begins: what it sees is its own */
        for (size_t i = 0; i < ntab; i++)
            tab[i].touched = 0;
    atomic_store(&phase, p);
    pthread_cond_broadcast(&cv);
}

static int use_context(void) { return nctx ? DRV(cuCtxSetCurrent)(ctxs[0]) : CUDA_SUCCESS; }

#define STATS_CAP 8192
static int stats_json(char *out, size_t cap) {
    size_t n = snprintf(out, cap,
                        "\"held\":%llu,\"held_s\":%.6f,\"held_max_s\":%.6f,\"passed\":%llu,"
                        "\"first_pass_s\":%.6f,\"held_all\":%llu,\"waits\":[",
                        (unsigned long long)st.held, secs(st.held_ns), secs(st.held_max_ns),
                        (unsigned long long)st.passed,
                        st.first_pass_ns ? secs(st.first_pass_ns - st.started_ns) : -1.0,
                        (unsigned long long)st.held_all);
    for (int i = 0; i < st.nwaits && n < cap; i++)
        n += snprintf(out + n, cap - n, "%s{\"on\":%llu,\"s\":%.6f,\"end_s\":%.6f,\"what\":\"%s\"}",
                      i ? "," : "", (unsigned long long)st.waits[i].on, secs(st.waits[i].ns),
                      secs(st.waits[i].end_ns), st.waits[i].what);
    if (n < cap)
        n += snprintf(out + n, cap - n, "]");
    return n;
}

static void do_status(struct conn *c) {
    char s[STATS_CAP];
    pthread_mutex_lock(&mu);
    stats_json(s, sizeof(s));
    size_t imported = 0; /* mapped back from pos's descriptors (their fd kept: see do_remap) */
    for (size_t i = 0; i < ntab; i++)
        imported += tab[i].fd >= 0;
    reply(c,
          "{\"ok\":true,\"pid\":%d,\"phase\":\"%s\",\"buffers\":%zu,\"owned_bytes\":%zu,"
          "\"foreign_allocs\":%llu,\"foreign_bytes\":%llu,\"inflight\":%ld,\"owning\":%s,"
          "\"imported\":%zu,\"nccl_launches\":%ld,%s}",
          getpid(), phase_name[atomic_load(&phase)], ntab, owned_bytes,
          (unsigned long long)foreign_allocs, (unsigned long long)foreign_bytes,
          atomic_load(&inflight), owning ? "true" : "false", imported, nccl_launches, s);
    pthread_mutex_unlock(&mu);
}

/* Arm the hold for the launch past NCCL launch `at` and wait (up to timeout_ms) for a launch
 * to begin it; 0 once held. A job already past `at` is refused with its count (`past`), as is
 * one that does not come there in time: pos then asks every rank again, further on. */
static int hold_at_launch(struct conn *c, long at, long timeout_ms) {
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += timeout_ms / 1000;
    until.tv_nsec += (timeout_ms % 1000) * 1000000L;
    if (until.tv_nsec >= 1000000000L)
        until.tv_sec++, until.tv_nsec -= 1000000000L;
    pthread_mutex_lock(&mu);
    if (nccl_launches > at) {
        long n = nccl_launches;
        pthread_mutex_unlock(&mu);
        reply(c, "{\"ok\":false,\"error\":\"the job has made %ld NCCL launches, past %ld\","
                 "\"past\":%ld}", n, at, n);
        return -1;
    }
    hold_at = at;
    while (atomic_load(&phase) == P_IDLE && hold_at >= 0)
        if (pthread_cond_timedwait(&cv, &mu, &until) == ETIMEDOUT)
            break;
    long n = nccl_launches;
    int held = atomic_load(&phase) == P_HOLD && hold_at < 0;
    hold_at = -1;
    pthread_mutex_unlock(&mu);
    if (!held)
        reply(c, "{\"ok\":false,\"error\":\"the job made no NCCL launch past %ld within %ld ms "
                 "(it has made %ld)\",\"past\":%ld}", at, timeout_ms, n, n);
    return held ? 0 : -1;
}

/* The cut: hold new calls (now, or with `at` >= 0 at the launch past NCCL launch `at`), wait
 * for those inside the driver, synchronise every context. */
static void do_cut(struct conn *c, long timeout_ms, long at) {
    pthread_mutex_lock(&mu);
    if (atomic_load(&phase) != P_IDLE) {
        pthread_mutex_unlock(&mu);
        fail(c, "another checkpoint or restore is running");
        return;
    }
    if (at < 0)
        begin_hold();
    pthread_mutex_unlock(&mu);
    if (at >= 0 && hold_at_launch(c, at, timeout_ms))
        return;
    uint64_t t0 = st.started_ns;
    while (atomic_load(&inflight) > 0) {
        if (now_ns() - t0 > (uint64_t)timeout_ms * 1000000ull) {
            pthread_mutex_lock(&mu);
            set_phase(P_IDLE);
            pthread_mutex_unlock(&mu);
            fail(c, "calls inside the driver did not return within the cut's timeout");
            return;
        }
        usleep(50);
    }
    uint64_t t1 = now_ns();
    CUresult r = CUDA_SUCCESS;
    pthread_mutex_lock(&mu);
    int n = nctx;
    CUcontext list[16];
    memcpy(list, ctxs, sizeof(list));
    pthread_mutex_unlock(&mu);
    for (int i = 0; i < n && r == CUDA_SUCCESS; i++)
        if ((r = DRV(cuCtxSetCurrent)(list[i])) == CUDA_SUCCESS)
            r = DRV(cuCtxSynchronize)();
    uint64_t t2 = now_ns();
    pthread_mutex_lock(&mu);
    if (r != CUDA_SUCCESS) {
        set_phase(P_IDLE);
        pthread_mutex_unlock(&mu);
        reply(c, "{\"ok\":false,\"error\":\"cuCtxSynchronize failed with CUresult %d\"}", r);
        return;
    }
    for (size_t i = 0; i < ntab; i++)
        tab[i].status = ST_PENDING;
    npending = ntab;
    reply(c, "{\"ok\":true,\"drain_s\":%.6f,\"sync_s\":%.6f,\"buffers\":%zu,\"bytes\":%zu}",
          secs(t1 - t0), secs(t2 - t1), ntab, owned_bytes);
    pthread_mutex_unlock(&mu);
}

/* Send one answer line of any length, written by `build` under mu. */
static void reply_built(struct conn *c, void (*build)(FILE *)) {
    char *s = NULL;
    size_t n = 0;
    FILE *f = open_memstream(&s, &n);
    if (!f) {
        fail(c, "out of memory");
        return;
    }
    pthread_mutex_lock(&mu);
    build(f);
    pthread_mutex_unlock(&mu);
    fputc('\n', f);
    fclose(f);
    send_all(c->fd, s, n);
    free(s);
}

/* The pending buffers that calls wait for now: pos copies (or fills) them first. */
static void build_wanted(FILE *f) {
    fputs("{\"ok\":true,\"vas\":[", f);
    int k = 0;
    for (size_t i = 0; i < ntab; i++)
        if (tab[i].wanted && tab[i].status == ST_PENDING)
            fprintf(f, "%s%llu", k++ ? "," : "", tab[i].va);
    fputs("]}", f);
}

static void build_table(FILE *f) {
    fprintf(f, "{\"ok\":true,\"phase\":\"%s\",\"buffers\":[", phase_name[atomic_load(&phase)]);
    for (size_t i = 0; i < ntab; i++)
        fprintf(f, "%s[%llu,%zu,%zu,%d,%d,%d]", i ? "," : "", tab[i].va, tab[i].size,
                tab[i].mapped, tab[i].device, tab[i].h != 0, tab[i].touched);
    fputs("]}", f);
}

/* ---- memory the driver will not export ----------------------------------------------------
 * After the driver's own checkpoint and restore of the job (a stop-the-world cycle that left it
 * running), the memory the driver brought back was not exportable on two H200s (driver
 * 580.159.04; the H100 exported it): cuMemExportToShareableHandle answered
 * CUDA_ERROR_INVALID_VALUE, and each refusal left a /dev/nvidiactl descriptor open that CRIU
 * then would not dump ("Can't dump file ... chr 195:255"). */

/* The descriptors open now, as a bitmap by number; ok = 0 when /proc/self/fd was unreadable. */
struct fdset {
    int ok;
    size_t n;
    unsigned char *has;
};

static struct fdset fds_open(void) {
    struct fdset s = {0};
    DIR *d = opendir("/proc/self/fd");
    if (!d)
        return s;
    s.ok = 1;
    for (struct dirent *e; (e = readdir(d));) {
        char *end;
        long fd = strtol(e->d_name, &end, 10);
        if (end == e->d_name || *end || fd < 0 || fd == dirfd(d))
            continue;
        if ((size_t)fd >= s.n) {
            size_t n = (size_t)fd * 2 + 64;
            unsigned char *has = realloc(s.has, n);
            if (!has) {
                s.ok = 0;
                break;
            }
            memset(has + s.n, 0, n - s.n);
            s.has = has, s.n = n;
        }
        s.has[fd] = 1;
    }
    closedir(d);
    return s;
}

static int is_nvidiactl(int fd) {
    struct stat sb;
    return fstat(fd, &sb) == 0 && S_ISCHR(sb.st_mode) && major(sb.st_rdev) == 195 &&
           minor(sb.st_rdev) == 255;
}

/* Retire the /dev/nvidiactl descriptors open now that were not open in `before` and are none
 * of the n in `keep` (the exports so far); how many. Each gets /dev/null in its place rather
 * than closed: CRIU dumps that, and the number stays taken, so that should the driver close
 * the number it leaked some day, it closes nothing of the job's. None when a listing failed. */
static size_t retire_leaked(const struct fdset *before, const int *keep, size_t n) {
    struct fdset now = fds_open();
    int null = open("/dev/null", O_RDWR | O_CLOEXEC);
    size_t retired = 0;
    for (size_t fd = 0; before->ok && now.ok && null >= 0 && fd < now.n; fd++) {
        int kept = (fd < before->n && before->has[fd]) || !now.has[fd] || (int)fd == null;
        for (size_t i = 0; i < n && !kept; i++)
            kept = keep[i] == (int)fd;
        if (!kept && is_nvidiactl((int)fd))
            retired += dup3(null, (int)fd, O_CLOEXEC) == (int)fd;
    }
    if (null >= 0)
        close(null);
    free(now.has);
    return retired;
}

/* Make a context of `device` current: the memory pos made there is accessible from it. */
static CUresult use_device(int device) {
    for (int i = 0; i < nctx; i++) {
        CUdevice d;
        if (DRV(cuCtxSetCurrent)(ctxs[i]) == CUDA_SUCCESS &&
            DRV(cuCtxGetDevice)(&d) == CUDA_SUCCESS && d == device)
            return CUDA_SUCCESS;
    }
    return CUDA_ERROR_INVALID_VALUE;
}

/* Move buffer o into new exportable memory at the same address: the new memory mapped at a
 * range of its own, the bytes copied device to device (16 GiB took 24 ms on an H200), then
 * mapped at o's address in place of the old. Caller holds mu, a context of o's device current,
 * the job's calls held. *lost: a failed swap could not map the old memory back either (the
 * buffer has no memory now). */
static CUresult reseat(struct owned *o, int *lost) {
    CUmemAllocationProp prop = prop_for(o->device);
    CUmemGenericAllocationHandle h = 0;
    CUdeviceptr tmp = 0;
    CUresult r = DRV(cuMemCreate)(&h, o->mapped, &prop, 0);
    if (r != CUDA_SUCCESS)
        return r;
    if ((r = DRV(cuMemAddressReserve)(&tmp, o->mapped, 0, 0, 0)) == CUDA_SUCCESS) {
        if ((r = map_rw(tmp, o->mapped, h, o->device)) == CUDA_SUCCESS) {
            if ((r = DRV(cuMemcpyDtoD_v2)(tmp, o->va, o->mapped)) == CUDA_SUCCESS)
                r = DRV(cuCtxSynchronize)(); /* device-to-device copies return at once */
            CUresult u = unmap(tmp, o->mapped);
            r = r == CUDA_SUCCESS ? u : r;
        }
        DRV(cuMemAddressFree)(tmp, o->mapped);
    }
    if (r == CUDA_SUCCESS && (r = unmap(o->va, o->mapped)) == CUDA_SUCCESS &&
        (r = map_rw(o->va, o->mapped, h, o->device)) != CUDA_SUCCESS)
        *lost = map_rw(o->va, o->mapped, o->h, o->device) != CUDA_SUCCESS;
    if (r != CUDA_SUCCESS) {
        DRV(cuMemRelease)(h);
        return r;
    }
    DRV(cuMemRelease)(o->h);
    o->h = h;
    return CUDA_SUCCESS;
}

/* One export's account: the descriptors open before the export that may leak one (all of the
 * loop's until the first refusal, then each export's own), what was moved and retired. */
struct export_run {
    struct fdset before;
    int refused;     /* a refusal came: from then on a fresh listing before each export */
    size_t reseated, reseated_bytes, leaked, need;
    uint64_t reseat_ns;
    int lost;
};

static void relist(struct export_run *x) {
    free(x->before.has);
    x->before = fds_open();
}

/* The driver's export of o's handle; a refusal's leaked descriptor retired. */
static CUresult export_handle(struct owned *o, int *fd, const int *done, size_t ndone,
                              struct export_run *x) {
    if (x->refused)
        relist(x);
    CUresult r = DRV(cuMemExportToShareableHandle)(fd, o->h, HANDLE_POSIX_FD, 0);
    if (r != CUDA_SUCCESS) {
        x->leaked += retire_leaked(&x->before, done, ndone);
        x->refused = 1;
    }
    return r;
}

/* One buffer's descriptor: a copy of the one it was mapped from, else the driver's export; a
 * buffer the driver will not export is reseated (on its own device) and exported again.
 * Caller holds mu. */
static CUresult export_one(struct owned *o, int *fd, const int *done, size_t ndone,
                           struct export_run *x) {
    if (o->fd >= 0)
        return (*fd = fcntl(o->fd, F_DUPFD_CLOEXEC, 0)) < 0 ? CUDA_ERROR_OPERATING_SYSTEM
                                                            : CUDA_SUCCESS;
    CUresult r = export_handle(o, fd, done, ndone, x);
    if (r != CUDA_ERROR_INVALID_VALUE)
        return r;
    uint64_t t0 = now_ns();
    if ((r = use_device(o->device)) == CUDA_SUCCESS)
        r = reseat(o, &x->lost);
    use_context();
    x->reseat_ns += now_ns() - t0;
    if (r == CUDA_ERROR_OUT_OF_MEMORY)
        x->need = o->mapped;
    if (r != CUDA_SUCCESS)
        return r;
    x->reseated++, x->reseated_bytes += o->mapped;
    return export_handle(o, fd, done, ndone, x);
}

/* Export every owned allocation as a file descriptor, in table order (phase hold only). When
 * the device has no room to reseat a buffer the answer says how much it lacks (`need`): pos
 * frees its shadow and asks again. A buffer left with no memory at all ends the process: it
 * must not compute without it. */
static void do_export(struct conn *c) {
    pthread_mutex_lock(&mu);
    int ph = atomic_load(&phase);
    size_t n = ntab, done = 0;
    int *fds = calloc(n ? n : 1, sizeof(int));
    struct export_run x = {0};
    CUresult r = ph == P_HOLD ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    if (r == CUDA_SUCCESS && n)
        r = use_context();
    if (r == CUDA_SUCCESS && n)
        x.before = fds_open();
    for (; fds && r == CUDA_SUCCESS && done < n; done++)
        r = export_one(&tab[done], &fds[done], fds, done, &x);
    CUdeviceptr at = done ? tab[done - 1].va : 0;
    pthread_mutex_unlock(&mu);
    free(x.before.has);
    if (!fds || r != CUDA_SUCCESS) {
        for (size_t i = 0; fds && i + 1 < done; i++)
            close(fds[i]);
        if (ph != P_HOLD)
            fail(c, "export needs the cut first");
        else if (x.lost) {
            reply(c,
                  "{\"ok\":false,\"error\":\"moving the buffer at 0x%llx into exportable memory "
                  "failed with CUresult %d, and its old memory could not be mapped back: the "
                  "process ends\"}",
                  at, r);
            fprintf(stderr, "pos: the buffer at 0x%llx lost its memory; ending the process\n", at);
            kill(getpid(), SIGKILL);
        } else
            reply(c,
                  "{\"ok\":false,\"error\":\"exporting the buffer at 0x%llx failed with "
                  "CUresult %d\",\"need\":%zu}",
                  at, r, x.need);
        free(fds);
        return;
    }
    if (reply(c,
              "{\"ok\":true,\"fds\":%zu,\"reseated\":%zu,\"reseated_bytes\":%zu,"
              "\"reseat_s\":%.6f,\"leaked\":%zu}",
              n, x.reseated, x.reseated_bytes, secs(x.reseat_ns), x.leaked) == 0)
        send_fds(c, fds, n);
    for (size_t i = 0; i < n; i++)
        close(fds[i]);
    free(fds);
}

/* The context's local memory is its per-thread stack times every thread the GPU can hold
 * (264 MiB for 1 KiB on the H100), and the driver's checkpoint copies it like any memory, in
 * the job's stall. So while the memory is given up the stack is set to `bytes` (the driver
 * grows it again at a launch that needs more), and the remap sets it back to what it was
 * (stack_kept, which CRIU keeps for a restore in a new process). Caller holds mu, context
 * current. The driver's answer, or -1 when it has no such call. */
static size_t stack_kept;

static int shrink_stack(size_t bytes) {
    __typeof__(&cuCtxGetLimit) get = DRV(cuCtxGetLimit);
    __typeof__(&cuCtxSetLimit) set = DRV(cuCtxSetLimit);
    size_t was = 0;
    if (!get || !set || get(&was, LIMIT_STACK) != CUDA_SUCCESS || was <= bytes)
        return -1;
    int r = set(LIMIT_STACK, bytes);
    if (r == CUDA_SUCCESS)
        stack_kept = was;
    return r;
}

static int grow_stack_back(void) {
    __typeof__(&cuCtxSetLimit) set = DRV(cuCtxSetLimit);
    int r = stack_kept && set ? set(LIMIT_STACK, stack_kept) : CUDA_SUCCESS;
    if (r == CUDA_SUCCESS)
        stack_kept = 0;
    return r;
}

/* Give up the physical memory (the helper holds it), keeping the addresses: phase hoisted. */
static void do_hoist(struct conn *c, const char *stack_arg) {
    pthread_mutex_lock(&mu);
    if (atomic_load(&phase) != P_HOLD) {
        pthread_mutex_unlock(&mu);
        fail(c, "hoist needs the cut first");
        return;
    }
    CUresult r = use_context();
    size_t released = 0, bytes = 0;
    set_phase(P_HOISTED);
    for (size_t i = 0; i < ntab && r == CUDA_SUCCESS; i++) {
        if (!tab[i].h)
            continue;
        if ((r = unmap(tab[i].va, tab[i].mapped)) == CUDA_SUCCESS &&
            (r = DRV(cuMemRelease)(tab[i].h)) == CUDA_SUCCESS) {
            tab[i].h = 0;
            if (tab[i].fd >= 0) /* CRIU cannot dump it; pos holds its own */
                close(tab[i].fd), tab[i].fd = -1;
            released++, bytes += tab[i].mapped;
        }
    }
    int stack_rc = r == CUDA_SUCCESS && stack_arg ? shrink_stack(strtoull(stack_arg, NULL, 0)) : -1;
    pthread_mutex_unlock(&mu);
    if (r != CUDA_SUCCESS)
        reply(c,
              "{\"ok\":false,\"error\":\"giving the memory up failed with CUresult %d after "
              "%zu buffers\"}",
              r, released);
    else
        reply(c, "{\"ok\":true,\"released\":%zu,\"bytes\":%zu,\"stack\":%zu,\"stack_rc\":%d}",
              released, bytes, stack_kept, stack_rc);
}

/* Map the descriptors that came with the request at the table's addresses: phase hold, or
 * with `restore` straight into the restore gate (memory that pos is still filling: should pos
 * go away at any moment after this, the job must not run on it). */
static void do_remap(struct conn *c, size_t want, int then_restore) {
    while (c->nfds < want) {
        int r = rx(c, 30000);
        if (r <= 0) {
            fail(c, "remap: fewer descriptors came than announced");
            return;
        }
    }
    pthread_mutex_lock(&mu);
    CUresult r = want == ntab ? use_context() : CUDA_ERROR_INVALID_VALUE;
    size_t mapped = 0;
    for (size_t i = 0; i < ntab && r == CUDA_SUCCESS; i++) {
        if (tab[i].h)
            continue; /* never given up */
        CUmemGenericAllocationHandle h = 0;
        r = DRV(cuMemImportFromShareableHandle)(&h, (void *)(intptr_t)c->fds[i], HANDLE_POSIX_FD);
        if (r == CUDA_SUCCESS && (r = map_rw(tab[i].va, tab[i].mapped, h, tab[i].device)))
            DRV(cuMemRelease)(h);
        if (r == CUDA_SUCCESS) {
            tab[i].h = h, mapped++;
            tab[i].fd = c->fds[i], c->fds[i] = -1; /* kept for the next export */
        }
    }
    int all = 1;
    for (size_t i = 0; i < ntab; i++)
        all &= tab[i].h != 0;
    uint64_t t0 = now_ns(); /* not fatal: the driver grows the stack at a launch anyway */
    int stack_rc = all && r == CUDA_SUCCESS ? grow_stack_back() : CUDA_SUCCESS;
    double stack_s = secs(now_ns() - t0);
    if (all && atomic_load(&phase) == P_HOISTED && then_restore) {
        memset(&st, 0, sizeof(st));
        st.started_ns = now_ns();
        for (size_t i = 0; i < ntab; i++)
            tab[i].status = ST_PENDING;
        npending = ntab;
        set_phase(P_RESTORE);
    } else if (all && atomic_load(&phase) == P_HOISTED) {
        set_phase(P_HOLD);
    }
    pthread_mutex_unlock(&mu);
    for (size_t i = 0; i < c->nfds; i++)
        if (c->fds[i] >= 0)
            close(c->fds[i]);
    c->nfds = 0;
    if (r != CUDA_SUCCESS)
        reply(c,
              "{\"ok\":false,\"error\":\"remap failed with CUresult %d (%zu of %zu buffers "
              "announced, %zu in the table)\"}",
              r, want, want, ntab);
    else
        reply(c, "{\"ok\":true,\"mapped\":%zu,\"stack_s\":%.6f,\"stack_rc\":%d}", mapped,
              stack_s, stack_rc);
}

static void mark_done(char *args) {
    pthread_mutex_lock(&mu);
    for (char *t = strtok(args, " "); t; t = strtok(NULL, " ")) {
        long i = find(strtoull(t, NULL, 0));
        if (i >= 0 && tab[i].status == ST_PENDING)
            tab[i].status = ST_DONE, npending--;
    }
    pthread_cond_broadcast(&cv);
    pthread_mutex_unlock(&mu);
}

static void do_move(struct conn *c, int from, int to) {
    pthread_mutex_lock(&mu);
    int ok = atomic_load(&phase) == from;
    if (ok && to == P_RESTORE) { /* the restore's own account: its calls from here */
        memset(&st, 0, sizeof(st));
        st.started_ns = now_ns();
    }
    if (ok)
        set_phase(to);
    pthread_mutex_unlock(&mu);
    if (ok)
        reply(c, "{\"ok\":true,\"phase\":\"%s\"}", phase_name[to]);
    else
        reply(c, "{\"ok\":false,\"error\":\"the job is in phase %s, not %s\"}",
              phase_name[atomic_load(&phase)], phase_name[from]);
}

static void do_end(struct conn *c) {
    char s[STATS_CAP];
    pthread_mutex_lock(&mu);
    int ph = atomic_load(&phase);
    if (ph != P_HOISTED) {
        set_phase(P_IDLE);
        /* the released calls account for their waits before the report is made */
        uint64_t until = now_ns() + 100000000ull;
        while (waiting > 0 && now_ns() < until) {
            pthread_mutex_unlock(&mu);
            usleep(50);
            pthread_mutex_lock(&mu);
        }
    }
    stats_json(s, sizeof(s));
    pthread_mutex_unlock(&mu);
    if (ph == P_HOISTED)
        fail(c, "the job's memory is given up: remap it first");
    else
        reply(c, "{\"ok\":true,%s}", s);
}

/* The helper went away (EOF, error, or silence past the stall bound) in the middle of an
 * operation: never leave the job held. A restore that released calls is half done: the job
 * must not compute on a mix of restored and stale buffers, so it ends. While hoisted, the
 * memory is pos's to give back: the calls stay held until a remap (the watchdog's). */
static void abandon(const char *why) {
    pthread_mutex_lock(&mu);
    int ph = atomic_load(&phase);
    if (ph == P_HOLD || ph == P_COPY)
        set_phase(P_IDLE);
    pthread_mutex_unlock(&mu);
    if (ph == P_RESTORE) {
        fprintf(stderr,
                "pos: the restore of this process was abandonned (%s) with buffers not "
                "back; ending the process\n",
                why);
        kill(getpid(), SIGKILL);
    }
}

static int stall_ms(void) {
    const char *s = getenv("POS_AGENT_STALL_S");
    double v = s ? atof(s) : 60.0;
    return v > 0 ? (int)(v * 1000) : 60000;
}

static void serve(int fd) {
    struct conn *c = calloc(1, sizeof(*c));
    if (!c) {
        close(fd);
        return;
    }
    c->fd = fd;
    char line[65536];
    int stall = stall_ms();
    for (;;) {
        int r = next_line(c, line, sizeof(line), stall);
        if (r <= 0) {
            char why[160];
            if (r == 0)
                snprintf(why, sizeof(why), "pos closed the connection");
            else if (r == -2)
                snprintf(why, sizeof(why), "pos sent nothing for %d s", stall / 1000);
            else
                snprintf(why, sizeof(why), "the connection failed (%s)", strerror(errno));
            int ph = atomic_load(&phase); /* EOF when idle or hoisted: pos's protocol */
            if (r != 0 || (ph != P_IDLE && ph != P_HOISTED))
                fprintf(stderr, "pos: the control connection ended in phase %s: %s\n",
                        phase_name[ph], why);
            abandon(why);
            break;
        }
        char *cmd = line + strspn(line, "+"); /* the bytes that carried descriptors */
        char *args = strchr(cmd, ' ');
        if (args)
            *args++ = 0;
        if (!strcmp(cmd, "status"))
            do_status(c);
        else if (!strcmp(cmd, "cut")) {
            char *more = NULL;
            long ms = args ? strtol(args, &more, 10) : stall;
            do_cut(c, ms > 0 ? ms : stall, more && *more ? strtol(more, NULL, 10) : -1);
        }
        else if (!strcmp(cmd, "table"))
            reply_built(c, build_table);
        else if (!strcmp(cmd, "wanted"))
            reply_built(c, build_wanted);
        else if (!strcmp(cmd, "export"))
            do_export(c);
        else if (!strcmp(cmd, "hoist"))
            do_hoist(c, args);
        else if (!strcmp(cmd, "remap"))
            do_remap(c, args ? strtoul(args, NULL, 10) : 0, args && strstr(args, "restore"));
        else if (!strcmp(cmd, "copy"))
            do_move(c, P_HOLD, P_COPY);
        else if (!strcmp(cmd, "restore"))
            do_move(c, P_HOLD, P_RESTORE);
        else if (!strcmp(cmd, "done"))
            mark_done(args ? args : cmd + 4);
        else if (!strcmp(cmd, "end"))
            do_end(c);
        else if (!strcmp(cmd, "bye")) {
            reply(c, "{\"ok\":true}");
            break;
        } else
            fail(c, "unknown request");
    }
    for (size_t i = 0; i < c->nfds; i++)
        close(c->fds[i]);
    close(fd);
    free(c);
}

static void *control(void *arg) {
    int ls = (int)(intptr_t)arg;
    in_agent = 1;
    sigset_t all;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, NULL); /* the job's signals go to its own threads */
    for (;;) {
        int fd = accept4(ls, NULL, NULL, SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EINTR || errno == ECONNABORTED)
                continue;
            usleep(100000);
            continue;
        }
        struct ucred cred;
        socklen_t len = sizeof(cred);
        if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) || cred.uid != 0) {
            const char *no = "{\"ok\":false,\"error\":\"pos answers root only\"}\n";
            send_all(fd, no, strlen(no));
            close(fd);
            continue;
        }
        serve(fd);
    }
    return NULL;
}

static pthread_once_t control_once = PTHREAD_ONCE_INIT;

static void control_start_once(void) {
    int ls = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    int n = snprintf(a.sun_path + 1, sizeof(a.sun_path) - 1, "pos-agent-%d", getpid());
    if (ls < 0 ||
        bind(ls, (struct sockaddr *)&a,
             (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + n)) ||
        listen(ls, 4)) {
        fprintf(stderr,
                "pos: the agent's control socket could not be opened (%s); this job "
                "cannot be checkpointed by pos\n",
                strerror(errno));
        if (ls >= 0)
            close(ls);
        return;
    }
    pthread_t t;
    pthread_attr_t at;
    pthread_attr_init(&at);
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    if (pthread_create(&t, &at, control, (void *)(intptr_t)ls)) {
        fprintf(stderr, "pos: the agent's control thread could not start\n");
        close(ls);
    }
    pthread_attr_destroy(&at);
    note("control socket @pos-agent-%d", getpid());
}

static void after_fork_child(void) {
    /* the control thread is not forked: a child that uses CUDA starts its own */
    pthread_once_t fresh = PTHREAD_ONCE_INIT;
    control_once = fresh;
    atomic_store(&inflight, 0);
}

static void start_control(void) { pthread_once(&control_once, control_start_once); }

__attribute__((constructor)) static void init(void) {
    find_real_dlsym();
    const char *own = getenv("POS_OWN");
    owning = !(own && !strcmp(own, "0"));
    pthread_atfork(NULL, NULL, after_fork_child);
}
