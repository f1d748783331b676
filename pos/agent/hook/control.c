/* The control thread: it listens on the abstract unix socket "\0pos-agent-<pid>" (root peers
 * only), serves one connection at a time, one operation a connection, and dispatches its
 * requests (protocol.md beside this file is the contract with pos/agent/control.py). It starts
 * with the job's first cuInit. */
#define _GNU_SOURCE
#include <errno.h>
#include <signal.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "agent.h"

static void note(const char *fmt, ...) {
    if (!getenv("POS_HOOK_DEBUG"))
        return;
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "poshook[%d]: ", getpid());
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
}

static int stall_ms(void) {
    const char *s = getenv("POS_AGENT_STALL_S");
    double v = s ? atof(s) : 60.0;
    return v > 0 ? (int)(v * 1000) : 60000;
}

/* How the last control connection ended, for `status` on the next one: pos, finding its
 * connection gone, asks on a new one and names the cause from the agent's own account (the job's
 * standard error may be kept nowhere, and the agent writes there only when it says something the
 * user must know). Under mu. */
static char last_end[224];
static const char *last_end_code = ""; /* how, for pos: eof, silent, reused, failed, bye */
static uint64_t last_end_ns;
static int last_end_said; /* the same line went to the job's standard error */

static void record_end(int said, const char *code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void record_end(int said, const char *code, const char *fmt, ...) {
    pthread_mutex_lock(&mu);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_end, sizeof(last_end), fmt, ap);
    va_end(ap);
    last_end_code = code;
    last_end_ns = now_ns(), last_end_said = said;
    pthread_mutex_unlock(&mu);
}

static void do_status(struct conn *c) {
    char s[STATS_CAP];
    char end[sizeof(last_end) + 96] = "";
    pthread_mutex_lock(&mu);
    stats_json(s, sizeof(s));
    if (last_end_ns)
        snprintf(end, sizeof(end),
                 ",\"last_end\":\"%s\",\"last_end_code\":\"%s\",\"last_end_s\":%.3f,"
                 "\"last_end_said\":%s",
                 last_end, last_end_code, secs(now_ns() - last_end_ns),
                 last_end_said ? "true" : "false");
    size_t imported = 0; /* mapped back from pos's descriptors (their fd kept: see do_remap) */
    for (size_t i = 0; i < ntab; i++)
        imported += tab[i].fd >= 0;
    struct peer_count peers = peer_count();
    imported += peers.own_kept; /* the job's own memory mapped back from pos's, too */
    reply(c,
          "{\"ok\":true,\"pid\":%d,\"phase\":\"%s\",\"buffers\":%zu,\"owned_bytes\":%zu,"
          "\"foreign_allocs\":%llu,\"foreign_bytes\":%llu,\"inflight\":%ld,\"owning\":%s,"
          "\"imported\":%zu,\"nccl_launches\":%ld,\"peer_maps\":%zu,\"peer_bytes\":%zu,"
          "\"ipc_maps\":%zu,\"peer_down\":%zu,\"peer_lost\":%zu,\"own_maps\":%zu,"
          "\"own_bytes\":%zu,\"own_down\":%zu,\"own_kept\":%zu,\"ungated\":\"%s\",\"waiting\":%ld,"
          "\"stall_s\":%.3f%s,%s}",
          getpid(), phase_name[atomic_load(&phase)], ntab, owned_bytes,
          (unsigned long long)foreign_allocs, (unsigned long long)foreign_bytes,
          atomic_load(&inflight), owning ? "true" : "false", imported, nccl_launches, peers.maps,
          peers.bytes, peers.ipc, peers.down, peers.lost, peers.owns, peers.own_bytes,
          peers.own_down, peers.own_kept, ungated, waiting, stall_ms() / 1000.0, end, s);
    pthread_mutex_unlock(&mu);
}

/* The pending buffers that calls wait for now: pos copies (or fills) them first. */
static void build_wanted(FILE *f) {
    fputs("{\"ok\":true,\"vas\":[", f);
    int k = 0;
    for (size_t i = 0; i < ntab; i++)
        if (tab[i].wanted && tab[i].status == ST_PENDING)
            fprintf(f, "%s%llu", k++ ? "," : "", tab[i].va);
    fputs("]}", f);
}

/* Version 2: each buffer an object of named fields (version 1, no `version` in the answer:
 * arrays [va, size, mapped, device, present, touched]). */
