/* Resolving the real driver: the agent's wrappers and its own calls reach libcuda's functions
 * through slots filled here on first use (or by the lookups' interposition, interpose.c). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>

#include "agent.h"

void *(*real_dlsym)(void *, const char *);
static void *libcuda;

#define DEFINE_OWN(name, params) void *volatile real_##name;
OWN(DEFINE_OWN)

/* libc's own dlsym: the agent exports one of its own (interpose.c). */
void find_real_dlsym(void) {
    if (!real_dlsym)
        real_dlsym = dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
    if (!real_dlsym)
        real_dlsym = dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5");
}

/* The driver's own `name`, for a call that reached our exported symbol directly. */
static void *driver_symbol(const char *name) {
    find_real_dlsym();
    if (!libcuda) {
        const char *path = getenv("POS_LIBCUDA");
        libcuda = dlopen(path && *path ? path : "libcuda.so.1", RTLD_LAZY);
    }
    return libcuda && real_dlsym ? real_dlsym(libcuda, name) : NULL;
}

void *real_of(void *volatile *slot, const char *name) {
    void *p = *slot;
    if (!p) {
        p = driver_symbol(name);
        *slot = p;
    }
    return p;
}
