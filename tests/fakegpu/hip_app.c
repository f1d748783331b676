/* hip_app: a HIP workload for the fake-driver tests, the ground truth of what pos trace must
 * see in a HIP process.
 *
 * Linked against the fake libamdhip64.so, it speaks workloads/harness.py's protocol like
 * cuda_app (`READY <pid>`, then one JSON line per command: load, lookup, alloc, launch, free,
 * spin N; `exit` or EOF ends it) with the HIP calls: hipModuleLoadData of kernels.cubin (the
 * fake does not care that it is NVIDIA code), hipModuleGetFunction, the three launch entry
 * points, hipMemcpy*, hipMemset*, hipFree*. Usage: hip_app DIR.
 *
 * hipLaunchKernel takes the address of a kernel's host-side stub, which hipcc gives the
 * kernel's own mangled name; the stubs below are named likewise, so that a symbol table maps
 * their addresses back to kernel names as it does in a real HIP binary. */
#define _GNU_SOURCE
#include <unistd.h>

#include "app_common.h"

/* ---- the HIP runtime API used here (x86-64 ABI of hip_runtime_api.h, ROCm 6) -------------- */
typedef int hipError_t;
typedef struct ihipModule_t *hipModule_t;
typedef struct ihipModuleSymbol_t *hipFunction_t;
typedef struct ihipStream_t *hipStream_t;
typedef struct ihipEvent_t *hipEvent_t;
typedef struct {
    uint32_t x, y, z;
} dim3;
enum { HtoH = 0, HtoD = 1, DtoH = 2, DtoD = 3, Default = 4 }; /* hipMemcpyKind */

const char *hipGetErrorString(hipError_t);
hipError_t hipInit(unsigned int);
hipError_t hipGetDeviceCount(int *);
hipError_t hipSetDevice(int);
hipError_t hipStreamCreate(hipStream_t *);
hipError_t hipStreamDestroy(hipStream_t);
hipError_t hipStreamSynchronize(hipStream_t);
hipError_t hipDeviceSynchronize(void);
hipError_t hipMalloc(void **, size_t);
hipError_t hipMallocManaged(void **, size_t, unsigned int);
hipError_t hipMallocAsync(void **, size_t, hipStream_t);
hipError_t hipExtMallocWithFlags(void **, size_t, unsigned int);
hipError_t hipFree(void *);
hipError_t hipFreeAsync(void *, hipStream_t);
hipError_t hipModuleLoadData(hipModule_t *, const void *);
hipError_t hipModuleGetFunction(hipFunction_t *, hipModule_t, const char *);
hipError_t hipModuleLaunchKernel(hipFunction_t, unsigned int, unsigned int, unsigned int,
                                 unsigned int, unsigned int, unsigned int, unsigned int,
                                 hipStream_t, void **, void **);
hipError_t hipExtModuleLaunchKernel(hipFunction_t, uint32_t, uint32_t, uint32_t, uint32_t,
                                    uint32_t, uint32_t, size_t, hipStream_t, void **, void **,
                                    hipEvent_t, hipEvent_t, uint32_t);
hipError_t hipLaunchKernel(const void *, dim3, dim3, void **, size_t, hipStream_t);
hipError_t hipMemcpy(void *, const void *, size_t, int);
hipError_t hipMemcpyAsync(void *, const void *, size_t, int, hipStream_t);
hipError_t hipMemcpyHtoD(void *, void *, size_t);
hipError_t hipMemcpyDtoH(void *, void *, size_t);
hipError_t hipMemcpyDtoD(void *, void *, size_t);
hipError_t hipMemset(void *, int, size_t);
hipError_t hipMemsetAsync(void *, int, size_t, hipStream_t);

static void check(hipError_t r, const char *call, int line) {
    if (r == 0)
        return;
    fprintf(stderr, "hip_app:%d: %s failed: %d (%s)\n", line, call, r, hipGetErrorString(r));
    exit(1);
}
#define CHECK(call) check((call), #call, __LINE__)

/* Host-side stubs of fill<float> and no_params, named as hipcc names them. */
__attribute__((noinline, used)) void _Z4fillIfEvPT_S0_i(float *out, float value, int n) {}
__attribute__((noinline, used)) void no_params(void) {}

