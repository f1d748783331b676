/* Fake libamdhip64.so: the HIP runtime API on a machine without a GPU, for pos's CI.
 *
 * pos traces HIP processes by attaching uprobes to the libamdhip64.so they map, so this
 * library exports the runtime's real symbols with the real x86-64 ABI (types mirror
 * hip_runtime_api.h of ROCm 6). As in the fake libcuda, "device memory" is host memory that
 * copies and sets really move, modules are accepted without being parsed, and launches are
 * checked and run nothing.
 *
 * ABI note: hipLaunchKernel takes its two dim3 arguments BY VALUE. A dim3 is 12 bytes of
 * integers, so the SysV ABI passes each in two registers (x | y << 32, then z):
 * f=rdi, grid=rsi:rdx, block=rcx:r8, args=r9, and sharedMem and stream on the stack as the 7th
 * and 8th eightbytes. pos/bpf/hip.c reads them there. */
#define _GNU_SOURCE
#include "fake_common.h"

typedef int hipError_t;
typedef void *hipDeviceptr_t;
typedef struct fake_module *hipModule_t;
typedef struct fake_function *hipFunction_t;
typedef struct ihipStream_t *hipStream_t;
typedef struct ihipEvent_t *hipEvent_t;
typedef struct {
    uint32_t x, y, z;
} dim3;

typedef enum {
    hipMemcpyHostToHost = 0,
    hipMemcpyHostToDevice = 1,
    hipMemcpyDeviceToHost = 2,
    hipMemcpyDeviceToDevice = 3,
    hipMemcpyDefault = 4,
} hipMemcpyKind;

enum {
    hipSuccess = 0,
    hipErrorInvalidValue = 1,
    hipErrorOutOfMemory = 2,
    hipErrorNotInitialized = 3,
    hipErrorInvalidDeviceFunction = 98,
    hipErrorInvalidDevice = 101,
    hipErrorInvalidImage = 200,
    hipErrorInvalidHandle = 400,
    hipErrorNotFound = 500,
};

#define MAGIC_STREAM 0x53545248u /* "STRH" */

struct ihipStream_t {
    uint32_t magic;
};

API const char *hipGetErrorString(hipError_t e) {
    switch (e) {
    case hipSuccess: return "no error";
    case hipErrorInvalidValue: return "invalid argument";
    case hipErrorOutOfMemory: return "out of memory";
    case hipErrorNotInitialized: return "initialization error";
    case hipErrorInvalidDeviceFunction: return "invalid device function";
    case hipErrorInvalidDevice: return "invalid device ordinal";
    case hipErrorInvalidImage: return "device kernel image is invalid";
    case hipErrorInvalidHandle: return "invalid resource handle";
    case hipErrorNotFound: return "named symbol not found";
    default: return "unknown error";
    }
}

API hipError_t hipInit(unsigned int flags) { return flags ? hipErrorInvalidValue : hipSuccess; }

API hipError_t hipGetDeviceCount(int *count) {
    if (!count)
        return hipErrorInvalidValue;
    *count = 1;
    return hipSuccess;
}

API hipError_t hipSetDevice(int device) {
    return device == 0 ? hipSuccess : hipErrorInvalidDevice;
}

/* ---- streams and synchronisation -------------------------------------------------------- */
static int stream_valid(hipStream_t s) {
    return (uintptr_t)s <= 2 || s->magic == MAGIC_STREAM; /* NULL, legacy, per-thread */
}

API hipError_t hipStreamCreate(hipStream_t *stream) {
    if (!stream)
        return hipErrorInvalidValue;
    struct ihipStream_t *s = malloc(sizeof(*s));
    if (!s)
        return hipErrorOutOfMemory;
    s->magic = MAGIC_STREAM;
    *stream = s;
    return hipSuccess;
}

API hipError_t hipStreamDestroy(hipStream_t s) {
    if ((uintptr_t)s <= 2 || s->magic != MAGIC_STREAM)
        return hipErrorInvalidHandle;
    s->magic = 0;
    free(s);
    return hipSuccess;
}

API hipError_t hipStreamSynchronize(hipStream_t s) {
    return stream_valid(s) ? hipSuccess : hipErrorInvalidHandle;
}

API hipError_t hipDeviceSynchronize(void) { return hipSuccess; }

/* ---- allocations ------------------------------------------------------------------------ */
static hipError_t mem_alloc(void **ptr, size_t size, hipStream_t s) {
    if (!ptr)
        return hipErrorInvalidValue;
    if (!stream_valid(s))
        return hipErrorInvalidHandle;
    if (size == 0) { /* HIP answers a zero-byte request with NULL, successfully */
        *ptr = NULL;
        return hipSuccess;
    }
    void *p = dev_alloc(size);
    if (!p)
        return hipErrorOutOfMemory;
    *ptr = p;
    return hipSuccess;
}

