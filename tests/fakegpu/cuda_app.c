/* cuda_app: a CUDA driver-API workload for the fake-driver tests, the ground truth of what pos
 * trace must see.
 *
 * Linked against the fake libcuda.so.1 (or, on a GPU machine, the real one: every call is a
 * valid driver call), it speaks workloads/harness.py's protocol: `READY <pid>`, then one JSON
 * line per command read from stdin (load, lookup, alloc, launch, structs, free, spin N) until
 * `exit` or EOF. Each JSON line reports the exact handles, pointers, sizes and parameter bytes it
 * passed to the driver.
 *
 * Usage: cuda_app MODE DIR, MODE being how the kernels' image is loaded:
 *   cubin    cuModuleLoadData(DIR/kernels.cubin)
 *   fatbin   cuModuleLoadDataEx(DIR/kernels.fatbin, no options)
 *   library  cuLibraryLoadData(DIR/kernels.zfatbin, compressed), kernels via cuLibraryGetKernel
 *   wrapped  dlopen(DIR/libkernels.so), cuModuleLoadData(its __fatBinC_Wrapper_t) */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <sys/mman.h>
#include <unistd.h>

#include "app_common.h"
#define POS_JOB_OWN_CHECK
#include "job_common.h"

/* ---- the driver API used here (x86-64 ABI of cuda.h, CUDA 13) ---------------------------- */
typedef int CUdevice;
typedef struct CUctx_st *CUcontext;
typedef struct CUmod_st *CUmodule;
typedef struct CUlib_st *CUlibrary;
typedef struct CUfunc_st *CUfunction;
typedef struct CUkern_st *CUkernel;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;

typedef struct {
    unsigned int gridDimX, gridDimY, gridDimZ;
    unsigned int blockDimX, blockDimY, blockDimZ;
    unsigned int sharedMemBytes;
    CUstream hStream;
    void *attrs;
    unsigned int numAttrs;
} CUlaunchConfig;


CUresult cuInit(unsigned int);
CUresult cuDriverGetVersion(int *);
CUresult cuDeviceGetCount(int *);
CUresult cuDeviceGet(CUdevice *, int);
CUresult cuDevicePrimaryCtxRetain(CUcontext *, CUdevice);
CUresult cuCtxSetCurrent(CUcontext);
CUresult cuCtxSynchronize(void);
CUresult cuGetErrorString(CUresult, const char **);
CUresult cuModuleLoadData(CUmodule *, const void *);
CUresult cuModuleLoadDataEx(CUmodule *, const void *, unsigned int, int *, void **);
CUresult cuModuleGetFunction(CUfunction *, CUmodule, const char *);
CUresult cuLibraryLoadData(CUlibrary *, const void *, int *, void **, unsigned int, int *,
                           void **, unsigned int);
CUresult cuLibraryGetKernel(CUkernel *, CUlibrary, const char *);
CUresult cuKernelGetFunction(CUfunction *, CUkernel);
CUresult cuStreamCreate(CUstream *, unsigned int);
CUresult cuStreamSynchronize(CUstream);
CUresult cuStreamSynchronize_ptsz(CUstream);
CUresult cuStreamDestroy_v2(CUstream);
CUresult cuEventCreate(CUevent *, unsigned int);
CUresult cuEventRecord(CUevent, CUstream);
CUresult cuEventSynchronize(CUevent);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuMemAllocPitch_v2(CUdeviceptr *, size_t *, size_t, size_t, unsigned int);
CUresult cuMemAllocAsync(CUdeviceptr *, size_t, CUstream);
CUresult cuMemFree_v2(CUdeviceptr);
CUresult cuMemFreeAsync(CUdeviceptr, CUstream);
CUresult cuMemGetAllocationGranularity(size_t *, const CUmemAllocationProp *, int);
CUresult cuMemAddressReserve(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
CUresult cuMemAddressFree(CUdeviceptr, size_t);
CUresult cuMemCreate(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *,
                     unsigned long long);
CUresult cuMemRelease(CUmemGenericAllocationHandle);
CUresult cuMemMap(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
CUresult cuMemSetAccess(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
CUresult cuMemUnmap(CUdeviceptr, size_t);
CUresult cuLaunchKernel(CUfunction, unsigned int, unsigned int, unsigned int, unsigned int,
                        unsigned int, unsigned int, unsigned int, CUstream, void **, void **);
CUresult cuLaunchKernel_ptsz(CUfunction, unsigned int, unsigned int, unsigned int, unsigned int,
                             unsigned int, unsigned int, unsigned int, CUstream, void **,
                             void **);
CUresult cuLaunchKernelEx(const CUlaunchConfig *, CUfunction, void **, void **);
CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *, CUfunction, void **, void **);
CUresult cuMemcpyHtoD_v2(CUdeviceptr, const void *, size_t);
CUresult cuMemcpyDtoH_v2(void *, CUdeviceptr, size_t);
CUresult cuMemcpyDtoD_v2(CUdeviceptr, CUdeviceptr, size_t);
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr, const void *, size_t, CUstream);
CUresult cuMemcpyDtoHAsync_v2(void *, CUdeviceptr, size_t, CUstream);
CUresult cuMemcpyDtoHAsync_v2_ptsz(void *, CUdeviceptr, size_t, CUstream);
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr, CUdeviceptr, size_t, CUstream);
CUresult cuMemcpyAsync(CUdeviceptr, CUdeviceptr, size_t, CUstream);
CUresult cuMemsetD8_v2(CUdeviceptr, unsigned char, size_t);
CUresult cuMemsetD32_v2(CUdeviceptr, unsigned int, size_t);
CUresult cuMemsetD8Async(CUdeviceptr, unsigned char, size_t, CUstream);
CUresult cuMemsetD32Async(CUdeviceptr, unsigned int, size_t, CUstream);