/* ---- state kept across phases ------------------------------------------------------------ */
static const char *dir;
static int loaded, looked_up, allocated;
static hipModule_t module;
static hipFunction_t functions[N_KERNELS];
static hipStream_t stream;
static char *A, *B, *C, *D, *M, *S, *E;
enum { A_SIZE = 8192, B_SIZE = 4000, C_SIZE = 1 << 20, D_SIZE = 256, M_SIZE = 12288 };
enum { S_SIZE = 65536, E_SIZE = 3000 };

static struct buf out, launches, copies, memsets, syncs;
static int seq;

static void phase_load(void) {
    int count;
    size_t size;
    CHECK(hipInit(0));
    CHECK(hipGetDeviceCount(&count));
    CHECK(hipSetDevice(0));
    const void *image = read_file(dir, "kernels.cubin", &size);
    CHECK(hipModuleLoadData(&module, image));
    reset(&out);
    put(&out, "{\"phase\":\"load\",\"api\":\"hipModuleLoadData\",\"module\":\"0x%llx\","
              "\"image\":\"0x%llx\",\"image_size\":%zu,\"devices\":%d}",
        PTR(module), PTR(image), size, count);
    loaded = 1;
    emit(&out);
}

static void phase_lookup(void) {
    if (!loaded) {
        phase_error("lookup", "load first");
        return;
    }
    reset(&out);
    put(&out, "{\"phase\":\"lookup\",\"functions\":{");
    for (int k = 0; k < N_KERNELS; k++) {
        CHECK(hipModuleGetFunction(&functions[k], module, kernel_names[k]));
        put(&out, "%s\"%s\":\"0x%llx\"", k ? "," : "", kernel_names[k], PTR(functions[k]));
    }
    put(&out, "},\"stubs\":{\"%s\":\"0x%llx\",\"%s\":\"0x%llx\"}}", kernel_names[K_FILL_F],
        PTR(_Z4fillIfEvPT_S0_i), kernel_names[K_NO_PARAMS], PTR(no_params));
    looked_up = 1;
    emit(&out);
}

static void alloc_entry(const char *api, const void *ptr, size_t size) {
    sep(&out);
    put(&out, "{\"kind\":\"alloc\",\"api\":\"%s\",\"ptr\":\"0x%llx\",\"size\":%zu}", api,
        PTR(ptr), size);
}

static void phase_alloc(void) {
    if (!loaded) {
        phase_error("alloc", "load first");
        return;
    }
    CHECK(hipStreamCreate(&stream));
    CHECK(hipMalloc((void **)&A, A_SIZE));
    CHECK(hipMalloc((void **)&B, B_SIZE));
    CHECK(hipMalloc((void **)&C, C_SIZE));
    CHECK(hipMalloc((void **)&D, D_SIZE));
    CHECK(hipMallocManaged((void **)&M, M_SIZE, 1 /* hipMemAttachGlobal */));
    CHECK(hipMallocAsync((void **)&S, S_SIZE, stream));
    CHECK(hipExtMallocWithFlags((void **)&E, E_SIZE, 1 /* hipDeviceMallocFinegrained */));
    reset(&out);
    put(&out, "{\"phase\":\"alloc\",\"stream\":\"0x%llx\",\"allocs\":[", PTR(stream));
    alloc_entry("hipMalloc", A, A_SIZE);
    alloc_entry("hipMalloc", B, B_SIZE);
    alloc_entry("hipMalloc", C, C_SIZE);
    alloc_entry("hipMalloc", D, D_SIZE);
    alloc_entry("hipMallocManaged", M, M_SIZE);
    put(&out, ",{\"kind\":\"alloc\",\"api\":\"hipMallocAsync\",\"ptr\":\"0x%llx\",\"size\":%d,"
              "\"stream\":\"0x%llx\"}", PTR(S), S_SIZE, PTR(stream));
    alloc_entry("hipExtMallocWithFlags", E, E_SIZE);
    put(&out, "]}");
    allocated = 1;
    emit(&out);
}

/* ---- launch ------------------------------------------------------------------------------ */
enum launch_api { MODULE_LAUNCH, EXT_MODULE_LAUNCH, LAUNCH };
static const char *const launch_api_names[] = {"hipModuleLaunchKernel",
                                               "hipExtModuleLaunchKernel", "hipLaunchKernel"};

