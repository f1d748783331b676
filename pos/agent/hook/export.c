/* The export: every owned allocation as a file descriptor, sent to pos in table order; and
 * memory the driver will not export.
 *
 * After the driver's own checkpoint and restore of the job (a stop-the-world cycle that left it
 * running), the memory the driver brought back was not exportable on two H200s (driver
 * 580.159.04; the H100 exported it): cuMemExportToShareableHandle answered
 * CUDA_ERROR_INVALID_VALUE, and each refusal left a /dev/nvidiactl descriptor open that CRIU
 * then would not dump ("Can't dump file ... chr 195:255"). */
#define _GNU_SOURCE
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include "agent.h"

/* The descriptors open now, as a bitmap by number; ok = 0 when /proc/self/fd was unreadable. */
struct fdset {
    int ok;
    size_t n;
    unsigned char *has;
};

static struct fdset fds_open(void) {
    struct fdset s = {0};
    DIR *d = opendir("/proc/self/fd");
    if (!d)
        return s;
    s.ok = 1;
    for (struct dirent *e; (e = readdir(d));) {
        char *end;
        long fd = strtol(e->d_name, &end, 10);
        if (end == e->d_name || *end || fd < 0 || fd == dirfd(d))
            continue;
        if ((size_t)fd >= s.n) {
            size_t n = (size_t)fd * 2 + 64;
            unsigned char *has = realloc(s.has, n);
            if (!has) {
                s.ok = 0;
                break;
            }
            memset(has + s.n, 0, n - s.n);
            s.has = has, s.n = n;
        }
        s.has[fd] = 1;
    }
    closedir(d);
    return s;
}

/* Room for n more descriptors in the table (asked before the cut, the job running): the
 * export, and the remap after it, then make theirs without the kernel growing the table while
 * the job is held; the soft RLIMIT_NOFILE is raised for them where the hard one allows. A
 * table that threads share waits for an RCU grace period at each growth: on the 2-core VM a
 * checkpoint of a 400-buffer job (fake driver) spent 15 ms of its export on the job's growth
 * alone. One descriptor is made above the highest open one plus n (within
 * RLIMIT_NOFILE) and closed: F_DUPFD takes the lowest free number from there, so no
 * descriptor of the job's is touched. */
void do_room(struct conn *c, size_t n) {
    uint64_t t0 = now_ns();
    struct fdset s = fds_open();
    size_t top = 0;
    for (size_t fd = s.n; s.ok && fd-- > 0 && !top;)
        top = s.has[fd] ? fd : 0;
    free(s.has);
    struct rlimit rl;
    size_t want = top + n;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY &&
        want >= rl.rlim_cur) {
        /* the soft limit raised toward the hard one: a job's own memory can come in thousands
         * of pieces (PyTorch's expandable segments map 20 MiB at a time), each a descriptor */
        struct rlimit up = {want + 1, rl.rlim_max};
        if (rl.rlim_max != RLIM_INFINITY && up.rlim_cur > rl.rlim_max)
            up.rlim_cur = rl.rlim_max;
        if (up.rlim_cur > rl.rlim_cur && setrlimit(RLIMIT_NOFILE, &up) == 0)
            rl.rlim_cur = up.rlim_cur;
        if (want >= rl.rlim_cur)
            want = rl.rlim_cur ? rl.rlim_cur - 1 : 0;
    }
    int high = s.ok && want > top ? fcntl(c->fd, F_DUPFD_CLOEXEC, (int)want) : -1;
    if (high >= 0)
        close(high);
    reply(c, "{\"ok\":true,\"top\":%zu,\"room\":%zu,\"made\":%s,\"room_s\":%.6f}", top,
          want, high >= 0 ? "true" : "false", secs(now_ns() - t0));
}

static int is_nvidiactl(int fd) {
    struct stat sb;
    return fstat(fd, &sb) == 0 && S_ISCHR(sb.st_mode) && major(sb.st_rdev) == 195 &&
           minor(sb.st_rdev) == 255;
}

