/* Two processes that share device memory, as NCCL's ranks do: an owner that exports an
 * allocation and an importer that maps it, either as cuMem memory (a POSIX fd handle, taken
 * from the owner with pidfd_getfd, imported and mapped) or through legacy IPC
 * (cuIpcGetMemHandle / cuIpcOpenMemHandle). The importer reaches the import and the open
 * through cuGetProcAddress, as a runtime does ("cuIpcOpenMemHandle" gives the _v2).
 *
 *   peer_job own DIR        cuMemCreate + map 2 MiB filled with 7, export it: "DIR/owner" holds
 *                           "PID FD"; at DIR/export it exports the handle it made again, as
 *                           NCCL does for a peer that connects later: "DIR/owner2"; at
 *                           DIR/free it unmaps the memory, then releases the handle it made,
 *                           as PyTorch's expandable segments do: "FREED"; at DIR/more it maps
 *                           2 MiB more filled with 8, as those segments grow: "MORE"
 *   peer_job import DIR     import DIR/owner's memory, map it, read it back (7); then at
 *                           DIR/release cuMemRelease (the mapping stays), at DIR/unmap cuMemUnmap
 *   peer_job ipc-own DIR    cuMemAlloc 1 MiB filled with 9 (plain driver memory: run it with
 *                           POS_OWN=0), its IPC handle in DIR/handle
 *   peer_job ipc-open DIR   open DIR/handle, read it back (9); at DIR/close cuIpcCloseMemHandle
 *
 * Each prints "READY <pid>" once set up, then a line per step done ("RELEASED", "UNMAPPED",
 * "CLOSED"), and runs until DIR/stop exists. A file is written whole under another name and
 * renamed into place, so that a reader sees it complete. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "job_common.h"

typedef void *CUcontext;

CUresult cuInit(unsigned);
CUresult cuDevicePrimaryCtxRetain(CUcontext *, int);
CUresult cuCtxSetCurrent(CUcontext);
CUresult cuGetProcAddress_v2(const char *, void **, int, unsigned long long, int *);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuMemAddressReserve(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
CUresult cuMemCreate(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *,
                     unsigned long long);
CUresult cuMemMap(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
CUresult cuMemUnmap(CUdeviceptr, size_t);
CUresult cuMemRelease(CUmemGenericAllocationHandle);
CUresult cuMemSetAccess(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
CUresult cuMemExportToShareableHandle(void *, CUmemGenericAllocationHandle, int,
                                      unsigned long long);
CUresult cuMemsetD32_v2(CUdeviceptr, unsigned, size_t);
CUresult cuMemcpyDtoH_v2(void *, CUdeviceptr, size_t);
CUresult cuIpcGetMemHandle(CUipcMemHandle *, CUdeviceptr);
CUresult cuIpcCloseMemHandle(CUdeviceptr);


#define VMM_BYTES (2u << 20)
#define IPC_BYTES (1u << 20)
static const char *dir;

static char *at(const char *name) {
    static char path[4096];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    return path;
}

static int exists(const char *name) {
    struct stat sb;
    return stat(at(name), &sb) == 0;
}

static void wait_for(const char *name) {
    while (!exists(name))
        usleep(1000);
}

static void say(const char *what) {
    printf("%s\n", what);
    fflush(stdout);
}

static void ready(void) {
    printf("READY %d\n", getpid());
    fflush(stdout);
}

static void publish(const char *name, const void *data, size_t n) {
    char tmp[4096];
    snprintf(tmp, sizeof(tmp), "%s.tmp", at(name));
    FILE *f = fopen(tmp, "wb");
    if (!f || fwrite(data, 1, n, f) != n || fclose(f) || rename(tmp, at(name)))
        exit(1);
}

static void *driver(const char *name) {
    void *fn = NULL;
    CHECK(cuGetProcAddress_v2(name, &fn, 12000, 0, NULL));
    return fn;
}

/* The first word of [p, p+n) read back, and that every word is the same. */
static unsigned read_back(CUdeviceptr p, size_t n) {
    unsigned *host = malloc(n);
    CHECK(host ? cuMemcpyDtoH_v2(host, p, n) : 1);
    for (size_t i = 1; i < n / 4; i++)
        if (host[i] != host[0])
            exit(1);
    unsigned v = host[0];
    free(host);
    return v;
}

static const CUmemAccessDesc rw = {{1, 0}, 3};

/* VMM_BYTES of the job's own, made, mapped and filled with `fill`: its handle into *h. */
static CUdeviceptr own_map(unsigned fill, CUmemGenericAllocationHandle *h) {
    CUmemAllocationProp prop = {.type = 1, .requestedHandleTypes = 1, .location = {1, 0}};
    CUdeviceptr va;
    CHECK(cuMemCreate(h, VMM_BYTES, &prop, 0));
    CHECK(cuMemAddressReserve(&va, VMM_BYTES, 0, 0, 0));
    CHECK(cuMemMap(va, VMM_BYTES, 0, *h, 0));
    CHECK(cuMemSetAccess(va, VMM_BYTES, &rw, 1));
    CHECK(cuMemsetD32_v2(va, fill, VMM_BYTES / 4));
    return va;
}

