/* Shared by the fake-driver workloads (cuda_app.c, hip_app.c): the kernels of kernels.cu as
 * the host sees them, the stdin/stdout protocol of workloads/harness.py, and a small JSON
 * writer. Each phase's JSON line is the ground truth the tracer tests compare against, so every
 * value printed is the exact value passed to the driver. */
#ifndef POS_APP_COMMON_H
#define POS_APP_COMMON_H

#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* Mangled names of kernels.cu (nm on the cubin), in the order the apps use them. */
enum {
    K_AXPY, K_PAIR_COPY, K_MIXED, K_SCALARS, K_FILL_F, K_FILL_I, K_NO_PARAMS, K_TENSOR_LIST,
    K_MANY, N_KERNELS
};
static const char *const kernel_names[N_KERNELS] = {
    "_Z4axpyfPKfPfi",     /* axpy(float, const float *, float *, int) */
    "_Z9pair_copy4Pairf", /* pair_copy(Pair, float) */
    "_Z5mixed5MixedPKd",  /* mixed(Mixed, const double *) */
    "_Z7scalarscsixdPf",  /* scalars(char, short, int, long long, double, float *) */
    "_Z4fillIfEvPT_S0_i", /* fill<float>(float *, float, int) */
    "_Z4fillIiEvPT_S0_i", /* fill<int>(int *, int, int) */
    "no_params",          /* extern "C" no_params() */
    "_Z11tensor_list10TensorListf", /* tensor_list(TensorList, float) */
    "_Z4manyPfiiiiiiiiiiiiiiiiiii", /* many(float *, int x 19) */
};

/* kernels.cu's by-value structs, with device pointers as 64-bit integers (same layout). */
struct Pair {
    uint64_t a;
    uint64_t b;
    int n;
};
struct Mixed {
    char tag;
    uint64_t p;
    uint32_t count;
};
struct TensorList {
    uint64_t addresses[110];
    int64_t numel[110];
    unsigned char block_to_tensor[320];
    int block_to_chunk[320];
    int start;
};
_Static_assert(sizeof(struct Pair) == 24, "Pair layout");
_Static_assert(sizeof(struct TensorList) == 3368, "TensorList layout");
_Static_assert(sizeof(struct Mixed) == 24 && __builtin_offsetof(struct Mixed, p) == 8,
               "Mixed layout");

/* scalars' parameters packed at their ABI offsets, for the `extra` launch form */
struct ScalarsArgs {
    char c;
    short s;
    int i;
    long long l;
    double d;
    uint64_t out;
};
_Static_assert(sizeof(struct ScalarsArgs) == 32 && __builtin_offsetof(struct ScalarsArgs, s) == 2 &&
                   __builtin_offsetof(struct ScalarsArgs, i) == 4 &&
                   __builtin_offsetof(struct ScalarsArgs, out) == 24,
               "scalars layout");

/* fill<int>'s parameters packed likewise */
struct FillIntArgs {
    uint64_t out;
    int value;
    int n;
};
_Static_assert(sizeof(struct FillIntArgs) == 16, "fill<int> layout");

/* ---- JSON ------------------------------------------------------------------------------- */
struct buf {
    char *s;
    size_t len, cap;
};

__attribute__((format(printf, 2, 3))) static void put(struct buf *b, const char *fmt, ...) {
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        size_t room = b->cap - b->len;
        int n = vsnprintf(b->s ? b->s + b->len : NULL, room, fmt, ap);
        va_end(ap);
        if (n < 0)
            abort();
        if ((size_t)n < room) {
            b->len += (size_t)n;
            return;
        }
        b->cap = (b->cap + (size_t)n + 1) * 2;
        b->s = realloc(b->s, b->cap);
        if (!b->s)
            abort();
    }
}

/* A comma unless this opens the list or object. */
static void sep(struct buf *b) {
    if (b->len && b->s[b->len - 1] != '[' && b->s[b->len - 1] != '{')
        put(b, ",");
}

static void put_hex(struct buf *b, const void *p, size_t n) {
    const unsigned char *c = p;
    put(b, "\"");
    for (size_t i = 0; i < n; i++)
        put(b, "%02x", c[i]);
    put(b, "\"");
}

static void reset(struct buf *b) {
    b->len = 0;
    if (b->s)
        b->s[0] = 0;
}