static void check(CUresult r, const char *call, int line) {
    if (r == 0)
        return;
    const char *text = NULL;
    cuGetErrorString(r, &text);
    fprintf(stderr, "cuda_app:%d: %s failed: %d (%s)\n", line, call, r, text ? text : "?");
    exit(1);
}
#define CHECK(call) check((call), #call, __LINE__)

/* ---- state kept across phases ------------------------------------------------------------ */
static const char *mode, *dir;
static int loaded, looked_up, allocated;
static CUmodule module;
static CUlibrary library;
static CUfunction functions[N_KERNELS];
static CUkernel kernels[N_KERNELS];
static CUstream stream;
static CUevent event;

/* The allocations (see phase_alloc) */
static CUdeviceptr A, B, C, D, P, S, V;
static size_t pitch, granularity;
static CUmemGenericAllocationHandle vmm;
enum { A_SIZE = 8192, B_SIZE = 4000, C_SIZE = 1 << 20, D_SIZE = 256, S_SIZE = 65536 };
enum { P_WIDTH = 1000, P_HEIGHT = 16, P_ELEM = 4 };

static struct buf out, launches, copies, memsets, syncs;
static int seq; /* order of the calls within a phase, across the four lists */

/* ---- load -------------------------------------------------------------------------------- */
static void phase_load(void) {
    int version, count;
    CUdevice dev;
    CUcontext ctx;
    CHECK(cuInit(0));
    CHECK(cuDriverGetVersion(&version));
    CHECK(cuDeviceGetCount(&count));
    CHECK(cuDeviceGet(&dev, 0));
    CHECK(cuDevicePrimaryCtxRetain(&ctx, dev));
    CHECK(cuCtxSetCurrent(ctx));

    const char *api;
    const void *image;
    size_t size = 0;
    void *handle;
    reset(&out);
    put(&out, "{\"phase\":\"load\",\"mode\":\"%s\"", mode);
    if (strcmp(mode, "cubin") == 0) {
        api = "cuModuleLoadData";
        image = read_file(dir, "kernels.cubin", &size);
        CHECK(cuModuleLoadData(&module, image));
        handle = module;
    } else if (strcmp(mode, "fatbin") == 0) {
        api = "cuModuleLoadDataEx";
        image = read_file(dir, "kernels.fatbin", &size);
        CHECK(cuModuleLoadDataEx(&module, image, 0, NULL, NULL));
        handle = module;
    } else if (strcmp(mode, "library") == 0) {
        api = "cuLibraryLoadData";
        image = read_file(dir, "kernels.zfatbin", &size);
        CHECK(cuLibraryLoadData(&library, image, NULL, NULL, 0, NULL, NULL, 0));
        handle = library;
    } else if (strcmp(mode, "wrapped") == 0) {
        char path[4096];
        snprintf(path, sizeof(path), "%s/libkernels.so", dir);
        void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
        if (!lib)
            fail(dlerror());
        image = dlsym(lib, "__fatDeviceText"); /* the __fatBinC_Wrapper_t */
        if (!image)
            fail(dlerror());
        const unsigned char *fatbin = *(const unsigned char *const *)((const char *)image + 8);
        uint16_t header;
        uint64_t body;
        memcpy(&header, fatbin + 6, sizeof(header));
        memcpy(&body, fatbin + 8, sizeof(body));
        size = header + body;
        api = "cuModuleLoadData";
        CHECK(cuModuleLoadData(&module, image));
        handle = module;
        put(&out, ",\"fatbin\":\"0x%llx\",\"library\":\"%s\"", PTR(fatbin), path);
    } else {
        phase_error("load", "unknown mode");
        return;
    }
    put(&out, ",\"api\":\"%s\",\"module\":\"0x%llx\",\"image\":\"0x%llx\",\"image_size\":%zu,"
              "\"driver_version\":%d,\"devices\":%d,\"context\":\"0x%llx\"}",
        api, PTR(handle), PTR(image), size, version, count, PTR(ctx));
    loaded = 1;
    emit(&out);
}

