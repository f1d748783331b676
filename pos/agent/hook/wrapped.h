/* The driver functions the gate wraps: what each call may touch, and what follows it. */
#ifndef POS_AGENT_WRAPPED_H
#define POS_AGENT_WRAPPED_H

/* HOOKS(X): X(name, params, args, touch, after). Each becomes an exported wrapper that enters
 * the gate with `touch`, calls the driver's own function, runs `after` (with its result r)
 * and leaves the gate. Every version and per-thread variant of a name is listed: cuda.h maps a
 * name to its newest version (cuMemcpyBatchAsync to cuMemcpyBatchAsync_v2), and a runtime gets
 * the one of its own CUDA version. gated.h says which entry points must be here (held to cuda.h
 * by tests/fakegpu/test_hook_list.py, which checks these parameters against cuda.h's too).
 * T_NONE: touches none of pos's buffers (CUDA arrays, managed memory, which pos never owns),
 * held by the cut alone. The memory calls at the end keep account of the memory pos does not
 * own (table.c: foreign) and of other processes' memory that the job maps (peer.c); the cut
 * holds them too, so that neither account changes while the job is held. */
#define HOOKS(X)                                                                                   \
    X(cuMemcpy, (CUdeviceptr d, CUdeviceptr s, size_t n), (d, s, n), T_WR(d, s), NOAFTER)          \
    X(cuMemcpy_ptds, (CUdeviceptr d, CUdeviceptr s, size_t n), (d, s, n), T_WR(d, s), NOAFTER)     \
    X(cuMemcpyAsync, (CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st), (d, s, n, st),         \
      T_WR(d, s), NOAFTER)                                                                         \
    X(cuMemcpyAsync_ptsz, (CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st), (d, s, n, st),    \
      T_WR(d, s), NOAFTER)                                                                         \
    X(cuMemcpyHtoD_v2, (CUdeviceptr d, const void *h, size_t n), (d, h, n), T_W(d), NOAFTER)       \
    X(cuMemcpyHtoD_v2_ptds, (CUdeviceptr d, const void *h, size_t n), (d, h, n), T_W(d), NOAFTER)  \
    X(cuMemcpyHtoDAsync_v2, (CUdeviceptr d, const void *h, size_t n, CUstream s), (d, h, n, s),    \
      T_W(d), NOAFTER)                                                                             \
    X(cuMemcpyHtoDAsync_v2_ptsz, (CUdeviceptr d, const void *h, size_t n, CUstream s),             \
      (d, h, n, s), T_W(d), NOAFTER)                                                               \
    X(cuMemcpyDtoH_v2, (void *h, CUdeviceptr s, size_t n), (h, s, n), T_R(s), NOAFTER)             \
    X(cuMemcpyDtoH_v2_ptds, (void *h, CUdeviceptr s, size_t n), (h, s, n), T_R(s), NOAFTER)        \
    X(cuMemcpyDtoHAsync_v2, (void *h, CUdeviceptr s, size_t n, CUstream st), (h, s, n, st),        \
      T_R(s), NOAFTER)                                                                             \
    X(cuMemcpyDtoHAsync_v2_ptsz, (void *h, CUdeviceptr s, size_t n, CUstream st), (h, s, n, st),   \
      T_R(s), NOAFTER)                                                                             \
    X(cuMemcpyDtoD_v2, (CUdeviceptr d, CUdeviceptr s, size_t n), (d, s, n), T_WR(d, s), NOAFTER)   \
    X(cuMemcpyDtoD_v2_ptds, (CUdeviceptr d, CUdeviceptr s, size_t n), (d, s, n), T_WR(d, s),       \
      NOAFTER)                                                                                     \
    X(cuMemcpyDtoDAsync_v2, (CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st), (d, s, n, st),  \
      T_WR(d, s), NOAFTER)                                                                         \
    X(cuMemcpyDtoDAsync_v2_ptsz, (CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st),            \
      (d, s, n, st), T_WR(d, s), NOAFTER)                                                          \
    X(cuMemcpyPeer, (CUdeviceptr d, CUcontext dc, CUdeviceptr s, CUcontext sc, size_t n),          \
      (d, dc, s, sc, n), T_WR(d, s), NOAFTER)                                                      \
    X(cuMemcpyPeerAsync,                                                                           \
      (CUdeviceptr d, CUcontext dc, CUdeviceptr s, CUcontext sc, size_t n, CUstream st),           \
      (d, dc, s, sc, n, st), T_WR(d, s), NOAFTER)                                                  \
    X(cuMemcpy2D_v2, (const void *p), (p), T_ALL, NOAFTER)                                         \
    X(cuMemcpy2DUnaligned_v2, (const void *p), (p), T_ALL, NOAFTER)                                \
    X(cuMemcpy2DAsync_v2, (const void *p, CUstream s), (p, s), T_ALL, NOAFTER)                     \
    X(cuMemcpy2DAsync_v2_ptsz, (const void *p, CUstream s), (p, s), T_ALL, NOAFTER)                \
    X(cuMemcpy3D_v2, (const void *p), (p), T_ALL, NOAFTER)                                         \
    X(cuMemcpy3DAsync_v2, (const void *p, CUstream s), (p, s), T_ALL, NOAFTER)                     \
    X(cuMemcpy3DAsync_v2_ptsz, (const void *p, CUstream s), (p, s), T_ALL, NOAFTER)                \
    X(cuMemcpy3DPeer, (const void *p), (p), T_ALL, NOAFTER)                                        \
    X(cuMemcpy3DPeerAsync, (const void *p, CUstream s), (p, s), T_ALL, NOAFTER)                    \
    X(cuMemcpyPeer_ptds, (CUdeviceptr d, CUcontext dc, CUdeviceptr s, CUcontext sc, size_t n),     \
      (d, dc, s, sc, n), T_WR(d, s), NOAFTER)                                                      \
    X(cuMemcpyPeerAsync_ptsz,                                                                      \
      (CUdeviceptr d, CUcontext dc, CUdeviceptr s, CUcontext sc, size_t n, CUstream st),           \
      (d, dc, s, sc, n, st), T_WR(d, s), NOAFTER)                                                  \
    X(cuMemcpy2D_v2_ptds, (const void *p), (p), T_ALL, NOAFTER)                                    \
    X(cuMemcpy2DUnaligned_v2_ptds, (const void *p), (p), T_ALL, NOAFTER)                           \
    X(cuMemcpy3D_v2_ptds, (const void *p), (p), T_ALL, NOAFTER)                                    \
    X(cuMemcpy3DPeer_ptds, (const void *p), (p), T_ALL, NOAFTER)                                   \
    X(cuMemcpy3DPeerAsync_ptsz, (const void *p, CUstream s), (p, s), T_ALL, NOAFTER)               \
    X(cuMemcpyAtoD_v2, (CUdeviceptr d, CUarray a, size_t o, size_t n), (d, a, o, n), T_W(d),       \
      NOAFTER)                                                                                     \
    X(cuMemcpyAtoD_v2_ptds, (CUdeviceptr d, CUarray a, size_t o, size_t n), (d, a, o, n), T_W(d),  \
      NOAFTER)                                                                                     \
    X(cuMemcpyDtoA_v2, (CUarray a, size_t o, CUdeviceptr s, size_t n), (a, o, s, n), T_R(s),       \
      NOAFTER)                                                                                     \
    X(cuMemcpyDtoA_v2_ptds, (CUarray a, size_t o, CUdeviceptr s, size_t n), (a, o, s, n), T_R(s),  \
      NOAFTER)                                                                                     \
    X(cuMemcpyHtoA_v2, (CUarray a, size_t o, const void *h, size_t n), (a, o, h, n), T_NONE,       \
      NOAFTER)                                                                                     \
    X(cuMemcpyHtoA_v2_ptds, (CUarray a, size_t o, const void *h, size_t n), (a, o, h, n), T_NONE,  \
      NOAFTER)                                                                                     \
    X(cuMemcpyHtoAAsync_v2, (CUarray a, size_t o, const void *h, size_t n, CUstream s),            \
      (a, o, h, n, s), T_NONE, NOAFTER)                                                            \
    X(cuMemcpyHtoAAsync_v2_ptsz, (CUarray a, size_t o, const void *h, size_t n, CUstream s),       \
      (a, o, h, n, s), T_NONE, NOAFTER)                                                            \
    X(cuMemcpyAtoH_v2, (void *h, CUarray a, size_t o, size_t n), (h, a, o, n), T_NONE, NOAFTER)    \
    X(cuMemcpyAtoH_v2_ptds, (void *h, CUarray a, size_t o, size_t n), (h, a, o, n), T_NONE,        \
      NOAFTER)                                                                                     \
    X(cuMemcpyAtoHAsync_v2, (void *h, CUarray a, size_t o, size_t n, CUstream s), (h, a, o, n, s), \
      T_NONE, NOAFTER)                                                                             \
    X(cuMemcpyAtoHAsync_v2_ptsz, (void *h, CUarray a, size_t o, size_t n, CUstream s),             \
      (h, a, o, n, s), T_NONE, NOAFTER)                                                            \
    X(cuMemcpyAtoA_v2, (CUarray d, size_t od, CUarray s, size_t os, size_t n), (d, od, s, os, n),  \
      T_NONE, NOAFTER)                                                                             \
    X(cuMemcpyAtoA_v2_ptds, (CUarray d, size_t od, CUarray s, size_t os, size_t n),                \
      (d, od, s, os, n), T_NONE, NOAFTER)                                                          \
    X(cuMemcpyBatchAsync,                                                                          \
      (CUdeviceptr *d, CUdeviceptr *s, size_t *n, size_t c, void *a, size_t *ai, size_t na,        \
       size_t *f, CUstream st),                                                                    \
      (d, s, n, c, a, ai, na, f, st), T_ALL, NOAFTER)                                              \
    X(cuMemcpyBatchAsync_ptsz,                                                                     \
      (CUdeviceptr *d, CUdeviceptr *s, size_t *n, size_t c, void *a, size_t *ai, size_t na,        \
       size_t *f, CUstream st),                                                                    \
      (d, s, n, c, a, ai, na, f, st), T_ALL, NOAFTER)                                              \
    X(cuMemcpyBatchAsync_v2,                                                                       \
      (CUdeviceptr *d, CUdeviceptr *s, size_t *n, size_t c, void *a, size_t *ai, size_t na,        \
       CUstream st),                                                                               \
      (d, s, n, c, a, ai, na, st), T_ALL, NOAFTER)                                                 \
    X(cuMemcpyBatchAsync_v2_ptsz,                                                                  \
      (CUdeviceptr *d, CUdeviceptr *s, size_t *n, size_t c, void *a, size_t *ai, size_t na,        \
       CUstream st),                                                                               \
      (d, s, n, c, a, ai, na, st), T_ALL, NOAFTER)                                                 \
    X(cuMemcpy3DBatchAsync, (size_t n, void *ops, size_t *f, unsigned long long fl, CUstream s),   \
      (n, ops, f, fl, s), T_ALL, NOAFTER)                                                          \
    X(cuMemcpy3DBatchAsync_ptsz,                                                                   \
      (size_t n, void *ops, size_t *f, unsigned long long fl, CUstream s), (n, ops, f, fl, s),     \
      T_ALL, NOAFTER)                                                                              \
    X(cuMemcpy3DBatchAsync_v2, (size_t n, void *ops, unsigned long long fl, CUstream s),           \
      (n, ops, fl, s), T_ALL, NOAFTER)                                                             \
    X(cuMemcpy3DBatchAsync_v2_ptsz, (size_t n, void *ops, unsigned long long fl, CUstream s),      \
      (n, ops, fl, s), T_ALL, NOAFTER)                                                             \
    X(cuMemBatchDecompressAsync, (void *p, size_t c, unsigned f, size_t *e, CUstream s),           \
      (p, c, f, e, s), T_ALL, NOAFTER)                                                             \
    X(cuMemBatchDecompressAsync_ptsz, (void *p, size_t c, unsigned f, size_t *e, CUstream s),      \
      (p, c, f, e, s), T_ALL, NOAFTER)                                                             \
    X(cuMemsetD8_v2, (CUdeviceptr d, unsigned char v, size_t n), (d, v, n), T_W(d), NOAFTER)       \
    X(cuMemsetD16_v2, (CUdeviceptr d, unsigned short v, size_t n), (d, v, n), T_W(d), NOAFTER)     \
    X(cuMemsetD32_v2, (CUdeviceptr d, unsigned int v, size_t n), (d, v, n), T_W(d), NOAFTER)       \
    X(cuMemsetD8_v2_ptds, (CUdeviceptr d, unsigned char v, size_t n), (d, v, n), T_W(d), NOAFTER)  \
    X(cuMemsetD16_v2_ptds, (CUdeviceptr d, unsigned short v, size_t n), (d, v, n), T_W(d),         \
      NOAFTER)                                                                                     \
    X(cuMemsetD32_v2_ptds, (CUdeviceptr d, unsigned int v, size_t n), (d, v, n), T_W(d), NOAFTER)  \
    X(cuMemsetD8Async, (CUdeviceptr d, unsigned char v, size_t n, CUstream s), (d, v, n, s),       \
      T_W(d), NOAFTER)                                                                             \
    X(cuMemsetD16Async, (CUdeviceptr d, unsigned short v, size_t n, CUstream s), (d, v, n, s),     \
      T_W(d), NOAFTER)                                                                             \
    X(cuMemsetD32Async, (CUdeviceptr d, unsigned int v, size_t n, CUstream s), (d, v, n, s),       \
      T_W(d), NOAFTER)                                                                             \
    X(cuMemsetD8Async_ptsz, (CUdeviceptr d, unsigned char v, size_t n, CUstream s), (d, v, n, s),  \
      T_W(d), NOAFTER)                                                                             \
    X(cuMemsetD16Async_ptsz, (CUdeviceptr d, unsigned short v, size_t n, CUstream s),              \
      (d, v, n, s), T_W(d), NOAFTER)                                                               \
    X(cuMemsetD32Async_ptsz, (CUdeviceptr d, unsigned int v, size_t n, CUstream s), (d, v, n, s),  \
      T_W(d), NOAFTER)                                                                             \
    X(cuMemsetD2D8_v2, (CUdeviceptr d, size_t p, unsigned char v, size_t w, size_t h),             \
      (d, p, v, w, h), T_W(d), NOAFTER)                                                            \
    X(cuMemsetD2D16_v2, (CUdeviceptr d, size_t p, unsigned short v, size_t w, size_t h),           \
      (d, p, v, w, h), T_W(d), NOAFTER)                                                            \
    X(cuMemsetD2D32_v2, (CUdeviceptr d, size_t p, unsigned int v, size_t w, size_t h),             \
      (d, p, v, w, h), T_W(d), NOAFTER)                                                            \
    X(cuMemsetD2D8Async,                                                                           \
      (CUdeviceptr d, size_t p, unsigned char v, size_t w, size_t h, CUstream s),                  \
      (d, p, v, w, h, s), T_W(d), NOAFTER)                                                         \
    X(cuMemsetD2D16Async,                                                                          \
      (CUdeviceptr d, size_t p, unsigned short v, size_t w, size_t h, CUstream s),                 \
      (d, p, v, w, h, s), T_W(d), NOAFTER)                                                         \
    X(cuMemsetD2D32Async,                                                                          \
      (CUdeviceptr d, size_t p, unsigned int v, size_t w, size_t h, CUstream s),                   \
      (d, p, v, w, h, s), T_W(d), NOAFTER)                                                         \
    X(cuMemsetD2D8_v2_ptds, (CUdeviceptr d, size_t p, unsigned char v, size_t w, size_t h),        \
      (d, p, v, w, h), T_W(d), NOAFTER)                                                            \
    X(cuMemsetD2D8Async_ptsz,                                                                      \
      (CUdeviceptr d, size_t p, unsigned char v, size_t w, size_t h, CUstream s),                  \
      (d, p, v, w, h, s), T_W(d), NOAFTER)                                                         \
    X(cuMemsetD2D16_v2_ptds, (CUdeviceptr d, size_t p, unsigned short v, size_t w, size_t h),      \
      (d, p, v, w, h), T_W(d), NOAFTER)                                                            \
    X(cuMemsetD2D16Async_ptsz,                                                                     \
      (CUdeviceptr d, size_t p, unsigned short v, size_t w, size_t h, CUstream s),                 \
      (d, p, v, w, h, s), T_W(d), NOAFTER)                                                         \
    X(cuMemsetD2D32_v2_ptds, (CUdeviceptr d, size_t p, unsigned int v, size_t w, size_t h),        \
      (d, p, v, w, h), T_W(d), NOAFTER)                                                            \
    X(cuMemsetD2D32Async_ptsz,                                                                     \
      (CUdeviceptr d, size_t p, unsigned int v, size_t w, size_t h, CUstream s),                   \
      (d, p, v, w, h, s), T_W(d), NOAFTER)                                                         \
    X(cuLaunchKernel,                                                                              \
      (CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, \
       unsigned sm, CUstream s, void **kp, void **ex),                                             \
      (f, gx, gy, gz, bx, by, bz, sm, s, kp, ex), T_LAUNCH(f, kp, ex), NOAFTER)                    \
    X(cuLaunchKernel_ptsz,                                                                         \
      (CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, \
       unsigned sm, CUstream s, void **kp, void **ex),                                             \
      (f, gx, gy, gz, bx, by, bz, sm, s, kp, ex), T_LAUNCH(f, kp, ex), NOAFTER)                    \
    X(cuLaunchKernelEx, (const CUlaunchConfig *c, CUfunction f, void **kp, void **ex),             \
      (c, f, kp, ex), T_LAUNCH(f, kp, ex), NOAFTER)                                                \
    X(cuLaunchKernelEx_ptsz, (const CUlaunchConfig *c, CUfunction f, void **kp, void **ex),        \
      (c, f, kp, ex), T_LAUNCH(f, kp, ex), NOAFTER)                                                \
    X(cuLaunchCooperativeKernel,                                                                   \
      (CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, \
       unsigned sm, CUstream s, void **kp),                                                        \
      (f, gx, gy, gz, bx, by, bz, sm, s, kp), T_LAUNCH(f, kp, NULL), NOAFTER)                      \
    X(cuLaunchCooperativeKernel_ptsz,                                                              \
      (CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, \
       unsigned sm, CUstream s, void **kp),                                                        \
      (f, gx, gy, gz, bx, by, bz, sm, s, kp), T_LAUNCH(f, kp, NULL), NOAFTER)                      \
    X(cuLaunch, (CUfunction f), (f), T_ALL, NOAFTER)                                               \
    X(cuLaunchGrid, (CUfunction f, int w, int h), (f, w, h), T_ALL, NOAFTER)                       \
    X(cuLaunchGridAsync, (CUfunction f, int w, int h, CUstream s), (f, w, h, s), T_ALL, NOAFTER)   \
    X(cuLaunchCooperativeKernelMultiDevice, (void *l, unsigned n, unsigned f), (l, n, f), T_ALL,   \
      NOAFTER)                                                                                     \
    X(cuGraphLaunch, (CUgraphExec g, CUstream s), (g, s), T_ALL, NOAFTER)                          \
    X(cuGraphLaunch_ptsz, (CUgraphExec g, CUstream s), (g, s), T_ALL, NOAFTER)                     \
    X(cuStreamWriteValue32_v2, (CUstream s, CUdeviceptr a, unsigned v, unsigned f), (s, a, v, f),  \
      T_W(a), NOAFTER)                                                                             \
    X(cuStreamWriteValue64_v2, (CUstream s, CUdeviceptr a, unsigned long long v, unsigned f),      \
      (s, a, v, f), T_W(a), NOAFTER)                                                               \
    X(cuStreamBatchMemOp_v2, (CUstream s, unsigned c, void *p, unsigned f), (s, c, p, f), T_ALL,   \
      NOAFTER)                                                                                     \
    X(cuStreamWriteValue32, (CUstream s, CUdeviceptr a, unsigned v, unsigned f), (s, a, v, f),     \
      T_W(a), NOAFTER)                                                                             \
    X(cuStreamWriteValue64, (CUstream s, CUdeviceptr a, unsigned long long v, unsigned f),         \
      (s, a, v, f), T_W(a), NOAFTER)                                                               \
    X(cuStreamWriteValue32_ptsz, (CUstream s, CUdeviceptr a, unsigned v, unsigned f),              \
      (s, a, v, f), T_W(a), NOAFTER)                                                               \
    X(cuStreamWriteValue64_ptsz, (CUstream s, CUdeviceptr a, unsigned long long v, unsigned f),    \
      (s, a, v, f), T_W(a), NOAFTER)                                                               \
    X(cuStreamWriteValue32_v2_ptsz, (CUstream s, CUdeviceptr a, unsigned v, unsigned f),           \
      (s, a, v, f), T_W(a), NOAFTER)                                                               \
    X(cuStreamWriteValue64_v2_ptsz, (CUstream s, CUdeviceptr a, unsigned long long v, unsigned f), \
      (s, a, v, f), T_W(a), NOAFTER)                                                               \
    X(cuStreamWaitValue32, (CUstream s, CUdeviceptr a, unsigned v, unsigned f), (s, a, v, f),      \
      T_R(a), NOAFTER)                                                                             \
    X(cuStreamWaitValue64, (CUstream s, CUdeviceptr a, unsigned long long v, unsigned f),          \
      (s, a, v, f), T_R(a), NOAFTER)                                                               \
    X(cuStreamWaitValue32_ptsz, (CUstream s, CUdeviceptr a, unsigned v, unsigned f), (s, a, v, f), \
      T_R(a), NOAFTER)                                                                             \
    X(cuStreamWaitValue64_ptsz, (CUstream s, CUdeviceptr a, unsigned long long v, unsigned f),     \
      (s, a, v, f), T_R(a), NOAFTER)                                                               \
    X(cuStreamWaitValue32_v2, (CUstream s, CUdeviceptr a, unsigned v, unsigned f), (s, a, v, f),   \
      T_R(a), NOAFTER)                                                                             \
    X(cuStreamWaitValue64_v2, (CUstream s, CUdeviceptr a, unsigned long long v, unsigned f),       \
      (s, a, v, f), T_R(a), NOAFTER)                                                               \
    X(cuStreamWaitValue32_v2_ptsz, (CUstream s, CUdeviceptr a, unsigned v, unsigned f),            \
      (s, a, v, f), T_R(a), NOAFTER)                                                               \
    X(cuStreamWaitValue64_v2_ptsz, (CUstream s, CUdeviceptr a, unsigned long long v, unsigned f),  \
      (s, a, v, f), T_R(a), NOAFTER)                                                               \
    X(cuStreamBatchMemOp, (CUstream s, unsigned c, void *p, unsigned f), (s, c, p, f), T_ALL,      \
      NOAFTER)                                                                                     \
    X(cuStreamBatchMemOp_ptsz, (CUstream s, unsigned c, void *p, unsigned f), (s, c, p, f), T_ALL, \
      NOAFTER)                                                                                     \
    X(cuStreamBatchMemOp_v2_ptsz, (CUstream s, unsigned c, void *p, unsigned f), (s, c, p, f),     \
      T_ALL, NOAFTER)                                                                              \
    X(cuMemPrefetchAsync, (CUdeviceptr p, size_t n, CUdevice d, CUstream s), (p, n, d, s), T_NONE, \
      NOAFTER)                                                                                     \
    X(cuMemPrefetchAsync_ptsz, (CUdeviceptr p, size_t n, CUdevice d, CUstream s), (p, n, d, s),    \
      T_NONE, NOAFTER)                                                                             \
    X(cuMemPrefetchAsync_v2, (CUdeviceptr p, size_t n, CUmemLocation l, unsigned f, CUstream s),   \
      (p, n, l, f, s), T_NONE, NOAFTER)                                                            \
    X(cuMemPrefetchAsync_v2_ptsz,                                                                  \
      (CUdeviceptr p, size_t n, CUmemLocation l, unsigned f, CUstream s), (p, n, l, f, s), T_NONE, \
      NOAFTER)                                                                                     \
    X(cuMemPrefetchBatchAsync,                                                                     \
      (CUdeviceptr *p, size_t *n, size_t c, CUmemLocation *l, size_t *li, size_t nl,               \
       unsigned long long f, CUstream s),                                                          \
      (p, n, c, l, li, nl, f, s), T_NONE, NOAFTER)                                                 \
    X(cuMemPrefetchBatchAsync_ptsz,                                                                \
      (CUdeviceptr *p, size_t *n, size_t c, CUmemLocation *l, size_t *li, size_t nl,               \
       unsigned long long f, CUstream s),                                                          \
      (p, n, c, l, li, nl, f, s), T_NONE, NOAFTER)                                                 \
    X(cuMemDiscardBatchAsync,                                                                      \
      (CUdeviceptr *p, size_t *n, size_t c, unsigned long long f, CUstream s), (p, n, c, f, s),    \
      T_NONE, NOAFTER)                                                                             \
    X(cuMemDiscardBatchAsync_ptsz,                                                                 \
      (CUdeviceptr *p, size_t *n, size_t c, unsigned long long f, CUstream s), (p, n, c, f, s),    \
      T_NONE, NOAFTER)                                                                             \
    X(cuMemDiscardAndPrefetchBatchAsync,                                                           \
      (CUdeviceptr *p, size_t *n, size_t c, CUmemLocation *l, size_t *li, size_t nl,               \
       unsigned long long f, CUstream s),                                                          \
      (p, n, c, l, li, nl, f, s), T_NONE, NOAFTER)                                                 \
    X(cuMemDiscardAndPrefetchBatchAsync_ptsz,                                                      \
      (CUdeviceptr *p, size_t *n, size_t c, CUmemLocation *l, size_t *li, size_t nl,               \
       unsigned long long f, CUstream s),                                                          \
      (p, n, c, l, li, nl, f, s), T_NONE, NOAFTER)                                                 \
    X(cuMemMapArrayAsync, (void *m, unsigned c, CUstream s), (m, c, s), T_NONE, NOAFTER)           \
    X(cuMemMapArrayAsync_ptsz, (void *m, unsigned c, CUstream s), (m, c, s), T_NONE, NOAFTER)      \
    X(cuMemAllocAsync, (CUdeviceptr * p, size_t n, CUstream s), (p, n, s), T_NONE,                 \
      IF_OK(foreign_add(*p, n)))                                                                   \
    X(cuMemAllocAsync_ptsz, (CUdeviceptr * p, size_t n, CUstream s), (p, n, s), T_NONE,            \
      IF_OK(foreign_add(*p, n)))                                                                   \
    X(cuMemAllocFromPoolAsync, (CUdeviceptr * p, size_t n, void *pool, CUstream s),                \
      (p, n, pool, s), T_NONE, IF_OK(foreign_add(*p, n)))                                          \
    X(cuMemAllocFromPoolAsync_ptsz, (CUdeviceptr * p, size_t n, void *pool, CUstream s),           \
      (p, n, pool, s), T_NONE, IF_OK(foreign_add(*p, n)))                                          \
    X(cuMemAllocManaged, (CUdeviceptr * p, size_t n, unsigned f), (p, n, f), T_NONE,               \
      IF_OK(foreign_add(*p, n)))                                                                   \
    X(cuMemAllocPitch_v2, (CUdeviceptr * p, size_t *pitch, size_t w, size_t h, unsigned e),        \
      (p, pitch, w, h, e), T_NONE, IF_OK(foreign_add(*p, pitch ? *pitch * h : 0)))                 \
    X(cuMemCreate,                                                                                 \
      (CUmemGenericAllocationHandle * h, size_t n, const void *prop, unsigned long long f),        \
      (h, n, prop, f), T_NONE, IF_OK(own_fresh(*h)))                                               \
    X(cuMemMap,                                                                                    \
      (CUdeviceptr p, size_t n, size_t o, CUmemGenericAllocationHandle h, unsigned long long f),   \
      (p, n, o, h, f), T_NONE, IF_OK(foreign_add(p, n); peer_mapped(p, n, o, h)))                  \
    X(cuMemUnmap, (CUdeviceptr p, size_t n), (p, n), T_W(p),                                       \
      IF_OK(foreign_remove(p); peer_unmapped(p, n)))                                               \
    X(cuMemSetAccess, (CUdeviceptr p, size_t n, const CUmemAccessDesc *d, size_t k), (p, n, d, k), \
      T_NONE, IF_OK(peer_access(p, n, d, k)))                                                      \
    X(cuMemImportFromShareableHandle, (CUmemGenericAllocationHandle * h, void *fd, int type),      \
      (h, fd, type), T_NONE, IF_OK(peer_imported(*h)))                                             \
    X(cuMemRelease, (CUmemGenericAllocationHandle h), (h = own_current(h)), T_NONE,                \
      IF_OK(peer_released(h)))                                                                     \
    X(cuIpcOpenMemHandle, (CUdeviceptr * p, CUipcMemHandle h, unsigned f), (p, h, f), T_NONE,      \
      IF_OK(ipc_opened(*p, &h, f)))                                                                \
    X(cuIpcOpenMemHandle_v2, (CUdeviceptr * p, CUipcMemHandle h, unsigned f), (p, h, f), T_NONE,   \
      IF_OK(ipc_opened(*p, &h, f)))                                                                \
    X(cuIpcCloseMemHandle, (CUdeviceptr p), (p), T_NONE, IF_OK(ipc_closed(p)))

#define NOAFTER ((void)0)
#define IF_OK(then)                                                                                \
    do {                                                                                           \
        if (r == CUDA_SUCCESS) {                                                                   \
            then;                                                                                  \
        }                                                                                          \
    } while (0)

#define DECLARE_HOOK(name, params, args, tch, after)                                               \
    extern void *volatile real_##name;                                                             \
    EXPORT CUresult name params;
HOOKS(DECLARE_HOOK)

#endif
