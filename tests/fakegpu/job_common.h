/* Shared by the fake-driver workloads (cuda_app.c, fill_job.c, peer_job.c): the driver types
 * they pass (the x86-64 ABI of cuda.h, CUDA 13), restated here rather than taken from pos's
 * agent, so that the fake's workloads check the ABI independently; and CHECK, which ends the
 * workload with the call's text and CUresult when a call fails. */
#ifndef POS_JOB_COMMON_H
#define POS_JOB_COMMON_H

#include <stdio.h>
#include <stdlib.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct {
    int type, id;
} CUmemLocation;
typedef struct {
    int type, requestedHandleTypes;
    CUmemLocation location;
    void *win32HandleMetaData;
    unsigned char allocFlags[8];
} CUmemAllocationProp;
typedef struct {
    CUmemLocation location;
    int flags;
} CUmemAccessDesc;
typedef struct {
    char reserved[64];
} CUipcMemHandle;

#ifndef POS_JOB_OWN_CHECK /* cuda_app.c reports failures in the harness's protocol instead */
#define CHECK(x)                                                                                   \
    do {                                                                                           \
        CUresult r_ = (x);                                                                         \
        if (r_) {                                                                                  \
            fprintf(stderr, "%s -> %d\n", #x, r_);                                                 \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)
#endif

#endif
