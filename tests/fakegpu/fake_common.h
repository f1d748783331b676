/* Internals shared by the fake GPU driver libraries (libcuda.c, libamdhip64.c).
 *
 * CI has no GPU, yet pos's uprobes must attach to a real shared library with the real driver
 * ABI, and pos's checkpoint engine must be driven against something. These fakes back "device
 * memory" with host memory (one mmap per allocation, so pointers look like the driver's and
 * data really round-trips), keep a table of what is allocated so that copies and frees are
 * checked like the driver checks them, and hand out stable handles for modules and functions.
 * They never run a kernel: SASS cannot execute on a CPU.
 *
 * Only API entry points are exported (the libraries are built with -fvisibility=hidden); each
 * is a real, non-inlined function of its own, because uprobes attach by symbol address. An
 * entry point never calls another entry point (that would fire two probes for one call): the
 * variants (_ptsz, Async ...) share static helpers instead. */
#ifndef POS_FAKE_COMMON_H
#define POS_FAKE_COMMON_H

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define API __attribute__((visibility("default"), noinline, used))

/* ---- memory: every range the fake handed out ------------------------------------------- */
enum range_kind {
    RANGE_ALLOC = 1,    /* plain allocation: usable memory, freed by base address */
    RANGE_RESERVED = 2, /* reserved virtual addresses (VMM): not usable until mapped */
    RANGE_MAPPED = 4,   /* a physical allocation mapped into a reservation: usable */
    RANGE_HOST = 8,     /* page-locked host memory (cuMemHostAlloc) */
    RANGE_IPC = 16,     /* another process's allocation, opened through legacy IPC */
};
#define RANGE_USABLE (RANGE_ALLOC | RANGE_MAPPED | RANGE_IPC)

struct range {
    uintptr_t base;
    size_t size;
    int kind;
};

static pthread_mutex_t ranges_lock = PTHREAD_MUTEX_INITIALIZER;
static struct range *ranges;
static size_t n_ranges, cap_ranges;

static size_t page_round(size_t n) {
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    return (n + page - 1) / page * page;
}

static int range_add(uintptr_t base, size_t size, int kind) {
    pthread_mutex_lock(&ranges_lock);
    if (n_ranges == cap_ranges) {
        size_t cap = cap_ranges ? cap_ranges * 2 : 64;
        struct range *r = realloc(ranges, cap * sizeof(*r));
        if (!r) {
            pthread_mutex_unlock(&ranges_lock);
            return -1;
        }
        ranges = r;
        cap_ranges = cap;
    }
    ranges[n_ranges++] = (struct range){base, size, kind};
    pthread_mutex_unlock(&ranges_lock);
    return 0;
}

/* Removes the range of one of `kinds` that starts at base; returns its size, 0 if none. */
static size_t range_remove(uintptr_t base, int kinds) {
    size_t size = 0;
    pthread_mutex_lock(&ranges_lock);
    for (size_t i = 0; i < n_ranges; i++) {
        if (ranges[i].base == base && (ranges[i].kind & kinds)) {
            size = ranges[i].size;
            ranges[i] = ranges[--n_ranges];
            break;
        }
    }
    pthread_mutex_unlock(&ranges_lock);
    return size;
}

/* 1 when [p, p + len) lies inside one range of one of `kinds`. */
static int range_covers(uintptr_t p, size_t len, int kinds) {
    int found = 0;
    pthread_mutex_lock(&ranges_lock);
    for (size_t i = 0; i < n_ranges && !found; i++)
        found = (ranges[i].kind & kinds) && p >= ranges[i].base &&
                p + len <= ranges[i].base + ranges[i].size && p + len >= p;
    pthread_mutex_unlock(&ranges_lock);
    return found;
}

/* 1 when [p, p + len) is tiled by whole ranges of one of `kinds`, one after another from p
 * (the driver's cuMemSetAccess over several mappings: every allocation in it whole). */
