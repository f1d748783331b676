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
 * fresh import of the owner's export). `status` says how many there are, `peers` lists them.
 *
 * The job's own cuMem mappings (cuMemCreate memory it mapped itself: NCCL's buffers, which its
 * peers import) are kept too, so that pos can find each import's owner exactly and have the
 * owner export it again: `exports` lists them, `stamp` writes a nonce into one (its bytes kept)
 * and `unstamp` puts the bytes back, `peek` reads an import's first bytes: the owner of an
 * import is the allocation whose nonce the importer reads through its mapping (sizes are no
 * guide: NCCL's buffers are often of one size). With the job held, `peer-down` unmaps every
 * import and releases its handle (the address range kept), `peer-export VA` sends a fresh
 * export of the job's own allocation at VA, and `peer-up` maps such exports at the old
 * addresses with the old access (protocol.md).
 *
 * The job's own allocations can be taken as pos takes the memory it owns: `own-export` exports
 * each before the cut, `own-take` at the cut marks them (and exports them all again if any
 * mapping changed since: each has a serial), `own-down` unmaps each and releases the job's
 * handle (pos's import holds the memory, and the driver's checkpoint no longer copies it:
 * about a third of a 2-rank NCCL job's hold, bench/results/2026-11-29.md), `own-up` maps
 * pos's descriptors back at the same addresses.
 * The job keeps the handle it made: NCCL frees from the address (cuMemRetainAllocationHandle,
 * which finds the handle mapped there now) but exports the handle it made again for a peer
 * that connects later, and a job may release it (PyTorch's expandable segments do, after
 * unmapping it); the agent answers those calls with the allocation mapped there now (or last,
 * `retired`), until the driver gives that number to a new handle.
 *
 * A process alone takes part too: its own memory (PyTorch's expandable segments, the whole of a
 * job started with them) is taken the same way, in thousands of pieces.
 *
 * Fail closed: a record the agent could not keep (its memory ran short, or more access
 * settings than it keeps) is counted (`peer_lost`), and pos then refuses the job, which would
 * otherwise look as if it mapped less than it does; while any import is down the job never
 * runs: `end` is refused, and a connection that ends then leaves the job held for the stall
 * bound (pos's watchdog puts the imports back on a new connection), then ends the process
 * (its image, taken with the imports down, restores it). */
#define _GNU_SOURCE
#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "agent.h"

#define MAX_ACCESS 16
#define STAMP 16 /* bytes of a nonce */

/* A live mapping of imported memory. */
struct peer_map {
    CUdeviceptr va;
    size_t size, offset;
    CUmemGenericAllocationHandle h;     /* the imported handle it maps */
    int released;                       /* the job released h: the mapping alone holds the memory */
    CUmemAccessDesc access[MAX_ACCESS]; /* what cuMemSetAccess gave its range, by location */
    int naccess;
    int down; /* taken down by pos (peer-down): unmapped, h released, until peer-up */
};

/* A live mapping of the job's own cuMem memory (an allocation its peers may import). pos may
 * take it as it takes the memory it owns (own-take, own-down, own-up): the memory then lives
 * in a fresh allocation mapped at the same address, whose handle becomes the job's. */
struct own_map {
    CUdeviceptr va;
    size_t size;
    CUmemGenericAllocationHandle h; /* the job's handle (0 while down) */
    CUmemGenericAllocationHandle was; /* the job's first handle, which it may still name (an
                                       * export for a peer that connects later, a release):
                                       * answered with h (0: pos never took it) */
    int released; /* the job released h: it cannot be exported again */
    CUmemAccessDesc access[MAX_ACCESS]; /* what cuMemSetAccess gave its range, by location */
    int naccess;
    int taken; /* exported to pos by own-take: own-down takes it down */
    int down;  /* taken down by pos (own-down): unmapped, h released, until own-up */
    int fd;   /* pos's descriptor it was mapped back from (own-up; -1: none): the driver does
               * not export an imported handle again, so an export of it is a copy of this */
    unsigned long serial; /* this mapping's number, new with each map and own-up: an export
                           * pos made before the cut (own-export) names the same memory at the
                           * cut only while the numbers it was given are still there */
};

/* The job's first handle of an allocation pos took, after the job unmapped it: PyTorch's
 * expandable segments unmap each piece, then release the handle they made, which the driver no
 * longer knows (own-down released it); the release goes to the handle that held the memory
 * since (own-up's import), until the job makes it or the driver gives the number anew. */
struct retired {
    CUmemGenericAllocationHandle was, h;
};

/* A nonce written over the job's bytes (stamp), for unstamp. */
struct stamp {
    CUdeviceptr va;
    unsigned char saved[STAMP];
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
static struct own_map *owns;
static size_t nowns, capowns;
static unsigned long own_serials; /* the last own_map serial given */
static struct retired *retireds;
static size_t nretireds, capretireds;
static struct stamp *stamps;
static size_t nstamps, capstamps;
static size_t lost; /* records not kept: pos must refuse the job */
static long max_records = -1; /* POS_AGENT_PEER_MAX: a bound on the records kept (-1: none) */

static int room(void) {
    if (max_records == -1) {
        const char *v = getenv("POS_AGENT_PEER_MAX");
        max_records = v && *v ? atol(v) : -2;
    }
    return max_records < 0 || (long)(nimports + nmaps + nipcs + nowns) < max_records;
}

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
    own_fresh(h);
    pthread_mutex_lock(&mu);
    if (imported_at(h) < 0) {
        if (room() && grow((void **)&imports, nimports, &capimports, sizeof(*imports)))
            imports[nimports++] = h;
        else
            lost++;
    }
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
    } else {
        for (size_t k = 0; k < nowns; k++)
            owns[k].released |= owns[k].h == h;
        for (size_t k = 0; k < nretireds;)
            if (retireds[k].h == h)
                retireds[k] = retireds[--nretireds];
            else
                k++;
    }
    pthread_mutex_unlock(&mu);
}

void peer_mapped(CUdeviceptr va, size_t size, size_t offset, CUmemGenericAllocationHandle h) {
    CUcontext cur = NULL; /* the agent's own calls on this memory need the job's context */
    if (DRV(cuCtxGetCurrent)(&cur) != CUDA_SUCCESS)
        cur = NULL;
    pthread_mutex_lock(&mu);
    if (cur)
        remember_ctx(cur);
    if (imported_at(h) >= 0) {
        if (room() && grow((void **)&maps, nmaps, &capmaps, sizeof(*maps)))
            maps[nmaps++] = (struct peer_map){.va = va, .size = size, .offset = offset, .h = h};
        else
            lost++;
    } else if (offset == 0) { /* the job's own allocation, from its start */
        if (room() && grow((void **)&owns, nowns, &capowns, sizeof(*owns)))
            owns[nowns++] = (struct own_map){.va = va, .size = size, .h = h, .fd = -1,
                                             .serial = ++own_serials};
        else
            lost++;
    }
    pthread_mutex_unlock(&mu);
}

/* Access is set per location, the others' left as they were: each location's last setting,
 * into `access` (n used). Caller holds mu. */
static void keep_access(CUmemAccessDesc *access, int *n, const CUmemAccessDesc *d, size_t k) {
    for (size_t j = 0; j < k; j++) {
        int a = 0;
        while (a < *n && (access[a].location.type != d[j].location.type ||
                          access[a].location.id != d[j].location.id))
            a++;
        if (a < MAX_ACCESS) {
            access[a] = d[j];
            *n += a == *n;
        } else {
            lost++; /* a putback could not give the range all its access */
        }
    }
}

void peer_access(CUdeviceptr va, size_t size, const CUmemAccessDesc *d, size_t n) {
    pthread_mutex_lock(&mu);
    for (size_t k = 0; k < nmaps; k++)
        if (maps[k].va < va + size && va < maps[k].va + maps[k].size)
            keep_access(maps[k].access, &maps[k].naccess, d, n);
    for (size_t k = 0; k < nowns; k++)
        if (owns[k].va < va + size && va < owns[k].va + owns[k].size)
            keep_access(owns[k].access, &owns[k].naccess, d, n);
    pthread_mutex_unlock(&mu);
}

/* The handle the driver knows for `h`, a handle the job holds: h itself, or for the first handle
 * of an allocation pos took, the allocation's handle now. */
CUmemGenericAllocationHandle own_current(CUmemGenericAllocationHandle h) {
    pthread_mutex_lock(&mu);
    CUmemGenericAllocationHandle now = h;
    for (size_t k = 0; k < nowns && now == h; k++)
        if (owns[k].was && owns[k].was == h && !owns[k].down)
            now = owns[k].h;
    for (size_t k = 0; k < nretireds && now == h; k++)
        if (retireds[k].was == h)
            now = retireds[k].h;
    pthread_mutex_unlock(&mu);
    return now;
}

/* An export (a POSIX descriptor) of the allocation at owns[k]: a copy of pos's descriptor it
 * was mapped back from, or the driver's own export. Caller holds mu. */
static CUresult export_own(size_t k, int *fd) {
    if (owns[k].fd >= 0) {
        *fd = fcntl(owns[k].fd, F_DUPFD_CLOEXEC, 0);
        return *fd >= 0 ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
    }
    return DRV(cuMemExportToShareableHandle)(fd, owns[k].h, HANDLE_POSIX_FD, 0);
}

/* The job's export of `h` (a POSIX descriptor, no flags) where h names an allocation pos took
 * (its first handle, or the one it has now): 1 and *fd (-1: none could be made); 0 where h
 * is not such a handle, for the driver to answer. */
int own_export(CUmemGenericAllocationHandle h, int *fd) {
    pthread_mutex_lock(&mu);
    int ours = 0;
    for (size_t k = 0; k < nowns && !ours && h; k++) {
        if (owns[k].was != h && owns[k].h != h)
            continue;
        /* down (pos holds it, the driver's cycle under way): the export waits for own-up, as
         * the job's other calls wait for its memory; a process whose memory never comes back
         * is ended (peers_fail_closed) */
        while (owns[k].down)
            pthread_cond_wait(&cv, &mu);
        if (owns[k].fd < 0 || (owns[k].was != h && owns[k].h != h))
            break; /* not mapped back from pos's (or no longer this handle): the driver's */
        ours = 1;
        if (export_own(k, fd) != CUDA_SUCCESS)
            *fd = -1;
    }
    pthread_mutex_unlock(&mu);
    return ours;
}

/* The driver made a handle `h` (a create, an import, the job's or the agent's own): a first
 * handle kept under that number is no longer the job's to name, and is answered no more (a
 * call on it is the new allocation's). Caller holds mu. */
void forget_was(CUmemGenericAllocationHandle h) {
    for (size_t k = 0; k < nowns; k++)
        if (owns[k].was == h)
            owns[k].was = 0;
    for (size_t k = 0; k < nretireds;)
        if (retireds[k].was == h)
            retireds[k] = retireds[--nretireds];
        else
            k++;
}

void own_fresh(CUmemGenericAllocationHandle h) {
    pthread_mutex_lock(&mu);
    forget_was(h);
    pthread_mutex_unlock(&mu);
}

void peer_unmapped(CUdeviceptr va, size_t size) {
    pthread_mutex_lock(&mu);
    for (size_t k = 0; k < nmaps;)
        if (maps[k].va >= va && maps[k].va < va + size)
            maps[k] = maps[--nmaps];
        else
            k++;
    for (size_t k = 0; k < nowns;)
        if (owns[k].va >= va && owns[k].va < va + size) {
            if (owns[k].fd >= 0)
                close(owns[k].fd);
            if (owns[k].was && owns[k].h && !owns[k].released) {
                if (grow((void **)&retireds, nretireds, &capretireds, sizeof(*retireds)))
                    retireds[nretireds++] = (struct retired){owns[k].was, owns[k].h};
                else
                    lost++; /* its release would name a handle the driver does not know */
            }
            owns[k] = owns[--nowns];
        } else {
            k++;
        }
    pthread_mutex_unlock(&mu);
}

void ipc_opened(CUdeviceptr va, const CUipcMemHandle *h, unsigned flags) {
    CUdeviceptr base = 0;
    size_t size = 0;
    __typeof__(&cuMemGetAddressRange_v2) range = DRV(cuMemGetAddressRange_v2);
    if (!range || range(&base, &size, va) != CUDA_SUCCESS)
        size = 0;
    pthread_mutex_lock(&mu);
    if (room() && grow((void **)&ipcs, nipcs, &capipcs, sizeof(*ipcs)))
        ipcs[nipcs++] = (struct ipc_map){.va = va, .size = size, .handle = *h, .flags = flags};
    else
        lost++;
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
    struct peer_count c = {.maps = nmaps, .ipc = nipcs, .owns = nowns, .lost = lost};
    for (size_t k = 0; k < nmaps; k++) {
        c.bytes += maps[k].size;
        c.down += maps[k].down;
    }
    for (size_t k = 0; k < nowns; k++) {
        c.own_bytes += owns[k].size;
        c.own_down += owns[k].down;
        c.own_kept += owns[k].fd >= 0;
    }
    return c;
}

void build_peers(FILE *f) {
    fputs("{\"ok\":true,\"maps\":[", f);
    for (size_t k = 0; k < nmaps; k++) {
        const struct peer_map *m = &maps[k];
        fprintf(f,
                "%s{\"va\":%llu,\"size\":%zu,\"offset\":%zu,\"released\":%s,\"down\":%s,"
                "\"access\":[",
                k ? "," : "", m->va, m->size, m->offset, m->released ? "true" : "false",
                m->down ? "true" : "false");
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

/* ---- finding owners, taking imports down, putting them back (pos's requests) ---------------- */

void build_exports(FILE *f) {
    fputs("{\"ok\":true,\"allocs\":[", f);
    for (size_t k = 0; k < nowns; k++) {
        const struct own_map *o = &owns[k];
        fprintf(f, "%s{\"va\":%llu,\"size\":%zu,\"released\":%s,\"down\":%s,\"access\":[",
                k ? "," : "", o->va, o->size, o->released ? "true" : "false",
                o->down ? "true" : "false");
        for (int a = 0; a < o->naccess; a++)
            fprintf(f, "%s{\"type\":%d,\"id\":%d,\"flags\":%d}", a ? "," : "",
                    o->access[a].location.type, o->access[a].location.id, o->access[a].flags);
        fputs("]}", f);
    }
    fputs("]}", f);
}

/* The job's calls are held: cut (hold), or its memory given up (hoisted, as a restored job
 * starts). */
static int held(struct conn *c, const char *what) {
    int ph = atomic_load(&phase);
    if (ph == P_HOLD || ph == P_HOISTED)
        return 1;
    char msg[160];
    snprintf(msg, sizeof(msg), "%s: the job is in phase %s, not hold (cut it first)", what,
             phase_name[ph]);
    fail(c, msg);
    return 0;
}

static int hex_bytes(const char *hex, unsigned char *out, size_t n) {
    for (size_t i = 0; i < n; i++) {
        unsigned v;
        if (sscanf(hex + 2 * i, "%2x", &v) != 1)
            return -1;
        out[i] = (unsigned char)v;
    }
    return 0;
}

static long own_at(CUdeviceptr va) {
    for (size_t k = 0; k < nowns; k++)
        if (va >= owns[k].va && va + STAMP <= owns[k].va + owns[k].size)
            return (long)k;
    return -1;
}

/* `stamp VA HEX`: the 16 bytes at VA (inside one of the job's own allocations) kept, the nonce
 * written there. */
void do_stamp(struct conn *c, const char *args) {
    char hex[2 * STAMP + 1] = "";
    unsigned long long va = 0;
    unsigned char nonce[STAMP];
    if (!args || sscanf(args, "%llu %32s", &va, hex) != 2 || hex_bytes(hex, nonce, STAMP)) {
        fail(c, "stamp: give VA and 32 hex digits");
        return;
    }
    if (!held(c, "stamp"))
        return;
    pthread_mutex_lock(&mu);
    CUresult r = own_at(va) < 0 ? CUDA_ERROR_INVALID_VALUE : use_context();
    struct stamp s = {.va = va};
    if (r == CUDA_SUCCESS && !grow((void **)&stamps, nstamps, &capstamps, sizeof(*stamps)))
        r = CUDA_ERROR_OUT_OF_MEMORY;
    if (r == CUDA_SUCCESS)
        r = DRV(cuMemcpyDtoH_v2)(s.saved, va, STAMP);
    if (r == CUDA_SUCCESS) {
        stamps[nstamps++] = s; /* kept before the write: an unstamp puts back what it saw */
        r = DRV(cuMemcpyHtoD_v2)(va, nonce, STAMP);
    }
    pthread_mutex_unlock(&mu);
    if (r == CUDA_SUCCESS)
        reply(c, "{\"ok\":true}");
    else
        reply(c, "{\"ok\":false,\"error\":\"stamp: the driver answered %d\",\"rc\":%d}", (int)r,
              (int)r);
}

/* Every stamped range gets its bytes back (the latest stamp first: the oldest bytes win); one
 * the driver would not write stays listed. Caller holds mu. */
int unstamp_all(void) {
    if (nstamps && use_context() != CUDA_SUCCESS)
        return (int)nstamps;
    for (size_t i = nstamps; i-- > 0;)
        if (DRV(cuMemcpyHtoD_v2)(stamps[i].va, stamps[i].saved, STAMP) == CUDA_SUCCESS)
            stamps[i].va = 0; /* put back */
    size_t kept = 0;
    for (size_t i = 0; i < nstamps; i++)
        if (stamps[i].va)
            stamps[kept++] = stamps[i];
    nstamps = kept;
    return (int)kept;
}

void do_unstamp(struct conn *c) {
    pthread_mutex_lock(&mu);
    int bad = unstamp_all();
    pthread_mutex_unlock(&mu);
    if (bad)
        reply(c, "{\"ok\":false,\"error\":\"unstamp: %d ranges not put back\"}", bad);
    else
        reply(c, "{\"ok\":true}");
}

/* `peek VA`: the 16 bytes at VA of one of the job's live imports, in hex. */
void do_peek(struct conn *c, const char *args) {
    unsigned long long va = args ? strtoull(args, NULL, 0) : 0;
    if (!held(c, "peek"))
        return;
    unsigned char b[STAMP];
    pthread_mutex_lock(&mu);
    int found = 0;
    for (size_t k = 0; k < nmaps; k++)
        found |= !maps[k].down && va >= maps[k].va && va + STAMP <= maps[k].va + maps[k].size;
    CUresult r = found ? use_context() : CUDA_ERROR_INVALID_VALUE;
    if (r == CUDA_SUCCESS)
        r = DRV(cuMemcpyDtoH_v2)(b, va, STAMP);
    pthread_mutex_unlock(&mu);
    if (r != CUDA_SUCCESS) {
        reply(c, "{\"ok\":false,\"error\":\"peek: the driver answered %d\",\"rc\":%d}", (int)r,
              (int)r);
        return;
    }
    char hex[2 * STAMP + 1];
    for (int i = 0; i < STAMP; i++)
        snprintf(hex + 2 * i, 3, "%02x", b[i]);
    reply(c, "{\"ok\":true,\"bytes\":\"%s\"}", hex);
}

/* The answer to a command that took memory down: how many allocations and bytes, or the
 * driver's code where it stopped part way (those taken down stay down). */
static void reply_down(struct conn *c, const char *what, CUresult r, size_t n, size_t bytes) {
    if (r == CUDA_SUCCESS)
        reply(c, "{\"ok\":true,\"down\":%zu,\"bytes\":%zu}", n, bytes);
    else
        reply(c, "{\"ok\":false,\"error\":\"%s: the driver answered %d\",\"rc\":%d}", what,
              (int)r, (int)r);
}

/* `peer-down`: every live import unmapped (its address range kept) and its handle released. */
void do_peer_down(struct conn *c) {
    if (!held(c, "peer-down"))
        return;
    pthread_mutex_lock(&mu);
    CUresult r = use_context();
    size_t n = 0, bytes = 0;
    for (size_t k = 0; k < nmaps && r == CUDA_SUCCESS; k++) {
        struct peer_map *m = &maps[k];
        if (m->down)
            continue;
        r = DRV(cuMemUnmap)(m->va, m->size);
        if (r != CUDA_SUCCESS)
            break;
        m->down = 1, n++, bytes += m->size; /* from here on it must come back before a run */
        if (!m->released) {
            long i = imported_at(m->h);
            r = DRV(cuMemRelease)(m->h);
            if (i >= 0)
                imports[i] = imports[--nimports];
        }
    }
    pthread_mutex_unlock(&mu);
    reply_down(c, "peer-down", r, n, bytes);
}

/* `peer-export VA`: a fresh export of the job's own allocation at VA, as one descriptor, in any
 * phase (an owner that pos let go still exports, as NCCL's own proxy does at any time). The
 * driver's own export (DRV): no gate, so that it works while the job is held. */
void do_peer_export(struct conn *c, const char *args) {
    unsigned long long va = args ? strtoull(args, NULL, 0) : 0;
    pthread_mutex_lock(&mu);
    long k = -1;
    for (size_t i = 0; i < nowns; i++)
        if (owns[i].va == va)
            k = (long)i;
    CUresult r = k < 0 || owns[k].released ? CUDA_ERROR_INVALID_VALUE : use_context();
    int fd = -1;
    if (r == CUDA_SUCCESS)
        r = export_own((size_t)k, &fd);
    pthread_mutex_unlock(&mu);
    if (r != CUDA_SUCCESS) {
        reply(c, "{\"ok\":false,\"error\":\"peer-export: %s\",\"rc\":%d}",
              k < 0 ? "no allocation of the job's own starts there"
                    : "the driver did not export it", (int)r);
        return;
    }
    reply(c, "{\"ok\":true,\"fds\":1}");
    send_fds(c, &fd, 1);
    close(fd);
}

/* The `want` descriptors of an `up` request (peer-up, own-up) came, and the job is held: 1;
 * else the request is answered (0). */
static int up_ready(struct conn *c, size_t want, const char *what) {
    while (c->nfds < want) {
        if (rx(c, 30000) <= 0) {
            char msg[96];
            snprintf(msg, sizeof(msg), "%s: fewer descriptors came than announced", what);
            fail(c, msg);
            return 0;
        }
    }
    return held(c, what);
}

/* The memory of descriptor `fd` imported, mapped at [va, va+size) from `offset` and given
 * `access`, into *h; on a failure nothing of it is left. Caller holds mu. */
static CUresult map_back(int fd, CUdeviceptr va, size_t size, size_t offset,
                         const CUmemAccessDesc *access, int naccess,
                         CUmemGenericAllocationHandle *h) {
    CUresult r = DRV(cuMemImportFromShareableHandle)(h, (void *)(intptr_t)fd, HANDLE_POSIX_FD);
    if (r == CUDA_SUCCESS)
        forget_was(*h);
    if (r == CUDA_SUCCESS && (r = DRV(cuMemMap)(va, size, offset, *h, 0)))
        DRV(cuMemRelease)(*h);
    if (r == CUDA_SUCCESS && naccess &&
        (r = DRV(cuMemSetAccess)(va, size, access, (size_t)naccess))) {
        DRV(cuMemUnmap)(va, size);
        DRV(cuMemRelease)(*h);
    }
    return r;
}

/* An `up` request's end: the descriptors not kept closed, the answer. */
static void up_answer(struct conn *c, const char *what, CUresult r, size_t up, size_t want) {
    for (size_t i = 0; i < c->nfds; i++)
        if (c->fds[i] >= 0)
            close(c->fds[i]);
    c->nfds = 0;
    if (r == CUDA_SUCCESS)
        reply(c, "{\"ok\":true,\"up\":%zu}", up);
    else
        reply(c, "{\"ok\":false,\"error\":\"%s: the driver answered %d after %zu of %zu\","
                 "\"rc\":%d}", what, (int)r, up, want, (int)r);
}

/* `peer-up N` + N descriptors: the imports that are down, in the order `peers` lists them,
 * each imported, mapped at its old address and offset, given its old access; its handle
 * released again where the job had released it, kept (as the job's) otherwise. A failure
 * leaves the rest down and the job held. */
void do_peer_up(struct conn *c, size_t want) {
    if (!up_ready(c, want, "peer-up"))
        return;
    pthread_mutex_lock(&mu);
    size_t down = 0, up = 0, fd_at = 0;
    for (size_t k = 0; k < nmaps; k++)
        down += maps[k].down;
    CUresult r = down == want ? use_context() : CUDA_ERROR_INVALID_VALUE;
    for (size_t k = 0; k < nmaps && r == CUDA_SUCCESS; k++) {
        struct peer_map *m = &maps[k];
        if (!m->down)
            continue;
        CUmemGenericAllocationHandle h = 0;
        r = map_back(c->fds[fd_at++], m->va, m->size, m->offset, m->access, m->naccess, &h);
        if (r != CUDA_SUCCESS)
            break;
        m->down = 0, up++;
        if (m->released) {
            DRV(cuMemRelease)(h); /* the mapping alone holds it, as before */
        } else {
            m->h = h; /* the job's handle now (NCCL frees from the pointer) */
            if (grow((void **)&imports, nimports, &capimports, sizeof(*imports)))
                imports[nimports++] = h;
            else
                lost++;
        }
    }
    pthread_mutex_unlock(&mu);
    up_answer(c, "peer-up", r, up, want);
}

/* ---- the job's own cuMem memory taken as pos takes its owned memory -------------------------- */

/* Whether owns[k] is device memory (not NCCL's cuMem host memory, which pos would make
 * anew on the device). Caller holds mu. */
static int on_device(size_t k) {
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof(prop));
    __typeof__(&cuMemGetAllocationPropertiesFromHandle) props =
        DRV(cuMemGetAllocationPropertiesFromHandle);
    return props && props(&prop, owns[k].h) == CUDA_SUCCESS &&
           prop.location.type == LOCATION_DEVICE;
}

/* Whether owns[k] can be taken: mapped, and its memory exportable (one the job released, or
 * made without a POSIX descriptor handle, stays the job's, for the driver's checkpoint; one
 * mapped back from pos's descriptor is always taken: the driver cannot checkpoint the import
 * that maps it). Caller holds mu. */
static int takeable(size_t k) {
    return !owns[k].down && (owns[k].fd >= 0 || (!owns[k].released && on_device(k)));
}

/* owns[k] as the n-th of a reply's lists: its address onto `vas`, its serial onto `serials`
 * (each 24 bytes an allocation). Caller holds mu. */
static void listed(size_t k, size_t n, char *vas, size_t *at, char *serials, size_t *sat) {
    *at += (size_t)snprintf(vas + *at, 24, "%s%llu", n > 1 ? "," : "", owns[k].va);
    *sat += (size_t)snprintf(serials + *sat, 24, "%s%lu", n > 1 ? "," : "", owns[k].serial);
}

static int by_serial(const void *a, const void *b) {
    unsigned long x = *(const unsigned long *)a, y = *(const unsigned long *)b;
    return x < y ? -1 : x > y;
}

/* A fresh export of each takeable allocation, in `exports` order, answered with their count,
 * bytes, addresses and serials, then the descriptors; `take`: marked for own-down. `known`
 * (sorted, `nknown` of them; NULL: none): the serials of allocations pos holds a descriptor of
 * already, which are marked but not exported again; the answer's `fresh` then lists the
 * places (in its addresses) of those that are, in order. */
static void export_takeable(struct conn *c, int take, const unsigned long *known,
                            size_t nknown) {
    pthread_mutex_lock(&mu);
    int *fds = calloc(nowns ? nowns : 1, sizeof(int));
    char *vas = calloc(nowns ? nowns : 1, 24), *serials = calloc(nowns ? nowns : 1, 24);
    char *fresh = calloc(nowns ? nowns : 1, 24);
    CUresult r = fds && vas && serials && fresh ? use_context() : CUDA_ERROR_OUT_OF_MEMORY;
    size_t n = 0, nfd = 0, bytes = 0, at = 0, sat = 0, fat = 0;
    for (size_t k = 0; k < nowns && r == CUDA_SUCCESS; k++) {
        int fd = -1;
        if (take)
            owns[k].taken = 0;
        if (!takeable(k))
            continue;
        int kept = known && bsearch(&owns[k].serial, known, nknown, sizeof(*known), by_serial);
        if (!kept && export_own(k, &fd) != CUDA_SUCCESS)
            continue;
        if (take)
            owns[k].taken = 1;
        bytes += owns[k].size, n++;
        listed(k, n, vas, &at, serials, &sat);
        if (!kept) {
            fds[nfd++] = fd;
            fat += (size_t)snprintf(fresh + fat, 24, "%s%zu", fat ? "," : "", n - 1);
        }
    }
    pthread_mutex_unlock(&mu);
    if (r != CUDA_SUCCESS) {
        reply(c, "{\"ok\":false,\"error\":\"%s: the driver answered %d\",\"rc\":%d}",
              take ? "own-take" : "own-export", (int)r, (int)r);
    } else {
        reply(c, "{\"ok\":true,\"fds\":%zu,\"bytes\":%zu,\"vas\":[%s],\"serials\":[%s],"
                 "\"same\":false%s%s%s}", nfd, bytes, vas, serials, known ? ",\"fresh\":[" : "",
              known ? fresh : "", known ? "]" : "");
        send_fds(c, fds, nfd);
    }
    for (size_t i = 0; i < nfd; i++)
        close(fds[i]);
    free(fds);
    free(vas);
    free(serials);
    free(fresh);
}

/* `own-export`: what own-take would export, while the job runs, marking nothing: pos imports
 * and maps it before the cut, so that the take at the cut is only its copy (the export and
 * the mapping were 0.03-0.11 s of each rank's take, the ranks held, bench/results/2026-11-30.md).
 * The memory stays the job's. */
void do_own_export(struct conn *c) {
    export_takeable(c, 0, NULL, 0);
}

/* `own-take [S,S,... [keep]]`: the job's own allocations that can be taken, marked for
 * own-down. With the serials an own-export gave, and those still the takeable ones: no new
 * export (`same`, `fds: 0`): pos's descriptors from then name this memory. Else a fresh export
 * of each; with `keep`, of each but those the serials name, whose descriptors pos holds
 * (`fresh` lists the others: a job that mapped one more piece since, as PyTorch's expandable
 * segments grow, had its 4,561 pieces exported and mapped again while it was held, 1.3 s of
 * its hold, bench/results/2026-12-01.md). pos copies them while every process is held. */
void do_own_take(struct conn *c, const char *args) {
    if (!held(c, "own-take"))
        return;
    size_t len = args ? strcspn(args, " \r\n") : 0;
    int keep = args && !strncmp(args + len, " keep", 5);
    const char *serials = len ? args : NULL;
    if (serials) {
        pthread_mutex_lock(&mu);
        char *vas = calloc(nowns ? nowns : 1, 24), *now = calloc(nowns ? nowns : 1, 24);
        size_t n = 0, bytes = 0, at = 0, sat = 0;
        for (size_t k = 0; k < nowns && vas && now; k++) {
            if (!takeable(k))
                continue;
            n++, bytes += owns[k].size;
            listed(k, n, vas, &at, now, &sat);
        }
        int same = vas && now && len == sat && !strncmp(serials, now, sat);
        for (size_t k = 0; k < nowns && same; k++)
            owns[k].taken = takeable(k);
        pthread_mutex_unlock(&mu);
        if (same)
            reply(c, "{\"ok\":true,\"fds\":0,\"bytes\":%zu,\"vas\":[%s],\"serials\":[%s],"
                     "\"same\":true}", bytes, vas, now);
        free(vas);
        free(now);
        if (same)
            return;
    }
    size_t nknown = 0;
    unsigned long *known = NULL;
    if (serials && keep) {
        for (size_t i = 0; i < len; i++)
            nknown += serials[i] == ',';
        known = calloc(++nknown, sizeof(*known));
        char *end = (char *)serials;
        for (size_t i = 0; known && i < nknown; i++, end += *end == ',')
            known[i] = strtoul(end, &end, 10);
        if (known)
            qsort(known, nknown, sizeof(*known), by_serial);
    }
    export_takeable(c, 1, known, known ? nknown : 0);
    free(known);
}

/* `own-down`: each of the job's own allocations unmapped (its address range kept) and the
 * job's handle released: what pos took (own-take) holds the memory, and the driver's
 * checkpoint no longer copies it. From here on the job must not run before `own-up`. */
void do_own_down(struct conn *c) {
    if (!held(c, "own-down"))
        return;
    pthread_mutex_lock(&mu);
    CUresult r = use_context();
    size_t n = 0, bytes = 0;
    for (size_t k = 0; k < nowns && r == CUDA_SUCCESS; k++) {
        struct own_map *o = &owns[k];
        if (o->down || !o->taken)
            continue;
        if ((r = DRV(cuMemUnmap)(o->va, o->size)) != CUDA_SUCCESS)
            break;
        o->down = 1, n++, bytes += o->size; /* from here on it must come back before a run */
        if (!o->was)
            o->was = o->h; /* the number the job keeps */
        if (o->fd >= 0) /* CRIU cannot dump it; what own-take gave pos holds the memory */
            close(o->fd), o->fd = -1;
        if (!o->released)
            r = DRV(cuMemRelease)(o->h);
        o->h = 0;
    }
    pthread_mutex_unlock(&mu);
    reply_down(c, "own-down", r, n, bytes);
}

/* `own-up N` + N descriptors: one for each allocation the last own-take took, in `exports`
 * order; each that is down imported, mapped at its old address, given its old access (one an
 * own-down that failed part way left mapped keeps its memory: its descriptor is closed). The
 * imported handle is the job's from here on (released again where the job had released its
 * own), and the job's first handle is answered with it. A failure leaves the rest down and the
 * job held. */
void do_own_up(struct conn *c, size_t want) {
    if (!up_ready(c, want, "own-up"))
        return;
    pthread_mutex_lock(&mu);
    size_t taken = 0, up = 0, fd_at = 0;
    for (size_t k = 0; k < nowns; k++)
        taken += owns[k].taken;
    CUresult r = taken == want ? use_context() : CUDA_ERROR_INVALID_VALUE;
    for (size_t k = 0; k < nowns && r == CUDA_SUCCESS; k++) {
        struct own_map *o = &owns[k];
        if (!o->taken)
            continue;
        if (!o->down) {
            o->taken = 0, fd_at++; /* still the job's own: its descriptor is closed below */
            continue;
        }
        CUmemGenericAllocationHandle h = 0;
        int fd = c->fds[fd_at++];
        r = map_back(fd, o->va, o->size, 0, o->access, o->naccess, &h);
        if (r != CUDA_SUCCESS)
            break;
        o->down = o->taken = 0, up++;
        o->serial = ++own_serials; /* pos's memory now, not what an export before named */
        o->fd = fd, c->fds[fd_at - 1] = -1; /* kept for the next export */
        if (o->released)
            DRV(cuMemRelease)(h); /* the mapping alone holds it, as before */
        else
            o->h = h;
    }
    pthread_cond_broadcast(&cv); /* exports that waited for it */
    pthread_mutex_unlock(&mu);
    up_answer(c, "own-up", r, up, want);
}

static int waiting_grace;
static void grace_done(void) {
    pthread_mutex_lock(&mu);
    waiting_grace = 0;
    pthread_mutex_unlock(&mu);
}

/* Ends the process unless its imports come back (another connection: the watchdog's) within
 * the agent's stall bound; meanwhile the job stays held. */
static void *grace(void *arg) {
    double limit_s = *(double *)arg;
    free(arg);
    uint64_t until = now_ns() + (uint64_t)(limit_s * 1e9);
    for (;;) {
        pthread_mutex_lock(&mu);
        struct peer_count pc = peer_count();
        size_t down = pc.down + pc.own_down + nstamps;
        pthread_mutex_unlock(&mu);
        if (!down) {
            grace_done();
            return NULL;
        }
        if (now_ns() >= until)
            break;
        usleep(100000);
    }
    fprintf(stderr,
            "pos: mappings of GPU memory that pos took down in this process stayed down for "
            "%g s after pos went away; ending the process (pos's image restores it)\n",
            limit_s);
    kill(getpid(), SIGKILL);
    return NULL;
}

/* The connection ended with imports down (or pos's marks not taken out): the job must never
 * run with a mapping missing. It stays held (1: the caller must not release it) while another
 * connection may still put them back (pos's watchdog, which has the image's links), for the
 * stall bound `limit_s`; then it ends. Hoisted, its calls stay held until a remap anyway, which
 * leaves it held (a remap for a restore is refused then: hoist.c). Caller holds mu. */
int peers_fail_closed(double limit_s) {
    int bad = unstamp_all();
    struct peer_count pc = peer_count();
    size_t down = pc.down + pc.own_down;
    if (!down && !bad)
        return 0;
    if (!waiting_grace) {
        double *arg = malloc(sizeof(*arg));
        pthread_t t;
        if (arg) {
            *arg = limit_s;
            pthread_attr_t at;
            pthread_attr_init(&at);
            pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
            waiting_grace = pthread_create(&t, &at, grace, arg) == 0;
            pthread_attr_destroy(&at);
        }
        if (!waiting_grace) { /* no thread to wait with: end now rather than risk a run */
            fprintf(stderr, "pos: imports of other processes' memory taken down and pos gone; "
                            "ending the process\n");
            kill(getpid(), SIGKILL);
        }
    }
    return 1;
}

/* The job's export of an allocation: of one pos took, a copy of pos's descriptor that maps it
 * now (the driver does not export that imported handle), whether the job names the handle it
 * had or the one it has; the driver's answer otherwise. Not held by a cut, as before it was
 * wrapped: an export touches no memory, and a rank held at the cut must not hold a peer that
 * is still connecting to it (NCCL's proxy exports for the peer) short of the same point. */
EXPORT CUresult cuMemExportToShareableHandle(void *fd, CUmemGenericAllocationHandle h, int type,
                                             unsigned long long flags) {
    int mine = -1;
    if (fd && type == HANDLE_POSIX_FD && !flags && own_export(h, &mine))
        return mine >= 0 ? (*(int *)fd = mine, CUDA_SUCCESS) : CUDA_ERROR_OUT_OF_MEMORY;
    return DRV(cuMemExportToShareableHandle)(fd, own_current(h), type, flags);
}
