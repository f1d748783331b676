/* Fake libcuda.so.1: the CUDA driver API on a machine without a GPU, for pos's CI.
 *
 * pos attaches real uprobes to the libcuda.so.1 that a process maps, so this library exports
 * the driver's real symbols with the real x86-64 ABI (the typedefs below mirror cuda.h of
 * CUDA 13; cuda.h itself is not included so that the build needs no CUDA headers). "Device
 * memory" is host memory: copies and sets really move bytes, so data round-trips. Module and
 * library loads accept a cubin, a fatbin or a __fatBinC_Wrapper_t without parsing it; function
 * lookups hand out one stable handle per (module, name); launches check their arguments as
 * the driver does and run nothing.
 *
 * The checkpoint API of driver 580 (cuCheckpointProcess*) keeps each process's state in
 * $POS_FAKECUDA_STATE_DIR/<pid> (default /tmp/pos-fakecuda) so that the state survives across
 * the processes that call it; cuInit marks the calling process as a CUDA process there (a
 * process of another PID namespace, a container's, is found as it names itself: see
 * state_path).
 * $POS_FAKECUDA_LOG names a file that gets "<name> <pid>" per checkpoint call, and the calls
 * named in $POS_FAKECUDA_FAIL (comma-separated; the checkpoint calls,
 * cuMemImportFromShareableHandle and cuMemHostRegister_v2) fail with CUDA_ERROR_UNKNOWN; "name:N" fails only
 * the first N calls of that name, counted across processes in the state directory (a transient
 * failure that an undo's retry gets past). $POS_FAKECUDA_HTOD_DELAY_US makes each copy from host
 * to device memory take that long more (a slow link: a restore's fill that visibly goes on while
 * the job runs). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>

#include "fake_common.h"
#include "../../pos/image/hash.h" /* pos_blocks, run on the CPU (see run_pos_blocks) */

/* ---- cuda.h types (CUDA 13), as far as these entry points need them ---------------------- */
typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef int CUjit_option;
typedef int CUlibraryOption;
typedef struct fake_module *CUmodule;
typedef struct fake_module *CUlibrary;
typedef struct fake_function *CUfunction;
typedef struct fake_function *CUkernel;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;
typedef struct CUlaunchAttribute_st CUlaunchAttribute; /* only passed through */
typedef struct CUctxCreateParams_st CUctxCreateParams; /* only passed through */

typedef struct {
    unsigned int gridDimX, gridDimY, gridDimZ;
    unsigned int blockDimX, blockDimY, blockDimZ;
    unsigned int sharedMemBytes;
    CUstream hStream;
    CUlaunchAttribute *attrs;
    unsigned int numAttrs;
} CUlaunchConfig;

typedef struct {
    int type; /* CUmemLocationType: 1 = device */
    int id;
} CUmemLocation;

typedef struct {
    int type;                 /* CUmemAllocationType: 1 = pinned */
    int requestedHandleTypes;
    CUmemLocation location;
    void *win32HandleMetaData;
    struct {
        unsigned char compressionType;
        unsigned char gpuDirectRDMACapable;
        unsigned short usage;
        unsigned char reserved[4];
    } allocFlags;
} CUmemAllocationProp;

typedef struct {
    CUmemLocation location;
    int flags; /* CUmemAccess_flags */
} CUmemAccessDesc;

typedef enum {
    CU_PROCESS_STATE_RUNNING = 0,
    CU_PROCESS_STATE_LOCKED = 1,
    CU_PROCESS_STATE_CHECKPOINTED = 2,
    CU_PROCESS_STATE_FAILED = 3,
} CUprocessState;

typedef struct {
    unsigned int timeoutMs;
    unsigned int reserved0;
    unsigned long long reserved1[7];
} CUcheckpointLockArgs;

typedef struct {
    unsigned long long reserved[8];
} CUcheckpointCheckpointArgs;

typedef struct {
    void *gpuPairs; /* CUcheckpointGpuPair * (two CUuuid each) */
    unsigned int gpuPairsCount;
    char reserved[52 - sizeof(void *)];
    unsigned long long reserved1;
} CUcheckpointRestoreArgs;

typedef struct {
    unsigned long long reserved[8];
} CUcheckpointUnlockArgs;

typedef struct {
    char reserved[64];
} CUipcMemHandle;

_Static_assert(sizeof(CUlaunchConfig) == 56, "CUlaunchConfig layout");
_Static_assert(__builtin_offsetof(CUlaunchConfig, hStream) == 32, "CUlaunchConfig.hStream");
_Static_assert(sizeof(CUmemAllocationProp) == 32, "CUmemAllocationProp layout");
_Static_assert(sizeof(CUcheckpointLockArgs) == 64, "CUcheckpointLockArgs layout");
_Static_assert(sizeof(CUcheckpointRestoreArgs) == 64, "CUcheckpointRestoreArgs layout");

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_IMAGE = 200,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_UNSUPPORTED_PTX_VERSION = 222,
    CUDA_ERROR_INVALID_HANDLE = 400,
    CUDA_ERROR_ILLEGAL_STATE = 401,
    CUDA_ERROR_NOT_FOUND = 500,
    CUDA_ERROR_MISALIGNED_ADDRESS = 716,
    CUDA_ERROR_NOT_SUPPORTED = 801,
    CUDA_ERROR_UNKNOWN = 999,
};

#define DRIVER_VERSION 13000
#define VMM_GRANULARITY (2u << 20) /* what cuMemGetAllocationGranularity reports on H100 */
#define PITCH_ALIGNMENT 512
#define MAX_DYNAMIC_SHARED (48u << 10) /* without cuFuncSetAttribute's opt-in */

