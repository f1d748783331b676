/* A process that holds an io_uring the way libuv does (io_uring_setup, the rings mapped
 * MAP_SHARED from its descriptor) and counts, one line a 20 ms, into OUT: what CRIU cannot dump
 * and pos must refuse before touching it (tests/process/test_io_uring.py).
 *
 *   io_uring_job OUT                 the process itself holds the ring (fd and mapping)
 *   io_uring_job OUT --close-fd      the ring's mapping only (its descriptor closed)
 *   io_uring_job OUT --child         a child holds it (counting into OUT.1), the parent none
 *   io_uring_job OUT --thread NAME   a thread named NAME made it (pt_tcpstore_uv: torchrun's
 *                                    store on libuv)
 *   io_uring_job OUT --fallback      as libuv does: when io_uring_setup fails with ENOSYS, an
 *                                    epoll instance instead (printed "EPOLL" on stderr), whose
 *                                    epoll_wait times its counting, as libuv's timers
 *
 * Exits 3 when the kernel refuses io_uring_setup (a seccomp filter, io_uring_disabled) and
 * there is no --fallback. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/io_uring.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

static int close_fd, fallback, epfd = -1;

static void ring(void) {
  struct io_uring_params p;
  memset(&p, 0, sizeof p);
  int fd = (int)syscall(__NR_io_uring_setup, 8, &p);
  if (fd < 0 && errno == ENOSYS && fallback) { /* libuv: no io_uring here, epoll alone */
    epfd = epoll_create1(EPOLL_CLOEXEC);
    if (epfd < 0) {
      perror("io_uring_job: epoll_create1");
      exit(2);
    }
    fprintf(stderr, "EPOLL\n");
    return;
  }
  if (fd < 0) {
    perror("io_uring_job: io_uring_setup");
    exit(3);
  }
  size_t len = p.sq_off.array + p.sq_entries * sizeof(unsigned);
  void *sq = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd,
                  IORING_OFF_SQ_RING);
  if (sq == MAP_FAILED) {
    perror("io_uring_job: mmap");
    exit(3);
  }
  if (close_fd)
    close(fd);
}

static void *in_thread(void *name) {
  pthread_setname_np(pthread_self(), name);
  ring();
  for (;;)
    pause();
  return NULL;
}

static void count(const char *path) {
  int fd = open(path, O_WRONLY | O_CREAT | O_APPEND, 0644);
  if (fd < 0) {
    perror("io_uring_job: open");
    exit(2);
  }
  for (int n = 1;; n++) {
    char line[32];
    int len = snprintf(line, sizeof line, "%d\n", n);
    if (write(fd, line, len) != len)
      exit(2);
    if (epfd >= 0) { /* the 20 ms tick as libuv's timers: epoll_wait's timeout */
      struct epoll_event ev;
      epoll_wait(epfd, &ev, 1, 20);
    } else {
      usleep(20000);
    }
  }
}

int main(int argc, char **argv) {
  const char *thread = NULL;
  int child = 0;
  if (argc < 2) {
    fprintf(stderr, "usage: io_uring_job OUT [--close-fd] [--child] [--thread NAME] [--fallback]\n");
    return 2;
  }
  for (int i = 2; i < argc; i++) {
    if (!strcmp(argv[i], "--close-fd"))
      close_fd = 1;
    else if (!strcmp(argv[i], "--fallback"))
      fallback = 1;
    else if (!strcmp(argv[i], "--child"))
      child = 1;
    else if (!strcmp(argv[i], "--thread") && i + 1 < argc)
      thread = argv[++i];
  }
  if (child) {
    pid_t pid = fork();
    if (pid < 0)
      return 2;
    if (pid == 0) {
      char path[4096];
      snprintf(path, sizeof path, "%s.1", argv[1]);
      ring();
      count(path);
    }
  } else if (thread) {
    pthread_t t;
    if (pthread_create(&t, NULL, in_thread, (void *)thread))
      return 2;
    for (int i = 0; i < 5000; i++) {      /* the ring exists before the first line */
      char maps[4096];
      snprintf(maps, sizeof maps, "/proc/%d/maps", getpid());
      FILE *f = fopen(maps, "r");
      char line[512];
      int found = 0;
      while (f && fgets(line, sizeof line, f))
        found |= strstr(line, "io_uring") != NULL;
      if (f)
        fclose(f);
      if (found)
        break;
      usleep(1000);
    }
  } else {
    ring();
  }
  count(argv[1]);
}