__attribute__((unused)) static int range_tiled(uintptr_t p, size_t len, int kinds) {
    uintptr_t at = p, end = p + len;
    int stuck = end <= p;
    pthread_mutex_lock(&ranges_lock);
    while (at < end && !stuck) {
        stuck = 1;
        for (size_t i = 0; i < n_ranges; i++)
            if ((ranges[i].kind & kinds) && ranges[i].base == at &&
                at + ranges[i].size <= end) {
                at += ranges[i].size;
                stuck = 0;
                break;
            }
    }
    pthread_mutex_unlock(&ranges_lock);
    return !stuck && at == end;
}

/* The range of one of `kinds` that holds p: 1 with *base and *size set, else 0. */
__attribute__((unused)) static int range_find(uintptr_t p, int kinds, uintptr_t *base,
                                              size_t *size) {
    int found = 0;
    pthread_mutex_lock(&ranges_lock);
    for (size_t i = 0; i < n_ranges && !found; i++)
        if ((ranges[i].kind & kinds) && p >= ranges[i].base &&
            p < ranges[i].base + ranges[i].size) {
            *base = ranges[i].base, *size = ranges[i].size;
            found = 1;
        }
    pthread_mutex_unlock(&ranges_lock);
    return found;
}

/* 1 when [p, p + len) overlaps any range of one of `kinds`. */
__attribute__((unused)) static int range_overlaps(uintptr_t p, size_t len, int kinds) {
    int found = 0;
    pthread_mutex_lock(&ranges_lock);
    for (size_t i = 0; i < n_ranges && !found; i++)
        found = (ranges[i].kind & kinds) && p < ranges[i].base + ranges[i].size &&
                ranges[i].base < p + len;
    pthread_mutex_unlock(&ranges_lock);
    return found;
}

/* "Device" memory: its own zero-filled mapping, page aligned (the driver aligns to >= 512). */
static void *dev_alloc(size_t size) {
    size_t len = page_round(size);
    void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
        return NULL;
    if (range_add((uintptr_t)p, size, RANGE_ALLOC) != 0) {
        munmap(p, len);
        return NULL;
    }
    return p;
}

static int dev_free(uintptr_t p) {
    size_t size = range_remove(p, RANGE_ALLOC);
    if (!size)
        return -1;
    munmap((void *)p, page_round(size));
    return 0;
}

/* ---- code images ---------------------------------------------------------------------- */
#define FATBIN_MAGIC 0xBA55ED50u         /* fatbin header (plain or compressed entries) */
#define FATBIN_WRAPPER_MAGIC 0x466243B1u /* __fatBinC_Wrapper_t: {magic, version, data, ...} */

enum image_kind {
    IMAGE_BAD = 0, IMAGE_ELF, IMAGE_FATBIN, IMAGE_WRAPPER, IMAGE_OFFLOAD_BUNDLE, IMAGE_PTX
};

static enum image_kind image_kind(const void *image) {
    if (!image)
        return IMAGE_BAD;
    const unsigned char *b = image;
    uint32_t magic;
    memcpy(&magic, b, sizeof(magic));
    if (memcmp(b, "\x7f" "ELF", 4) == 0)
        return IMAGE_ELF;
    if (magic == FATBIN_MAGIC)
        return IMAGE_FATBIN;
    if (magic == FATBIN_WRAPPER_MAGIC) {
        const void *data;
        memcpy(&data, b + 8, sizeof(data));
        return data && image_kind(data) == IMAGE_FATBIN ? IMAGE_WRAPPER : IMAGE_BAD;
    }
    if (memcmp(b, "__CLANG_OFFLOAD_BUNDLE__", 24) == 0 || memcmp(b, "CCOB", 4) == 0)
        return IMAGE_OFFLOAD_BUNDLE; /* HIP code objects: plain and compressed bundles */
    if (memcmp(b, "//", 2) == 0 || memcmp(b, ".version", 8) == 0)
        return IMAGE_PTX;            /* PTX text (pos's own checksum kernel, image/blocks.ptx) */
    return IMAGE_BAD;
}