/* Launches kernel k one way and records what was passed, as cuda_app's launch() does. The
 * JSON's grid is in blocks for every form (hipExtModuleLaunchKernel is given threads). */
static void launch(enum launch_api api, int k, struct dims d, void **params, const size_t *sizes,
                   int n, void *buffer, size_t buffer_size) {
    void *extra[] = {(void *)1 /* HIP_LAUNCH_PARAM_BUFFER_POINTER */, buffer,
                     (void *)2 /* HIP_LAUNCH_PARAM_BUFFER_SIZE */, &buffer_size,
                     (void *)3 /* HIP_LAUNCH_PARAM_END */};
    void **x = buffer ? extra : NULL;
    void **kp = buffer ? NULL : params; /* with `extra`, params holds the offsets */
    const void *f = functions[k];
    switch (api) {
    case MODULE_LAUNCH:
        CHECK(hipModuleLaunchKernel(functions[k], d.grid[0], d.grid[1], d.grid[2], d.block[0],
                                    d.block[1], d.block[2], d.shared_mem, d.stream, kp, x));
        break;
    case EXT_MODULE_LAUNCH:
        CHECK(hipExtModuleLaunchKernel(functions[k], d.grid[0] * d.block[0],
                                       d.grid[1] * d.block[1], d.grid[2] * d.block[2],
                                       d.block[0], d.block[1], d.block[2], d.shared_mem,
                                       d.stream, kp, x, NULL, NULL, 0));
        break;
    case LAUNCH: {
        f = k == K_FILL_F ? (const void *)_Z4fillIfEvPT_S0_i : (const void *)no_params;
        dim3 grid = {d.grid[0], d.grid[1], d.grid[2]}, block = {d.block[0], d.block[1], d.block[2]};
        CHECK(hipLaunchKernel(f, grid, block, kp, d.shared_mem, d.stream));
        break;
    }
    }
    record_launch(&launches, seq++, launch_api_names[api], kernel_names[k], f, &d, params, sizes, n,
                  buffer, buffer_size);
}

static const char *const directions[] = {"HtoH", "HtoD", "DtoH", "DtoD", "default"};

static void copy_entry(const char *api, const void *dst, const void *src, size_t size, int kind,
                       hipStream_t s) {
    sep(&copies);
    put(&copies, "{\"seq\":%d,\"api\":\"%s\",\"dst\":\"0x%llx\",\"src\":\"0x%llx\",\"size\":%zu,"
                 "\"direction\":\"%s\",\"stream\":\"0x%llx\"}",
        seq++, api, PTR(dst), PTR(src), size, directions[kind], PTR(s));
}

static void memset_entry(const char *api, const void *dst, size_t size, int value,
                         hipStream_t s) {
    sep(&memsets);
    put(&memsets, "{\"seq\":%d,\"api\":\"%s\",\"dst\":\"0x%llx\",\"size\":%zu,\"value\":%d,"
                  "\"stream\":\"0x%llx\"}",
        seq++, api, PTR(dst), size, value, PTR(s));
}