/* ---- errors ----------------------------------------------------------------------------- */
static const struct {
    CUresult code;
    const char *name, *text;
} errors[] = {
    {CUDA_SUCCESS, "CUDA_SUCCESS", "no error"},
    {CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {CUDA_ERROR_INVALID_IMAGE, "CUDA_ERROR_INVALID_IMAGE", "device kernel image is invalid"},
    {CUDA_ERROR_MISALIGNED_ADDRESS, "CUDA_ERROR_MISALIGNED_ADDRESS",
     "misaligned address"},
    {CUDA_ERROR_UNSUPPORTED_PTX_VERSION, "CUDA_ERROR_UNSUPPORTED_PTX_VERSION",
     "the provided PTX was compiled with an unsupported toolchain."},
    {CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {CUDA_ERROR_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {CUDA_ERROR_ILLEGAL_STATE, "CUDA_ERROR_ILLEGAL_STATE",
     "the operation cannot be performed in the present state"},
    {CUDA_ERROR_NOT_FOUND, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
    {CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
    {CUDA_ERROR_UNKNOWN, "CUDA_ERROR_UNKNOWN", "unknown error"},
};

static CUresult error_lookup(CUresult error, const char **out, int want_name) {
    if (!out)
        return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < sizeof(errors) / sizeof(errors[0]); i++) {
        if (errors[i].code == error) {
            *out = want_name ? errors[i].name : errors[i].text;
            return CUDA_SUCCESS;
        }
    }
    *out = NULL;
    return CUDA_ERROR_INVALID_VALUE;
}

API CUresult cuGetErrorString(CUresult error, const char **pStr) {
    return error_lookup(error, pStr, 0);
}
API CUresult cuGetErrorName(CUresult error, const char **pStr) {
    return error_lookup(error, pStr, 1);
}

/* ---- initialisation, devices, contexts --------------------------------------------------- */
#define MAGIC_CONTEXT 0x43545854u /* "CTXT" */
#define MAGIC_STREAM 0x5354524du  /* "STRM" */
#define MAGIC_EVENT 0x45564e54u   /* "EVNT" */
#define MAGIC_VMM 0x564d4d48u     /* "VMMH" */

struct CUctx_st {
    uint32_t magic;
    CUdevice device;
};
struct CUstream_st {
    uint32_t magic;
    unsigned int flags;
    int capturing; /* between cuStreamBeginCapture and cuStreamEndCapture */
};
struct CUevent_st {
    uint32_t magic;
    unsigned int flags;
};

static int initialized;
static int primary_retained;  /* cuDevicePrimaryCtxRetain minus Release */
static struct CUctx_st primary_context = {MAGIC_CONTEXT, 0};
static __thread CUcontext current_context;

#define NEED_CONTEXT()                                                                         \
    do {                                                                                       \
        if (!initialized)                                                                      \
            return CUDA_ERROR_NOT_INITIALIZED;                                                 \
        if (!current_context)                                                                  \
            return CUDA_ERROR_INVALID_CONTEXT;                                                 \
    } while (0)

static void state_mark_cuda_process(void);

API CUresult cuInit(unsigned int flags) {
    if (flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (!initialized)
        state_mark_cuda_process();
    initialized = 1;
    return CUDA_SUCCESS;
}

API CUresult cuDriverGetVersion(int *version) {
    if (!version)
        return CUDA_ERROR_INVALID_VALUE;
    *version = DRIVER_VERSION;
    return CUDA_SUCCESS;
}

API CUresult cuDeviceGetCount(int *count) {
    if (!initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!count)
        return CUDA_ERROR_INVALID_VALUE;
    *count = 1;
    return CUDA_SUCCESS;
}

/* The one fake GPU's UUID: bytes 0x10..0x1f (NVML's form: GPU-10111213-1415-...). */
API CUresult cuDeviceGetUuid_v2(unsigned char uuid[16], CUdevice dev) {
    if (!initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!uuid)
        return CUDA_ERROR_INVALID_VALUE;
    if (dev != 0)
        return CUDA_ERROR_INVALID_DEVICE;
    for (int i = 0; i < 16; i++)
        uuid[i] = (unsigned char)(0x10 + i);
    return CUDA_SUCCESS;
}

API CUresult cuDeviceGet(CUdevice *device, int ordinal) {
    if (!initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!device)
        return CUDA_ERROR_INVALID_VALUE;
    if (ordinal != 0)
        return CUDA_ERROR_INVALID_DEVICE;
    *device = 0;
    return CUDA_SUCCESS;
}

API CUresult cuDeviceGetName(char *name, int len, CUdevice dev) {
    if (!initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (dev != 0)
        return CUDA_ERROR_INVALID_DEVICE;
    if (!name || len <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    snprintf(name, (size_t)len, "pos fake GPU (host memory)");
    return CUDA_SUCCESS;
}

static CUresult context_create(CUcontext *pctx, CUdevice dev) {
    if (!initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!pctx)
        return CUDA_ERROR_INVALID_VALUE;
    if (dev != 0)
        return CUDA_ERROR_INVALID_DEVICE;
    struct CUctx_st *c = malloc(sizeof(*c));
    if (!c)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *c = (struct CUctx_st){MAGIC_CONTEXT, dev};
    *pctx = current_context = c;
    return CUDA_SUCCESS;
}

API CUresult cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev) {
    (void)flags;
    return context_create(pctx, dev);
}

API CUresult cuCtxCreate_v4(CUcontext *pctx, CUctxCreateParams *params, unsigned int flags,
                            CUdevice dev) {
    (void)params;
    (void)flags;
    return context_create(pctx, dev);
}

API CUresult cuCtxDestroy_v2(CUcontext ctx) {
    if (!initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!ctx || ctx == &primary_context || ctx->magic != MAGIC_CONTEXT)
        return CUDA_ERROR_INVALID_CONTEXT;
    if (current_context == ctx)
        current_context = NULL;
    ctx->magic = 0;
    free(ctx);
    return CUDA_SUCCESS;
}

API CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
    if (!initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!pctx)
        return CUDA_ERROR_INVALID_VALUE;
    if (dev != 0)
        return CUDA_ERROR_INVALID_DEVICE;
    *pctx = &primary_context;
    primary_retained++;
    return CUDA_SUCCESS;
}

API CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int *flags, int *active) {
    if (!initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (dev != 0)
        return CUDA_ERROR_INVALID_DEVICE;
    if (!flags || !active)
        return CUDA_ERROR_INVALID_VALUE;
    *flags = 0;
    *active = primary_retained > 0;
    return CUDA_SUCCESS;
}

/* Not the driver's: for the tests, what this process holds now, which an operation of pos must
 * have let go of when it ends: with kinds 0 the holds on the primary context, else the ranges
 * (allocations, mappings, page-locked memory) of those kinds. */
API long fakeHeld(int kinds) {
    if (!kinds)
        return primary_retained;
    long n = 0;
    pthread_mutex_lock(&ranges_lock);
    for (size_t i = 0; i < n_ranges; i++)
        n += (ranges[i].kind & kinds) != 0;
    pthread_mutex_unlock(&ranges_lock);
    return n;
}

/* Only CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL (9): the one device of the fake. */
API CUresult cuPointerGetAttribute(void *data, int attribute, CUdeviceptr ptr) {
    if (!initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!data || !ptr || attribute != 9)
        return CUDA_ERROR_INVALID_VALUE;
    *(int *)data = 0;
    return CUDA_SUCCESS;
}

API CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
    if (!initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (dev != 0)
        return CUDA_ERROR_INVALID_DEVICE;
    if (primary_retained > 0)
        primary_retained--;
    return CUDA_SUCCESS;
}

API CUresult cuCtxSetCurrent(CUcontext ctx) {
    if (!initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (ctx && ctx->magic != MAGIC_CONTEXT)
        return CUDA_ERROR_INVALID_CONTEXT;
    current_context = ctx;
    return CUDA_SUCCESS;
}

API CUresult cuCtxGetCurrent(CUcontext *pctx) {
    if (!initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!pctx)
        return CUDA_ERROR_INVALID_VALUE;
    *pctx = current_context;
    return CUDA_SUCCESS;
}

API CUresult cuCtxSynchronize(void) {
    NEED_CONTEXT();
    return CUDA_SUCCESS;
}

/* The per-thread stack (CU_LIMIT_STACK_SIZE, 0) alone: 1 KiB, as the real driver starts. */
static size_t stack_limit = 1024;

API CUresult cuCtxGetLimit(size_t *value, int limit) {
    NEED_CONTEXT();
    if (!value || limit != 0)
        return CUDA_ERROR_INVALID_VALUE;
    *value = stack_limit;
    return CUDA_SUCCESS;
}

API CUresult cuCtxSetLimit(int limit, size_t value) {
    NEED_CONTEXT();
    if (limit != 0)
        return CUDA_ERROR_INVALID_VALUE;
    stack_limit = value;
    return CUDA_SUCCESS;
}

/* ---- streams and events ----------------------------------------------------------------- */
/* A stream cuStreamCreate made (not NULL, CU_STREAM_LEGACY (1) or CU_STREAM_PER_THREAD (2)). */
static int own_stream(CUstream s) {
    return (uintptr_t)s > 2 && s->magic == MAGIC_STREAM;
}

/* NULL, CU_STREAM_LEGACY (1), CU_STREAM_PER_THREAD (2) or a stream of ours. */
static int stream_valid(CUstream s) {
    return (uintptr_t)s <= 2 || own_stream(s);
}

API CUresult cuStreamCreate(CUstream *phStream, unsigned int flags) {
    NEED_CONTEXT();
    if (!phStream || flags > 1) /* CU_STREAM_DEFAULT or CU_STREAM_NON_BLOCKING */
        return CUDA_ERROR_INVALID_VALUE;
    struct CUstream_st *s = malloc(sizeof(*s));
    if (!s)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *s = (struct CUstream_st){MAGIC_STREAM, flags, 0};
    *phStream = s;
    return CUDA_SUCCESS;
}

/* Stream capture, as far as the agent looks at it: whether a stream is capturing (the graph
 * it would make is not kept). */
API CUresult cuStreamBeginCapture_v2(CUstream s, int mode) {
    NEED_CONTEXT();
    if (!own_stream(s) || mode < 0 || mode > 2)
        return CUDA_ERROR_INVALID_VALUE;
    s->capturing = 1;
    return CUDA_SUCCESS;
}

API CUresult cuStreamEndCapture(CUstream s, void **graph) {
    NEED_CONTEXT();
    if (!own_stream(s) || !s->capturing || !graph)
        return CUDA_ERROR_INVALID_VALUE;
    s->capturing = 0;
    *graph = NULL;
    return CUDA_SUCCESS;
}

API CUresult cuStreamIsCapturing(CUstream s, int *status) {
    NEED_CONTEXT();
    if (!stream_valid(s) || !status)
        return CUDA_ERROR_INVALID_VALUE;
    *status = own_stream(s) && s->capturing; /* CU_STREAM_CAPTURE_STATUS_ACTIVE = 1 */
    return CUDA_SUCCESS;
}

API CUresult cuThreadExchangeStreamCaptureMode(int *mode) {
    if (!mode || *mode < 0 || *mode > 2)
        return CUDA_ERROR_INVALID_VALUE;
    static __thread int current; /* CU_STREAM_CAPTURE_MODE_GLOBAL */
    int previous = current;
    current = *mode;
    *mode = previous;
    return CUDA_SUCCESS;
}

static CUresult stream_sync(CUstream s) {
    NEED_CONTEXT();
    return stream_valid(s) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}
API CUresult cuStreamSynchronize(CUstream s) { return stream_sync(s); }
API CUresult cuStreamSynchronize_ptsz(CUstream s) { return stream_sync(s); }

API CUresult cuStreamDestroy_v2(CUstream s) {
    NEED_CONTEXT();
    if (!own_stream(s))
        return CUDA_ERROR_INVALID_HANDLE;
    s->magic = 0;
    free(s);
    return CUDA_SUCCESS;
}

API CUresult cuEventCreate(CUevent *phEvent, unsigned int flags) {
    NEED_CONTEXT();
    if (!phEvent)
        return CUDA_ERROR_INVALID_VALUE;
    struct CUevent_st *e = malloc(sizeof(*e));
    if (!e)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *e = (struct CUevent_st){MAGIC_EVENT, flags};
    *phEvent = e;
    return CUDA_SUCCESS;
}

static CUresult event_record(CUevent e, CUstream s) {
    NEED_CONTEXT();
    if (!e || e->magic != MAGIC_EVENT || !stream_valid(s))
        return CUDA_ERROR_INVALID_HANDLE;
    return CUDA_SUCCESS;
}
API CUresult cuEventRecord(CUevent e, CUstream s) { return event_record(e, s); }
API CUresult cuEventRecord_ptsz(CUevent e, CUstream s) { return event_record(e, s); }

API CUresult cuEventSynchronize(CUevent e) {
    NEED_CONTEXT();
    return e && e->magic == MAGIC_EVENT ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

API CUresult cuEventDestroy_v2(CUevent e) {
    NEED_CONTEXT();
    if (!e || e->magic != MAGIC_EVENT)
        return CUDA_ERROR_INVALID_HANDLE;
    e->magic = 0;
    free(e);
    return CUDA_SUCCESS;
}

/* ---- allocations ------------------------------------------------------------------------ */
static CUresult mem_alloc(CUdeviceptr *dptr, size_t size, CUstream s) {
    NEED_CONTEXT();
    if (!dptr || size == 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (!stream_valid(s))
        return CUDA_ERROR_INVALID_HANDLE;
    void *p = dev_alloc(size);
    if (!p)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *dptr = (CUdeviceptr)(uintptr_t)p;
    return CUDA_SUCCESS;
}

API CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t size) { return mem_alloc(dptr, size, 0); }
API CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t size, CUstream s) {
    return mem_alloc(dptr, size, s);
}
API CUresult cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t size, CUstream s) {
    return mem_alloc(dptr, size, s);
}

API CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t width, size_t height,
                                unsigned int elementSize) {
    NEED_CONTEXT();
    if (!dptr || !pPitch || !width || !height ||
        (elementSize != 4 && elementSize != 8 && elementSize != 16))
        return CUDA_ERROR_INVALID_VALUE;
    size_t pitch = (width + PITCH_ALIGNMENT - 1) / PITCH_ALIGNMENT * PITCH_ALIGNMENT;
    void *p = dev_alloc(pitch * height);
    if (!p)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *dptr = (CUdeviceptr)(uintptr_t)p;
    *pPitch = pitch;
    return CUDA_SUCCESS;
}

static CUresult mem_free(CUdeviceptr p, CUstream s) {
    NEED_CONTEXT();
    if (!stream_valid(s))
        return CUDA_ERROR_INVALID_HANDLE;
    if (p == 0)
        return CUDA_SUCCESS;
    return dev_free((uintptr_t)p) == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}
API CUresult cuMemFree_v2(CUdeviceptr p) { return mem_free(p, 0); }
API CUresult cuMemFreeAsync(CUdeviceptr p, CUstream s) { return mem_free(p, s); }
API CUresult cuMemFreeAsync_ptsz(CUdeviceptr p, CUstream s) { return mem_free(p, s); }

/* ---- virtual memory management: reserve addresses, create memory, map it there ---------- */
struct vmm_handle {
    uint32_t magic;
    int fd; /* memfd holding the "physical" memory, so that mappings share it */
    size_t size;
    long restores; /* the driver's restores of this process before the handle was made */
    int imported;  /* made by cuMemImportFromShareableHandle: another process's memory */
    int handle_types; /* as cuMemCreate was asked (an import: the descriptor it came from) */
};

/* Live mappings of imported memory, by address: the driver's restore of a process that had one
 * at its checkpoint fails with CUDA_ERROR_NOT_SUPPORTED (801), measured on two H200s (driver
 * 580.159.04, bench/peer_probe.py). Their count goes to the state directory ("peer-PID"); the
 * checkpoint keeps it as it was then ("peer-checkpointed-PID"), which the restore, called by
 * another process, reads. */
#define MAX_PEER_MAPS 1024
static uintptr_t peer_vas[MAX_PEER_MAPS];
static int npeer_vas;
static void peer_maps_publish(void);

/* POS_FAKECUDA_STALE_EXPORT=1: memory made before the driver's last restore of this process is
 * not exported (CUDA_ERROR_INVALID_VALUE), as two H200s (driver 580.159.04) did after a
 * stop-the-world cycle that left the job running; the H100 exported it. */
static long restores_of_self(void);
static const char *state_dir(void);
static int stale_exports(void) {
    const char *v = getenv("POS_FAKECUDA_STALE_EXPORT");
    return v && strcmp(v, "1") == 0;
}

static int granular(size_t n) { return n && n % VMM_GRANULARITY == 0; }

API CUresult cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop,
                                           int option) {
    (void)option;
    if (!initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!granularity || !prop)
        return CUDA_ERROR_INVALID_VALUE;
    *granularity = VMM_GRANULARITY;
    return CUDA_SUCCESS;
}

API CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment,
                                 CUdeviceptr addr, unsigned long long flags) {
    NEED_CONTEXT();
    if (!ptr || !granular(size) || flags || (alignment & (alignment - 1)))
        return CUDA_ERROR_INVALID_VALUE;
    if (alignment < VMM_GRANULARITY)
        alignment = VMM_GRANULARITY;
    /* over-reserve, then trim to an aligned window */
    uintptr_t raw = (uintptr_t)mmap((void *)(uintptr_t)addr, size + alignment, PROT_NONE,
                                    MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if ((void *)raw == MAP_FAILED)
        return CUDA_ERROR_OUT_OF_MEMORY;
    uintptr_t base = (raw + alignment - 1) & ~(uintptr_t)(alignment - 1);
    if (base > raw)
        munmap((void *)raw, base - raw);
    munmap((void *)(base + size), raw + alignment - base);
    if (range_add(base, size, RANGE_RESERVED) != 0) {
        munmap((void *)base, size);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *ptr = base;
    return CUDA_SUCCESS;
}

API CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
    NEED_CONTEXT();
    if (!range_covers(ptr, size, RANGE_RESERVED) || range_overlaps(ptr, size, RANGE_MAPPED))
        return CUDA_ERROR_INVALID_VALUE;
    if (range_remove(ptr, RANGE_RESERVED) != size)
        return CUDA_ERROR_INVALID_VALUE;
    munmap((void *)(uintptr_t)ptr, size);
    return CUDA_SUCCESS;
}

API CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                         const CUmemAllocationProp *prop, unsigned long long flags) {
    NEED_CONTEXT();
    if (!handle || !prop || flags || !granular(size) || prop->type != 1 ||
        prop->location.type != 1)
        return CUDA_ERROR_INVALID_VALUE;
    if (prop->location.id != 0)
        return CUDA_ERROR_INVALID_DEVICE;
    struct vmm_handle *h = malloc(sizeof(*h));
    if (!h)
        return CUDA_ERROR_OUT_OF_MEMORY;
    h->fd = memfd_create("pos-fakecuda-vmm", MFD_CLOEXEC);
    if (h->fd < 0 || ftruncate(h->fd, (off_t)size) != 0) {
        if (h->fd >= 0)
            close(h->fd);
        free(h);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    h->magic = MAGIC_VMM;
    h->size = size;
    h->restores = stale_exports() ? restores_of_self() : 0;
    h->imported = 0;
    h->handle_types = prop->requestedHandleTypes;
    *handle = (CUmemGenericAllocationHandle)(uintptr_t)h;
    return CUDA_SUCCESS;
}

static struct vmm_handle *vmm_handle(CUmemGenericAllocationHandle handle) {
    struct vmm_handle *h = (struct vmm_handle *)(uintptr_t)handle;
    return h && h->magic == MAGIC_VMM ? h : NULL;
}

API CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
    NEED_CONTEXT();
    struct vmm_handle *h = vmm_handle(handle);
    if (!h)
        return CUDA_ERROR_INVALID_HANDLE;
    close(h->fd); /* mappings keep the memory alive, as the driver's do */
    h->magic = 0;
    free(h);
    return CUDA_SUCCESS;
}

static int injected_failure(const char *name); /* POS_FAKECUDA_FAIL: defined below */

API CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset,
                      CUmemGenericAllocationHandle handle, unsigned long long flags) {
    NEED_CONTEXT();
    struct vmm_handle *h = vmm_handle(handle);
    if (!h)
        return CUDA_ERROR_INVALID_HANDLE;
    if (flags || offset || !granular(size) || size > h->size ||
        !range_covers(ptr, size, RANGE_RESERVED) || range_overlaps(ptr, size, RANGE_MAPPED))
        return CUDA_ERROR_INVALID_VALUE;
    void *p = mmap((void *)(uintptr_t)ptr, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED,
                   h->fd, 0);
    if (p == MAP_FAILED)
        return CUDA_ERROR_OUT_OF_MEMORY;
    if (range_add(ptr, size, RANGE_MAPPED) != 0)
        return CUDA_ERROR_OUT_OF_MEMORY;
    if (h->imported && npeer_vas < MAX_PEER_MAPS) {
        peer_vas[npeer_vas++] = ptr;
        peer_maps_publish();
    }
    return CUDA_SUCCESS;
}

API CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc,
                            size_t count) {
    NEED_CONTEXT();
    /* one mapping, part of it, or several whole ones one after another */
    if (!desc || !count ||
        !(range_covers(ptr, size, RANGE_MAPPED) || range_tiled(ptr, size, RANGE_MAPPED)))
        return CUDA_ERROR_INVALID_VALUE;
    return CUDA_SUCCESS; /* mappings are already read-write */
}

API CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
    NEED_CONTEXT();
    if (range_remove(ptr, RANGE_MAPPED) != size)
        return CUDA_ERROR_INVALID_VALUE;
    for (int i = 0; i < npeer_vas; i++)
        if (peer_vas[i] == ptr) {
            peer_vas[i] = peer_vas[--npeer_vas];
            peer_maps_publish();
            break;
        }
    /* back to reserved, inaccessible addresses */
    mmap((void *)(uintptr_t)ptr, size, PROT_NONE,
         MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
    return CUDA_SUCCESS;
}

/* Page-locked host memory: plain host memory here. */
API CUresult cuMemHostAlloc(void **pp, size_t size, unsigned int flags) {
    (void)flags;
    NEED_CONTEXT();
    if (!pp || !size)
        return CUDA_ERROR_INVALID_VALUE;
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
        return CUDA_ERROR_OUT_OF_MEMORY;
    if (range_add((uintptr_t)p, size, RANGE_HOST) != 0) {
        munmap(p, size);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *pp = p;
    return CUDA_SUCCESS;
}

API CUresult cuMemFreeHost(void *p) {
    NEED_CONTEXT();
    size_t n = range_remove((uintptr_t)p, RANGE_HOST);
    if (!n)
        return CUDA_ERROR_INVALID_VALUE;
    munmap(p, n);
    return CUDA_SUCCESS;
}

API CUresult cuMemHostRegister_v2(void *p, size_t size, unsigned int flags) {
    (void)flags;
    NEED_CONTEXT();
    if (injected_failure("cuMemHostRegister_v2"))
        return CUDA_ERROR_UNKNOWN;
    if (!p || !size)
        return CUDA_ERROR_INVALID_VALUE;
    return range_add((uintptr_t)p, size, RANGE_HOST) == 0 ? CUDA_SUCCESS
                                                            : CUDA_ERROR_OUT_OF_MEMORY;
}

API CUresult cuMemHostUnregister(void *p) {
    NEED_CONTEXT();
    return range_remove((uintptr_t)p, RANGE_HOST) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* A 16 GiB device, of which the fake's allocations take nothing it tracks. */
API CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total) {
    NEED_CONTEXT();
    if (!free_bytes || !total)
        return CUDA_ERROR_INVALID_VALUE;
    *total = (size_t)16 << 30;
    /* POS_FAKECUDA_FREE_MIB: a GPU nearly full (the tests of what pos does without room) */
    const char *f = getenv("POS_FAKECUDA_FREE_MIB");
    *free_bytes = f && *f ? (size_t)strtoull(f, NULL, 10) << 20 : (size_t)8 << 30;
    return CUDA_SUCCESS;
}

/* Each such refusal leaves a descriptor of a character device 195:255 open, as the driver's left
 * one of /dev/nvidiactl (where the state directory can hold the node: root, no nodev). */
static void leak_nvidiactl(void) {
    char path[4096];
    snprintf(path, sizeof(path), "%s/nvidiactl", state_dir());
    mkdir(state_dir(), 0777);
    if (mknod(path, S_IFCHR | 0600, makedev(195, 255)) == 0 || errno == EEXIST) {
        int leaked = open(path, O_PATH | O_CLOEXEC); /* left open on purpose */
        (void)leaked;
    }
}

/* What the handle was made with: the driver's restore of the process leaves that as it was (an
 * H200, driver 580.159.04, bench/export_probe.py). */
API CUresult cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp *prop,
                                                    CUmemGenericAllocationHandle handle) {
    NEED_CONTEXT();
    struct vmm_handle *h = vmm_handle(handle);
    if (!h)
        return CUDA_ERROR_INVALID_HANDLE;
    if (!prop)
        return CUDA_ERROR_INVALID_VALUE;
    memset(prop, 0, sizeof(*prop));
    prop->type = 1;
    prop->requestedHandleTypes = h->handle_types;
    prop->location.type = 1;
    return CUDA_SUCCESS;
}

