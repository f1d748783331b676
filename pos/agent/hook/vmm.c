/* Owned memory: cuMemAlloc becomes exportable VMM memory (POSIX fd handles) in address ranges
 * the agent reserves, so that pos can import it from outside, and so that the job can give the
 * physical memory up (keeping the addresses) while the driver checkpoints it. */
#include <unistd.h>

#include "agent.h"

CUmemAllocationProp prop_for(int device) {
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
        __typeof__(&cuDeviceGetCount) count = DRV(cuDeviceGetCount);
        __typeof__(&cuDeviceCanAccessPeer) can = DRV(cuDeviceCanAccessPeer);
        int n = 0;
        if (count && can && count(&n) == CUDA_SUCCESS)
            for (int d = 0; d < n && d < 16; d++) {
                int ok = 0;
                if (d != device && can(&ok, d, device) == CUDA_SUCCESS && ok)
                    reach[device][nreach[device]++] =
                        (CUmemAccessDesc){.location = {LOCATION_DEVICE, d}, .flags = ACCESS_RW};
            }
    }
    int n = nreach[device];
    pthread_mutex_unlock(&rmu);
    return n;
}

CUresult map_rw(CUdeviceptr va, size_t n, CUmemGenericAllocationHandle h, int device) {
    CUresult r = DRV(cuMemMap)(va, n, 0, h, 0);
    if (r == CUDA_SUCCESS &&
        (r = DRV(cuMemSetAccess)(va, n, reach[device], reach_of(device))) != CUDA_SUCCESS)
        DRV(cuMemUnmap)(va, n);
    return r;
}

CUresult unmap(CUdeviceptr va, size_t n) { return DRV(cuMemUnmap)(va, n); }

int owning = -1; /* POS_OWN=0 turns ownership off (a measurement baseline) */

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

static size_t granularity[16];

/* Allocate `size` bytes as exportable VMM memory at addresses of our own; CUDA_ERROR_* else. */
/* `whole`: the allocation is all of its granules (a slab), not the `size` the job asked for. */
CUresult own_alloc(CUdeviceptr *out, size_t size, int whole) {
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
    if (r == CUDA_SUCCESS)
        own_fresh(h); /* a number the job's first handle of its own memory had */
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

/* Free an owned allocation; 1 if `p` was not ours. */
int own_free(CUdeviceptr p, CUresult *r) {
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

int is_owned(CUdeviceptr p) {
    pthread_mutex_lock(&mu);
    long i = find(p);
    int yes = i >= 0 && tab[i].va == p;
    pthread_mutex_unlock(&mu);
    return yes;
}