/* ---- lookup ------------------------------------------------------------------------------ */
static void phase_lookup(void) {
    if (!loaded) {
        phase_error("lookup", "load first");
        return;
    }
    int lib = library != NULL;
    for (int k = 0; k < N_KERNELS; k++) {
        if (lib) {
            CHECK(cuLibraryGetKernel(&kernels[k], library, kernel_names[k]));
            CHECK(cuKernelGetFunction(&functions[k], kernels[k]));
        } else {
            CHECK(cuModuleGetFunction(&functions[k], module, kernel_names[k]));
        }
    }
    reset(&out);
    put(&out, "{\"phase\":\"lookup\",\"functions\":{");
    for (int k = 0; k < N_KERNELS; k++)
        put(&out, "%s\"%s\":\"0x%llx\"", k ? "," : "", kernel_names[k], PTR(functions[k]));
    put(&out, "}");
    if (lib) {
        put(&out, ",\"kernels\":{");
        for (int k = 0; k < N_KERNELS; k++)
            put(&out, "%s\"%s\":\"0x%llx\"", k ? "," : "", kernel_names[k], PTR(kernels[k]));
        put(&out, "}");
    }
    put(&out, "}");
    looked_up = 1;
    emit(&out);
}

/* ---- alloc ------------------------------------------------------------------------------- */
/* `kind` is pos's name for the event the call makes: alloc, reserve, create */
static void alloc_entry(const char *kind, const char *api, CUdeviceptr ptr, size_t size) {
    sep(&out);
    put(&out, "{\"kind\":\"%s\",\"api\":\"%s\",\"ptr\":\"0x%llx\",\"size\":%zu}", kind, api,
        ptr, size);
}

static void phase_alloc(void) {
    if (!loaded) {
        phase_error("alloc", "load first");
        return;
    }
    CHECK(cuStreamCreate(&stream, 0));
    CHECK(cuEventCreate(&event, 0));
    CHECK(cuMemAlloc_v2(&A, A_SIZE));
    CHECK(cuMemAlloc_v2(&B, B_SIZE));
    CHECK(cuMemAlloc_v2(&C, C_SIZE));
    CHECK(cuMemAlloc_v2(&D, D_SIZE));
    CHECK(cuMemAllocPitch_v2(&P, &pitch, P_WIDTH, P_HEIGHT, P_ELEM));
    CHECK(cuMemAllocAsync(&S, S_SIZE, stream));

    /* VMM, as PyTorch's expandable segments do it: reserve 2 granules, back the first */
    CUmemAllocationProp prop = {.type = 1 /* pinned */, .location = {1 /* device */, 0}};
    CUmemAccessDesc access = {.location = {1, 0}, .flags = 3 /* read-write */};
    CHECK(cuMemGetAllocationGranularity(&granularity, &prop, 0));
    CHECK(cuMemAddressReserve(&V, 2 * granularity, 0, 0, 0));
    CHECK(cuMemCreate(&vmm, granularity, &prop, 0));
    CHECK(cuMemMap(V, granularity, 0, vmm, 0));
    CHECK(cuMemSetAccess(V, granularity, &access, 1));

    reset(&out);
    put(&out, "{\"phase\":\"alloc\",\"stream\":\"0x%llx\",\"event\":\"0x%llx\",\"allocs\":[",
        PTR(stream), PTR(event));
    alloc_entry("alloc", "cuMemAlloc_v2", A, A_SIZE);
    alloc_entry("alloc", "cuMemAlloc_v2", B, B_SIZE);
    alloc_entry("alloc", "cuMemAlloc_v2", C, C_SIZE);
    alloc_entry("alloc", "cuMemAlloc_v2", D, D_SIZE);
    put(&out, ",{\"kind\":\"alloc\",\"api\":\"cuMemAllocPitch_v2\",\"ptr\":\"0x%llx\","
              "\"size\":%zu,\"pitch\":%zu,\"width\":%d,\"height\":%d}",
        P, pitch * P_HEIGHT, pitch, P_WIDTH, P_HEIGHT);
    put(&out, ",{\"kind\":\"alloc\",\"api\":\"cuMemAllocAsync\",\"ptr\":\"0x%llx\",\"size\":%d,"
              "\"stream\":\"0x%llx\"}", S, S_SIZE, PTR(stream));
    alloc_entry("reserve", "cuMemAddressReserve", V, 2 * granularity);
    put(&out, ",{\"kind\":\"create\",\"api\":\"cuMemCreate\",\"ptr\":\"0x%llx\",\"size\":%zu,"
              "\"handle\":\"0x%llx\"}", vmm, granularity, vmm); /* pos keeps the handle as ptr */
    put(&out, ",{\"kind\":\"alloc\",\"api\":\"cuMemMap\",\"ptr\":\"0x%llx\",\"size\":%zu,"
              "\"handle\":\"0x%llx\"}", V, granularity, vmm);
    put(&out, "]}");
    allocated = 1;
    emit(&out);
}