/* Shareable handles: the memfd itself, as the driver's POSIX file descriptor handle is. */
API CUresult cuMemExportToShareableHandle(void *shareable, CUmemGenericAllocationHandle handle,
                                          int type, unsigned long long flags) {
    NEED_CONTEXT();
    struct vmm_handle *h = vmm_handle(handle);
    if (!h)
        return CUDA_ERROR_INVALID_HANDLE;
    if (!shareable || type != 1 || flags)
        return CUDA_ERROR_INVALID_VALUE;
    if (stale_exports() && h->restores < restores_of_self()) {
        leak_nvidiactl();
        return CUDA_ERROR_INVALID_VALUE;
    }
    int fd = fcntl(h->fd, F_DUPFD_CLOEXEC, 0);
    if (fd < 0)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *(int *)shareable = fd;
    return CUDA_SUCCESS;
}

API CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle,
                                            void *shareable, int type) {
    NEED_CONTEXT();
    if (injected_failure("cuMemImportFromShareableHandle"))
        return CUDA_ERROR_UNKNOWN;
    struct stat sb;
    int fd = (int)(intptr_t)shareable;
    if (!handle || type != 1 || fstat(fd, &sb) != 0 || sb.st_size <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    struct vmm_handle *h = malloc(sizeof(*h));
    if (!h)
        return CUDA_ERROR_OUT_OF_MEMORY;
    h->fd = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (h->fd < 0) {
        free(h);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    h->magic = MAGIC_VMM;
    h->size = (size_t)sb.st_size;
    h->restores = stale_exports() ? restores_of_self() : 0;
    h->imported = 1;
    h->handle_types = 1;
    *handle = (CUmemGenericAllocationHandle)(uintptr_t)h;
    return CUDA_SUCCESS;
}

/* The allocation that holds p: its base and size (either may be NULL). */
API CUresult cuMemGetAddressRange_v2(CUdeviceptr *pbase, size_t *psize, CUdeviceptr p) {
    NEED_CONTEXT();
    uintptr_t base;
    size_t size;
    if (!range_find(p, RANGE_USABLE, &base, &size))
        return CUDA_ERROR_NOT_FOUND;
    if (pbase)
        *pbase = base;
    if (psize)
        *psize = size;
    return CUDA_SUCCESS;
}

/* ---- legacy IPC: a cuMemAlloc allocation opened by another process -----------------------
 * The handle names the owner's process and the allocation. The first handle of an allocation
 * turns its memory into a shared memfd mapping at the same address (its bytes kept); an opener
 * maps that through /proc/PID/map_files (root, as pos's tests run). As with the driver, only
 * cuMemAlloc's memory is shared this way: VMM memory has cuMemExportToShareableHandle. */
#define MAGIC_IPC 0x49504348u /* "IPCH" */
struct ipc_handle {
    uint32_t magic;
    int pid;
    uint64_t base, size;
};
_Static_assert(sizeof(struct ipc_handle) <= sizeof(CUipcMemHandle), "ipc handle size");

static void ipc_path(char *out, size_t len, int pid, uintptr_t base, size_t size) {
    snprintf(out, len, "/proc/%d/map_files/%lx-%lx", pid, (unsigned long)base,
             (unsigned long)(base + page_round(size)));
}

/* The allocation at base as a shared mapping of a memfd of its own: 0, or -1. */
static int ipc_share(uintptr_t base, size_t size) {
    char path[128], target[256];
    ipc_path(path, sizeof(path), getpid(), base, size);
    if (readlink(path, target, sizeof(target)) > 0)
        return 0; /* a file's mapping already: shared before */
    size_t len = page_round(size);
    int fd = memfd_create("pos-fakecuda-ipc", MFD_CLOEXEC);
    if (fd < 0)
        return -1;
    int ok = ftruncate(fd, (off_t)len) == 0;
    for (size_t at = 0; ok && at < len;) {
        ssize_t k = pwrite(fd, (const char *)base + at, len - at, (off_t)at);
        ok = k > 0;
        at += ok ? (size_t)k : 0;
    }
    ok = ok && mmap((void *)base, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0) !=
                   MAP_FAILED;
    close(fd);
    return ok ? 0 : -1;
}

API CUresult cuIpcGetMemHandle(CUipcMemHandle *handle, CUdeviceptr p) {
    NEED_CONTEXT();
    uintptr_t base;
    size_t size;
    if (!handle || !range_find(p, RANGE_ALLOC, &base, &size) || base != p)
        return CUDA_ERROR_INVALID_VALUE;
    if (ipc_share(base, size) != 0)
        return CUDA_ERROR_OUT_OF_MEMORY;
    struct ipc_handle h = {MAGIC_IPC, getpid(), base, size};
    memset(handle, 0, sizeof(*handle));
    memcpy(handle, &h, sizeof(h));
    return CUDA_SUCCESS;
}

static CUresult ipc_open(CUdeviceptr *p, const CUipcMemHandle *handle, unsigned int flags) {
    NEED_CONTEXT();
    struct ipc_handle h;
    memcpy(&h, handle, sizeof(h));
    if (!p || h.magic != MAGIC_IPC || flags > 1) /* 1: CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS */
        return CUDA_ERROR_INVALID_VALUE;
    char path[128];
    ipc_path(path, sizeof(path), h.pid, h.base, h.size);
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0)
        return CUDA_ERROR_INVALID_VALUE; /* the owner or its allocation is gone */
    void *m = mmap(NULL, page_round(h.size), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (m == MAP_FAILED)
        return CUDA_ERROR_OUT_OF_MEMORY;
    if (range_add((uintptr_t)m, h.size, RANGE_IPC) != 0) {
        munmap(m, page_round(h.size));
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *p = (CUdeviceptr)(uintptr_t)m;
    return CUDA_SUCCESS;
}

API CUresult cuIpcOpenMemHandle(CUdeviceptr *p, CUipcMemHandle handle, unsigned int flags) {
    return ipc_open(p, &handle, flags);
}
API CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *p, CUipcMemHandle handle, unsigned int flags) {
    return ipc_open(p, &handle, flags);
}

API CUresult cuIpcCloseMemHandle(CUdeviceptr p) {
    NEED_CONTEXT();
    size_t size = range_remove(p, RANGE_IPC);
    if (!size)
        return CUDA_ERROR_INVALID_VALUE;
    munmap((void *)(uintptr_t)p, page_round(size));
    return CUDA_SUCCESS;
}

/* cuGetProcAddress: the exported function of the version a caller of `cudaVersion` gets
 * (here: the _v2 of a name when there is one), per-thread-stream variants when asked. */
static void *self_handle(void) {
    static void *self;
    Dl_info info; /* named by a function of its own: an exported one may be an interposer's */
    if (!self && dladdr((void *)self_handle, &info) && info.dli_fname)
        self = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
    return self;
}

static CUresult proc_address(const char *symbol, void **pfn, unsigned long long flags) {
    if (!symbol || !pfn)
        return CUDA_ERROR_INVALID_VALUE;
    char name[256];
    const char *suffixes[] = {(flags & 2) ? "_v2_ptsz" : "_v2", (flags & 2) ? "_ptsz" : "",
                              (flags & 2) ? "_v2_ptds" : "", (flags & 2) ? "_ptds" : "", ""};
    for (size_t i = 0; i < sizeof(suffixes) / sizeof(*suffixes); i++) {
        snprintf(name, sizeof(name), "%s%s", symbol, suffixes[i]);
        /* this library's own symbol (through whatever dlsym the process has: a preloaded
         * interposer may hand back its wrapper, as it does for the real driver) */
        void *p = dlsym(self_handle(), name);
        if (p) {
            *pfn = p;
            return CUDA_SUCCESS;
        }
    }
    *pfn = NULL;
    return CUDA_ERROR_NOT_FOUND;
}

API CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion,
                                 unsigned long long flags, int *symbolStatus) {
    (void)cudaVersion;
    CUresult r = proc_address(symbol, pfn, flags);
    if (symbolStatus)
        *symbolStatus = r == CUDA_SUCCESS ? 0 : 1;
    return r;
}

API CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion,
                              unsigned long long flags) {
    (void)cudaVersion;
    return proc_address(symbol, pfn, flags);
}

