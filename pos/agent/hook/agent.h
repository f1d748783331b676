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
 * Calls reach the driver three ways, all interposed (interpose.c). No CUPTI: a process that
 * subscribed CUPTI cannot be checkpointed by the driver.
 *
 * Control: a thread listens on the abstract unix socket "\0pos-agent-<pid>" (root peers only);
 * protocol.md beside this file is the contract with pos/agent/control.py.
 *
 * One file per concern, this header what they share (nothing of it is exported: the library
 * is built with -fvisibility=hidden, and only the driver's entry points, EXPORT, are seen):
 *   abi.h       the driver's types           resolve.c   the driver's own functions
 *   wrapped.h   the gated wrappers' list     interpose.c dlsym and cuGetProcAddress
 *   hooks.c     the gated wrappers
 *   gated.h     which entry points the gate must know (held to cuda.h by a test)
 *   table.c     owned and foreign memory     gate.c      the gate, phases, its statistics
 *   cut.c       the cut, the collective cut  vmm.c       owned memory
 *   alloc.c     cuMemAlloc/Free, slabs       wire.c      the socket's lines and descriptors
 *   control.c   the thread, the requests     export.c    export, reseat
 *   hoist.c     hoist, remap                 ops.c       done, phase moves, end
 *   peer.c      other processes' memory the job maps (what the driver cannot restore)
 */
#ifndef POS_AGENT_H
#define POS_AGENT_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/types.h>
#include <time.h>

#include "abi.h"

/* ---- the real driver (resolve.c) ----------------------------------------------------------- */
void find_real_dlsym(void);
extern void *(*real_dlsym)(void *, const char *);
/* The driver's own `name`, looked up once into *slot. */
void *real_of(void *volatile *slot, const char *name);

static inline uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}
static inline double secs(uint64_t ns) { return (double)ns / 1e9; }

/* ---- what one call may touch (gate.c) ------------------------------------------------------ */
/* Buffers it may write, buffers it may read, or everything; a kernel launch, whatever its
 * parameters point into (see launch_words). */
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

/* ---- the driver's functions ------------------------------------------------------------------
 * Those the gate wraps (wrapped.h), and those with wrappers of their own or that the agent calls
 * (OWN). Each has a slot for the driver's own function; the agent's own calls go there through
 * DRV, never through a wrapper. */
#include "wrapped.h"

/* Those with wrappers of their own, which the lookups hand out as wrapped.h's: each name once,
 * with its parameters. */
#define OWN_WRAPPERS(X)                                                                            \
    X(cuInit, (unsigned flags))                                                                    \
    X(cuMemExportToShareableHandle, (void *fd, CUmemGenericAllocationHandle h, int type,           \
                                     unsigned long long flags))                                    \
    X(cuMemAlloc_v2, (CUdeviceptr *p, size_t n))                                                   \
    X(cuMemFree_v2, (CUdeviceptr p))                                                               \
    X(cuMemFreeAsync, (CUdeviceptr p, CUstream s))                                                 \
    X(cuMemFreeAsync_ptsz, (CUdeviceptr p, CUstream s))                                            \
    X(cuGetProcAddress, (const char *sym, void **pfn, int ver, unsigned long long flags))          \
    X(cuGetProcAddress_v2, (const char *sym, void **pfn, int ver, unsigned long long flags,        \
                            int *status))
/* Those the agent calls itself, and wraps not. */
#define OWN_CALLED(X)                                                                              \
    X(cuCtxGetCurrent, (CUcontext *c))                                                             \
    X(cuCtxSetCurrent, (CUcontext c))                                                              \
    X(cuCtxGetDevice, (CUdevice *d))                                                               \
    X(cuCtxSynchronize, (void))                                                                    \
    X(cuMemGetAllocationGranularity, (size_t *g, const CUmemAllocationProp *p, int option))        \
    X(cuMemAddressReserve, (CUdeviceptr *p, size_t n, size_t align, CUdeviceptr addr,              \
                            unsigned long long flags))                                             \
    X(cuMemAddressFree, (CUdeviceptr p, size_t n))                                                 \
    X(cuStreamSynchronize, (CUstream s))                                                           \
    X(cuCtxGetLimit, (size_t *value, int limit))                                                   \
    X(cuCtxSetLimit, (int limit, size_t value))                                                    \
    X(cuDeviceGetCount, (int *n))                                                                  \
    X(cuDeviceCanAccessPeer, (int *can, CUdevice d, CUdevice peer))                                \
    X(cuMemGetAddressRange_v2, (CUdeviceptr *base, size_t *size, CUdeviceptr p))                   \
    X(cuMemGetAllocationPropertiesFromHandle,                                                      \
      (CUmemAllocationProp * prop, CUmemGenericAllocationHandle h))