/* ---- launch ------------------------------------------------------------------------------ */
enum launch_api { LAUNCH, LAUNCH_PTSZ, LAUNCH_EX, LAUNCH_EX_PTSZ };
static const char *const launch_api_names[] = {"cuLaunchKernel", "cuLaunchKernel_ptsz",
                                               "cuLaunchKernelEx", "cuLaunchKernelEx_ptsz"};

/* Launches kernel k one way and records exactly what was passed: each parameter's bytes as
 * they lie in memory (sizes[i] bytes at params[i]), or the packed `extra` buffer. */
static void launch(enum launch_api api, int k, struct dims d, void **params, const size_t *sizes,
                   int n, void *buffer, size_t buffer_size) {
    void *extra[] = {(void *)1 /* CU_LAUNCH_PARAM_BUFFER_POINTER */, buffer,
                     (void *)2 /* CU_LAUNCH_PARAM_BUFFER_SIZE */, &buffer_size,
                     (void *)0 /* CU_LAUNCH_PARAM_END */};
    void **x = buffer ? extra : NULL;
    void **kp = buffer ? NULL : params; /* with `extra`, params holds the offsets */
    CUfunction f = functions[k];
    CUlaunchConfig config = {d.grid[0], d.grid[1], d.grid[2], d.block[0], d.block[1],
                             d.block[2], d.shared_mem, d.stream, NULL, 0};
    switch (api) {
    case LAUNCH:
        CHECK(cuLaunchKernel(f, d.grid[0], d.grid[1], d.grid[2], d.block[0], d.block[1],
                             d.block[2], d.shared_mem, d.stream, kp, x));
        break;
    case LAUNCH_PTSZ:
        CHECK(cuLaunchKernel_ptsz(f, d.grid[0], d.grid[1], d.grid[2], d.block[0], d.block[1],
                                  d.block[2], d.shared_mem, d.stream, kp, x));
        break;
    case LAUNCH_EX:
        CHECK(cuLaunchKernelEx(&config, f, kp, x));
        break;
    case LAUNCH_EX_PTSZ:
        CHECK(cuLaunchKernelEx_ptsz(&config, f, kp, x));
        break;
    }
    record_launch(&launches, seq++, launch_api_names[api], kernel_names[k], f, &d, params, sizes, n,
                  buffer, buffer_size);
}

static void copy_entry(const char *api, uint64_t dst, uint64_t src, size_t size,
                       const char *direction, CUstream s) {
    sep(&copies);
    put(&copies, "{\"seq\":%d,\"api\":\"%s\",\"dst\":\"0x%llx\",\"src\":\"0x%llx\",\"size\":%zu,"
                 "\"direction\":\"%s\",\"stream\":\"0x%llx\"}",
        seq++, api, (unsigned long long)dst, (unsigned long long)src, size, direction, PTR(s));
}

static void memset_entry(const char *api, CUdeviceptr dst, size_t bytes, unsigned value,
                         CUstream s) {
    sep(&memsets);
    put(&memsets, "{\"seq\":%d,\"api\":\"%s\",\"dst\":\"0x%llx\",\"size\":%zu,\"value\":%u,"
                  "\"stream\":\"0x%llx\"}",
        seq++, api, dst, bytes, value, PTR(s));
}

