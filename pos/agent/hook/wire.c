/* The wire of the control socket: requests are text lines, answers one JSON line each;
 * descriptors travel as SCM_RIGHTS, at most MAX_FDS a message, each message carrying one '+'
 * byte (protocol.md). */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include "agent.h"

/* Whether c->fd is still the socket accepted (not closed, nor another file by that number). */
static int same_socket(const struct conn *c) {
    struct stat sb;
    return fstat(c->fd, &sb) == 0 && S_ISSOCK(sb.st_mode) && sb.st_dev == c->dev &&
           sb.st_ino == c->ino;
}

#define RX_TICK_MS 1000 /* how often a wait checks that its descriptor is still the socket */

/* Read more bytes (and any descriptors sent with them); 0 at EOF, -1 on error, -2 on timeout,
 * -3 when the descriptor is no longer the accepted socket (other code of the job closed the
 * number, or reused it: a poll on a file that never becomes readable would wait unseen). */
int rx(struct conn *c, int timeout_ms) {
    uint64_t until = now_ns() + (uint64_t)timeout_ms * 1000000ull;
    for (;;) {
        if (!same_socket(c))
            return -3;
        uint64_t now = now_ns();
        if (now >= until)
            return -2;
        uint64_t left_ms = (until - now + 999999) / 1000000;
        struct pollfd p = {.fd = c->fd, .events = POLLIN};
        int n = poll(&p, 1, left_ms < RX_TICK_MS ? (int)left_ms : RX_TICK_MS);
        if (n < 0 && errno != EINTR)
            return -1;
        if (n > 0) {
            if (!same_socket(c))
                return -3;
            break;
        }
    }
    char cbuf[CMSG_SPACE(MAX_FDS * sizeof(int))];
    struct iovec iov = {.iov_base = c->buf + c->len, .iov_len = sizeof(c->buf) - c->len - 1};
    struct msghdr m = {
        .msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf, .msg_controllen = sizeof(cbuf)};
    ssize_t got = recvmsg(c->fd, &m, MSG_CMSG_CLOEXEC);
    if (got <= 0)
        return got == 0 ? 0 : -1;
    for (struct cmsghdr *h = CMSG_FIRSTHDR(&m); h; h = CMSG_NXTHDR(&m, h))
        if (h->cmsg_level == SOL_SOCKET && h->cmsg_type == SCM_RIGHTS) {
            size_t k = (h->cmsg_len - CMSG_LEN(0)) / sizeof(int);
            int *f = (int *)CMSG_DATA(h);
            for (size_t i = 0; i < k; i++) {
                if (c->nfds == c->capfds) {
                    size_t cap = c->capfds ? 2 * c->capfds : 1024;
                    int *more = realloc(c->fds, cap * sizeof(*more));
                    if (more)
                        c->fds = more, c->capfds = cap;
                }
                if (c->nfds < c->capfds)
                    c->fds[c->nfds++] = f[i];
                else /* no memory for it: the request finds fewer than it announced */
                    close(f[i]);
            }
        }
    c->len += (size_t)got;
    return 1;
}

/* The next line (without its newline) into `line`; 0 at EOF, -1 on error, -2 on timeout, -3
 * when the descriptor is no longer the socket (rx). */
int next_line(struct conn *c, char *line, size_t cap, int timeout_ms) {
    for (;;) {
        char *nl = memchr(c->buf, '\n', c->len);
        if (nl) {
            size_t n = (size_t)(nl - c->buf);
            if (n >= cap)
                n = cap - 1;
            memcpy(line, c->buf, n);
            line[n] = 0;
            c->len -= (size_t)(nl - c->buf) + 1;
            memmove(c->buf, nl + 1, c->len);
            return 1;
        }
        if (c->len >= sizeof(c->buf) - 1) {
            errno = EMSGSIZE;
            return -1;
        }
        int r = rx(c, timeout_ms);
        if (r <= 0)
            return r;
    }
}

int send_all(int fd, const char *s, size_t n) {
    while (n) {
        ssize_t k = send(fd, s, n, MSG_NOSIGNAL);
        if (k <= 0)
            return -1;
        s += k, n -= (size_t)k;
    }
    return 0;
}

int reply(struct conn *c, const char *fmt, ...) {
    char *s = NULL;
    size_t n = 0;
    FILE *f = open_memstream(&s, &n);
    if (!f)
        return -1;
    va_list ap;
    va_start(ap, fmt);
    vfprintf(f, fmt, ap);
    va_end(ap);
    fputc('\n', f);
    fclose(f);
    int r = send_all(c->fd, s, n);
    free(s);
    return r;
}

int fail(struct conn *c, const char *what) {
    return reply(c, "{\"ok\":false,\"error\":\"%s\"}", what);
}

/* Send `n` descriptors after a reply line, MAX_FDS per message. */
int send_fds(struct conn *c, const int *fds, size_t n) {
    for (size_t at = 0; at < n; at += MAX_FDS) {
        size_t k = n - at < MAX_FDS ? n - at : MAX_FDS;
        char cbuf[CMSG_SPACE(MAX_FDS * sizeof(int))];
        memset(cbuf, 0, sizeof(cbuf));
        char byte = '+';
        struct iovec iov = {.iov_base = &byte, .iov_len = 1};
        struct msghdr m = {.msg_iov = &iov,
                           .msg_iovlen = 1,
                           .msg_control = cbuf,
                           .msg_controllen = CMSG_SPACE(k * sizeof(int))};
        struct cmsghdr *h = CMSG_FIRSTHDR(&m);
        h->cmsg_level = SOL_SOCKET, h->cmsg_type = SCM_RIGHTS;
        h->cmsg_len = CMSG_LEN(k * sizeof(int));
        memcpy(CMSG_DATA(h), fds + at, k * sizeof(int));
        if (sendmsg(c->fd, &m, MSG_NOSIGNAL) != 1)
            return -1;
    }
    return 0;
}

/* Send one answer line of any length, written by `build` under mu. */
void reply_built(struct conn *c, void (*build)(FILE *)) {
    char *s = NULL;
    size_t n = 0;
    FILE *f = open_memstream(&s, &n);
    if (!f) {
        fail(c, "out of memory");
        return;
    }
    pthread_mutex_lock(&mu);
    build(f);
    pthread_mutex_unlock(&mu);
    fputc('\n', f);
    fclose(f);
    send_all(c->fd, s, n);
    free(s);
}