static void own(void) {
    CUmemGenericAllocationHandle h, more;
    CUdeviceptr va = own_map(7, &h);
    int fd, grown = 0;
    CHECK(cuMemExportToShareableHandle(&fd, h, 1, 0));
    char line[64];
    int n = snprintf(line, sizeof(line), "%d %d\n", getpid(), fd);
    publish("owner", line, (size_t)n);
    ready();
    while (!exists("stop") && !exists("export") && !exists("free")) {
        if (!grown && exists("more")) {
            own_map(8, &more);
            grown = 1;
            say("MORE");
        }
        usleep(1000);
    }
    if (exists("stop"))
        return;
    if (exists("free")) {
        CHECK(cuMemUnmap(va, VMM_BYTES));
        CHECK(cuMemRelease(h)); /* the handle it made, whatever came since */
        say("FREED");
        return;
    }
    CHECK(cuMemExportToShareableHandle(&fd, h, 1, 0)); /* the handle it made, whatever came since */
    n = snprintf(line, sizeof(line), "%d %d\n", getpid(), fd);
    publish("owner2", line, (size_t)n);
    say("EXPORTED");
}

/* Memory as PyTorch's expandable segments map it: SEGMENT_PIECES allocations one after
 * another in one reservation, filled with 7, 8, 9, ..., their access given once over all of
 * them; then one more in a reservation of its own. */
#define SEGMENT_PIECES 3
static void segment(void) {
    CUmemAllocationProp prop = {.type = 1, .requestedHandleTypes = 1, .location = {1, 0}};
    CUmemGenericAllocationHandle h[SEGMENT_PIECES], apart;
    CUdeviceptr va;
    CHECK(cuMemAddressReserve(&va, SEGMENT_PIECES * VMM_BYTES, 0, 0, 0));
    for (unsigned i = 0; i < SEGMENT_PIECES; i++) {
        CHECK(cuMemCreate(&h[i], VMM_BYTES, &prop, 0));
        CHECK(cuMemMap(va + i * VMM_BYTES, VMM_BYTES, 0, h[i], 0));
    }
    CHECK(cuMemSetAccess(va, SEGMENT_PIECES * VMM_BYTES, &rw, 1));
    for (unsigned i = 0; i < SEGMENT_PIECES; i++)
        CHECK(cuMemsetD32_v2(va + i * VMM_BYTES, 7 + i, VMM_BYTES / 4));
    own_map(7 + SEGMENT_PIECES, &apart);
    ready();
}

static void import(void) {
    CUresult (*import_fd)(CUmemGenericAllocationHandle *, void *, int) =
        driver("cuMemImportFromShareableHandle");
    wait_for("owner");
    int pid, theirs;
    FILE *f = fopen(at("owner"), "r");
    if (!f || fscanf(f, "%d %d", &pid, &theirs) != 2)
        exit(1);
    fclose(f);
    int pidfd = (int)syscall(SYS_pidfd_open, pid, 0);
    int fd = pidfd < 0 ? -1 : (int)syscall(SYS_pidfd_getfd, pidfd, theirs, 0);
    CUmemGenericAllocationHandle h;
    CUdeviceptr va;
    CHECK(fd < 0 ? 1 : import_fd(&h, (void *)(intptr_t)fd, 1));
    CHECK(cuMemAddressReserve(&va, VMM_BYTES, 0, 0, 0));
    CHECK(cuMemMap(va, VMM_BYTES, 0, h, 0));
    CHECK(cuMemSetAccess(va, VMM_BYTES, &rw, 1));
    CHECK(read_back(va, VMM_BYTES) == 7 ? 0 : 1);
    printf("MAPPED 0x%llx\n", va);
    ready();
    wait_for("release");
    CHECK(cuMemRelease(h));
    say("RELEASED");
    wait_for("unmap");
    CHECK(cuMemUnmap(va, VMM_BYTES));
    say("UNMAPPED");
}

static void ipc_own(void) {
    CUdeviceptr p;
    CUipcMemHandle h;
    CHECK(cuMemAlloc_v2(&p, IPC_BYTES));
    CHECK(cuMemsetD32_v2(p, 9, IPC_BYTES / 4));
    CHECK(cuIpcGetMemHandle(&h, p));
    publish("handle", &h, sizeof(h));
    ready();
}

static void ipc_open(void) {
    CUresult (*open_handle)(CUdeviceptr *, CUipcMemHandle, unsigned) = driver("cuIpcOpenMemHandle");
    wait_for("handle");
    CUipcMemHandle h;
    FILE *f = fopen(at("handle"), "rb");
    if (!f || fread(&h, sizeof(h), 1, f) != 1)
        exit(1);
    fclose(f);
    CUdeviceptr p;
    CHECK(open_handle(&p, h, 1));
    CHECK(read_back(p, IPC_BYTES) == 9 ? 0 : 1);
    printf("OPENED 0x%llx\n", p);
    ready();
    wait_for("close");
    CHECK(cuIpcCloseMemHandle(p));
    say("CLOSED");
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s own|segment|import|ipc-own|ipc-open DIR\n", argv[0]);
        return 2;
    }
    dir = argv[2];
    CUcontext ctx;
    CHECK(cuInit(0));
    CHECK(cuDevicePrimaryCtxRetain(&ctx, 0));
    CHECK(cuCtxSetCurrent(ctx));
    if (!strcmp(argv[1], "own"))
        own();
    else if (!strcmp(argv[1], "segment"))
        segment();
    else if (!strcmp(argv[1], "import"))
        import();
    else if (!strcmp(argv[1], "ipc-own"))
        ipc_own();
    else if (!strcmp(argv[1], "ipc-open"))
        ipc_open();
    else
        return 2;
    wait_for("stop");
    return 0;
}