/* Retire the /dev/nvidiactl descriptors open now that were not open in `before` and are none
 * of the n in `keep` (the exports so far); how many. Each gets /dev/null in its place rather
 * than closed: CRIU dumps that, and the number stays taken, so that should the driver close
 * the number it leaked some day, it closes nothing of the job's. None when a listing failed. */
static size_t retire_leaked(const struct fdset *before, const int *keep, size_t n) {
    struct fdset now = fds_open();
    int null = open("/dev/null", O_RDWR | O_CLOEXEC);
    size_t retired = 0;
    for (size_t fd = 0; before->ok && now.ok && null >= 0 && fd < now.n; fd++) {
        int kept = (fd < before->n && before->has[fd]) || !now.has[fd] || (int)fd == null;
        for (size_t i = 0; i < n && !kept; i++)
            kept = keep[i] == (int)fd;
        if (!kept && is_nvidiactl((int)fd))
            retired += dup3(null, (int)fd, O_CLOEXEC) == (int)fd;
    }
    if (null >= 0)
        close(null);
    free(now.has);
    return retired;
}

/* Make a context of `device` current: the memory pos made there is accessible from it. */
static CUresult use_device(int device) {
    for (int i = 0; i < nctx; i++) {
        CUdevice d;
        if (DRV(cuCtxSetCurrent)(ctxs[i]) == CUDA_SUCCESS &&
            DRV(cuCtxGetDevice)(&d) == CUDA_SUCCESS && d == device)
            return CUDA_SUCCESS;
    }
    return CUDA_ERROR_INVALID_VALUE;
}

/* Move buffer o into new exportable memory at the same address: the new memory mapped at a
 * range of its own, the bytes copied device to device (16 GiB took 24 ms on an H200), then
 * mapped at o's address in place of the old. Caller holds mu, a context of o's device current,
 * the job's calls held. *lost: a failed swap could not map the old memory back either (the
 * buffer has no memory now). */
static CUresult reseat(struct owned *o, int *lost) {
    CUmemAllocationProp prop = prop_for(o->device);
    CUmemGenericAllocationHandle h = 0;
    CUdeviceptr tmp = 0;
    CUresult r = DRV(cuMemCreate)(&h, o->mapped, &prop, 0);
    if (r != CUDA_SUCCESS)
        return r;
    forget_was(h); /* a number the job's first handle of its own memory had */
    if ((r = DRV(cuMemAddressReserve)(&tmp, o->mapped, 0, 0, 0)) == CUDA_SUCCESS) {
        if ((r = map_rw(tmp, o->mapped, h, o->device)) == CUDA_SUCCESS) {
            if ((r = DRV(cuMemcpyDtoD_v2)(tmp, o->va, o->mapped)) == CUDA_SUCCESS)
                r = DRV(cuCtxSynchronize)(); /* device-to-device copies return at once */
            CUresult u = unmap(tmp, o->mapped);
            r = r == CUDA_SUCCESS ? u : r;
        }
        DRV(cuMemAddressFree)(tmp, o->mapped);
    }
    if (r == CUDA_SUCCESS && (r = unmap(o->va, o->mapped)) == CUDA_SUCCESS &&
        (r = map_rw(o->va, o->mapped, h, o->device)) != CUDA_SUCCESS)
        *lost = map_rw(o->va, o->mapped, o->h, o->device) != CUDA_SUCCESS;
    if (r != CUDA_SUCCESS) {
        DRV(cuMemRelease)(h);
        return r;
    }
    DRV(cuMemRelease)(o->h);
    o->h = h;
    return CUDA_SUCCESS;
}

/* One export's account: the descriptors open before the export that may leak one (all of the
 * loop's until the first refusal, then each export's own), what was moved and retired. */
struct export_run {
    struct fdset before;
    int refused; /* a refusal came: from then on a fresh listing before each export */
    size_t reseated, reseated_bytes, leaked, need;
    uint64_t reseat_ns;
    int lost;
};

static void relist(struct export_run *x) {
    free(x->before.has);
    x->before = fds_open();
}