static void sync_entry(const char *api, const void *handle, CUstream s) {
    sep(&syncs);
    put(&syncs, "{\"seq\":%d,\"api\":\"%s\",\"handle\":\"0x%llx\",\"stream\":\"0x%llx\"}", seq++,
        api, PTR(handle), PTR(s));
}

static void expect_bytes(const unsigned char *got, unsigned char want, size_t n, const char *what) {
    for (size_t i = 0; i < n; i++)
        if (got[i] != want) {
            fprintf(stderr, "cuda_app: %s: byte %zu is %#x, expected %#x\n", what, i, got[i], want);
            exit(1);
        }
}

/* A page boundary with one readable page after it, then an inaccessible page. */
static char *memory_edge(void) {
    static char *edge;
    if (!edge) {
        long page = sysconf(_SC_PAGESIZE);
        char *m = mmap(NULL, 3 * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (m == MAP_FAILED || mprotect(m + 2 * page, page, PROT_NONE) != 0) {
            perror("mmap");
            exit(1);
        }
        edge = m + page;
    }
    return edge;
}

static void phase_launch(void) {
    if (!looked_up || !allocated) {
        phase_error("launch", "lookup and alloc first");
        return;
    }
    reset(&launches);
    reset(&copies);
    reset(&memsets);
    reset(&syncs);
    put(&launches, "[");
    put(&copies, "[");
    put(&memsets, "[");
    put(&syncs, "[");
    seq = 0;

    /* axpy(alpha, x, y, n) with x an INTERIOR pointer of A */
    {
        float alpha = 2.5f;
        CUdeviceptr x = A + 16, y = B;
        int n = 1000;
        void *params[] = {&alpha, &x, &y, &n};
        size_t sizes[] = {sizeof(alpha), sizeof(x), sizeof(y), sizeof(n)};
        launch(LAUNCH, K_AXPY, (struct dims){{4, 1, 1}, {256, 1, 1}, 0, NULL}, params, sizes, 4,
               NULL, 0);
    }
    /* pair_copy(Pair{a, b, n}, scale): a struct holding two device pointers, across a page
     * boundary and near where its memory ends, as a main thread's stack may end a few KiB above
     * the frame of a launch; the parameter array right at that end, so that the probe cannot
     * read the memory around it in one go */
    {
        struct Pair *pair = (struct Pair *)(memory_edge() - 8);
        memset(pair, 0, sizeof(*pair)); /* padding bytes are part of the ground truth */
        pair->a = C;
        pair->b = P;
        pair->n = 64;
        float *scale = (float *)(memory_edge() + 64);
        *scale = 0.5f;
        void **params = (void **)(memory_edge() + sysconf(_SC_PAGESIZE) - 2 * sizeof(void *));
        params[0] = pair;
        params[1] = scale;
        size_t sizes[] = {sizeof(*pair), sizeof(*scale)};
        launch(LAUNCH_PTSZ, K_PAIR_COPY, (struct dims){{1, 1, 1}, {64, 1, 1}, 0, stream}, params,
               sizes, 2, NULL, 0);
    }
    /* mixed(Mixed{tag, p, count}, src): a pointer after padding inside the struct */
    {
        struct Mixed m;
        memset(&m, 0, sizeof(m));
        m.tag = 'M';
        m.p = S;
        m.count = 32;
        CUdeviceptr src = V;
        void *params[] = {&m, &src};
        size_t sizes[] = {sizeof(m), sizeof(src)};
        launch(LAUNCH_EX, K_MIXED, (struct dims){{1, 1, 1}, {32, 1, 1}, 256, stream}, params,
               sizes, 2, NULL, 0);
    }
    /* scalars(c, s, i, l, d, out): every scalar width, recognisable values */
    {
        char c = 'C';
        short s = 0x1234;
        int i = 0x5678abcd;
        long long l = 0x1122334455667788LL;
        double d = 6.25;
        CUdeviceptr o = D;
        void *params[] = {&c, &s, &i, &l, &d, &o};
        size_t sizes[] = {sizeof(c), sizeof(s), sizeof(i), sizeof(l), sizeof(d), sizeof(o)};
        launch(LAUNCH, K_SCALARS, (struct dims){{1, 1, 1}, {1, 1, 1}, 0, NULL}, params, sizes, 6,
               NULL, 0);
    }
    /* fill<float>(out, value, n) on a 3-D grid */
    {
        CUdeviceptr o = C;
        float value = 1.5f;
        int n = 4096;
        void *params[] = {&o, &value, &n};
        size_t sizes[] = {sizeof(o), sizeof(value), sizeof(n)};
        launch(LAUNCH, K_FILL_F, (struct dims){{2, 3, 4}, {8, 4, 2}, 0, NULL}, params, sizes, 3,
               NULL, 0);
    }
    /* fill<int>(out, value, n) through the `extra` form, out an interior pointer of S */
    {
        struct FillIntArgs a;
        memset(&a, 0, sizeof(a));
        a.out = S + 1024;
        a.value = 7;
        a.n = 256;
        void *offsets[] = {(void *)__builtin_offsetof(struct FillIntArgs, out),
                           (void *)__builtin_offsetof(struct FillIntArgs, value),
                           (void *)__builtin_offsetof(struct FillIntArgs, n)};
        size_t sizes[] = {sizeof(a.out), sizeof(a.value), sizeof(a.n)};
        launch(LAUNCH, K_FILL_I, (struct dims){{1, 1, 1}, {256, 1, 1}, 0, stream}, offsets, sizes,
               3, &a, sizeof(a));
    }
    /* no_params(): kernelParams NULL, through the plain and the Ex form */
    launch(LAUNCH, K_NO_PARAMS, (struct dims){{1, 1, 1}, {1, 1, 1}, 0, NULL}, NULL, NULL, 0, NULL,
           0);
    launch(LAUNCH_EX_PTSZ, K_NO_PARAMS, (struct dims){{2, 1, 1}, {32, 1, 1}, 0, stream}, NULL,
           NULL, 0, NULL, 0);

    /* copies: a pattern goes host -> A -> V -> host and must come back unchanged */
    static unsigned char src[4096], back[4096], src2[2048], back2[2048], back3[B_SIZE];
    for (size_t i = 0; i < sizeof(src); i++)
        src[i] = (unsigned char)(i * 7 + 3);
    for (size_t i = 0; i < sizeof(src2); i++)
        src2[i] = (unsigned char)(i * 13 + 1);
    CHECK(cuMemcpyHtoD_v2(A, src, sizeof(src)));
    copy_entry("cuMemcpyHtoD_v2", A, PTR(src), sizeof(src), "HtoD", NULL);
    CHECK(cuMemcpyDtoD_v2(V, A, sizeof(src)));
    copy_entry("cuMemcpyDtoD_v2", V, A, sizeof(src), "DtoD", NULL);
    CHECK(cuMemcpyDtoH_v2(back, V, sizeof(back)));
    copy_entry("cuMemcpyDtoH_v2", PTR(back), V, sizeof(back), "DtoH", NULL);
    /* the same on the stream, at offsets inside the allocations */
    CHECK(cuMemcpyHtoDAsync_v2(A + 4096, src2, sizeof(src2), stream));
    copy_entry("cuMemcpyHtoDAsync_v2", A + 4096, PTR(src2), sizeof(src2), "HtoD", stream);
    CHECK(cuMemcpyDtoDAsync_v2(V + 8192, A + 4096, sizeof(src2), stream));
    copy_entry("cuMemcpyDtoDAsync_v2", V + 8192, A + 4096, sizeof(src2), "DtoD", stream);
    CHECK(cuMemcpyDtoHAsync_v2(back2, V + 8192, sizeof(back2), stream));
    copy_entry("cuMemcpyDtoHAsync_v2", PTR(back2), V + 8192, sizeof(back2), "DtoH", stream);
    /* unified addressing: cuMemcpyAsync infers the direction */
    CHECK(cuMemcpyAsync(B, V, B_SIZE, stream));
    copy_entry("cuMemcpyAsync", B, V, B_SIZE, "default", stream);
    CHECK(cuMemcpyDtoHAsync_v2_ptsz(back3, B, B_SIZE, stream));
    copy_entry("cuMemcpyDtoHAsync_v2_ptsz", PTR(back3), B, B_SIZE, "DtoH", stream);

    /* sets */
    CHECK(cuMemsetD8_v2(D, 0xab, D_SIZE));
    memset_entry("cuMemsetD8_v2", D, D_SIZE, 0xab, NULL);
    CHECK(cuMemsetD32_v2(C, 0xdeadbeef, 1024));
    memset_entry("cuMemsetD32_v2", C, 1024 * 4, 0xdeadbeef, NULL);
    CHECK(cuMemsetD32Async(S + 4096, 0x01020304, 512, stream));
    memset_entry("cuMemsetD32Async", S + 4096, 512 * 4, 0x01020304, stream);
    CHECK(cuMemsetD8Async(P, 0x5a, 64, stream));
    memset_entry("cuMemsetD8Async", P, 64, 0x5a, stream);

    /* synchronisation */
    CHECK(cuEventRecord(event, stream));
    sync_entry("cuEventRecord", event, stream);
    CHECK(cuStreamSynchronize(stream));
    sync_entry("cuStreamSynchronize", stream, stream);
    CHECK(cuEventSynchronize(event));
    sync_entry("cuEventSynchronize", event, NULL);
    CHECK(cuCtxSynchronize());
    sync_entry("cuCtxSynchronize", NULL, NULL);

    /* verify, reading the sets back (these reads are copies too, and recorded) */
    if (memcmp(back, src, sizeof(src)) || memcmp(back2, src2, sizeof(src2)) ||
        memcmp(back3, src, B_SIZE))
        fail("cuda_app: copied data did not round-trip");
    static unsigned char d8[D_SIZE], d32[2048];
    CHECK(cuMemcpyDtoH_v2(d8, D, sizeof(d8)));
    copy_entry("cuMemcpyDtoH_v2", PTR(d8), D, sizeof(d8), "DtoH", NULL);
    expect_bytes(d8, 0xab, sizeof(d8), "cuMemsetD8_v2");
    CHECK(cuMemcpyDtoH_v2(d32, S + 4096, sizeof(d32)));
    copy_entry("cuMemcpyDtoH_v2", PTR(d32), S + 4096, sizeof(d32), "DtoH", NULL);
    for (size_t i = 0; i < sizeof(d32) / 4; i++) {
        uint32_t w;
        memcpy(&w, d32 + 4 * i, 4);
        if (w != 0x01020304)
            fail("cuda_app: cuMemsetD32Async did not set its words");
    }
    CHECK(cuStreamSynchronize_ptsz(stream));
    sync_entry("cuStreamSynchronize_ptsz", stream, stream);

    put(&launches, "]");
    put(&copies, "]");
    put(&memsets, "]");
    put(&syncs, "]");
    reset(&out);
    put(&out, "{\"phase\":\"launch\",\"launches\":%s,\"copies\":%s,\"memsets\":%s,\"syncs\":%s}",
        launches.s, copies.s, memsets.s, syncs.s);
    emit(&out);
}

/* ---- free -------------------------------------------------------------------------------- */
static void phase_free(void) {
    if (!allocated) {
        phase_error("free", "alloc first");
        return;
    }
    reset(&out);
    put(&out, "{\"phase\":\"free\",\"frees\":[");
    CUdeviceptr plain[] = {A, B, C, D, P};
    for (int i = 0; i < 5; i++) {
        CHECK(cuMemFree_v2(plain[i]));
        sep(&out);
        put(&out, "{\"kind\":\"free\",\"api\":\"cuMemFree_v2\",\"ptr\":\"0x%llx\"}", plain[i]);
    }
    CHECK(cuMemFreeAsync(S, stream));
    put(&out, ",{\"kind\":\"free\",\"api\":\"cuMemFreeAsync\",\"ptr\":\"0x%llx\","
              "\"stream\":\"0x%llx\"}", S, PTR(stream));
    CHECK(cuMemUnmap(V, granularity));
    put(&out, ",{\"kind\":\"free\",\"api\":\"cuMemUnmap\",\"ptr\":\"0x%llx\",\"size\":%zu}", V,
        granularity);
    CHECK(cuMemRelease(vmm));
    put(&out, ",{\"kind\":\"release\",\"api\":\"cuMemRelease\",\"ptr\":\"0x%llx\","
              "\"handle\":\"0x%llx\"}", vmm, vmm);
    CHECK(cuMemAddressFree(V, 2 * granularity));
    put(&out, ",{\"kind\":\"unreserve\",\"api\":\"cuMemAddressFree\",\"ptr\":\"0x%llx\","
              "\"size\":%zu}", V, 2 * granularity);
    put(&out, "]}");
    allocated = 0;
    emit(&out);
}

/* ---- structs: parameters far from each other ------------------------------------------- */
static void list_of(struct TensorList *l, unsigned char seed) {
    memset(l, 0, sizeof(*l));
    for (int i = 0; i < 110; i++) {
        l->addresses[i] = i < 3 ? C + 4096 * (uint64_t)i : 0;
        l->numel[i] = i < 3 ? 1024 : 0;
    }
    for (int i = 0; i < 320; i++) {
        l->block_to_tensor[i] = (unsigned char)(i % 3 + seed);
        l->block_to_chunk[i] = i / 3;
    }
    l->start = seed;
}

/* Launches whose parameters lie apart, as large by-value structs lie: the first three are kept
 * whole by a capture, the fourth not (its four parameters lie in four places). */
static void phase_structs(void) {
    if (!looked_up || !allocated) {
        phase_error("structs", "lookup and alloc first");
        return;
    }
    reset(&launches);
    put(&launches, "[");
    seq = 0;
    /* a caller's frame, as an inlined ATen multi_tensor_apply lays it out: the 3 KiB list 3.5 KiB
     * above the scale, its end 6.8 KiB above it */
    static _Alignas(4096) unsigned char frame[4 * 4096];
    size_t sizes[] = {sizeof(struct TensorList), sizeof(float)};
    {
        struct TensorList *l = (struct TensorList *)(frame + 4096 + 3584);
        list_of(l, 0);
        float *scale = (float *)(frame + 4096);
        *scale = 0.5f;
        void *params[] = {l, scale};
        launch(LAUNCH, K_TENSOR_LIST, (struct dims){{320, 1, 1}, {1024, 1, 1}, 0, stream}, params,
               sizes, 2, NULL, 0);
    }
    /* the list on the heap, the scale on the stack */
    {
        static struct TensorList *l;
        if (!l)
            l = malloc(sizeof(*l));
        list_of(l, 1);
        float scale = 0.25f;
        void *params[] = {l, &scale};
        launch(LAUNCH_EX, K_TENSOR_LIST, (struct dims){{320, 1, 1}, {1024, 1, 1}, 0, stream},
               params, sizes, 2, NULL, 0);
    }
    /* 20 parameters, the last four (past the tracer's 16 slots) 40 bytes below the others, as
     * cuBLASLt's splitKreduce's lay on the H100 */
    {
        static CUdeviceptr o;
        o = C;
        unsigned char *at = frame + 2 * 4096 + 1024;
        void *params[20];
        size_t many_sizes[20];
        params[0] = &o;
        many_sizes[0] = sizeof(o);
        for (int i = 1; i < 20; i++) {
            int *v = (int *)(i < 16 ? at + 8 * i : at - 40 + 4 * (i - 16));
            *v = 100 + i;
            params[i] = v;
            many_sizes[i] = sizeof(int);
        }
        launch(LAUNCH, K_MANY, (struct dims){{1, 1, 1}, {1, 1, 1}, 0, stream}, params,
               many_sizes, 20, NULL, 0);
    }
    /* axpy's four parameters in four places: on the stack, the heap, and two of the frame's
     * pages 8 KiB apart */
    {
        float alpha = 3.0f;
        static CUdeviceptr *x;
        if (!x)
            x = malloc(sizeof(*x));
        *x = A;
        CUdeviceptr *y = (CUdeviceptr *)frame;
        *y = B;
        int *n = (int *)(frame + 3 * 4096);
        *n = 512;
        void *params[] = {&alpha, x, y, n};
        size_t axpy_sizes[] = {sizeof(alpha), sizeof(*x), sizeof(*y), sizeof(*n)};
        launch(LAUNCH, K_AXPY, (struct dims){{2, 1, 1}, {256, 1, 1}, 0, NULL}, params, axpy_sizes,
               4, NULL, 0);
    }
    put(&launches, "]");
    reset(&out);
    put(&out, "{\"phase\":\"structs\",\"launches\":%s}", launches.s);
    emit(&out);
}

/* ---- spin N: launch overhead, as fast as possible ---------------------------------------- */
static void phase_spin(long n) {
    if (!looked_up) {
        phase_error("spin", "lookup first");
        return;
    }
    CUdeviceptr o = allocated ? C : 0;
    float value = 1.0f;
    int count = 1024;
    void *params[] = {&o, &value, &count};
    double t0 = now();
    for (long i = 0; i < n; i++)
        CHECK(cuLaunchKernel(functions[K_FILL_F], 4, 1, 1, 256, 1, 1, 0, NULL, params, NULL));
    CHECK(cuCtxSynchronize());
    double t = now() - t0;
    reset(&out);
    put(&out, "{\"phase\":\"spin\",\"launches\":%ld,\"seconds\":%.9f}", n, t);
    emit(&out);
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s cubin|fatbin|library|wrapped DIR\n", argv[0]);
        return 2;
    }
    mode = argv[1];
    dir = argv[2];
    return serve();
}
