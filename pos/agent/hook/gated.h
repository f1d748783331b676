/* Which of the driver's entry points the gate must know.
 *
 * FAMILIES: the entry points that read or write device memory, or make or unmake it, by the
 * beginning of their names (every version and per-thread variant of each). Of those, every one
 * that cuda.h declares is wrapped (wrapped.h, or OWN_WRAPPERS in agent.h), let through (PASSES),
 * or refused (LEGACY); tests/fakegpu/test_hook_list.py holds this file and wrapped.h to cuda.h,
 * so an entry point a newer header adds fails that test until someone decides.
 *
 * At run time an entry point of a family that the agent neither wraps nor lets through, which
 * the job looks up (dlsym, cuGetProcAddress) or links to (interpose.c), is kept (gate.c,
 * ungated_lookup): every later cut is refused, so that no checkpoint or refill of the job runs
 * while a call the gate cannot see may read or write its memory (protocol.md). */
#ifndef POS_AGENT_GATED_H
#define POS_AGENT_GATED_H

#define FAMILIES(X)                                                                                \
    X(cuMemcpy)             /* copies */                                                           \
    X(cuMemset)             /* fills */                                                            \
    X(cuMemBatchDecompress) /* decompression into device memory */                               \
    X(cuLaunch)             /* kernels */                                                          \
    X(cuGraphLaunch)        /* graphs: their kernels and copies */                                 \
    X(cuStreamWriteValue)   /* stream memory operations */                                         \
    X(cuStreamWaitValue)                                                                           \
    X(cuStreamBatchMemOp)                                                                          \
    X(cuMemPrefetch)        /* managed memory moved, hinted or discarded */                        \
    X(cuMemDiscard)                                                                                \
    X(cuMemAdvise)                                                                                 \
    X(cuMemAlloc)           /* memory made or imported */                                          \
    X(cuMemCreate)                                                                                 \
    X(cuMemMap)                                                                                    \
    X(cuMemImport)                                                                                 \
    X(cuIpc)                                                                                       \
    X(cuMemFree)            /* memory unmade */                                                    \
    X(cuMemUnmap)                                                                                  \
    X(cuMemRelease)

/* Entry points of the families that pass without a wrapper, and why. */
#define PASSES(X)                                                                                  \
    X(cuMemAdvise)           /* a hint on managed memory: no bytes read or written, no work */     \
    X(cuMemAdvise_v2)        /* enqueued, and pos owns no managed memory */                        \
    X(cuLaunchHostFunc)      /* a host function in stream order: it may make no CUDA call, and */  \
    X(cuLaunchHostFunc_ptsz) /* device memory is reached through CUDA calls only */                \
    X(cuMemAllocHost)        /* page-locked host memory: the job's own, which CRIU dumps */        \
    X(cuMemAllocHost_v2)                                                                           \
    X(cuMemFreeHost)                                                                               \
    X(cuIpcGetMemHandle)     /* names memory for another process, touches none (the other */      \
                             /* process's use of it is its own agent's) */                         \
    X(cuIpcGetEventHandle)   /* events, not memory */                                              \
    X(cuIpcOpenEventHandle)

/* Entry points of the families that the agent refuses: the API before CUDA 3.2 (32-bit
 * addresses and sizes: CUdeviceptr_v1, unsigned int), which cuda.h declares only for the
 * driver's own build and no toolkit since builds a call to. They are not wrapped, so a job that
 * looks one up cannot be checkpointed, as with an unknown entry point (read by the test only). */
#define LEGACY(X)                                                                                  \
    X(cuMemAlloc)                                                                                  \
    X(cuMemAllocPitch)                                                                             \
    X(cuMemFree)                                                                                   \
    X(cuMemcpyHtoD)                                                                                \
    X(cuMemcpyDtoH)                                                                                \
    X(cuMemcpyDtoD)                                                                                \
    X(cuMemcpyHtoDAsync)                                                                           \
    X(cuMemcpyDtoHAsync)                                                                           \
    X(cuMemcpyDtoDAsync)                                                                           \
    X(cuMemcpyAtoD)                                                                                \
    X(cuMemcpyDtoA)                                                                                \
    X(cuMemcpyHtoA)                                                                                \
    X(cuMemcpyAtoH)                                                                                \
    X(cuMemcpyAtoA)                                                                                \
    X(cuMemcpyHtoAAsync)                                                                           \
    X(cuMemcpyAtoHAsync)                                                                           \
    X(cuMemcpy2D)                                                                                  \
    X(cuMemcpy2DUnaligned)                                                                         \
    X(cuMemcpy2DAsync)                                                                             \
    X(cuMemcpy3D)                                                                                  \
    X(cuMemcpy3DAsync)                                                                             \
    X(cuMemsetD8)                                                                                  \
    X(cuMemsetD16)                                                                                 \
    X(cuMemsetD32)                                                                                 \
    X(cuMemsetD2D8)                                                                                \
    X(cuMemsetD2D16)                                                                               \
    X(cuMemsetD2D32)

#endif