#define OWN(X) OWN_WRAPPERS(X) OWN_CALLED(X)
#define DECLARE_OWN(name, params) extern void *volatile real_##name;
#define PROTO_WRAPPER(name, params) EXPORT CUresult name params;
#define PROTO_CALLED(name, params) CUresult name params;
OWN(DECLARE_OWN)
OWN_WRAPPERS(PROTO_WRAPPER)
OWN_CALLED(PROTO_CALLED)
/* The driver's own function (a wrapper's too: cuMemCreate, cuMemMap, cuMemRelease,
 * cuMemImportFromShareableHandle ...), for the agent's own calls: they pass no gate, and pos's
 * re-imports of the job's own memory are not peer memory. */
#define DRV(name) ((__typeof__(&name))real_of(&real_##name, #name))

/* ---- the table of owned allocations (table.c) ---------------------------------------------- */
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
    int wanted;  /* a call waits for it now (pos copies or fills it first) */
    int touched; /* a call let through a gate since the operation began may use it: the
                    buffers the job needs first, which a restore of its image fills first */
    int saved;   /* in a checkpoint's copy, its own bytes as of the cut are safe (shadowed, or
                    in host memory), what it points into perhaps not yet: a call that only
                    writes it, at the addresses of its parameters, may go (gate.c) */
};

enum { P_IDLE, P_HOLD, P_COPY, P_RESTORE, P_HOISTED };
extern const char *const phase_name[];

extern pthread_mutex_t mu; /* table, phase changes, stats */
extern pthread_cond_t cv;  /* phase or a status changed */
extern struct owned *tab;
extern size_t ntab;
extern size_t owned_bytes;
extern uint64_t foreign_allocs, foreign_bytes; /* live allocations pos could not own */
extern _Atomic int phase;
extern _Atomic long inflight; /* calls past the gate, not yet out */
extern long waiting;          /* calls waiting in the gate (mu) */
extern size_t npending;       /* buffers ST_PENDING (mu) */
extern CUcontext ctxs[16];
extern int nctx;

/* Caller holds mu for each. */
long find(CUdeviceptr p);
int insert(const struct owned *o);
void drop(long i);
void remember_ctx(CUcontext c);
CUresult use_context(void);
/* A live allocation pos does not own, made or gone (each takes mu). */
void foreign_add(CUdeviceptr p, size_t n);
void foreign_remove(CUdeviceptr p);

/* ---- the gate (gate.c) and the cut (cut.c) ------------------------------------------------ */
/* One call that waited: the address it waited for last (a parameter word of a launch, or a
 * copy's address; 0: every buffer), how long, when it went on (from the operation's start),
 * and what it was (the kernel's name, or the driver function's). */
#define MAX_WAITS 16
struct gate_wait {
    CUdeviceptr on;
    uint64_t ns, end_ns;
    char what[121]; /* a copy (the driver's goes with its module), JSON-safe */
};
struct stats {
    uint64_t held, held_ns, held_max_ns, passed, first_pass_ns, started_ns;
    uint64_t held_all; /* calls that waited for every buffer (what they touch not known) */
    int nwaits;        /* the operation's first MAX_WAITS waits */
    struct gate_wait waits[MAX_WAITS];
};
extern struct stats st;
extern __thread int in_agent; /* the control thread's own driver calls pass untouched */

void gate_enter(const struct touch *t);
void gate_exit(void);
const char *call_name(const struct touch *t);
void set_phase(int p); /* caller holds mu */
#define STATS_CAP 8192
int stats_json(char *out, size_t cap); /* caller holds mu */

/* An entry point of gated.h's families that the job looked up (or links to) and the agent
 * does not wrap: the first one is kept, so that every later cut is refused; a lookup made while
 * an operation runs waits as a call that may touch every buffer. */
extern char ungated[64]; /* its name, "" while none (mu) */
void ungated_lookup(const char *name);
void scan_linked(void); /* the same for what the job's objects link to (interpose.c) */

extern long nccl_launches; /* NCCL kernels launched (mu) */
extern long hold_at;       /* a cut waits for the launch past this count (mu); -1: none */
void begin_hold(void);     /* caller holds mu; the phase is idle */

