/* The hoist (the job gives its physical memory up to pos, keeping the addresses) and the
 * remap (it maps pos's descriptors back at the same addresses). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "agent.h"

/* The context's local memory is its per-thread stack times every thread the GPU can hold
 * (264 MiB for 1 KiB on the H100), and the driver's checkpoint copies it like any memory, in
 * the job's stall. So while the memory is given up the stack is set to `bytes` (the driver
 * grows it again at a launch that needs more), and the remap sets it back to what it was
 * (stack_kept, which CRIU keeps for a restore in a new process). Caller holds mu, context
 * current. The driver's answer, or -1 when it has no such call. */
static size_t stack_kept;

static int shrink_stack(size_t bytes) {
    __typeof__(&cuCtxGetLimit) get = DRV(cuCtxGetLimit);
    __typeof__(&cuCtxSetLimit) set = DRV(cuCtxSetLimit);
    size_t was = 0;
    if (!get || !set || get(&was, LIMIT_STACK) != CUDA_SUCCESS || was <= bytes)
        return -1;
    int r = set(LIMIT_STACK, bytes);
    if (r == CUDA_SUCCESS)
        stack_kept = was;
    return r;
}

static int grow_stack_back(void) {
    __typeof__(&cuCtxSetLimit) set = DRV(cuCtxSetLimit);
    int r = stack_kept && set ? set(LIMIT_STACK, stack_kept) : CUDA_SUCCESS;
    if (r == CUDA_SUCCESS)
        stack_kept = 0;
    return r;
}

/* A job's heap keeps what it freed: glibc gives memory back to the kernel only from the top
 * of an arena, and a model loaded through host memory leaves hundreds of MiB of it free inside
 * (a 7B server: a 413 MiB heap). CRIU's dump would write it and every restore read it back.
 * malloc_trim gives every arena's free pages back, the job none the wiser; looked up at run
 * time, for a libc without it. Seconds it took, -1 when there is none. Not under mu: it takes
 * the job's malloc locks, which a job thread may hold for a moment. */
static double trim_heap(void) {
    int (*trim)(size_t) = (int (*)(size_t))dlsym(RTLD_DEFAULT, "malloc_trim");
    if (!trim)
        return -1.0;
    uint64_t t0 = now_ns();
    trim(0);
    return secs(now_ns() - t0);
}

/* Give up the physical memory (the helper holds it), keeping the addresses: phase hoisted.
 * `args`: "[STACK] [trim]": the stack the context keeps (shrink_stack), and whether the job's
 * heap gives its free memory back (trim_heap) before the driver's checkpoint and CRIU's dump. */
void do_hoist(struct conn *c, const char *args) {
    const char *stack_arg = args && *args >= '0' && *args <= '9' ? args : NULL;
    int trim = args && strstr(args, "trim") != NULL;
    pthread_mutex_lock(&mu);
    if (atomic_load(&phase) != P_HOLD) {
        pthread_mutex_unlock(&mu);
        fail(c, "hoist needs the cut first");
        return;
    }
    CUresult r = use_context();
    size_t released = 0, bytes = 0;
    set_phase(P_HOISTED);
    uint64_t t0 = now_ns();
    for (size_t i = 0; i < ntab && r == CUDA_SUCCESS; i++) {
        if (!tab[i].h)
            continue;
        if ((r = unmap(tab[i].va, tab[i].mapped)) == CUDA_SUCCESS &&
            (r = DRV(cuMemRelease)(tab[i].h)) == CUDA_SUCCESS) {
            tab[i].h = 0;
            if (tab[i].fd >= 0) /* CRIU cannot dump it; pos holds its own */
                close(tab[i].fd), tab[i].fd = -1;
            released++, bytes += tab[i].mapped;
        }
    }
    double loop_s = secs(now_ns() - t0);
    int stack_rc = r == CUDA_SUCCESS && stack_arg ? shrink_stack(strtoull(stack_arg, NULL, 0)) : -1;
    pthread_mutex_unlock(&mu);
    double trim_s = r == CUDA_SUCCESS && trim ? trim_heap() : -1.0;
    if (r != CUDA_SUCCESS)
        reply(c,
              "{\"ok\":false,\"error\":\"giving the memory up failed with CUresult %d after "
              "%zu buffers\"}",
              r, released);
    else
        reply(c,
              "{\"ok\":true,\"released\":%zu,\"bytes\":%zu,\"stack\":%zu,\"stack_rc\":%d,"
              "\"trim_s\":%.4f,\"loop_s\":%.6f}",
              released, bytes, stack_kept, stack_rc, trim_s, loop_s);
}