/* "0x..." of a pointer or handle */
#define PTR(p) ((unsigned long long)(uintptr_t)(p))

/* Prints one phase's JSON line and flushes it. */
static void emit(struct buf *b) {
    fwrite(b->s, 1, b->len, stdout);
    fputc('\n', stdout);
    fflush(stdout);
}

static void phase_error(const char *phase, const char *what) {
    struct buf b = {0};
    put(&b, "{\"phase\":\"%s\",\"error\":\"%s\"}", phase, what);
    emit(&b);
    free(b.s);
}

/* ---- helpers ---------------------------------------------------------------------------- */
static void *read_file(const char *dir, const char *name, size_t *size) {
    char path[4096];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "cannot open %s\n", path);
        exit(1);
    }
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    /* 8-aligned, as images must be; kept for the process's life (the tracer reads it later) */
    void *p = aligned_alloc(8, ((size_t)n + 8) & ~(size_t)7);
    if (!p || fread(p, 1, (size_t)n, f) != (size_t)n) {
        fprintf(stderr, "cannot read %s\n", path);
        exit(1);
    }
    fclose(f);
    *size = (size_t)n;
    return p;
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* The next command from stdin without its newline; NULL at EOF or `exit`. */
static char *next_command(char *line, size_t len) {
    if (!fgets(line, (int)len, stdin))
        return NULL;
    line[strcspn(line, "\r\n")] = 0;
    return strcmp(line, "exit") == 0 ? NULL : line;
}

static void fail(const char *what) {
    fprintf(stderr, "%s\n", what);
    exit(1);
}

/* A launch's shape, as both APIs take it (a stream is a pointer in both). */
struct dims {
    unsigned grid[3], block[3], shared_mem;
    void *stream;
};

/* One launch as the tracer must record it: each parameter's bytes as they lie in memory (for the
 * `extra` form, `params[i]` is the offset of parameter i inside `buffer`). */
static void record_launch(struct buf *b, int seq, const char *api, const char *name, const void *f,
                          const struct dims *d, void **params, const size_t *sizes, int n,
                          const void *buffer, size_t buffer_size) {
    sep(b);
    put(b, "{\"seq\":%d,\"api\":\"%s\",\"name\":\"%s\",\"function\":\"0x%llx\","
           "\"grid\":[%u,%u,%u],\"block\":[%u,%u,%u],\"shared_mem\":%u,"
           "\"stream\":\"0x%llx\",\"params\":[",
        seq, api, name, PTR(f), d->grid[0], d->grid[1], d->grid[2], d->block[0], d->block[1],
        d->block[2], d->shared_mem, PTR(d->stream));
    for (int i = 0; i < n; i++) {
        sep(b);
        put_hex(b, buffer ? (const char *)buffer + (size_t)params[i] : params[i], sizes[i]);
    }
    put(b, "]");
    if (buffer) {
        put(b, ",\"extra\":true,\"buffer\":");
        put_hex(b, buffer, buffer_size);
    }
    put(b, "}");
}

/* The phases each app defines, and the protocol loop that runs them (workloads/harness.py's
 * Job): READY <pid>, then one phase per line on stdin until `exit` or EOF. */
static void phase_load(void);
static void phase_lookup(void);
static void phase_alloc(void);
static void phase_launch(void);
static void phase_free(void);
static void phase_spin(long n);
static void phase_structs(void);

static int serve(void) {
    printf("READY %d\n", (int)getpid());
    fflush(stdout);
    char line[256], *cmd;
    while ((cmd = next_command(line, sizeof(line)))) {
        if (strcmp(cmd, "load") == 0)
            phase_load();
        else if (strcmp(cmd, "lookup") == 0)
            phase_lookup();
        else if (strcmp(cmd, "alloc") == 0)
            phase_alloc();
        else if (strcmp(cmd, "launch") == 0)
            phase_launch();
        else if (strcmp(cmd, "free") == 0)
            phase_free();
        else if (strcmp(cmd, "structs") == 0)
            phase_structs();
        else if (strncmp(cmd, "spin ", 5) == 0)
            phase_spin(atol(cmd + 5));
        else
            phase_error("unknown", "unknown command");
    }
    return 0;
}

#endif
