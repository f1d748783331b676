/* The fake-driver twin of workloads/fill_job.py: a job of many buffers that knows nothing of
 * pos. Operation k (k = 1, 2, ...) fills buffer (k-1) % N with the 32-bit k (cuMemsetD32),
 * and launches a kernel, so that the state after exactly K operations is known (fill_job.torn).
 * It reaches the driver the three ways a real job does: cuMemAlloc through cuGetProcAddress
 * (as a runtime), cuMemsetD32 through dlsym on libcuda, and cuLaunchKernel linked directly.
 * While PAUSE_FILE exists it makes no CUDA call (it prints "PAUSED K", K operations made, as
 * it finds the file). FILL_JOB_POOL_BYTES=N also takes N bytes from the stream-ordered pool
 * (cuMemAllocAsync), which pos cannot own. FILL_JOB_AXPY=NAME makes every
 * operation a launch of the kernel NAME with axpy's parameters on the first buffer instead
 * (nothing changes: the fake runs no kernel), whose address it prints as "BUFFER0 0x..."
 * before READY. FILL_JOB_ELEMENTWISE=NAME (N >= 3) launches NAME instead as PyTorch launches
 * its elementwise kernels for one output: (count, a functor holding the third buffer's address,
 * the data array {second buffer, first buffer}: the output, then the input), and prints the
 * three addresses as BUFFER0-2. FILL_JOB_NCCL=1 makes each operation's launch one of a kernel
 * named as NCCL's are, one operation every 2 ms, as a rank of a DDP job makes a collective now
 * and then: two such jobs cut before the same NCCL launch hold the same state.
 * FILL_JOB_COPY=NAME looks the driver's copy NAME up (cuGetProcAddress) and, every operation,
 * copies the first buffer onto itself through it (nothing changes), as a runtime newer than pos
 * would; with FILL_JOB_COPY_WHEN=FILE, it looks it up (and prints "LOOKED UP") at the first
 * operation that finds FILE. FILL_JOB_LINKED=LIB copies so through LIB's future_copy instead (a
 * library linked to such an entry point).
 *
 *   fill_job KERNELS.cubin N BYTES [PAUSE_FILE]       prints "READY <pid>" once allocated
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include "job_common.h"

typedef void *CUcontext, *CUmodule, *CUfunction, *CUstream;
CUresult cuInit(unsigned);
CUresult cuDevicePrimaryCtxRetain(CUcontext *, int);
CUresult cuCtxSetCurrent(CUcontext);
CUresult cuModuleLoadData(CUmodule *, const void *);
CUresult cuModuleGetFunction(CUfunction *, CUmodule, const char *);
CUresult cuLaunchKernel(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                        unsigned, CUstream, void **, void **);
CUresult cuGetProcAddress_v2(const char *, void **, int, unsigned long long, int *);
CUresult cuMemAllocAsync(CUdeviceptr *, size_t, CUstream);


static void *slurp(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    void *p = malloc((size_t)n);
    if (p && fread(p, 1, (size_t)n, f) != (size_t)n)
        p = NULL;
    fclose(f);
    return p;
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s KERNELS.cubin N BYTES [PAUSE_FILE]\n", argv[0]);
        return 2;
    }
    int n = atoi(argv[2]);
    size_t bytes = strtoull(argv[3], NULL, 0);
    const char *pause = argc > 4 ? argv[4] : NULL;
    CUcontext ctx;
    CHECK(cuInit(0));
    CHECK(cuDevicePrimaryCtxRetain(&ctx, 0));
    CHECK(cuCtxSetCurrent(ctx));
    CUresult (*alloc)(CUdeviceptr *, size_t);
    CHECK(cuGetProcAddress_v2("cuMemAlloc", (void **)&alloc, 12000, 0, NULL));
    void *lib = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
    CUresult (*memset32)(CUdeviceptr, unsigned, size_t) = lib ? dlsym(lib, "cuMemsetD32_v2") : 0;
    if (!memset32)
        return 1;
    CUmodule mod;
    CUfunction fn;
    void *cubin = slurp(argv[1]);
    CHECK(cubin ? 0 : 1);
    CHECK(cuModuleLoadData(&mod, cubin));
    int nccl = getenv("FILL_JOB_NCCL") != NULL;
    CHECK(cuModuleGetFunction(&fn, mod, nccl ? "ncclDevKernel_AllReduce_Sum_f32_RING_LL"
                                              : "no_params"));
    const char *elementwise = getenv("FILL_JOB_ELEMENTWISE");
    const char *launched_name = elementwise ? elementwise : getenv("FILL_JOB_AXPY");
    int launches_only = launched_name != NULL;
    CUfunction launched; /* the kernel every operation launches instead */
    if (launches_only)
        CHECK(cuModuleGetFunction(&launched, mod, launched_name));
    CUdeviceptr *buf = calloc((size_t)n, sizeof(*buf));
    for (int i = 0; i < n; i++) {
        CHECK(alloc(&buf[i], bytes));
        CHECK(memset32(buf[i], 0, bytes / 4));
    }
    CUresult (*copy)(CUdeviceptr, CUdeviceptr, size_t, CUstream) = NULL;
    const char *copy_name = getenv("FILL_JOB_COPY");
    const char *copy_when = getenv("FILL_JOB_COPY_WHEN");
    const char *linked = getenv("FILL_JOB_LINKED");
    if (linked) {
        void *future = dlopen(linked, RTLD_NOW);
        copy = future ? dlsym(future, "future_copy") : NULL;
        CHECK(copy ? 0 : 1);
    }
    const char *pool = getenv("FILL_JOB_POOL_BYTES");
    if (pool) {
        CUdeviceptr p;
        CHECK(cuMemAllocAsync(&p, strtoull(pool, NULL, 0), NULL));
    }
    for (int i = 0; launches_only && i < (elementwise ? 3 : 1); i++)
        printf("BUFFER%d 0x%llx\n", i, buf[i]);
    printf("READY %d\n", getpid());
    fflush(stdout);
    struct stat sb;
    for (uint32_t k = 1;; k++) {
        if (pause && stat(pause, &sb) == 0) {
            printf("PAUSED %u\n", k - 1);
            fflush(stdout);
            while (stat(pause, &sb) == 0)
                usleep(1000);
        }
        if (copy_name && !copy && (!copy_when || stat(copy_when, &sb) == 0)) {
            CHECK(cuGetProcAddress_v2(copy_name, (void **)&copy, 13000, 0, NULL));
            if (copy_when) {
                printf("LOOKED UP\n");
                fflush(stdout);
            }
        }
        if (launches_only && !elementwise) {
            float alpha = 1.0f;
            int count = (int)(bytes / 4);
            void *params[] = {&alpha, &buf[0], &buf[0], &count};
            CHECK(cuLaunchKernel(launched, 1, 1, 1, 256, 1, 1, 0, NULL, params, NULL));
            continue;
        }
        if (launches_only) { /* as PyTorch's: (N, a functor holding buf[2], {buf[1], buf[0]}) */
            int count = (int)(bytes / 4);
            CUdeviceptr data[2] = {buf[1], buf[0]};
            void *params[] = {&count, &buf[2], data};
            CHECK(cuLaunchKernel(launched, 1, 1, 1, 256, 1, 1, 0, NULL, params, NULL));
            continue;
        }
        CHECK(memset32(buf[(k - 1) % (uint32_t)n], k, bytes / 4));
        if (copy)
            CHECK(copy(buf[0], buf[0], bytes, NULL));
        CHECK(cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL));
        if (nccl)
            usleep(2000);
        else if (k % 64 == 0)
            usleep(100);
    }
}