API CUresult cuCtxGetDevice(CUdevice *device) {
    NEED_CONTEXT();
    if (!device)
        return CUDA_ERROR_INVALID_VALUE;
    *device = 0;
    return CUDA_SUCCESS;
}

/* ---- modules, libraries, functions, kernels --------------------------------------------- */
static CUresult module_load(CUmodule *module, const void *image) {
    NEED_CONTEXT();
    if (!module || !image)
        return CUDA_ERROR_INVALID_VALUE;
    struct fake_module *m = module_new(image);
    if (!m)
        return CUDA_ERROR_INVALID_IMAGE;
    *module = m;
    return CUDA_SUCCESS;
}

API CUresult cuModuleLoadData(CUmodule *module, const void *image) {
    if (injected_failure("cuModuleLoadData"))
        return CUDA_ERROR_UNSUPPORTED_PTX_VERSION; /* as a driver older than the PTX does */
    return module_load(module, image);
}

API CUresult cuModuleLoadDataEx(CUmodule *module, const void *image, unsigned int numOptions,
                                CUjit_option *options, void **optionValues) {
    if (numOptions && (!options || !optionValues))
        return CUDA_ERROR_INVALID_VALUE;
    return module_load(module, image);
}

API CUresult cuModuleLoadFatBinary(CUmodule *module, const void *fatCubin) {
    return module_load(module, fatCubin);
}

API CUresult cuLibraryLoadData(CUlibrary *library, const void *code, CUjit_option *jitOptions,
                               void **jitOptionsValues, unsigned int numJitOptions,
                               CUlibraryOption *libraryOptions, void **libraryOptionValues,
                               unsigned int numLibraryOptions) {
    if ((numJitOptions && (!jitOptions || !jitOptionsValues)) ||
        (numLibraryOptions && (!libraryOptions || !libraryOptionValues)))
        return CUDA_ERROR_INVALID_VALUE;
    /* unlike modules, libraries need no current context */
    if (!initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!library || !code)
        return CUDA_ERROR_INVALID_VALUE;
    struct fake_module *m = module_new(code);
    if (!m)
        return CUDA_ERROR_INVALID_IMAGE;
    *library = m;
    return CUDA_SUCCESS;
}

static CUresult lookup(struct fake_function **out, struct fake_module *m, const char *name,
                       uint32_t magic) {
    if (!initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!out || !name)
        return CUDA_ERROR_INVALID_VALUE;
    if (!is_module(m))
        return CUDA_ERROR_INVALID_HANDLE;
    struct fake_function *f = module_lookup(m, name, magic);
    if (!f)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *out = f;
    return CUDA_SUCCESS;
}