/* ---- owned memory (vmm.c) ------------------------------------------------------------------ */
extern int owning;
CUmemAllocationProp prop_for(int device);
CUresult map_rw(CUdeviceptr va, size_t n, CUmemGenericAllocationHandle h, int device);
CUresult unmap(CUdeviceptr va, size_t n);
CUresult own_alloc(CUdeviceptr *out, size_t size, int whole);
int own_free(CUdeviceptr p, CUresult *r);
int is_owned(CUdeviceptr p);

/* ---- peer memory (peer.c): what the job maps of other processes' memory ---------------- */
struct conn;
/* The job's own calls, once the driver said yes (each takes mu). */
void peer_imported(CUmemGenericAllocationHandle h);
void peer_released(CUmemGenericAllocationHandle h);
void peer_mapped(CUdeviceptr va, size_t size, size_t offset, CUmemGenericAllocationHandle h);
void peer_access(CUdeviceptr va, size_t size, const CUmemAccessDesc *d, size_t n);
void peer_unmapped(CUdeviceptr va, size_t size);
CUmemGenericAllocationHandle own_current(CUmemGenericAllocationHandle h); /* take mu */
int own_export(CUmemGenericAllocationHandle h, int *fd); /* takes mu */
void own_fresh(CUmemGenericAllocationHandle h);  /* takes mu */
void forget_was(CUmemGenericAllocationHandle h); /* caller holds mu */
void ipc_opened(CUdeviceptr va, const CUipcMemHandle *h, unsigned flags);
void ipc_closed(CUdeviceptr va);
/* Caller holds mu. */
struct peer_count {
    size_t maps, bytes, ipc;
    size_t owns, own_bytes; /* the job's own cuMem mappings (NCCL's buffers): the driver's
                             * checkpoint copies them into the job's host memory */
    size_t down;     /* maps taken down by pos, not yet put back */
    size_t own_down; /* the job's own allocations taken down by pos, not yet put back */
    size_t own_kept; /* of them, those mapped back from pos's descriptors: a driver's
                      * checkpoint cannot restore such imports, so pos takes them every time */
    size_t lost; /* records the agent could not keep: pos refuses the job */
};
struct peer_count peer_count(void);
void build_peers(FILE *f);
void build_exports(FILE *f);
int unstamp_all(void);
int peers_fail_closed(double limit_s);
/* pos's requests (peer.c) */
void do_stamp(struct conn *c, const char *args);
void do_unstamp(struct conn *c);
void do_peek(struct conn *c, const char *args);
void do_peer_down(struct conn *c);
void do_peer_export(struct conn *c, const char *args);
void do_peer_up(struct conn *c, size_t want);
void do_own_export(struct conn *c);
void do_own_take(struct conn *c, const char *serials);
void do_own_down(struct conn *c);
void do_own_up(struct conn *c, size_t want);

/* ---- the control socket (wire.c) ------------------------------------------------------------ */
enum { MAX_FDS = 250 }; /* file descriptors per message (SCM_MAX_FD is 253) */

struct conn {
    int fd;
    dev_t dev; /* the accepted socket, by identity: other code of the job that closes or */
    ino_t ino; /* reuses the number must not leave the agent reading whatever it is now */
    char buf[65536];
    size_t len;
    int *fds; /* received descriptors not yet consumed, in order: grown as they come (a job's
               * own memory with PyTorch's expandable segments comes in thousands of pieces) */
    size_t nfds, capfds;
};

int rx(struct conn *c, int timeout_ms);
int next_line(struct conn *c, char *line, size_t cap, int timeout_ms);
int send_all(int fd, const char *s, size_t n);
int reply(struct conn *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
int fail(struct conn *c, const char *what);
int send_fds(struct conn *c, const int *fds, size_t n);
void reply_built(struct conn *c, void (*build)(FILE *));

/* ---- the requests (cut.c, export.c, hoist.c, ops.c) ---------------------------------------- */
void do_cut(struct conn *c, long timeout_ms, long at);
void do_export(struct conn *c);
void do_room(struct conn *c, size_t n);
void do_hoist(struct conn *c, const char *stack_arg);
void do_remap(struct conn *c, size_t want, int then_restore);
void mark_done(char *args, int saved_only);
void do_move(struct conn *c, int from, int to);
void do_end(struct conn *c);

#endif
