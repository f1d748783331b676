/* Moving an operation on: buffers saved or back (`done`), a phase to the next, the end. */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "agent.h"

void mark_done(char *args, int saved_only) {
    pthread_mutex_lock(&mu);
    for (char *t = strtok(args, " "); t; t = strtok(NULL, " ")) {
        long i = find(strtoull(t, NULL, 0));
        if (i >= 0 && saved_only)
            tab[i].saved = 1;
        else if (i >= 0 && tab[i].status == ST_PENDING)
            tab[i].status = ST_DONE, npending--;
    }
    pthread_cond_broadcast(&cv);
    pthread_mutex_unlock(&mu);
}

void do_move(struct conn *c, int from, int to) {
    pthread_mutex_lock(&mu);
    int ok = atomic_load(&phase) == from;
    if (ok && to == P_RESTORE) { /* the restore's own account: its calls from here */
        memset(&st, 0, sizeof(st));
        st.started_ns = now_ns();
    }
    if (ok)
        set_phase(to);
    pthread_mutex_unlock(&mu);
    if (ok)
        reply(c, "{\"ok\":true,\"phase\":\"%s\"}", phase_name[to]);
    else
        reply(c, "{\"ok\":false,\"error\":\"the job is in phase %s, not %s\"}",
              phase_name[atomic_load(&phase)], phase_name[from]);
}

void do_end(struct conn *c) {
    char s[STATS_CAP];
    pthread_mutex_lock(&mu);
    int bad = unstamp_all();
    struct peer_count pc = peer_count();
    size_t down = pc.down + pc.own_down;
    pthread_mutex_unlock(&mu);
    if (bad || down) { /* the job must not run so: pos puts them back, or ends it */
        reply(c, "{\"ok\":false,\"error\":\"%s\"}",
              down ? "mappings pos took down are not back: put them back first (peer-up, own-up)"
                   : "pos's marks could not be taken out of the job's memory");
        return;
    }
    pthread_mutex_lock(&mu);
    int ph = atomic_load(&phase);
    if (ph != P_HOISTED) {
        set_phase(P_IDLE);
        /* the released calls account for their waits before the report is made */
        uint64_t until = now_ns() + 100000000ull;
        while (waiting > 0 && now_ns() < until) {
            pthread_mutex_unlock(&mu);
            usleep(50);
            pthread_mutex_lock(&mu);
        }
    }
    stats_json(s, sizeof(s));
    pthread_mutex_unlock(&mu);
    if (ph == P_HOISTED)
        fail(c, "the job's memory is given up: remap it first");
    else
        reply(c, "{\"ok\":true,%s}", s);
}
