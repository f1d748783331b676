/* Peer memory: device memory of another process that the job has mapped, which the driver
 * cannot restore.
 *
 * Measured on two H200s (driver 580.159.04; bench/results/2026-11-27-multigpu, s6-call1): a
 * process that has mapped memory imported from another process (cuMemImportFromShareableHandle
 * of a POSIX fd, then cuMemMap; on the same GPU or another) is checkpointed by the driver, but
 * cuCheckpointProcessRestore then fails with CUDA_ERROR_NOT_SUPPORTED (801) and the process is
 * lost; a legacy cuIpcOpenMemHandle mapping fails the restore with CUDA_ERROR_INVALID_VALUE. The
 * owner (the exporter), and host memory registered with cuMemHostRegister, restore fine. An
 * importer that unmapped and released the imported memory before the driver's checkpoint, and
 * after the restore imported a fresh export of the owner's and mapped it at the same address,
 * came through. NCCL's defaults (P2P and SHM over cuMem) make exactly such imports.
 *
 * So the agent follows the job's own imports, maps, access settings, unmaps and releases (pos's
 * re-imports of the job's own memory go to the driver directly, DRV, and are not peer memory),
 * and keeps for each live mapping what taking it down before the driver's checkpoint and
 * putting it back after its restore need: the address, the size, the offset into the
 * allocation and the access given to it (the handle itself is gone by then: the putback maps a
 * fresh import of the owner's export). Neither is done yet: `status` says how many there are,
 * `peers` lists them (protocol.md). */
#include <stdlib.h>
#include <string.h>

#include "agent.h"

#define MAX_ACCESS 16

/* A live mapping of imported memory. */
struct peer_map {
    CUdeviceptr va;
    size_t size, offset;
    CUmemGenericAllocationHandle h;     /* the imported handle it maps */
    int released;                       /* the job released h: the mapping alone holds the memory */
    CUmemAccessDesc access[MAX_ACCESS]; /* what cuMemSetAccess gave its range, by location */
    int naccess;
};

/* A live legacy IPC mapping: the owner's handle and the flags it was opened with, for opening
 * it again. */
struct ipc_map {
    CUdeviceptr va;
    size_t size; /* the driver's answer for the range (0: it did not say) */
    CUipcMemHandle handle;
    unsigned flags;
};

/* All under mu. */
static CUmemGenericAllocationHandle *imports; /* handles the job imported, not yet released */
static size_t nimports, capimports;
static struct peer_map *maps;
static size_t nmaps, capmaps;
static struct ipc_map *ipcs;
static size_t nipcs, capipcs;

/* Room for one more of `size` bytes in *list (n used, *cap allocated); 0 when none. */
static int grow(void **list, size_t n, size_t *cap, size_t size) {
    if (n < *cap)
        return 1;
    size_t c = *cap ? 2 * *cap : 16;
    void *l = realloc(*list, c * size);
    if (!l)
        return 0;
    *list = l, *cap = c;
    return 1;
}

static long imported_at(CUmemGenericAllocationHandle h) {
    for (size_t i = 0; i < nimports; i++)
        if (imports[i] == h)
            return (long)i;
    return -1;
}

void peer_imported(CUmemGenericAllocationHandle h) {
    pthread_mutex_lock(&mu);
    if (imported_at(h) < 0 && grow((void **)&imports, nimports, &capimports, sizeof(*imports)))
        imports[nimports++] = h;
    pthread_mutex_unlock(&mu);
}

/* The driver may give the number to a handle of the job's own next: from here on a map of it is
 * not peer memory; the mappings made of it live on. */
void peer_released(CUmemGenericAllocationHandle h) {
    pthread_mutex_lock(&mu);
    long i = imported_at(h);
    if (i >= 0) {
        imports[i] = imports[--nimports];
        for (size_t k = 0; k < nmaps; k++)
            maps[k].released |= maps[k].h == h;
    }
    pthread_mutex_unlock(&mu);
}

