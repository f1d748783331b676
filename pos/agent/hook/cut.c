/* The cut: hold new calls, wait for those inside the driver, synchronise every context; now,
 * or just before an NCCL launch (the collective cut: ranks held before the same collective).
 *
 * A job of several processes (DDP's ranks) is cut consistently only where every rank stands
 * before the same collective: a rank held after launching collective k while its peer is held
 * before it would wait for that peer forever. Every rank launches the same collectives in the
 * same order (NCCL requires it), so the agent counts its NCCL kernel launches from the start,
 * and a cut given AT holds the job just before the launch that would make the count AT+1. */
#include <errno.h>
#include <string.h>
#include <unistd.h>

#include "agent.h"

long nccl_launches;       /* NCCL kernels launched (mu) */
static long hold_at = -1; /* a cut waits for the launch past this count (mu); -1: none */

/* Whether a kernel is NCCL's, remembered per function: a launch asks the driver for a name
 * once per kernel (NCCL's are ncclDevKernel_* or, before 2.19, ncclKernel_*, mangled or not). */
#define KINDS 4096
static struct {
    _Atomic(uintptr_t) f;
    _Atomic int nccl; /* 0: being learnt, 1: not NCCL's, 2: NCCL's */
} kinds[KINDS];

static int named_nccl(const struct touch *t) {
    const char *n = call_name(t);
    return strstr(n, "ncclDevKernel") || strstr(n, "ncclKernel");
}

int is_nccl(const struct touch *t) {
    uintptr_t f = (uintptr_t)t->f;
    size_t h = (size_t)((f >> 4) * 0x9E3779B97F4A7C15ull) % KINDS;
    for (int probe = 0; f && probe < 64; probe++, h = (h + 1) % KINDS) {
        uintptr_t seen = atomic_load(&kinds[h].f);
        if (!seen && atomic_compare_exchange_strong(&kinds[h].f, &seen, f)) {
            int yes = named_nccl(t);
            atomic_store(&kinds[h].nccl, yes ? 2 : 1);
            return yes;
        }
        if (seen == f) {
            int k = atomic_load(&kinds[h].nccl);
            if (k)
                return k == 2;
            break; /* being learnt by another thread: ask the driver here too */
        }
    }
    return named_nccl(t);
}

static void begin_hold(void) { /* caller holds mu; the phase is idle */
    memset(&st, 0, sizeof(st));
    st.started_ns = now_ns();
    set_phase(P_HOLD);
}

/* An NCCL launch arrives: counted, and the hold a cut armed for this point begins (this
 * launch then waits in the gate with every other call). */
void nccl_arrive(void) {
    pthread_mutex_lock(&mu);
    if (hold_at >= 0 && nccl_launches >= hold_at && atomic_load(&phase) == P_IDLE) {
        hold_at = -1;
        begin_hold();
    }
    nccl_launches++;
    pthread_mutex_unlock(&mu);
}

/* Arm the hold for the launch past NCCL launch `at` and wait (up to timeout_ms) for a launch
 * to begin it; 0 once held. A job already past `at` is refused with its count (`past`), as is
 * one that does not come there in time: pos then asks every rank again, further on. */
static int hold_at_launch(struct conn *c, long at, long timeout_ms) {
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += timeout_ms / 1000;
    until.tv_nsec += (timeout_ms % 1000) * 1000000L;
    if (until.tv_nsec >= 1000000000L)
        until.tv_sec++, until.tv_nsec -= 1000000000L;
    pthread_mutex_lock(&mu);
    if (nccl_launches > at) {
        long n = nccl_launches;
        pthread_mutex_unlock(&mu);
        reply(c,
              "{\"ok\":false,\"error\":\"the job has made %ld NCCL launches, past %ld\","
              "\"past\":%ld}",
              n, at, n);
        return -1;
    }
    hold_at = at;
    while (atomic_load(&phase) == P_IDLE && hold_at >= 0)
        if (pthread_cond_timedwait(&cv, &mu, &until) == ETIMEDOUT)
            break;
    long n = nccl_launches;
    int held = atomic_load(&phase) == P_HOLD && hold_at < 0;
    hold_at = -1;
    pthread_mutex_unlock(&mu);
    if (!held)
        reply(c,
              "{\"ok\":false,\"error\":\"the job made no NCCL launch past %ld within %ld ms "
              "(it has made %ld)\",\"past\":%ld}",
              at, timeout_ms, n, n);
    return held ? 0 : -1;
}

/* The cut: hold new calls (now, or with `at` >= 0 at the launch past NCCL launch `at`), wait
 * for those inside the driver, synchronise every context. */
void do_cut(struct conn *c, long timeout_ms, long at) {
    pthread_mutex_lock(&mu);
    if (atomic_load(&phase) != P_IDLE) {
        pthread_mutex_unlock(&mu);
        fail(c, "another checkpoint or restore is running");
        return;
    }
    if (at < 0)
        begin_hold();
    pthread_mutex_unlock(&mu);
    if (at >= 0 && hold_at_launch(c, at, timeout_ms))
        return;
    uint64_t t0 = st.started_ns;
    while (atomic_load(&inflight) > 0) {
        if (now_ns() - t0 > (uint64_t)timeout_ms * 1000000ull) {
            pthread_mutex_lock(&mu);
            set_phase(P_IDLE);
            pthread_mutex_unlock(&mu);
            fail(c, "calls inside the driver did not return within the cut's timeout");
            return;
        }
        usleep(50);
    }
    uint64_t t1 = now_ns();
    CUresult r = CUDA_SUCCESS;
    pthread_mutex_lock(&mu);
    int n = nctx;
    CUcontext list[16];
    memcpy(list, ctxs, sizeof(list));
    pthread_mutex_unlock(&mu);
    for (int i = 0; i < n && r == CUDA_SUCCESS; i++)
        if ((r = DRV(cuCtxSetCurrent)(list[i])) == CUDA_SUCCESS)
            r = DRV(cuCtxSynchronize)();
    uint64_t t2 = now_ns();
    pthread_mutex_lock(&mu);
    if (r != CUDA_SUCCESS) {
        set_phase(P_IDLE);
        pthread_mutex_unlock(&mu);
        reply(c, "{\"ok\":false,\"error\":\"cuCtxSynchronize failed with CUresult %d\"}", r);
        return;
    }
    for (size_t i = 0; i < ntab; i++)
        tab[i].status = ST_PENDING;
    npending = ntab;
    reply(c, "{\"ok\":true,\"drain_s\":%.6f,\"sync_s\":%.6f,\"buffers\":%zu,\"bytes\":%zu}",
          secs(t1 - t0), secs(t2 - t1), ntab, owned_bytes);
    pthread_mutex_unlock(&mu);
}