API CUresult cuModuleUnload(CUmodule hmod) {
    if (!initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    return is_module(hmod) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE; /* kept: handles stay valid */
}

API CUresult cuModuleGetFunction(CUfunction *hfunc, CUmodule hmod, const char *name) {
    return lookup(hfunc, hmod, name, MAGIC_FUNCTION);
}

API CUresult cuLibraryGetKernel(CUkernel *pKernel, CUlibrary library, const char *name) {
    return lookup(pKernel, library, name, MAGIC_KERNEL);
}

API CUresult cuKernelGetFunction(CUfunction *pFunc, CUkernel kernel) {
    NEED_CONTEXT();
    if (!pFunc)
        return CUDA_ERROR_INVALID_VALUE;
    if (!is_function(kernel, MAGIC_KERNEL))
        return CUDA_ERROR_INVALID_HANDLE;
    struct fake_function *f = kernel_function(kernel);
    if (!f)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *pFunc = f;
    return CUDA_SUCCESS;
}

/* The parameter layout of a kernel, as cuFuncGetParamInfo answers it. The fake parses no
 * image: it knows these layouts only, and says "not supported" for the rest (as a driver
 * before 12.4 would), fill_job's no_params included. */
static const struct {
    const char *name;
    int n;
    size_t offset[4], size[4];
} param_layouts[] = {
    {"_Z4axpyfPKfPfi", 4, {0, 8, 16, 24}, {4, 8, 8, 4}}, /* axpy(float, const float*, float*, int) */
    /* PyTorch's elementwise kernels for one output, and the one for several: (int N, a functor
     * holding an address, std::array<char*, 2> data) */
    {"_ZN2at6native29vectorized_elementwise_kernelILi4EN4test4CopyESt5arrayIPcLm2EEEEviT0_T1_", 3,
     {0, 8, 16}, {4, 8, 16}},
    {"_ZN2at6native27unrolled_elementwise_kernelIN4test4CopyESt5arrayIPcLm2EELi4EEEviT_T0_", 3,
     {0, 8, 16}, {4, 8, 16}},
    {"_ZN2at6native45unrolled_elementwise_kernel_for_multi_outputsILi2EN4test4CopyESt5arrayIPcLm2EEEEviT0_T1_",
     3, {0, 8, 16}, {4, 8, 16}},
    /* named as PyTorch's reduction and foreach kernels, which take every address by value */
    {"_ZN2at6native13reduce_kernelILi512ELi1EN4test4CopyEEEvT1_", 3, {0, 8, 16}, {4, 8, 16}},
    {"_ZN2at6native50_GLOBAL__N__b6ca21f8_17_ForeachUnaryOp_cu_77fe623d25multi_tensor_apply_"
     "kernelIN4test4CopyEEEvT_",
     3, {0, 8, 16}, {4, 8, 16}},
};

static CUresult param_info(CUfunction f, size_t i, size_t *offset, size_t *size) {
    if (!initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!is_function(f, MAGIC_FUNCTION) && !is_function(f, MAGIC_KERNEL))
        return CUDA_ERROR_INVALID_HANDLE;
    if (!offset)
        return CUDA_ERROR_INVALID_VALUE;
    for (size_t k = 0; k < sizeof(param_layouts) / sizeof(*param_layouts); k++) {
        if (strcmp(param_layouts[k].name, f->name) != 0)
            continue;
        if (i >= (size_t)param_layouts[k].n)
            return CUDA_ERROR_INVALID_VALUE;
        *offset = param_layouts[k].offset[i];
        if (size)
            *size = param_layouts[k].size[i];
        return CUDA_SUCCESS;
    }
    return CUDA_ERROR_NOT_SUPPORTED;
}

API CUresult cuFuncGetParamInfo(CUfunction func, size_t paramIndex, size_t *paramOffset,
                                size_t *paramSize) {
    return param_info(func, paramIndex, paramOffset, paramSize);
}

API CUresult cuKernelGetParamInfo(CUkernel kernel, size_t paramIndex, size_t *paramOffset,
                                  size_t *paramSize) {
    return param_info(kernel, paramIndex, paramOffset, paramSize);
}

/* A kernel's (mangled) name, as the driver (>= 12.3) answers it. */
static CUresult name_of(const char **name, CUfunction f) {
    if (!initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!name)
        return CUDA_ERROR_INVALID_VALUE;
    if (!is_function(f, MAGIC_FUNCTION) && !is_function(f, MAGIC_KERNEL))
        return CUDA_ERROR_INVALID_HANDLE;
    *name = f->name;
    return CUDA_SUCCESS;
}

API CUresult cuFuncGetName(const char **name, CUfunction func) { return name_of(name, func); }

API CUresult cuKernelGetName(const char **name, CUkernel kernel) { return name_of(name, kernel); }

/* ---- launches: checked like the driver checks them, then nothing runs ------------------- */
#define LAUNCH_PARAM_END 0
#define LAUNCH_PARAM_BUFFER_POINTER 1
#define LAUNCH_PARAM_BUFFER_SIZE 2

/* pos's own checksum kernel (pos/image/blocks.cu), the one kernel the fake runs: each of its
 * `threads` threads hashes one block with hash.h's code, as the GPU's threads do, so that the
 * engine's use of it (pos/concurrent/gpuhash.py) is tested here; that the GPU computes the
 * same is tests/gpu's. Its memory is host memory, as all of the fake's. */
static CUresult run_pos_blocks(uint64_t threads, void **params) {
    if (!params)
        return CUDA_ERROR_INVALID_VALUE;
    const unsigned char *src = *(const unsigned char **)params[0];
    uint64_t n = *(uint64_t *)params[1], k = *(uint64_t *)params[5];
    uint64_t *hashes = *(uint64_t **)params[2];
    const uint64_t *starts = *(const uint64_t **)params[3], *ends = *(const uint64_t **)params[4];
    unsigned char *hits = *(unsigned char **)params[6];
    if ((uintptr_t)src % 16) /* the GPU's 16-byte loads need it */
        return CUDA_ERROR_MISALIGNED_ADDRESS;
    for (uint64_t b = 0; b < threads && b * BLOCK < n; b++) {
        uint64_t at = b * BLOCK, len = n - at < BLOCK ? n - at : BLOCK;
        hashes[b] = pos_hash_point(src + at, len, starts, ends, k, hits);
    }
    return CUDA_SUCCESS;
}

static CUresult launch(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                       unsigned by, unsigned bz, unsigned shmem, CUstream s, void **params,
                       void **extra) {
    NEED_CONTEXT();
    /* a CUkernel is accepted where a CUfunction is, as the driver does */
    if (!is_function(f, MAGIC_FUNCTION) && !is_function(f, MAGIC_KERNEL))
        return CUDA_ERROR_INVALID_HANDLE;
    if (!stream_valid(s))
        return CUDA_ERROR_INVALID_HANDLE;
    if (!launch_dims_valid(gx, gy, gz, bx, by, bz) || shmem > MAX_DYNAMIC_SHARED)
        return CUDA_ERROR_INVALID_VALUE;
    if (params && extra)
        return CUDA_ERROR_INVALID_VALUE;
    if (extra) {
        void *buffer = NULL;
        size_t *size = NULL;
        int i = 0;
        for (; i < 64 && extra[i] != (void *)LAUNCH_PARAM_END; i += 2) {
            if (extra[i] == (void *)LAUNCH_PARAM_BUFFER_POINTER)
                buffer = extra[i + 1];
            else if (extra[i] == (void *)LAUNCH_PARAM_BUFFER_SIZE)
                size = extra[i + 1];
            else
                return CUDA_ERROR_INVALID_VALUE;
        }
        if (i >= 64 || !buffer || !size || (*size == 0 && f->has_params == 1))
            return CUDA_ERROR_INVALID_VALUE;
    } else if (!params && f->has_params == 1) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (strcmp(f->name, "pos_blocks") == 0)
        return run_pos_blocks(gx * (uint64_t)bx, params);
    return CUDA_SUCCESS;
}

API CUresult cuLaunchKernel(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                            unsigned int gridDimZ, unsigned int blockDimX, unsigned int blockDimY,
                            unsigned int blockDimZ, unsigned int sharedMemBytes, CUstream hStream,
                            void **kernelParams, void **extra) {
    return launch(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ,
                  sharedMemBytes, hStream, kernelParams, extra);
}

API CUresult cuLaunchKernel_ptsz(CUfunction f, unsigned int gridDimX, unsigned int gridDimY,
                                 unsigned int gridDimZ, unsigned int blockDimX,
                                 unsigned int blockDimY, unsigned int blockDimZ,
                                 unsigned int sharedMemBytes, CUstream hStream,
                                 void **kernelParams, void **extra) {
    return launch(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ,
                  sharedMemBytes, hStream, kernelParams, extra);
}

static CUresult launch_ex(const CUlaunchConfig *c, CUfunction f, void **params, void **extra) {
    if (!c || (c->numAttrs && !c->attrs))
        return CUDA_ERROR_INVALID_VALUE;
    return launch(f, c->gridDimX, c->gridDimY, c->gridDimZ, c->blockDimX, c->blockDimY,
                  c->blockDimZ, c->sharedMemBytes, c->hStream, params, extra);
}

API CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **kernelParams,
                              void **extra) {
    return launch_ex(config, f, kernelParams, extra);
}

API CUresult cuLaunchKernelEx_ptsz(const CUlaunchConfig *config, CUfunction f,
                                   void **kernelParams, void **extra) {
    return launch_ex(config, f, kernelParams, extra);
}

/* ---- copies and sets: real bytes move --------------------------------------------------- */
enum { HOST = 0, DEVICE = 1, EITHER = 2 };

static int side_valid(CUdeviceptr p, size_t n, int side) {
    if (!p)
        return 0;
    return side != DEVICE || range_covers((uintptr_t)p, n, RANGE_USABLE);
}

