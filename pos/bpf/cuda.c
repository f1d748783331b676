/* Uprobes on the CUDA driver library (libcuda.so.1). One function per exported symbol:
 * on_<symbol> at entry, ret_<symbol> at return; pos/tracer/probes.py lists which exist.
 * Argument positions follow cuda.h; arguments 7 and up are read from the stack. */
#include "common.h"

/* ---- allocations ------------------------------------------------------------------------ */
#define ALLOC(sym, size, stream)                                                               \
    int on_##sym(struct pt_regs *ctx) { return stash(API_##sym, ARG1, size, stream, 0); }     \
    int ret_##sym(struct pt_regs *ctx) { return alloc_ret(ctx, API_##sym, POS_ALLOC); }

ALLOC(cuMemAlloc_v2, ARG2, 0)
ALLOC(cuMemAllocManaged, ARG2, 0)
ALLOC(cuMemAllocAsync, ARG2, ARG3)
ALLOC(cuMemAllocAsync_ptsz, ARG2, ARG3)
ALLOC(cuMemAllocFromPoolAsync, ARG2, ARG4)
ALLOC(cuMemAllocFromPoolAsync_ptsz, ARG2, ARG4)

/* cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pPitch, size_t width, size_t height, uint elem) */
int on_cuMemAllocPitch_v2(struct pt_regs *ctx) {
    return stash(API_cuMemAllocPitch_v2, ARG1, ARG2, ARG4, 0);
}
int ret_cuMemAllocPitch_v2(struct pt_regs *ctx) {
    struct pos_pending p;
    if (!take(ctx, API_cuMemAllocPitch_v2, &p))
        return 0;
    return emit(ctx, POS_ALLOC, API_cuMemAllocPitch_v2, read_u64(p.out), read_u64(p.a) * p.b, 0,
                0, 0);
}

#define FREE(sym, stream)                                                                      \
    int on_##sym(struct pt_regs *ctx) { return emit(ctx, POS_FREE, API_##sym, ARG1, 0, stream, 0, 0); }

FREE(cuMemFree_v2, 0)
FREE(cuMemFreeAsync, ARG2)
FREE(cuMemFreeAsync_ptsz, ARG2)

/* ---- virtual memory management (PyTorch's expandable segments) --------------------------- */
/* cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr, flags) */
int on_cuMemAddressReserve(struct pt_regs *ctx) {
    return stash(API_cuMemAddressReserve, ARG1, ARG2, 0, 0);
}
int ret_cuMemAddressReserve(struct pt_regs *ctx) {
    return alloc_ret(ctx, API_cuMemAddressReserve, POS_RESERVE);
}
int on_cuMemAddressFree(struct pt_regs *ctx) {
    return emit(ctx, POS_UNRESERVE, API_cuMemAddressFree, ARG1, ARG2, 0, 0, 0);
}
/* cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const prop *, flags) */
int on_cuMemCreate(struct pt_regs *ctx) { return stash(API_cuMemCreate, ARG1, ARG2, 0, 0); }
int ret_cuMemCreate(struct pt_regs *ctx) { return alloc_ret(ctx, API_cuMemCreate, POS_CREATE); }
int on_cuMemRelease(struct pt_regs *ctx) {
    return emit(ctx, POS_RELEASE, API_cuMemRelease, ARG1, 0, 0, 0, 0);
}
/* cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, handle, flags): memory becomes usable */
int on_cuMemMap(struct pt_regs *ctx) { return stash(API_cuMemMap, ARG1, ARG2, ARG4, 0); }
int ret_cuMemMap(struct pt_regs *ctx) {
    struct pos_pending p;
    if (!take(ctx, API_cuMemMap, &p))
        return 0;
    return emit(ctx, POS_ALLOC, API_cuMemMap, p.out, p.a, p.b, 0, 0);
}
int on_cuMemUnmap(struct pt_regs *ctx) {
    return emit(ctx, POS_FREE, API_cuMemUnmap, ARG1, ARG2, 0, 0, 0);
}

/* ---- launches ---------------------------------------------------------------------------- */
/* cuLaunchKernel(f, gx, gy, gz, bx, by, bz, shmem, stream, kernelParams, extra) */
#define LAUNCH(sym)                                                                            \
    int on_##sym(struct pt_regs *ctx) {                                                        \
        u64 st[5] = {};                                                                        \
        bpf_probe_read_user(st, sizeof(st), (void *)(PT_REGS_SP(ctx) + 8));                    \
        return launch(ctx, API_##sym, ARG1, st[2], ARG2, ARG3, ARG4, ARG5, ARG6, st[0], st[1], \
                      st[3], st[4]);                                                           \
    }

LAUNCH(cuLaunchKernel)
LAUNCH(cuLaunchKernel_ptsz)
LAUNCH(cuLaunchCooperativeKernel)
LAUNCH(cuLaunchCooperativeKernel_ptsz)

/* cuLaunchKernelEx(const CUlaunchConfig *config, f, kernelParams, extra); the config holds
 * gridDim[3], blockDim[3], sharedMemBytes (u32 each), then hStream at offset 32. */