/* Map the descriptors that came with the request at the table's addresses: phase hold, or
 * with `restore` straight into the restore gate (memory that pos is still filling: should pos
 * go away at any moment after this, the job must not run on it). */
void do_remap(struct conn *c, size_t want, int then_restore) {
    uint64_t asked = now_ns();
    pthread_mutex_lock(&mu);
    struct peer_count pc = peer_count();
    size_t down = pc.down + pc.own_down;
    pthread_mutex_unlock(&mu);
    if (then_restore && down) { /* the restore gate lets calls run: not without every import */
        fail(c, "mappings pos took down are not back: put them back first (peer-up, own-up)");
        return;
    }
    while (c->nfds < want) {
        int r = rx(c, 30000);
        if (r <= 0) {
            fail(c, "remap: fewer descriptors came than announced");
            return;
        }
    }
    uint64_t came = now_ns();
    pthread_mutex_lock(&mu);
    CUresult r = want == ntab ? use_context() : CUDA_ERROR_INVALID_VALUE;
    size_t mapped = 0;
    for (size_t i = 0; i < ntab && r == CUDA_SUCCESS; i++) {
        if (tab[i].h)
            continue; /* never given up */
        CUmemGenericAllocationHandle h = 0;
        r = DRV(cuMemImportFromShareableHandle)(&h, (void *)(intptr_t)c->fds[i], HANDLE_POSIX_FD);
        if (r == CUDA_SUCCESS)
            forget_was(h); /* a number the job's first handle of its own memory had */
        if (r == CUDA_SUCCESS && (r = map_rw(tab[i].va, tab[i].mapped, h, tab[i].device)))
            DRV(cuMemRelease)(h);
        if (r == CUDA_SUCCESS) {
            tab[i].h = h, mapped++;
            tab[i].fd = c->fds[i], c->fds[i] = -1; /* kept for the next export */
        }
    }
    uint64_t looped = now_ns();
    int all = 1;
    for (size_t i = 0; i < ntab; i++)
        all &= tab[i].h != 0;
    uint64_t t0 = now_ns(); /* not fatal: the driver grows the stack at a launch anyway */
    int stack_rc = all && r == CUDA_SUCCESS ? grow_stack_back() : CUDA_SUCCESS;
    double stack_s = secs(now_ns() - t0);
    if (all && atomic_load(&phase) == P_HOISTED && then_restore) {
        memset(&st, 0, sizeof(st));
        st.started_ns = now_ns();
        for (size_t i = 0; i < ntab; i++)
            tab[i].status = ST_PENDING, tab[i].saved = 0;
        npending = ntab;
        set_phase(P_RESTORE);
    } else if (all && atomic_load(&phase) == P_HOISTED) {
        set_phase(P_HOLD);
    }
    pthread_mutex_unlock(&mu);
    for (size_t i = 0; i < c->nfds; i++)
        if (c->fds[i] >= 0)
            close(c->fds[i]);
    c->nfds = 0;
    if (r != CUDA_SUCCESS)
        reply(c,
              "{\"ok\":false,\"error\":\"remap failed with CUresult %d (%zu of %zu buffers "
              "announced, %zu in the table)\"}",
              r, want, want, ntab);
    else
        reply(c,
              "{\"ok\":true,\"mapped\":%zu,\"stack_s\":%.6f,\"stack_rc\":%d,\"rx_s\":%.6f,"
              "\"loop_s\":%.6f}",
              mapped, stack_s, stack_rc, secs(came - asked), secs(looped - came));
}
