/* Uprobes on the HIP runtime (libamdhip64.so). Same events as cuda.c; on_<symbol> at entry,
 * ret_<symbol> at return. HIP code objects carry no layout pos parses yet, so launches are
 * recorded as 8-byte slots (layout_known = 0) unless user space pushed a layout. */
#include "common.h"

#define ALLOC(sym, size, stream)                                                               \
    int on_##sym(struct pt_regs *ctx) { return stash(API_##sym, ARG1, size, stream, 0); }     \
    int ret_##sym(struct pt_regs *ctx) { return alloc_ret(ctx, API_##sym, POS_ALLOC); }

ALLOC(hipMalloc, ARG2, 0)
ALLOC(hipMallocManaged, ARG2, 0)
ALLOC(hipMallocAsync, ARG2, ARG3)
ALLOC(hipExtMallocWithFlags, ARG2, 0)

int on_hipFree(struct pt_regs *ctx) { return emit(ctx, POS_FREE, API_hipFree, ARG1, 0, 0, 0, 0); }
int on_hipFreeAsync(struct pt_regs *ctx) {
    return emit(ctx, POS_FREE, API_hipFreeAsync, ARG1, 0, ARG2, 0, 0);
}

/* hipModuleLaunchKernel has cuLaunchKernel's signature */
int on_hipModuleLaunchKernel(struct pt_regs *ctx) {
    u64 st[5] = {};
    bpf_probe_read_user(st, sizeof(st), (void *)(PT_REGS_SP(ctx) + 8));
    return launch(ctx, API_hipModuleLaunchKernel, ARG1, st[2], ARG2, ARG3, ARG4, ARG5, ARG6, st[0],
                  st[1], st[3], st[4]);
}
/* hipExtModuleLaunchKernel(f, globalX, globalY, globalZ, localX, localY, localZ, shmem, stream,
 * kernelParams, extra, ...): work sizes are in threads, the grid is global / local */
int on_hipExtModuleLaunchKernel(struct pt_regs *ctx) {
    u64 st[5] = {};
    bpf_probe_read_user(st, sizeof(st), (void *)(PT_REGS_SP(ctx) + 8));
    u32 lx = ARG5 ? ARG5 : 1, ly = ARG6 ? ARG6 : 1, lz = st[0] ? st[0] : 1;
    return launch(ctx, API_hipExtModuleLaunchKernel, ARG1, st[2], (u32)ARG2 / lx, (u32)ARG3 / ly,
                  (u32)ARG4 / lz, lx, ly, lz, st[1], st[3], st[4]);
}
/* hipLaunchKernel(const void *host_fn, dim3 grid, dim3 block, void **args, size_t shmem,
 * hipStream_t stream): each 12-byte dim3 travels in two registers (x|y<<32, z) */
int on_hipLaunchKernel(struct pt_regs *ctx) {
    u64 g = ARG2, b = ARG4;
    return launch(ctx, API_hipLaunchKernel, ARG1, stack_arg(ctx, 8), (u32)g, g >> 32, (u32)ARG3,
                  (u32)b, b >> 32, (u32)ARG5, stack_arg(ctx, 7), ARG6, 0);
}

/* hipMemcpyKind: 0 HtoH, 1 HtoD, 2 DtoH, 3 DtoD, 4 default */
static __always_inline u64 hip_direction(u64 kind) {
    switch (kind) {
    case 0: return POS_HTOH;
    case 1: return POS_HTOD;
    case 2: return POS_DTOH;
    case 3: return POS_DTOD;
    default: return POS_DEFAULT;
    }
}
int on_hipMemcpy(struct pt_regs *ctx) {
    return emit(ctx, POS_MEMCPY, API_hipMemcpy, ARG1, ARG2, ARG3, 0, hip_direction(ARG4));
}
int on_hipMemcpyAsync(struct pt_regs *ctx) {
    return emit(ctx, POS_MEMCPY, API_hipMemcpyAsync, ARG1, ARG2, ARG3, ARG5, hip_direction(ARG4));
}
int on_hipMemcpyHtoD(struct pt_regs *ctx) {
    return emit(ctx, POS_MEMCPY, API_hipMemcpyHtoD, ARG1, ARG2, ARG3, 0, POS_HTOD);
}
int on_hipMemcpyDtoH(struct pt_regs *ctx) {
    return emit(ctx, POS_MEMCPY, API_hipMemcpyDtoH, ARG1, ARG2, ARG3, 0, POS_DTOH);
}
int on_hipMemcpyDtoD(struct pt_regs *ctx) {
    return emit(ctx, POS_MEMCPY, API_hipMemcpyDtoD, ARG1, ARG2, ARG3, 0, POS_DTOD);
}
/* hipMemset(dst, int value, size_t bytes[, stream]) */
int on_hipMemset(struct pt_regs *ctx) {
    return emit(ctx, POS_MEMSET, API_hipMemset, ARG1, ARG3, (u32)ARG2, 0, 1);
}
int on_hipMemsetAsync(struct pt_regs *ctx) {
    return emit(ctx, POS_MEMSET, API_hipMemsetAsync, ARG1, ARG3, (u32)ARG2, ARG4, 1);
}

int on_hipDeviceSynchronize(struct pt_regs *ctx) {
    return emit(ctx, POS_SYNC, API_hipDeviceSynchronize, 0, 0, 0, 0, 0);
}
int on_hipStreamSynchronize(struct pt_regs *ctx) {
    return emit(ctx, POS_SYNC, API_hipStreamSynchronize, ARG1, ARG1, 0, 0, 0);
}

int on_hipModuleLoadData(struct pt_regs *ctx) {
    return stash(API_hipModuleLoadData, ARG1, ARG2, 0, 0);
}
int ret_hipModuleLoadData(struct pt_regs *ctx) { return module_ret(ctx, API_hipModuleLoadData); }
int on_hipModuleGetFunction(struct pt_regs *ctx) {
    return stash(API_hipModuleGetFunction, ARG1, ARG2, ARG3, 0);
}
int ret_hipModuleGetFunction(struct pt_regs *ctx) {
    return function_ret(ctx, API_hipModuleGetFunction);
}
