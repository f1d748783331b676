/* The gate: every wrapped call enters it, at once while no operation runs (one atomic add),
 * else after waiting for what the phase requires: the cut and the hoist hold every call, the
 * checkpoint's copy holds writes to buffers not yet saved, the restore holds reads and writes
 * of buffers not back yet. */
#include <ctype.h>
#include <string.h>

#include "agent.h"

struct stats st;
__thread int in_agent;

/* ---- NCCL's launches: counted, for the collective cut (cut.c) ---------------------------------
 * A job of several processes is cut where every rank stands before the same collective, so the
 * gate counts each rank's NCCL kernel launches and begins a hold a cut armed at that count. */
long nccl_launches;       /* NCCL kernels launched (mu) */
long hold_at = -1;        /* a cut waits for the launch past this count (mu); -1: none */

/* What the gate knows of a kernel by its name, remembered per function: a launch asks the
 * driver for a name once per kernel.
 * - NCCL's kernels (ncclDevKernel_* or, before 2.19, ncclKernel_*, mangled or not) are counted.
 * - PyTorch's elementwise kernels only read the tensors of their data array after the first.
 *   TensorIterator's gpu_kernel (ATen/native/cuda/CUDALoops.cuh) launches
 *   vectorized_elementwise_kernel(int N, func_t f, array_t data) and
 *   unrolled_elementwise_kernel(int N, func_t f, array_t data, ...) for exactly one output:
 *   data[0] is the output's address, data[1..] the inputs'. The kernels for several outputs
 *   have other names; the functor f may hold addresses it writes (AMP's found_inf), so only
 *   the data array's words after the first are reads.
 * - PyTorch's reductions and foreach kernels take every address they use by value and read
 *   none out of device memory: reduce_kernel(ReduceOp r) (ATen/native/cuda/Reduce.cuh), its
 *   src, dst, acc_buf, cta_buf and semaphores in r; multi_tensor_apply_kernel(T meta, U f,
 *   args...) (ATen/native/cuda/MultiTensorApply.cuh), the tensors' addresses in meta and the
 *   fused optimizers' lr, grad_scale and found_inf pointers in args. Such a kernel writes only
 *   at its parameters' addresses, so a write waits only for its buffer's own bytes. */
enum { K_LEARNT = 1, K_NCCL = 2, K_ELEMENTWISE = 4, K_BYVALUE = 8 };
#define DATA_PARAM 2 /* the data array's place among those kernels' parameters */
#define KINDS 4096
static struct {
    _Atomic(uintptr_t) f;
    _Atomic int kind; /* 0: being learnt, else K_LEARNT and what was learnt */
} kinds[KINDS];

static const char *const elementwise[] = {"_ZN2at6native29vectorized_elementwise_kernelI",
                                          "_ZN2at6native27unrolled_elementwise_kernelI"};
#define ATEN "_ZN2at6native"                          /* at::native, mangled */
#define REDUCE ATEN "13reduce_kernelI"                  /* at::native::reduce_kernel<...> */
#define MULTI_TENSOR "25multi_tensor_apply_kernelI"     /* in a namespace of its file's */

static int named_kind(const struct touch *t) {
    const char *n = call_name(t);
    int k = K_LEARNT;
    if (strstr(n, "ncclDevKernel") || strstr(n, "ncclKernel"))
        k |= K_NCCL;
    for (size_t i = 0; i < sizeof(elementwise) / sizeof(*elementwise); i++)
        if (!strncmp(n, elementwise[i], strlen(elementwise[i])))
            k |= K_ELEMENTWISE;
    if (!strncmp(n, REDUCE, strlen(REDUCE)) ||
        (!strncmp(n, ATEN, strlen(ATEN)) && strstr(n, MULTI_TENSOR)))
        k |= K_BYVALUE;
    return k;
}

static int kind_of(const struct touch *t) {
    uintptr_t f = (uintptr_t)t->f;
    size_t h = (size_t)((f >> 4) * 0x9E3779B97F4A7C15ull) % KINDS;
    for (int probe = 0; f && probe < 64; probe++, h = (h + 1) % KINDS) {
        uintptr_t seen = atomic_load(&kinds[h].f);
        if (!seen && atomic_compare_exchange_strong(&kinds[h].f, &seen, f)) {
            int k = named_kind(t);
            atomic_store(&kinds[h].kind, k);
            return k;
        }
        if (seen == f) {
            int k = atomic_load(&kinds[h].kind);
            if (k)
                return k;
            break; /* being learnt by another thread: ask the driver here too */
        }
    }
    return named_kind(t);
}

/* ---- entry points the gate does not know (gated.h) ------------------------------------------ */
char ungated[64];