void peer_mapped(CUdeviceptr va, size_t size, size_t offset, CUmemGenericAllocationHandle h) {
    pthread_mutex_lock(&mu);
    if (imported_at(h) >= 0 && grow((void **)&maps, nmaps, &capmaps, sizeof(*maps)))
        maps[nmaps++] = (struct peer_map){.va = va, .size = size, .offset = offset, .h = h};
    pthread_mutex_unlock(&mu);
}

/* Access is set per location, the others' left as they were: each location's last setting. */
void peer_access(CUdeviceptr va, size_t size, const CUmemAccessDesc *d, size_t n) {
    pthread_mutex_lock(&mu);
    for (size_t k = 0; k < nmaps; k++) {
        struct peer_map *m = &maps[k];
        if (m->va >= va + size || va >= m->va + m->size)
            continue;
        for (size_t j = 0; j < n; j++) {
            int a = 0;
            while (a < m->naccess && (m->access[a].location.type != d[j].location.type ||
                                      m->access[a].location.id != d[j].location.id))
                a++;
            if (a < MAX_ACCESS) {
                m->access[a] = d[j];
                m->naccess += a == m->naccess;
            }
        }
    }
    pthread_mutex_unlock(&mu);
}

void peer_unmapped(CUdeviceptr va, size_t size) {
    pthread_mutex_lock(&mu);
    for (size_t k = 0; k < nmaps;)
        if (maps[k].va >= va && maps[k].va < va + size)
            maps[k] = maps[--nmaps];
        else
            k++;
    pthread_mutex_unlock(&mu);
}

void ipc_opened(CUdeviceptr va, const CUipcMemHandle *h, unsigned flags) {
    CUdeviceptr base = 0;
    size_t size = 0;
    __typeof__(&cuMemGetAddressRange_v2) range = DRV(cuMemGetAddressRange_v2);
    if (!range || range(&base, &size, va) != CUDA_SUCCESS)
        size = 0;
    pthread_mutex_lock(&mu);
    if (grow((void **)&ipcs, nipcs, &capipcs, sizeof(*ipcs)))
        ipcs[nipcs++] = (struct ipc_map){.va = va, .size = size, .handle = *h, .flags = flags};
    pthread_mutex_unlock(&mu);
}

void ipc_closed(CUdeviceptr va) {
    pthread_mutex_lock(&mu);
    for (size_t k = 0; k < nipcs; k++)
        if (ipcs[k].va == va) {
            ipcs[k] = ipcs[--nipcs];
            break;
        }
    pthread_mutex_unlock(&mu);
}

struct peer_count peer_count(void) {
    struct peer_count c = {.maps = nmaps, .ipc = nipcs};
    for (size_t k = 0; k < nmaps; k++)
        c.bytes += maps[k].size;
    return c;
}

void build_peers(FILE *f) {
    fputs("{\"ok\":true,\"maps\":[", f);
    for (size_t k = 0; k < nmaps; k++) {
        const struct peer_map *m = &maps[k];
        fprintf(f, "%s{\"va\":%llu,\"size\":%zu,\"offset\":%zu,\"released\":%s,\"access\":[",
                k ? "," : "", m->va, m->size, m->offset, m->released ? "true" : "false");
        for (int a = 0; a < m->naccess; a++)
            fprintf(f, "%s{\"type\":%d,\"id\":%d,\"flags\":%d}", a ? "," : "",
                    m->access[a].location.type, m->access[a].location.id, m->access[a].flags);
        fputs("]}", f);
    }
    fputs("],\"ipc\":[", f);
    for (size_t k = 0; k < nipcs; k++)
        fprintf(f, "%s{\"va\":%llu,\"size\":%zu,\"flags\":%u}", k ? "," : "", ipcs[k].va,
                ipcs[k].size, ipcs[k].flags);
    fputs("]}", f);
}