API hipError_t hipMalloc(void **ptr, size_t size) { return mem_alloc(ptr, size, NULL); }

API hipError_t hipMallocManaged(void **ptr, size_t size, unsigned int flags) {
    if (flags != 1 && flags != 2) /* hipMemAttachGlobal, hipMemAttachHost */
        return hipErrorInvalidValue;
    return mem_alloc(ptr, size, NULL);
}

API hipError_t hipMallocAsync(void **ptr, size_t size, hipStream_t s) {
    return mem_alloc(ptr, size, s);
}

API hipError_t hipExtMallocWithFlags(void **ptr, size_t size, unsigned int flags) {
    (void)flags; /* hipDeviceMallocDefault, ...Finegrained, ...Uncached: all host memory here */
    return mem_alloc(ptr, size, NULL);
}

static hipError_t mem_free(void *p, hipStream_t s) {
    if (!stream_valid(s))
        return hipErrorInvalidHandle;
    if (!p)
        return hipSuccess;
    return dev_free((uintptr_t)p) == 0 ? hipSuccess : hipErrorInvalidValue;
}

API hipError_t hipFree(void *p) { return mem_free(p, NULL); }
API hipError_t hipFreeAsync(void *p, hipStream_t s) { return mem_free(p, s); }

/* ---- modules and functions -------------------------------------------------------------- */
API hipError_t hipModuleLoadData(hipModule_t *module, const void *image) {
    if (!module || !image)
        return hipErrorInvalidValue;
    struct fake_module *m = module_new(image);
    if (!m)
        return hipErrorInvalidImage;
    *module = m;
    return hipSuccess;
}

API hipError_t hipModuleGetFunction(hipFunction_t *function, hipModule_t module,
                                    const char *name) {
    if (!function || !name)
        return hipErrorInvalidValue;
    if (!is_module(module))
        return hipErrorInvalidHandle;
    struct fake_function *f = module_lookup(module, name, MAGIC_FUNCTION);
    if (!f)
        return hipErrorOutOfMemory;
    *function = f;
    return hipSuccess;
}

/* ---- launches --------------------------------------------------------------------------- */
#define HIP_LAUNCH_PARAM_BUFFER_POINTER ((void *)0x01)
#define HIP_LAUNCH_PARAM_BUFFER_SIZE ((void *)0x02)
#define HIP_LAUNCH_PARAM_END ((void *)0x03) /* 3 in HIP, unlike CUDA's 0 */

static hipError_t module_launch(hipFunction_t f, unsigned gx, unsigned gy, unsigned gz,
                                unsigned bx, unsigned by, unsigned bz, size_t shmem,
                                hipStream_t s, void **params, void **extra) {
    if (!is_function(f, MAGIC_FUNCTION))
        return hipErrorInvalidHandle;
    if (!stream_valid(s))
        return hipErrorInvalidHandle;
    if (!launch_dims_valid(gx, gy, gz, bx, by, bz) || shmem > (64u << 10) || (params && extra))
        return hipErrorInvalidValue;
    if (extra) {
        void *buffer = NULL;
        size_t *size = NULL;
        int i = 0;
        for (; i < 64 && extra[i] != HIP_LAUNCH_PARAM_END; i += 2) {
            if (extra[i] == HIP_LAUNCH_PARAM_BUFFER_POINTER)
                buffer = extra[i + 1];
            else if (extra[i] == HIP_LAUNCH_PARAM_BUFFER_SIZE)
                size = extra[i + 1];
            else
                return hipErrorInvalidValue;
        }
        if (i >= 64 || !buffer || !size || (*size == 0 && f->has_params == 1))
            return hipErrorInvalidValue;
    } else if (!params && f->has_params == 1) {
        return hipErrorInvalidValue;
    }
    return hipSuccess;
}

API hipError_t hipModuleLaunchKernel(hipFunction_t f, unsigned int gridDimX,
                                     unsigned int gridDimY, unsigned int gridDimZ,
                                     unsigned int blockDimX, unsigned int blockDimY,
                                     unsigned int blockDimZ, unsigned int sharedMemBytes,
                                     hipStream_t stream, void **kernelParams, void **extra) {
    return module_launch(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ,
                         sharedMemBytes, stream, kernelParams, extra);
}