static void build_table(FILE *f) {
    fprintf(f, "{\"ok\":true,\"version\":2,\"phase\":\"%s\",\"buffers\":[",
            phase_name[atomic_load(&phase)]);
    for (size_t i = 0; i < ntab; i++)
        fprintf(f,
                "%s{\"va\":%llu,\"size\":%zu,\"mapped\":%zu,\"device\":%d,\"present\":%s,"
                "\"touched\":%s}",
                i ? "," : "", tab[i].va, tab[i].size, tab[i].mapped, tab[i].device,
                tab[i].h ? "true" : "false", tab[i].touched ? "true" : "false");
    fputs("]}", f);
}

/* The helper went away (EOF, error, silence past the stall bound, or the descriptor closed or
 * reused by other code of the job) in the middle of an operation: never leave the job held. A
 * restore that released calls is half done: the job must not compute on a mix of restored and
 * stale buffers, so it ends. While hoisted, the memory is pos's to give back: the calls stay
 * held until a remap (the watchdog's). */
static void abandon(const char *why) {
    pthread_mutex_lock(&mu);
    int ph = atomic_load(&phase);
    /* never a run with an import down: held until another connection puts it back, or ended */
    int keep = ph != P_HOISTED && peers_fail_closed(stall_ms() / 1000.0);
    if (!keep && (ph == P_HOLD || ph == P_COPY))
        set_phase(P_IDLE);
    pthread_mutex_unlock(&mu);
    if (ph == P_RESTORE) {
        fprintf(stderr,
                "pos: the restore of this process was abandonned (%s) with buffers not "
                "back; ending the process\n",
                why);
        kill(getpid(), SIGKILL);
    }
}

static void serve(int fd) {
    struct conn *c = calloc(1, sizeof(*c));
    if (!c) {
        close(fd);
        return;
    }
    c->fd = fd;
    struct stat sb;
    if (fstat(fd, &sb) == 0)
        c->dev = sb.st_dev, c->ino = sb.st_ino;
    char line[65536];
    int stall = stall_ms();
    uint64_t last = now_ns(); /* pos's last request */
    for (;;) {
        int r = next_line(c, line, sizeof(line), stall);
        if (r <= 0) {
            char why[160];
            const char *code = r == 0 ? "eof" : r == -2 ? "silent" : r == -3 ? "reused" : "failed";
            if (r == 0)
                snprintf(why, sizeof(why), "pos's end closed (EOF)");
            else if (r == -2)
                snprintf(why, sizeof(why), "pos sent nothing for %g s (POS_AGENT_STALL_S)",
                         stall / 1000.0);
            else if (r == -3)
                snprintf(why, sizeof(why),
                         "its descriptor %d was closed or reused by other code of this process",
                         fd);
            else
                snprintf(why, sizeof(why), "the connection failed (%s)", strerror(errno));
            int ph = atomic_load(&phase); /* EOF when idle or hoisted: pos's protocol */
            int say = r != 0 || (ph != P_IDLE && ph != P_HOISTED);
            if (say)
                fprintf(stderr, "pos: the control connection ended in phase %s: %s\n",
                        phase_name[ph], why);
            record_end(say, code, "in phase %s, %.1f s after pos's last request: %s",
                       phase_name[ph], secs(now_ns() - last), why);
            abandon(why);
            if (r == -3)
                fd = -1; /* the number is someone else's now */
            break;
        }
        last = now_ns();
        char *cmd = line + strspn(line, "+"); /* the bytes that carried descriptors */
        char *args = strchr(cmd, ' ');
        if (args)
            *args++ = 0;
        if (!strcmp(cmd, "status"))
            do_status(c);
        else if (!strcmp(cmd, "cut")) {
            char *more = NULL;
            long ms = args ? strtol(args, &more, 10) : stall;
            do_cut(c, ms > 0 ? ms : stall, more && *more ? strtol(more, NULL, 10) : -1);
        } else if (!strcmp(cmd, "table"))
            reply_built(c, build_table);
        else if (!strcmp(cmd, "wanted"))
            reply_built(c, build_wanted);
        else if (!strcmp(cmd, "peers"))
            reply_built(c, build_peers);
        else if (!strcmp(cmd, "exports"))
            reply_built(c, build_exports);
        else if (!strcmp(cmd, "stamp"))
            do_stamp(c, args);
        else if (!strcmp(cmd, "unstamp"))
            do_unstamp(c);
        else if (!strcmp(cmd, "peek"))
            do_peek(c, args);
        else if (!strcmp(cmd, "peer-down"))
            do_peer_down(c);
        else if (!strcmp(cmd, "peer-export"))
            do_peer_export(c, args);
        else if (!strcmp(cmd, "peer-up"))
            do_peer_up(c, args ? strtoul(args, NULL, 10) : 0);
        else if (!strcmp(cmd, "own-export"))
            do_own_export(c);
        else if (!strcmp(cmd, "own-take"))
            do_own_take(c, args);
        else if (!strcmp(cmd, "own-down"))
            do_own_down(c);
        else if (!strcmp(cmd, "own-up"))
            do_own_up(c, args ? strtoul(args, NULL, 10) : 0);
        else if (!strcmp(cmd, "export"))
            do_export(c);
        else if (!strcmp(cmd, "room"))
            do_room(c, args ? strtoul(args, NULL, 10) : 0);
        else if (!strcmp(cmd, "hoist"))
            do_hoist(c, args);
        else if (!strcmp(cmd, "remap"))
            do_remap(c, args ? strtoul(args, NULL, 10) : 0, args && strstr(args, "restore"));
        else if (!strcmp(cmd, "copy"))
            do_move(c, P_HOLD, P_COPY);
        else if (!strcmp(cmd, "restore"))
            do_move(c, P_HOLD, P_RESTORE);
        else if (!strcmp(cmd, "done"))
            mark_done(args ? args : cmd + 4, 0);
        else if (!strcmp(cmd, "saved"))
            mark_done(args ? args : cmd + 5, 1);
        else if (!strcmp(cmd, "end"))
            do_end(c);
        else if (!strcmp(cmd, "bye")) {
            reply(c, "{\"ok\":true}");
            record_end(0, "bye", "in phase %s: pos said bye", phase_name[atomic_load(&phase)]);
            break;
        } else
            fail(c, "unknown request");
    }
    for (size_t i = 0; i < c->nfds; i++)
        if (c->fds[i] >= 0)
            close(c->fds[i]);
    free(c->fds);
    if (fd >= 0)
        close(fd);
    free(c);
}

