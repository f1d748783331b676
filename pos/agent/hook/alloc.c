/* The job's cuMemAlloc and cuMemFree: owned memory (vmm.c), small allocations in shared slabs. */
#include <stdlib.h>

#include "agent.h"

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
        return CUDA_ERROR_OUT_OF_MEMORY; /* the slab stays owned, unused */
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
        if (r == CUDA_SUCCESS)
            foreign_remove(p);
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