void ungated_lookup(const char *name) {
    pthread_mutex_lock(&mu);
    for (size_t k = 0, first = !ungated[0]; first && k < sizeof(ungated) - 1 && name[k]; k++)
        ungated[k] = isalnum((unsigned char)name[k]) || name[k] == '_' ? name[k] : '?';
    pthread_mutex_unlock(&mu);
    /* the job may call it as soon as it has it: during an operation, not before the operation
     * needs no buffer any more (all saved, or all back) */
    struct touch t = T_ALL;
    t.call = name;
    gate_enter(&t);
    gate_exit();
}

void begin_hold(void) { /* caller holds mu; the phase is idle */
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


static int pending(CUdeviceptr p) {
    long i = find(p);
    return i >= 0 && tab[i].status == ST_PENDING;
}

/* Pending, and its own bytes not yet safe: what a write at a parameter's address alone waits
 * for in a checkpoint's copy. */
static int unsaved(CUdeviceptr p) {
    long i = find(p);
    return i >= 0 && tab[i].status == ST_PENDING && !tab[i].saved;
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

/* A launch's parameter words, `n` of them (-1: unknown), from reads[0] to reads[1] those its
 * kernel only reads, and from outs[0] to outs[1] those it writes at without reading addresses
 * out of their buffers (none of either for most kernels: see kind_of, whose answer is
 * `kind`). */
struct words {
    int n, reads[2], outs[2];
    CUdeviceptr w[MAX_WORDS];
};

static void param_words(const struct touch *t, int kind, struct words *out) {
    out->reads[0] = out->reads[1] = out->outs[0] = out->outs[1] = 0;
    if (!t->kp) { /* the parameters' buffer and its size in `extra`, or none */
        const void *buf = NULL;
        size_t size = 0;
        for (int i = 0; t->ex && i < 64 && t->ex[i]; i += 2) {
            if (t->ex[i] == LAUNCH_PARAM_BUFFER_POINTER)
                buf = t->ex[i + 1];
            else if (t->ex[i] == LAUNCH_PARAM_BUFFER_SIZE && t->ex[i + 1])
                size = *(const size_t *)t->ex[i + 1];
        }
        out->n = buf ? add_words(out->w, 0, buf, size) : t->ex ? -1 : 0;
        return;
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
        else { /* both say "no parameter 0": a kernel without parameters */
            out->n = r == CUDA_ERROR_INVALID_VALUE && rk == CUDA_ERROR_INVALID_VALUE ? 0 : -1;
            return;
        }
    }
    int n = 0, reads = kind & K_ELEMENTWISE;
    for (size_t i = 0; r == CUDA_SUCCESS && n >= 0; r = info(t->f, ++i, &off, &size)) {
        int from = n;
        n = add_words(out->w, n, t->kp[i], size);
        if (reads && i == DATA_PARAM && n > from && size % sizeof(CUdeviceptr) == 0)
            out->outs[0] = from, out->outs[1] = out->reads[0] = from + 1, out->reads[1] = n;
    }
    out->n = n >= 0 && r == CUDA_ERROR_INVALID_VALUE ? n : -1;
}

static void launch_words(const struct touch *t, int kind, struct words *out) {
    param_words(t, kind, out);
    if (kind & K_BYVALUE && out->n > 0)
        out->outs[0] = 0, out->outs[1] = out->n;
}

/* A pending buffer among `p`, or 0; those from skip[0] to skip[1] left out, and those from
 * outs[0] to outs[1] only while their own bytes are not saved. Caller holds mu. */
static CUdeviceptr pending_but(const CUdeviceptr *p, int n, const int skip[2],
                               const int outs[2]) {
    for (int i = 0; i < n; i++)
        if ((i < skip[0] || i >= skip[1]) &&
            (i >= outs[0] && i < outs[1] ? unsaved(p[i]) : pending(p[i])))
            return p[i];
    return 0;
}

static const int NONE[2] = {0, 0};

static CUdeviceptr first_pending(const CUdeviceptr *p, int n) {
    return pending_but(p, n, NONE, NONE);
}

/* Whether a call touching `t` must wait in the current phase; `k`: a launch's words (k->n < 0:
 * unknown). `*on`: the pending buffer it waits for (0: every buffer, or the phase holds all).
 * Caller holds mu. */
static int must_wait(const struct touch *t, const struct words *k, CUdeviceptr *on) {
    *on = 0;
    switch (atomic_load(&phase)) {
    case P_IDLE:
        return 0;
    case P_COPY: /* writes wait for their buffer to be saved; reads pass; a launch may write
                    any buffer its parameter words point into (pos reports a buffer done only
                    once the buffers its own bytes point into are saved too) but those its
                    kernel is known only to read (kind_of), and those it writes at without
                    reading addresses out of them wait only for their own bytes (`saved`); a
                    launch whose parameters cannot be known waits for every buffer */
        if (t->all || (t->launch && k->n < 0))
            return npending > 0;
        return (*on = first_pending(t->w, t->nw)) ||
               (t->launch && (*on = pending_but(k->w, k->n, k->reads, k->outs)));
    case P_RESTORE: /* reads and writes wait for their buffer to be back */
        if (t->all || (t->launch && k->n < 0))
            return npending > 0;
        return (*on = first_pending(t->w, t->nw)) || (*on = first_pending(t->r, t->nr)) ||
               (*on = first_pending(k->w, k->n));
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

/* The phases whose gate reads a launch's parameter words (the checkpoint's and the
 * restore's); the cut and the hoist hold every call. */
static int gated(int ph) { return ph == P_COPY || ph == P_RESTORE; }

/* What a waiting call was, for the gate's account: a launch's kernel by name (cuFuncGetName,
 * or cuKernelGetName for a CUkernel handle), else the driver function. */
typedef CUresult (*name_fn)(const char **, void *);
static void *volatile real_cuFuncGetName, *volatile real_cuKernelGetName;
const char *call_name(const struct touch *t) {
    const char *n = NULL;
    if (t->launch) {
        name_fn f = (name_fn)real_of(&real_cuFuncGetName, "cuFuncGetName");
        name_fn k = (name_fn)real_of(&real_cuKernelGetName, "cuKernelGetName");
        if (!(f && f(&n, t->f) == CUDA_SUCCESS && n) && !(k && k(&n, t->f) == CUDA_SUCCESS && n))
            n = NULL;
    }
    return n ? n : t->call ? t->call : "?";
}

/* A launch's words into `k`, once (`*asked`), as soon as the phase is one that reads them. */
static void ask_words(const struct touch *t, int kind, int *asked, struct words *k) {
    if (t->launch && !*asked && gated(atomic_load(&phase)))
        *asked = 1, launch_words(t, kind, k);
}

/* Enter the driver for a call touching `t`: at once when idle (one atomic add), else after
 * waiting for what the phase requires. The add and the phase read are sequentially
 * consistent, as the cut's store and drain: either the cut sees this call in flight and
 * waits for it, or this call sees the cut and waits. */
void gate_enter(const struct touch *t) {
    if (in_agent)
        return;
    int kind = t->launch ? kind_of(t) : 0; /* once a call: a launch's words need it too */
    if (kind & K_NCCL)
        nccl_arrive();
    atomic_fetch_add(&inflight, 1);
    if (atomic_load(&phase) == P_IDLE)
        return;
    atomic_fetch_sub(&inflight, 1);
    /* a launch's parameter words, asked of the driver once a gate is open (a call held since
     * before, as in a job that CRIU restored, asks when it opens) */
    struct words k = {.n = -1};
    int asked = 0;
    ask_words(t, kind, &asked, &k);
    CUdeviceptr on, last = 0;
    pthread_mutex_lock(&mu);
    /* the gate may have opened since: a launch that had not asked would wait for every buffer,
     * and, the phase's broadcast gone by, until the next one */
    ask_words(t, kind, &asked, &k);
    if (must_wait(t, &k, &on)) {
        uint64_t t0 = now_ns();
        waiting++;
        do {
            last = on;
            long w = on ? find(on) : -1;
            if (w >= 0)
                tab[w].wanted = 1;
            pthread_cond_wait(&cv, &mu);
            ask_words(t, kind, &asked, &k);
        } while (must_wait(t, &k, &on));
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
            struct gate_wait *w = &st.waits[st.nwaits++];
            *w = (struct gate_wait){.on = last, .ns = waited, .end_ns = now_ns() - st.started_ns};
            /* names are C identifiers, mangled: anything else becomes '?' */
            size_t k = 0;
            for (const char *c = call_name(t); *c && k < sizeof(w->what) - 1; c++)
                w->what[k++] = isalnum((unsigned char)*c) || *c == '_' ? *c : '?';
        }
    }
    if (asked || gated(atomic_load(&phase))) /* what it may use (unknown words: nothing) */
        mark_touched(t, k.w, k.n);
    st.passed++;
    if (!st.first_pass_ns && atomic_load(&phase) != P_IDLE)
        st.first_pass_ns = now_ns();
    atomic_fetch_add(&inflight, 1);
    pthread_mutex_unlock(&mu);
}

void gate_exit(void) {
    if (!in_agent)
        atomic_fetch_sub(&inflight, 1);
}

void set_phase(int p) { /* caller holds mu */
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

int stats_json(char *out, size_t cap) {
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