static void sync_entry(const char *api, const void *handle) {
    sep(&syncs);
    put(&syncs, "{\"seq\":%d,\"api\":\"%s\",\"handle\":\"0x%llx\",\"stream\":\"0x%llx\"}", seq++,
        api, PTR(handle), PTR(handle));
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
        void *x = A + 16, *y = B;
        int n = 1000;
        void *params[] = {&alpha, &x, &y, &n};
        size_t sizes[] = {sizeof(alpha), sizeof(x), sizeof(y), sizeof(n)};
        launch(MODULE_LAUNCH, K_AXPY, (struct dims){{4, 1, 1}, {256, 1, 1}, 0, NULL}, params,
               sizes, 4, NULL, 0);
    }
    /* pair_copy(Pair{a, b, n}, scale) */
    {
        struct Pair pair;
        memset(&pair, 0, sizeof(pair));
        pair.a = PTR(C);
        pair.b = PTR(M);
        pair.n = 64;
        float scale = 0.5f;
        void *params[] = {&pair, &scale};
        size_t sizes[] = {sizeof(pair), sizeof(scale)};
        launch(MODULE_LAUNCH, K_PAIR_COPY, (struct dims){{1, 1, 1}, {64, 1, 1}, 0, stream},
               params, sizes, 2, NULL, 0);
    }
    /* mixed(Mixed{tag, p, count}, src) through hipExtModuleLaunchKernel */
    {
        struct Mixed m;
        memset(&m, 0, sizeof(m));
        m.tag = 'M';
        m.p = PTR(S);
        m.count = 32;
        void *src = E;
        void *params[] = {&m, &src};
        size_t sizes[] = {sizeof(m), sizeof(src)};
        launch(EXT_MODULE_LAUNCH, K_MIXED, (struct dims){{2, 1, 1}, {32, 1, 1}, 256, stream},
               params, sizes, 2, NULL, 0);
    }
    /* scalars(c, s, i, l, d, out) through the `extra` form */
    {
        struct ScalarsArgs a;
        memset(&a, 0, sizeof(a));
        a.c = 'C';
        a.s = 0x1234;
        a.i = 0x5678abcd;
        a.l = 0x1122334455667788LL;
        a.d = 6.25;
        a.out = PTR(D);
        void *offsets[] = {(void *)__builtin_offsetof(struct ScalarsArgs, c),
                           (void *)__builtin_offsetof(struct ScalarsArgs, s),
                           (void *)__builtin_offsetof(struct ScalarsArgs, i),
                           (void *)__builtin_offsetof(struct ScalarsArgs, l),
                           (void *)__builtin_offsetof(struct ScalarsArgs, d),
                           (void *)__builtin_offsetof(struct ScalarsArgs, out)};
        size_t sizes[] = {sizeof(a.c), sizeof(a.s), sizeof(a.i),
                          sizeof(a.l), sizeof(a.d), sizeof(a.out)};
        launch(MODULE_LAUNCH, K_SCALARS, (struct dims){{1, 1, 1}, {1, 1, 1}, 0, NULL}, offsets,
               sizes, 6, &a, sizeof(a));
    }
    /* fill<float>(out, value, n) through hipLaunchKernel: dim3s by value, all distinct */
    {
        void *o = C;
        float value = 1.5f;
        int n = 4096;
        void *params[] = {&o, &value, &n};
        size_t sizes[] = {sizeof(o), sizeof(value), sizeof(n)};
        launch(LAUNCH, K_FILL_F, (struct dims){{2, 3, 4}, {8, 4, 2}, 128, stream}, params, sizes,
               3, NULL, 0);
    }
    /* fill<int>(out, value, n), out an interior pointer of S */
    {
        void *o = S + 1024;
        int value = 7, n = 256;
        void *params[] = {&o, &value, &n};
        size_t sizes[] = {sizeof(o), sizeof(value), sizeof(n)};
        launch(MODULE_LAUNCH, K_FILL_I, (struct dims){{1, 1, 1}, {256, 1, 1}, 0, stream}, params,
               sizes, 3, NULL, 0);
    }
    /* no_params(): no arguments at all */
    launch(LAUNCH, K_NO_PARAMS, (struct dims){{5, 6, 7}, {1, 2, 3}, 0, NULL}, NULL, NULL, 0, NULL,
           0);
    launch(MODULE_LAUNCH, K_NO_PARAMS, (struct dims){{1, 1, 1}, {1, 1, 1}, 0, stream}, NULL, NULL,
           0, NULL, 0);

    /* copies: host -> A -> M -> host, and on the stream at offsets */
    static unsigned char src[4096], back[4096], src2[2048], back2[2048], back3[2048];
    for (size_t i = 0; i < sizeof(src); i++)
        src[i] = (unsigned char)(i * 7 + 3);
    for (size_t i = 0; i < sizeof(src2); i++)
        src2[i] = (unsigned char)(i * 13 + 1);
    CHECK(hipMemcpy(A, src, sizeof(src), HtoD));
    copy_entry("hipMemcpy", A, src, sizeof(src), HtoD, NULL);
    CHECK(hipMemcpyDtoD(M, A, sizeof(src)));
    copy_entry("hipMemcpyDtoD", M, A, sizeof(src), DtoD, NULL);
    CHECK(hipMemcpyDtoH(back, M, sizeof(back)));
    copy_entry("hipMemcpyDtoH", back, M, sizeof(back), DtoH, NULL);
    CHECK(hipMemcpyHtoD(B + 16, src2, sizeof(src2)));
    copy_entry("hipMemcpyHtoD", B + 16, src2, sizeof(src2), HtoD, NULL);
    CHECK(hipMemcpy(E, B + 16, sizeof(src2), DtoD));
    copy_entry("hipMemcpy", E, B + 16, sizeof(src2), DtoD, NULL);
    CHECK(hipMemcpyAsync(S + 8192, E, sizeof(src2), Default, stream));
    copy_entry("hipMemcpyAsync", S + 8192, E, sizeof(src2), Default, stream);
    CHECK(hipMemcpyAsync(back2, S + 8192, sizeof(back2), DtoH, stream));
    copy_entry("hipMemcpyAsync", back2, S + 8192, sizeof(back2), DtoH, stream);

    /* sets */
    CHECK(hipMemset(D, 0xab, D_SIZE));
    memset_entry("hipMemset", D, D_SIZE, 0xab, NULL);
    CHECK(hipMemsetAsync(C + 4096, 0x5a, 2048, stream));
    memset_entry("hipMemsetAsync", C + 4096, 2048, 0x5a, stream);

    CHECK(hipStreamSynchronize(stream));
    sync_entry("hipStreamSynchronize", stream);
    CHECK(hipMemcpy(back3, C + 4096, sizeof(back3), Default));
    copy_entry("hipMemcpy", back3, C + 4096, sizeof(back3), Default, NULL);
    CHECK(hipDeviceSynchronize());
    sync_entry("hipDeviceSynchronize", NULL);

    if (memcmp(back, src, sizeof(src)) || memcmp(back2, src2, sizeof(src2)))
        fail("hip_app: copied data did not round-trip");
    for (size_t i = 0; i < sizeof(back3); i++)
        if (back3[i] != 0x5a)
            fail("hip_app: hipMemsetAsync did not set its bytes");

    put(&launches, "]");
    put(&copies, "]");
    put(&memsets, "]");
    put(&syncs, "]");
    reset(&out);
    put(&out, "{\"phase\":\"launch\",\"launches\":%s,\"copies\":%s,\"memsets\":%s,\"syncs\":%s}",
        launches.s, copies.s, memsets.s, syncs.s);
    emit(&out);
}