/* ---- modules and functions: one stable handle per (module, name) ------------------------ */
#define MAGIC_MODULE 0x4d4f444cu   /* "MODL" */
#define MAGIC_FUNCTION 0x46554e43u /* "FUNC" */
#define MAGIC_KERNEL 0x4b45524eu   /* "KERN" */

struct fake_function {
    uint32_t magic;              /* MAGIC_FUNCTION or MAGIC_KERNEL */
    int has_params;              /* 1 yes, 0 no, -1 unknown (see name_has_params) */
    struct fake_module *module;
    struct fake_function *next;  /* the module's list */
    struct fake_function *function; /* a kernel's CUfunction (cuKernelGetFunction), lazily */
    char name[];
};

struct fake_module {
    uint32_t magic;
    enum image_kind kind;
    const void *image;
    struct fake_function *functions;
};

static pthread_mutex_t modules_lock = PTHREAD_MUTEX_INITIALIZER;

static struct fake_module *module_new(const void *image) {
    enum image_kind kind = image_kind(image);
    if (kind == IMAGE_BAD)
        return NULL;
    struct fake_module *m = calloc(1, sizeof(*m));
    if (m) {
        m->magic = MAGIC_MODULE;
        m->kind = kind;
        m->image = image;
    }
    return m;
}

static int is_module(const void *m) {
    return m && ((const struct fake_module *)m)->magic == MAGIC_MODULE;
}

static int is_function(const void *f, uint32_t magic) {
    return f && ((const struct fake_function *)f)->magic == magic;
}

/* Whether a kernel takes parameters, from its name alone (the fake does not parse images):
 * an Itanium-mangled non-template name `_Z<len><name>v` takes none, any other mangled name
 * takes some, and an extern "C" name cannot tell (-1). */
static int name_has_params(const char *name) {
    if (strncmp(name, "_Z", 2) != 0)
        return -1;
    char *rest;
    long len = strtol(name + 2, &rest, 10);
    if (len <= 0 || rest == name + 2 || (long)strlen(rest) < len)
        return 1;
    return strcmp(rest + len, "v") != 0;
}

static struct fake_function *function_new(struct fake_module *m, const char *name,
                                          uint32_t magic) {
    struct fake_function *f = calloc(1, sizeof(*f) + strlen(name) + 1);
    if (!f)
        return NULL;
    f->magic = magic;
    f->module = m;
    f->has_params = name_has_params(name);
    strcpy(f->name, name);
    return f;
}

/* The module's function (or kernel) called `name`, created on first lookup. */
static struct fake_function *module_lookup(struct fake_module *m, const char *name,
                                           uint32_t magic) {
    pthread_mutex_lock(&modules_lock);
    struct fake_function *f = m->functions;
    while (f && !(f->magic == magic && strcmp(f->name, name) == 0))
        f = f->next;
    if (!f && (f = function_new(m, name, magic))) {
        f->next = m->functions;
        m->functions = f;
    }
    pthread_mutex_unlock(&modules_lock);
    return f;
}

/* A kernel's function handle: distinct from the kernel's own, stable. */
__attribute__((unused)) static struct fake_function *kernel_function(struct fake_function *k) {
    pthread_mutex_lock(&modules_lock);
    if (!k->function)
        k->function = function_new(k->module, k->name, MAGIC_FUNCTION);
    struct fake_function *f = k->function;
    pthread_mutex_unlock(&modules_lock);
    return f;
}

/* Grid and block checks shared by every launch form: 1 when valid. */
static int launch_dims_valid(unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                             unsigned bz) {
    return gx && gy && gz && bx && by && bz && bz <= 64 &&
           (unsigned long long)bx * by * bz <= 1024;
}

#endif
