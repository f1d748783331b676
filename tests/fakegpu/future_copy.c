/* A library linked to an entry point of a driver newer than pos (the fake's
 * cuMemcpyFutureAsync), as code built with a newer cuda.h links: the dynamic linker binds it to
 * libcuda's function, which no lookup of the agent sees (fill_job's FILL_JOB_LINKED). */
#include "job_common.h"

typedef void *CUstream;
CUresult cuMemcpyFutureAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s);

__attribute__((visibility("default"))) CUresult future_copy(CUdeviceptr dst, CUdeviceptr src,
                                                            size_t n, CUstream s) {
    return cuMemcpyFutureAsync(dst, src, n, s);
}