static CUresult copy(CUdeviceptr dst, int dst_side, CUdeviceptr src, int src_side, size_t n,
                     CUstream s) {
    NEED_CONTEXT();
    if (!stream_valid(s))
        return CUDA_ERROR_INVALID_HANDLE;
    if (n == 0)
        return CUDA_SUCCESS;
    if (!side_valid(dst, n, dst_side) || !side_valid(src, n, src_side))
        return CUDA_ERROR_INVALID_VALUE;
    memmove((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n);
    return CUDA_SUCCESS;
}

#define H(p) ((CUdeviceptr)(uintptr_t)(p))

API CUresult cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t n) {
    return copy(dst, EITHER, src, EITHER, n, 0);
}
API CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s) {
    return copy(dst, EITHER, src, EITHER, n, s);
}
API CUresult cuMemcpyAsync_ptsz(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s) {
    return copy(dst, EITHER, src, EITHER, n, s);
}
/* An entry point of a driver newer than pos (a name of the copies' family that no cuda.h
 * declares): a job that looks it up cannot be gated, and pos must refuse to cut it. */
API CUresult cuMemcpyFutureAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s) {
    return copy(dst, EITHER, src, EITHER, n, s);
}
/* $POS_FAKECUDA_HTOD_DELAY_US, before each copy from host to device memory. */
static void slow_link(void) {
    static long us = -1;
    if (us < 0) {
        const char *v = getenv("POS_FAKECUDA_HTOD_DELAY_US");
        us = v && *v ? atol(v) : 0;
    }
    if (us > 0)
        usleep((useconds_t)us);
}

API CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n) {
    slow_link();
    return copy(dst, DEVICE, H(src), HOST, n, 0);
}
API CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n) {
    return copy(H(dst), HOST, src, DEVICE, n, 0);
}
API CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n) {
    return copy(dst, DEVICE, src, DEVICE, n, 0);
}
API CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, CUstream s) {
    slow_link();
    return copy(dst, DEVICE, H(src), HOST, n, s);
}
API CUresult cuMemcpyHtoDAsync_v2_ptsz(CUdeviceptr dst, const void *src, size_t n, CUstream s) {
    slow_link();
    return copy(dst, DEVICE, H(src), HOST, n, s);
}
API CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, CUstream s) {
    return copy(H(dst), HOST, src, DEVICE, n, s);
}
API CUresult cuMemcpyDtoHAsync_v2_ptsz(void *dst, CUdeviceptr src, size_t n, CUstream s) {
    return copy(H(dst), HOST, src, DEVICE, n, s);
}
API CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s) {
    return copy(dst, DEVICE, src, DEVICE, n, s);
}
API CUresult cuMemcpyDtoDAsync_v2_ptsz(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s) {
    return copy(dst, DEVICE, src, DEVICE, n, s);
}

static CUresult set(CUdeviceptr dst, unsigned value, unsigned elem, size_t count, CUstream s) {
    NEED_CONTEXT();
    if (!stream_valid(s))
        return CUDA_ERROR_INVALID_HANDLE;
    if (count == 0)
        return CUDA_SUCCESS;
    if (dst % elem || count > SIZE_MAX / elem || !side_valid(dst, count * elem, DEVICE))
        return CUDA_ERROR_INVALID_VALUE;
    if (elem == 1) {
        memset((void *)(uintptr_t)dst, (int)(value & 0xff), count);
    } else if (elem == 2) {
        uint16_t *p = (uint16_t *)(uintptr_t)dst;
        for (size_t i = 0; i < count; i++)
            p[i] = (uint16_t)value;
    } else {
        uint32_t *p = (uint32_t *)(uintptr_t)dst;
        for (size_t i = 0; i < count; i++)
            p[i] = value;
    }
    return CUDA_SUCCESS;
}

API CUresult cuMemsetD8_v2(CUdeviceptr dst, unsigned char uc, size_t n) {
    return set(dst, uc, 1, n, 0);
}
API CUresult cuMemsetD16_v2(CUdeviceptr dst, unsigned short us, size_t n) {
    return set(dst, us, 2, n, 0);
}
API CUresult cuMemsetD32_v2(CUdeviceptr dst, unsigned int ui, size_t n) {
    return set(dst, ui, 4, n, 0);
}
API CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char uc, size_t n, CUstream s) {
    return set(dst, uc, 1, n, s);
}
API CUresult cuMemsetD8Async_ptsz(CUdeviceptr dst, unsigned char uc, size_t n, CUstream s) {
    return set(dst, uc, 1, n, s);
}
API CUresult cuMemsetD32Async(CUdeviceptr dst, unsigned int ui, size_t n, CUstream s) {
    return set(dst, ui, 4, n, s);
}
API CUresult cuMemsetD32Async_ptsz(CUdeviceptr dst, unsigned int ui, size_t n, CUstream s) {
    return set(dst, ui, 4, n, s);
}

/* ---- checkpoint API (driver 580): per-pid state in a file, shared across processes ------- */
static const char *const state_names[] = {"running", "locked", "checkpointed", "failed"};

static const char *state_dir(void) {
    const char *d = getenv("POS_FAKECUDA_STATE_DIR");
    return d && *d ? d : "/tmp/pos-fakecuda";
}

/* The inode of PID's PID namespace ("pid:[N]" -> N), 0 where it cannot be read. */
static unsigned long pidns_inode(const char *pid) {
    char link[64], target[64] = {0};
    snprintf(link, sizeof(link), "/proc/%s/ns/pid", pid);
    if (readlink(link, target, sizeof(target) - 1) < 0)
        return 0;
    return strtoul(target + strcspn(target, "[") + 1, NULL, 10);
}

/* PID as its own PID namespace sees it (the last NSpid field). */
static int inner_pid(int pid) {
    char path[64], line[256];
    int inner = pid;
    snprintf(path, sizeof(path), "/proc/%d/status", pid);
    FILE *f = fopen(path, "r");
    if (!f)
        return pid;
    while (fgets(line, sizeof(line), f))
        if (strncmp(line, "NSpid:", 6) == 0) {
            char *last = strrchr(line, '\t');
            inner = atoi(last ? last + 1 : line + 6);
        }
    fclose(f);
    return inner;
}

/* When PID started, in clock ticks after boot (/proc/PID/stat's 22nd field), 0 if unknown. */
static unsigned long long start_ticks(const char *pid) {
    char path[64], buf[1024] = {0};
    snprintf(path, sizeof(path), "/proc/%s/stat", pid);
    FILE *f = fopen(path, "r");
    if (!f)
        return 0;
    size_t n = fread(buf, 1, sizeof(buf) - 1, f);
    fclose(f);
    buf[n] = 0;
    char *p = strrchr(buf, ')');
    for (int field = 2; p && field < 22; field++)
        p = strchr(p + 1, ' ');
    return p ? strtoull(p + 1, NULL, 10) : 0;
}

/* A process in the caller's PID namespace is known by its PID; one in another (a container's
 * process, seen from the host) by that namespace's inode, its PID there and its start, which
 * is what it can name itself by (state_mark_cuda_process writes both): the inodes of ended
 * namespaces come back, so the start tells a new process from the stale file of an old one. */
static void state_path(char *out, size_t len, int pid) {
    char proc[16];
    snprintf(proc, sizeof(proc), "%d", pid);
    unsigned long theirs = pidns_inode(proc), mine = pidns_inode("self");
    if (theirs && mine && theirs != mine)
        snprintf(out, len, "%s/ns%lu-%d-%llu", state_dir(), theirs, inner_pid(pid),
                 start_ticks(proc));
    else
        snprintf(out, len, "%s/%d", state_dir(), pid);
}

static void state_alias_path(char *out, size_t len) {
    snprintf(out, len, "%s/ns%lu-%d-%llu", state_dir(), pidns_inode("self"), (int)getpid(),
             start_ticks("self"));
}

/* -1 when the process never called cuInit (no state file). */
static int state_read(int pid) {
    char path[4096], buf[32] = {0};
    state_path(path, sizeof(path), pid);
    FILE *f = fopen(path, "r");
    if (!f)
        return -1;
    size_t n = fread(buf, 1, sizeof(buf) - 1, f);
    fclose(f);
    buf[n] = 0;
    buf[strcspn(buf, "\n")] = 0;
    for (int i = 0; i < 4; i++)
        if (strcmp(buf, state_names[i]) == 0)
            return i;
    return CU_PROCESS_STATE_FAILED;
}

static int state_write_path(const char *path, int state) {
    char tmp[4200];
    const char *dir = state_dir();
    if (mkdir(dir, 0777) == 0)
        chmod(dir, 01777); /* shared by every user's processes, like /tmp */
    snprintf(tmp, sizeof(tmp), "%s.%d.tmp", path, (int)getpid());
    FILE *f = fopen(tmp, "w");
    if (!f)
        return -1;
    int ok = fprintf(f, "%s\n", state_names[state]) > 0;
    ok = (fclose(f) == 0) && ok;
    if (!ok || rename(tmp, path) != 0) {
        unlink(tmp);
        return -1;
    }
    return 0;
}