static void *control(void *arg) {
    int ls = (int)(intptr_t)arg;
    in_agent = 1;
    sigset_t all;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, NULL); /* the job's signals go to its own threads */
    for (;;) {
        int fd = accept4(ls, NULL, NULL, SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EINTR || errno == ECONNABORTED)
                continue;
            usleep(100000);
            continue;
        }
        struct ucred cred;
        socklen_t len = sizeof(cred);
        if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) || cred.uid != 0) {
            const char *no = "{\"ok\":false,\"error\":\"pos answers root only\"}\n";
            send_all(fd, no, strlen(no));
            close(fd);
            continue;
        }
        serve(fd);
    }
    return NULL;
}

static pthread_once_t control_once = PTHREAD_ONCE_INIT;

static void control_start_once(void) {
    int ls = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    int n = snprintf(a.sun_path + 1, sizeof(a.sun_path) - 1, "pos-agent-%d", getpid());
    if (ls < 0 ||
        bind(ls, (struct sockaddr *)&a,
             (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + n)) ||
        listen(ls, 4)) {
        fprintf(stderr,
                "pos: the agent's control socket could not be opened (%s); this job "
                "cannot be checkpointed by pos\n",
                strerror(errno));
        if (ls >= 0)
            close(ls);
        return;
    }
    pthread_t t;
    pthread_attr_t at;
    pthread_attr_init(&at);
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    if (pthread_create(&t, &at, control, (void *)(intptr_t)ls)) {
        fprintf(stderr, "pos: the agent's control thread could not start\n");
        close(ls);
    }
    pthread_attr_destroy(&at);
    note("control socket @pos-agent-%d", getpid());
}

static void after_fork_child(void) {
    /* the control thread is not forked: a child that uses CUDA starts its own */
    pthread_once_t fresh = PTHREAD_ONCE_INIT;
    control_once = fresh;
    atomic_store(&inflight, 0);
}

static void start_control(void) { pthread_once(&control_once, control_start_once); }

/* CUDA_ERROR_OPERATING_SYSTEM, which cuInit answered a job that `pos run --clonable` started
 * as PID 1 of PID and network namespaces of its own (four H100s, driver 580.159.04): the job
 * fails on its own terms, so the agent says what pos did to it, once. */
#define OS_CALL_FAILED 304

EXPORT CUresult cuInit(unsigned flags) {
    CUresult r = DRV(cuInit)(flags);
    static atomic_int said;
    if (r == CUDA_SUCCESS)
        start_control();
    else if ((int)r == OS_CALL_FAILED && getpid() == 1 && !atomic_exchange(&said, 1))
        fprintf(stderr, "pos: CUDA did not start (cuInit: error %d, an OS call failed) in the PID "
                        "and network namespaces of `pos run --clonable`: run this job without "
                        "--clonable\n",
                (int)r);
    return r;
}

__attribute__((constructor)) static void init(void) {
    find_real_dlsym();
    const char *own = getenv("POS_OWN");
    owning = !(own && !strcmp(own, "0"));
    pthread_atfork(NULL, NULL, after_fork_child);
}