struct pos_launch_config {
    u32 grid[3];
    u32 block[3];
    u32 shared_mem;
    u32 pad;
    u64 stream;
};
#define LAUNCH_EX(sym)                                                                         \
    int on_##sym(struct pt_regs *ctx) {                                                        \
        struct pos_launch_config c = {};                                                       \
        bpf_probe_read_user(&c, sizeof(c), (void *)ARG1);                                      \
        return launch(ctx, API_##sym, ARG2, c.stream, c.grid[0], c.grid[1], c.grid[2],         \
                      c.block[0], c.block[1], c.block[2], c.shared_mem, ARG3, ARG4);           \
    }

LAUNCH_EX(cuLaunchKernelEx)
LAUNCH_EX(cuLaunchKernelEx_ptsz)

/* A graph launch is opaque: its kernels are not seen one by one. */
#define GRAPH(sym)                                                                             \
    int on_##sym(struct pt_regs *ctx) {                                                        \
        return launch(ctx, API_##sym, ARG1, ARG2, 0, 0, 0, 0, 0, 0, 0, 0, 0);                  \
    }

GRAPH(cuGraphLaunch)
GRAPH(cuGraphLaunch_ptsz)

/* ---- copies and sets --------------------------------------------------------------------- */
#define COPY(sym, dir, dst, src, size, stream)                                                 \
    int on_##sym(struct pt_regs *ctx) {                                                        \
        return emit(ctx, POS_MEMCPY, API_##sym, dst, src, size, stream, dir);                  \
    }

COPY(cuMemcpy, POS_DEFAULT, ARG1, ARG2, ARG3, 0)
COPY(cuMemcpy_ptds, POS_DEFAULT, ARG1, ARG2, ARG3, 0)
COPY(cuMemcpyAsync, POS_DEFAULT, ARG1, ARG2, ARG3, ARG4)
COPY(cuMemcpyAsync_ptsz, POS_DEFAULT, ARG1, ARG2, ARG3, ARG4)
COPY(cuMemcpyHtoD_v2, POS_HTOD, ARG1, ARG2, ARG3, 0)
COPY(cuMemcpyHtoD_v2_ptds, POS_HTOD, ARG1, ARG2, ARG3, 0)
COPY(cuMemcpyDtoH_v2, POS_DTOH, ARG1, ARG2, ARG3, 0)
COPY(cuMemcpyDtoH_v2_ptds, POS_DTOH, ARG1, ARG2, ARG3, 0)
COPY(cuMemcpyDtoD_v2, POS_DTOD, ARG1, ARG2, ARG3, 0)
COPY(cuMemcpyDtoD_v2_ptds, POS_DTOD, ARG1, ARG2, ARG3, 0)
COPY(cuMemcpyHtoDAsync_v2, POS_HTOD, ARG1, ARG2, ARG3, ARG4)
COPY(cuMemcpyHtoDAsync_v2_ptsz, POS_HTOD, ARG1, ARG2, ARG3, ARG4)
COPY(cuMemcpyDtoHAsync_v2, POS_DTOH, ARG1, ARG2, ARG3, ARG4)
COPY(cuMemcpyDtoHAsync_v2_ptsz, POS_DTOH, ARG1, ARG2, ARG3, ARG4)
COPY(cuMemcpyDtoDAsync_v2, POS_DTOD, ARG1, ARG2, ARG3, ARG4)
COPY(cuMemcpyDtoDAsync_v2_ptsz, POS_DTOD, ARG1, ARG2, ARG3, ARG4)
/* cuMemcpyPeer(dst, dstCtx, src, srcCtx, size) and its Async form (stream 6th) */
COPY(cuMemcpyPeer, POS_DTOD, ARG1, ARG3, ARG5, 0)
COPY(cuMemcpyPeer_ptds, POS_DTOD, ARG1, ARG3, ARG5, 0)
COPY(cuMemcpyPeerAsync, POS_DTOD, ARG1, ARG3, ARG5, ARG6)
COPY(cuMemcpyPeerAsync_ptsz, POS_DTOD, ARG1, ARG3, ARG5, ARG6)