static int state_write(int pid, int state) {
    char path[4096];
    state_path(path, sizeof(path), pid);
    return state_write_path(path, state);
}

/* The state file this process created at cuInit, removed when it exits normally. */
static char marked_path[4096], marked_alias[4096];
static int marked_pid;

static void state_mark_cuda_process(void) {
    if (state_write((int)getpid(), CU_PROCESS_STATE_RUNNING) == 0) {
        marked_pid = (int)getpid();
        state_path(marked_path, sizeof(marked_path), marked_pid);
        state_alias_path(marked_alias, sizeof(marked_alias));
        state_write_path(marked_alias, CU_PROCESS_STATE_RUNNING);
    }
}

__attribute__((destructor)) static void state_unmark(void) {
    if (marked_pid && marked_pid == (int)getpid()) { /* not in a forked child */
        unlink(marked_path);
        unlink(marked_alias);
    }
}

static void checkpoint_log(const char *name, int pid) {
    const char *path = getenv("POS_FAKECUDA_LOG");
    if (!path || !*path)
        return;
    int fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0666);
    if (fd < 0)
        return;
    char line[128];
    int n = snprintf(line, sizeof(line), "%s %d\n", name, pid);
    ssize_t written = write(fd, line, (size_t)n); /* one write: concurrent lines stay whole */
    (void)written;
    close(fd);
}

/* A count kept in the state directory's file `name` (shared by every process), raised by
 * `by` first; 1 where the file cannot be kept. */
static long counter(const char *name, long by) {
    char path[4096];
    snprintf(path, sizeof(path), "%s/%s", state_dir(), name);
    if (mkdir(state_dir(), 0777) == 0)
        chmod(state_dir(), 01777);
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0666);
    if (fd < 0)
        return 1;
    flock(fd, LOCK_EX);
    char buf[32] = {0};
    ssize_t n = pread(fd, buf, sizeof(buf) - 1, 0);
    long count = (n > 0 ? strtol(buf, NULL, 10) : 0) + by;
    int len = snprintf(buf, sizeof(buf), "%ld\n", count);
    if (by && (ftruncate(fd, 0) != 0 || pwrite(fd, buf, (size_t)len, 0) != len))
        count = 1;
    close(fd); /* releases the lock */
    return count;
}

/* Calls of `name` made so far (this one included). */
static long count_call(const char *name) {
    char file[300];
    snprintf(file, sizeof(file), "fail-count-%s", name);
    return counter(file, 1);
}

static long restores_of_self(void) {
    char file[64];
    snprintf(file, sizeof(file), "restores-%d", (int)getpid());
    return counter(file, 0);
}

static int injected_failure(const char *name) {
    const char *list = getenv("POS_FAKECUDA_FAIL");
    size_t len = strlen(name);
    while (list && *list) {
        size_t n = strcspn(list, ",");
        if (n >= len && strncmp(list, name, len) == 0) {
            if (n == len)
                return 1;
            if (list[len] == ':')
                return count_call(name) <= strtol(list + len + 1, NULL, 10);
        }
        list += n + (list[n] == ',');
    }
    return 0;
}

static int all_zero(const void *p, size_t n) {
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++)
        if (b[i])
            return 0;
    return 1;
}

/* Common prologue: log, injected failure, argument and target checks; on success *state is
 * the target's state. */
/* A process of another PID namespace with no state that maps this library: it cannot have
 * called cuInit as itself (that writes its state), so CRIU restored it from a checkpointed
 * process, as the driver finds such a copy (the state of one image's copies, each in new
 * namespaces, is each copy's own from then on). */
static int restored_elsewhere(int pid) {
    char proc[16], path[64], line[4096];
    snprintf(proc, sizeof(proc), "%d", pid);
    unsigned long theirs = pidns_inode(proc), mine = pidns_inode("self");
    if (!theirs || !mine || theirs == mine)
        return 0;
    snprintf(path, sizeof(path), "/proc/%d/maps", pid);
    FILE *f = fopen(path, "r");
    int found = 0;
    while (f && !found && fgets(line, sizeof(line), f))
        found = strstr(line, "/libcuda.so") != NULL;
    if (f)
        fclose(f);
    return found;
}

static CUresult checkpoint_begin(const char *name, int pid, int args_valid, int *state) {
    checkpoint_log(name, pid);
    if (injected_failure(name))
        return CUDA_ERROR_UNKNOWN;
    if (!args_valid || pid <= 0 || (kill(pid, 0) != 0 && errno == ESRCH))
        return CUDA_ERROR_INVALID_VALUE;
    *state = state_read(pid);
    if (*state < 0 && restored_elsewhere(pid)) /* a copy CRIU made in a new PID namespace */
        *state = CU_PROCESS_STATE_CHECKPOINTED;
    if (*state < 0) /* alive but never initialised CUDA */
        return CUDA_ERROR_NOT_INITIALIZED;
    return CUDA_SUCCESS;
}

/* A transition from `from` to `to`, or CUDA_ERROR_ILLEGAL_STATE. */
static CUresult transition(const char *name, int pid, int args_valid, int from, int to) {
    int state;
    CUresult r = checkpoint_begin(name, pid, args_valid, &state);
    if (r != CUDA_SUCCESS)
        return r;
    if (state != from)
        return CUDA_ERROR_ILLEGAL_STATE;
    return state_write(pid, to) == 0 ? CUDA_SUCCESS : CUDA_ERROR_UNKNOWN;
}

/* The optional argument structs' reserved fields must be zero. */
API CUresult cuCheckpointProcessLock(int pid, CUcheckpointLockArgs *args) {
    int valid = !args || (!args->reserved0 && all_zero(args->reserved1, sizeof(args->reserved1)));
    return transition(__func__, pid, valid, CU_PROCESS_STATE_RUNNING, CU_PROCESS_STATE_LOCKED);
}

API CUresult cuCheckpointProcessCheckpoint(int pid, CUcheckpointCheckpointArgs *args) {
    int valid = !args || all_zero(args, sizeof(*args));
    CUresult r = transition(__func__, pid, valid, CU_PROCESS_STATE_LOCKED,
                            CU_PROCESS_STATE_CHECKPOINTED);
    if (r == CUDA_SUCCESS) { /* what the restore will fail on: the imports mapped now */
        char live[64], kept[64];
        snprintf(live, sizeof(live), "peer-%d", pid);
        snprintf(kept, sizeof(kept), "peer-checkpointed-%d", pid);
        counter(kept, counter(live, 0) - counter(kept, 0));
    }
    return r;
}

static void peer_maps_publish(void) {
    char file[64];
    snprintf(file, sizeof(file), "peer-%d", (int)getpid());
    long now = counter(file, 0);
    counter(file, npeer_vas - now);
}

API CUresult cuCheckpointProcessRestore(int pid, CUcheckpointRestoreArgs *args) {
    int valid = !args || ((args->gpuPairs || !args->gpuPairsCount) &&
                          all_zero(args->reserved, sizeof(args->reserved)) && !args->reserved1);
    char peers[64];
    snprintf(peers, sizeof(peers), "peer-checkpointed-%d", pid);
    int state;
    if (valid && counter(peers, 0) > 0 && checkpoint_begin(__func__, pid, 1, &state) == 0 &&
        state == CU_PROCESS_STATE_CHECKPOINTED)
        return CUDA_ERROR_NOT_SUPPORTED; /* stays checkpointed: the driver's undo fails too */
    CUresult r = transition(__func__, pid, valid, CU_PROCESS_STATE_CHECKPOINTED,
                            CU_PROCESS_STATE_LOCKED);
    if (r == CUDA_SUCCESS) {
        char file[64];
        snprintf(file, sizeof(file), "restores-%d", pid);
        counter(file, 1);
    }
    return r;
}

API CUresult cuCheckpointProcessUnlock(int pid, CUcheckpointUnlockArgs *args) {
    int valid = !args || all_zero(args, sizeof(*args));
    return transition(__func__, pid, valid, CU_PROCESS_STATE_LOCKED, CU_PROCESS_STATE_RUNNING);
}

API CUresult cuCheckpointProcessGetState(int pid, CUprocessState *out) {
    int state;
    CUresult r = checkpoint_begin(__func__, pid, out != NULL, &state);
    if (r == CUDA_SUCCESS)
        *out = (CUprocessState)state;
    return r;
}

API CUresult cuCheckpointProcessGetRestoreThreadId(int pid, int *tid) {
    int state;
    CUresult r = checkpoint_begin(__func__, pid, tid != NULL, &state);
    if (r == CUDA_SUCCESS)
        *tid = pid; /* the fake has no restore thread of its own: the main thread stands in */
    return r;
}
