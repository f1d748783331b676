/* The driver ABI the agent needs, as cuda.h of CUDA 13 spells it (no CUDA headers at build
 * time). */
#ifndef POS_AGENT_ABI_H
#define POS_AGENT_ABI_H

#include <stddef.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef int CUdevice;
typedef void *CUcontext, *CUstream, *CUfunction, *CUgraphExec, *CUarray;
typedef struct {
    int type, id;
} CUmemLocation;
typedef struct {
    int type, requestedHandleTypes;
    CUmemLocation location;
    void *win32HandleMetaData;
    unsigned long long allocFlags;
} CUmemAllocationProp;
typedef struct {
    CUmemLocation location;
    int flags;
} CUmemAccessDesc;
typedef struct {
    unsigned int gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes;
    CUstream hStream;
    void *attrs;
    unsigned int numAttrs;
} CUlaunchConfig;
typedef struct {
    char reserved[64];
} CUipcMemHandle;

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_OPERATING_SYSTEM = 304,
    CUDA_ERROR_NOT_FOUND = 500
};
enum { MEM_PINNED = 1, HANDLE_POSIX_FD = 1, LOCATION_DEVICE = 1, ACCESS_RW = 3, LIMIT_STACK = 0 };
/* keys of a launch's `extra` array */
#define LAUNCH_PARAM_BUFFER_POINTER ((void *)0x01)
#define LAUNCH_PARAM_BUFFER_SIZE ((void *)0x02)

#define EXPORT __attribute__((visibility("default")))

#endif