/* Work sizes are in threads; the grid is global / local. */
API hipError_t hipExtModuleLaunchKernel(hipFunction_t f, uint32_t globalWorkSizeX,
                                        uint32_t globalWorkSizeY, uint32_t globalWorkSizeZ,
                                        uint32_t localWorkSizeX, uint32_t localWorkSizeY,
                                        uint32_t localWorkSizeZ, size_t sharedMemBytes,
                                        hipStream_t hStream, void **kernelParams, void **extra,
                                        hipEvent_t startEvent, hipEvent_t stopEvent,
                                        uint32_t flags) {
    (void)startEvent;
    (void)stopEvent;
    (void)flags;
    if (!localWorkSizeX || !localWorkSizeY || !localWorkSizeZ)
        return hipErrorInvalidValue;
    return module_launch(f, globalWorkSizeX / localWorkSizeX, globalWorkSizeY / localWorkSizeY,
                         globalWorkSizeZ / localWorkSizeZ, localWorkSizeX, localWorkSizeY,
                         localWorkSizeZ, sharedMemBytes, hStream, kernelParams, extra);
}

/* function_address is the host-side stub of a kernel (real HIP resolves it through what
 * __hipRegisterFunction registered); the fake takes any non-NULL address. */
API hipError_t hipLaunchKernel(const void *function_address, dim3 numBlocks, dim3 dimBlocks,
                               void **args, size_t sharedMemBytes, hipStream_t stream) {
    if (!function_address)
        return hipErrorInvalidDeviceFunction;
    if (!stream_valid(stream))
        return hipErrorInvalidHandle;
    if (!launch_dims_valid(numBlocks.x, numBlocks.y, numBlocks.z, dimBlocks.x, dimBlocks.y,
                           dimBlocks.z) ||
        sharedMemBytes > (64u << 10))
        return hipErrorInvalidValue;
    (void)args; /* may be NULL for a kernel without parameters; the fake cannot tell */
    return hipSuccess;
}

/* ---- copies and sets -------------------------------------------------------------------- */
enum { HOST = 0, DEVICE = 1, EITHER = 2 };

static int side_valid(const void *p, size_t n, int side) {
    if (!p)
        return 0;
    return side != DEVICE || range_covers((uintptr_t)p, n, RANGE_USABLE);
}

static hipError_t copy(void *dst, int dst_side, const void *src, int src_side, size_t n,
                       hipStream_t s) {
    if (!stream_valid(s))
        return hipErrorInvalidHandle;
    if (n == 0)
        return hipSuccess;
    if (!side_valid(dst, n, dst_side) || !side_valid(src, n, src_side))
        return hipErrorInvalidValue;
    memmove(dst, src, n);
    return hipSuccess;
}

static hipError_t copy_kind(void *dst, const void *src, size_t n, hipMemcpyKind kind,
                            hipStream_t s) {
    switch (kind) {
    case hipMemcpyHostToHost: return copy(dst, HOST, src, HOST, n, s);
    case hipMemcpyHostToDevice: return copy(dst, DEVICE, src, HOST, n, s);
    case hipMemcpyDeviceToHost: return copy(dst, HOST, src, DEVICE, n, s);
    case hipMemcpyDeviceToDevice: return copy(dst, DEVICE, src, DEVICE, n, s);
    case hipMemcpyDefault: return copy(dst, EITHER, src, EITHER, n, s);
    }
    return hipErrorInvalidValue;
}

API hipError_t hipMemcpy(void *dst, const void *src, size_t sizeBytes, hipMemcpyKind kind) {
    return copy_kind(dst, src, sizeBytes, kind, NULL);
}

API hipError_t hipMemcpyAsync(void *dst, const void *src, size_t sizeBytes, hipMemcpyKind kind,
                              hipStream_t stream) {
    return copy_kind(dst, src, sizeBytes, kind, stream);
}

API hipError_t hipMemcpyHtoD(hipDeviceptr_t dst, void *src, size_t sizeBytes) {
    return copy(dst, DEVICE, src, HOST, sizeBytes, NULL);
}

API hipError_t hipMemcpyDtoH(void *dst, hipDeviceptr_t src, size_t sizeBytes) {
    return copy(dst, HOST, src, DEVICE, sizeBytes, NULL);
}

API hipError_t hipMemcpyDtoD(hipDeviceptr_t dst, hipDeviceptr_t src, size_t sizeBytes) {
    return copy(dst, DEVICE, src, DEVICE, sizeBytes, NULL);
}

static hipError_t set(void *dst, int value, size_t n, hipStream_t s) {
    if (!stream_valid(s))
        return hipErrorInvalidHandle;
    if (n == 0)
        return hipSuccess;
    if (!side_valid(dst, n, DEVICE))
        return hipErrorInvalidValue;
    memset(dst, value & 0xff, n);
    return hipSuccess;
}

API hipError_t hipMemset(void *dst, int value, size_t sizeBytes) {
    return set(dst, value, sizeBytes, NULL);
}

API hipError_t hipMemsetAsync(void *dst, int value, size_t sizeBytes, hipStream_t stream) {
    return set(dst, value, sizeBytes, stream);
}
