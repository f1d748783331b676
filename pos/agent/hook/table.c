/* The table of owned allocations, by address, and the live allocations pos does not own. */
#include <stdlib.h>
#include <string.h>

#include "agent.h"

const char *const phase_name[] = {"idle", "hold", "copy", "restore", "hoisted"};

pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
struct owned *tab;
size_t ntab;
static size_t captab;
size_t owned_bytes;
uint64_t foreign_allocs, foreign_bytes;
_Atomic int phase = P_IDLE;
_Atomic long inflight;
long waiting;
size_t npending;
CUcontext ctxs[16];
int nctx;

/* Index of the entry containing p, or -1. Caller holds mu. */
long find(CUdeviceptr p) {
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

int insert(const struct owned *o) {
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

void drop(long i) {
    owned_bytes -= tab[i].size;
    if (tab[i].status == ST_PENDING)
        npending--;
    memmove(&tab[i], &tab[i + 1], (ntab - (size_t)i - 1) * sizeof(*tab));
    ntab--;
}

void remember_ctx(CUcontext c) {
    for (int i = 0; i < nctx; i++)
        if (ctxs[i] == c)
            return;
    if (nctx < 16)
        ctxs[nctx++] = c;
}

CUresult use_context(void) { return nctx ? DRV(cuCtxSetCurrent)(ctxs[0]) : CUDA_SUCCESS; }

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

static void add_locked(CUdeviceptr p, size_t n) {
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

void foreign_add(CUdeviceptr p, size_t n) {
    if (!p)
        return;
    pthread_mutex_lock(&mu);
    add_locked(p, n);
    pthread_mutex_unlock(&mu);
}

void foreign_remove(CUdeviceptr p) {
    pthread_mutex_lock(&mu);
    struct foreign *f = fcap && p > 1 ? foreign_slot(p, 0) : NULL;
    if (f) {
        foreign_allocs--;
        foreign_bytes -= f->n;
        f->p = 1;
    }
    pthread_mutex_unlock(&mu);
}