static void phase_free(void) {
    if (!allocated) {
        phase_error("free", "alloc first");
        return;
    }
    reset(&out);
    put(&out, "{\"phase\":\"free\",\"frees\":[");
    char *plain[] = {A, B, C, D, M, E};
    for (int i = 0; i < 6; i++) {
        CHECK(hipFree(plain[i]));
        sep(&out);
        put(&out, "{\"kind\":\"free\",\"api\":\"hipFree\",\"ptr\":\"0x%llx\"}", PTR(plain[i]));
    }
    CHECK(hipFreeAsync(S, stream));
    put(&out, ",{\"kind\":\"free\",\"api\":\"hipFreeAsync\",\"ptr\":\"0x%llx\","
              "\"stream\":\"0x%llx\"}]}", PTR(S), PTR(stream));
    allocated = 0;
    emit(&out);
}

static void phase_spin(long n) {
    if (!looked_up) {
        phase_error("spin", "lookup first");
        return;
    }
    void *o = allocated ? C : NULL;
    float value = 1.0f;
    int count = 1024;
    void *params[] = {&o, &value, &count};
    double t0 = now();
    for (long i = 0; i < n; i++)
        CHECK(hipModuleLaunchKernel(functions[K_FILL_F], 4, 1, 1, 256, 1, 1, 0, NULL, params,
                                    NULL));
    CHECK(hipDeviceSynchronize());
    double t = now() - t0;
    reset(&out);
    put(&out, "{\"phase\":\"spin\",\"launches\":%ld,\"seconds\":%.9f}", n, t);
    emit(&out);
}

static void phase_structs(void) { phase_error("structs", "cuda_app only"); }

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s DIR\n", argv[0]);
        return 2;
    }
    dir = argv[1];
    return serve();
}