/* The driver's export of o's handle; a refusal's leaked descriptor retired. */
static CUresult export_handle(struct owned *o, int *fd, const int *done, size_t ndone,
                              struct export_run *x) {
    if (x->refused)
        relist(x);
    CUresult r = DRV(cuMemExportToShareableHandle)(fd, o->h, HANDLE_POSIX_FD, 0);
    if (r != CUDA_SUCCESS) {
        x->leaked += retire_leaked(&x->before, done, ndone);
        x->refused = 1;
    }
    return r;
}

/* One buffer's descriptor: a copy of the one it was mapped from, else the driver's export; a
 * buffer the driver will not export is reseated (on its own device) and exported again.
 * Caller holds mu. */
static CUresult export_one(struct owned *o, int *fd, const int *done, size_t ndone,
                           struct export_run *x) {
    if (o->fd >= 0)
        return (*fd = fcntl(o->fd, F_DUPFD_CLOEXEC, 0)) < 0 ? CUDA_ERROR_OPERATING_SYSTEM
                                                            : CUDA_SUCCESS;
    CUresult r = export_handle(o, fd, done, ndone, x);
    if (r != CUDA_ERROR_INVALID_VALUE)
        return r;
    uint64_t t0 = now_ns();
    if ((r = use_device(o->device)) == CUDA_SUCCESS)
        r = reseat(o, &x->lost);
    use_context();
    x->reseat_ns += now_ns() - t0;
    if (r == CUDA_ERROR_OUT_OF_MEMORY)
        x->need = o->mapped;
    if (r != CUDA_SUCCESS)
        return r;
    x->reseated++, x->reseated_bytes += o->mapped;
    return export_handle(o, fd, done, ndone, x);
}

/* Export every owned allocation as a file descriptor, in table order (phase hold only). When
 * the device has no room to reseat a buffer the answer says how much it lacks (`need`): pos
 * frees its shadow and asks again. A buffer left with no memory at all ends the process: it
 * must not compute without it. */
void do_export(struct conn *c) {
    uint64_t asked = now_ns();
    pthread_mutex_lock(&mu);
    uint64_t locked = now_ns();
    int ph = atomic_load(&phase);
    size_t n = ntab, done = 0;
    int *fds = calloc(n ? n : 1, sizeof(int));
    struct export_run x = {0};
    CUresult r = ph == P_HOLD ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    if (r == CUDA_SUCCESS && n)
        r = use_context();
    if (r == CUDA_SUCCESS && n)
        x.before = fds_open();
    for (; fds && r == CUDA_SUCCESS && done < n; done++)
        r = export_one(&tab[done], &fds[done], fds, done, &x);
    CUdeviceptr at = done ? tab[done - 1].va : 0;
    uint64_t looped = now_ns();
    pthread_mutex_unlock(&mu);
    free(x.before.has);
    if (!fds || r != CUDA_SUCCESS) {
        for (size_t i = 0; fds && i + 1 < done; i++)
            close(fds[i]);
        if (ph != P_HOLD)
            fail(c, "export needs the cut first");
        else if (x.lost) {
            reply(c,
                  "{\"ok\":false,\"error\":\"moving the buffer at 0x%llx into exportable memory "
                  "failed with CUresult %d, and its old memory could not be mapped back: the "
                  "process ends\"}",
                  at, r);
            fprintf(stderr, "pos: the buffer at 0x%llx lost its memory; ending the process\n", at);
            kill(getpid(), SIGKILL);
        } else
            reply(c,
                  "{\"ok\":false,\"error\":\"exporting the buffer at 0x%llx failed with "
                  "CUresult %d\",\"need\":%zu}",
                  at, r, x.need);
        free(fds);
        return;
    }
    if (reply(c,
              "{\"ok\":true,\"fds\":%zu,\"reseated\":%zu,\"reseated_bytes\":%zu,"
              "\"reseat_s\":%.6f,\"leaked\":%zu,\"lock_s\":%.6f,\"loop_s\":%.6f}",
              n, x.reseated, x.reseated_bytes, secs(x.reseat_ns), x.leaked,
              secs(locked - asked), secs(looped - locked)) == 0)
        send_fds(c, fds, n);
    for (size_t i = 0; i < n; i++)
        close(fds[i]);
    free(fds);
}
