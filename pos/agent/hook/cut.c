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
    scan_linked();
    pthread_mutex_lock(&mu);
    if (atomic_load(&phase) != P_IDLE) {
        pthread_mutex_unlock(&mu);
        fail(c, "another checkpoint or restore is running");
        return;
    }
    if (ungated[0]) { /* a call the gate cannot see may touch the memory (gated.h) */
        char name[sizeof(ungated)];
        memcpy(name, ungated, sizeof(name));
        pthread_mutex_unlock(&mu);
        reply(c,
              "{\"ok\":false,\"error\":\"the job can call %s, which the gate does not "
              "know\",\"ungated\":\"%s\"}",
              name, name);
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
        tab[i].status = ST_PENDING, tab[i].saved = 0;
    npending = ntab;
    reply(c, "{\"ok\":true,\"drain_s\":%.6f,\"sync_s\":%.6f,\"buffers\":%zu,\"bytes\":%zu}",
          secs(t1 - t0), secs(t2 - t1), ntab, owned_bytes);
    pthread_mutex_unlock(&mu);
}