/* cuMemcpy2D_v2(const CUDA_MEMCPY2D *): the copied rectangle's first byte and its extent. */
struct pos_memcpy2d {
    u64 src_x, src_y;
    u32 src_type, pad0;
    u64 src_host, src_device, src_array, src_pitch;
    u64 dst_x, dst_y;
    u32 dst_type, pad1;
    u64 dst_host, dst_device, dst_array, dst_pitch;
    u64 width, height;
};
static __always_inline int copy2d(struct pt_regs *ctx, u16 api, u64 desc, u64 stream) {
    struct pos_memcpy2d d = {};
    bpf_probe_read_user(&d, sizeof(d), (void *)desc);
    /* CUmemorytype: 1 host, 2 device, 3 array, 4 unified */
    u64 src = d.src_type == 1 ? d.src_host : d.src_device;
    u64 dst = d.dst_type == 1 ? d.dst_host : d.dst_device;
    src += d.src_y * d.src_pitch + d.src_x;
    dst += d.dst_y * d.dst_pitch + d.dst_x;
    u64 dir = POS_DEFAULT;
    if (d.src_type == 1 && d.dst_type == 2)
        dir = POS_HTOD;
    else if (d.src_type == 2 && d.dst_type == 1)
        dir = POS_DTOH;
    else if (d.src_type == 2 && d.dst_type == 2)
        dir = POS_DTOD;
    else if (d.src_type == 1 && d.dst_type == 1)
        dir = POS_HTOH;
    u64 pitch = d.dst_type == 2 ? d.dst_pitch : d.src_pitch;
    u64 size = d.height ? (d.height - 1) * pitch + d.width : 0;
    return emit(ctx, POS_MEMCPY, api, dst, src, size, stream, dir);
}
int on_cuMemcpy2D_v2(struct pt_regs *ctx) { return copy2d(ctx, API_cuMemcpy2D_v2, ARG1, 0); }
int on_cuMemcpy2D_v2_ptds(struct pt_regs *ctx) {
    return copy2d(ctx, API_cuMemcpy2D_v2_ptds, ARG1, 0);
}
int on_cuMemcpy2DAsync_v2(struct pt_regs *ctx) {
    return copy2d(ctx, API_cuMemcpy2DAsync_v2, ARG1, ARG2);
}
int on_cuMemcpy2DAsync_v2_ptsz(struct pt_regs *ctx) {
    return copy2d(ctx, API_cuMemcpy2DAsync_v2_ptsz, ARG1, ARG2);
}

/* cuMemsetD{8,16,32}(dst, value, count[, stream]): size in bytes = count * element size */
#define SET(sym, elem, stream)                                                                 \
    int on_##sym(struct pt_regs *ctx) {                                                        \
        return emit(ctx, POS_MEMSET, API_##sym, ARG1, ARG3 * elem, ARG2, stream, elem);        \
    }

SET(cuMemsetD8_v2, 1, 0)
SET(cuMemsetD8_v2_ptds, 1, 0)
SET(cuMemsetD16_v2, 2, 0)
SET(cuMemsetD16_v2_ptds, 2, 0)
SET(cuMemsetD32_v2, 4, 0)
SET(cuMemsetD32_v2_ptds, 4, 0)
SET(cuMemsetD8Async, 1, ARG4)
SET(cuMemsetD8Async_ptsz, 1, ARG4)
SET(cuMemsetD16Async, 2, ARG4)
SET(cuMemsetD16Async_ptsz, 2, ARG4)
SET(cuMemsetD32Async, 4, ARG4)
SET(cuMemsetD32Async_ptsz, 4, ARG4)

/* ---- synchronisation --------------------------------------------------------------------- */
#define SYNC(sym, handle, stream)                                                              \
    int on_##sym(struct pt_regs *ctx) {                                                        \
        return emit(ctx, POS_SYNC, API_##sym, handle, stream, 0, 0, 0);                        \
    }

SYNC(cuCtxSynchronize, 0, 0)
SYNC(cuStreamSynchronize, ARG1, ARG1)
SYNC(cuStreamSynchronize_ptsz, ARG1, ARG1)
SYNC(cuEventRecord, ARG1, ARG2)
SYNC(cuEventRecord_ptsz, ARG1, ARG2)
SYNC(cuEventSynchronize, ARG1, 0)
SYNC(cuStreamWaitEvent, ARG2, ARG1)
SYNC(cuStreamWaitEvent_ptsz, ARG2, ARG1)

/* ---- modules and functions (names and parameter layouts) --------------------------------- */
#define MODULE(sym)                                                                            \
    int on_##sym(struct pt_regs *ctx) { return stash(API_##sym, ARG1, ARG2, 0, 0); }          \
    int ret_##sym(struct pt_regs *ctx) { return module_ret(ctx, API_##sym); }

MODULE(cuModuleLoadData)
MODULE(cuModuleLoadDataEx)
MODULE(cuModuleLoadFatBinary)
MODULE(cuLibraryLoadData)

/* cuModuleGetFunction(CUfunction *f, CUmodule m, const char *name), cuLibraryGetKernel alike */
#define FUNCTION(sym)                                                                          \
    int on_##sym(struct pt_regs *ctx) { return stash(API_##sym, ARG1, ARG2, ARG3, 0); }       \
    int ret_##sym(struct pt_regs *ctx) { return function_ret(ctx, API_##sym); }

FUNCTION(cuModuleGetFunction)
FUNCTION(cuLibraryGetKernel)
/* cuKernelGetFunction(CUfunction *f, CUkernel k): no name; user space knows the kernel's */
int on_cuKernelGetFunction(struct pt_regs *ctx) {
    return stash(API_cuKernelGetFunction, ARG1, ARG2, 0, 0);
}
int ret_cuKernelGetFunction(struct pt_regs *ctx) {
    return function_ret(ctx, API_cuKernelGetFunction);
}
