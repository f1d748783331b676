/* Interposing the lookups. Calls reach the driver three ways: direct linking (this library's
 * exported symbols come first), dlsym on libcuda (ours replaces the libc one) and
 * cuGetProcAddress (runtimes and frameworks: the pointer it returns is named with dladdr and
 * swapped for our wrapper of it, whose driver slot it fills). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <string.h>

#include "agent.h"

struct entry {
    const char *name;
    void *wrapper;
    void *volatile *real;
};
#define ENTRY(name, params, args, tch, after) {#name, (void *)name, &real_##name},
#define ENTRY_OWN(name) {#name, (void *)name, &real_##name},
static const struct entry entries[] = {
    HOOKS(ENTRY) ENTRY_OWN(cuInit) ENTRY_OWN(cuMemAlloc_v2) ENTRY_OWN(cuMemFree_v2)
        ENTRY_OWN(cuMemFreeAsync) ENTRY_OWN(cuMemFreeAsync_ptsz) ENTRY_OWN(cuGetProcAddress)
            ENTRY_OWN(cuGetProcAddress_v2)};

/* `p`, a function of the driver, or our wrapper of it (whose real slot is filled). */
static void *swap(void *p) {
    Dl_info info;
    if (!p || !dladdr(p, &info) || !info.dli_sname || info.dli_saddr != p || !info.dli_fname ||
        !strstr(info.dli_fname, "libcuda"))
        return p;
    for (size_t i = 0; i < sizeof(entries) / sizeof(*entries); i++)
        if (!strcmp(entries[i].name, info.dli_sname)) {
            if (!*entries[i].real)
                *entries[i].real = p;
            return entries[i].wrapper;
        }
    return p;
}

EXPORT void *dlsym(void *handle, const char *name) {
    find_real_dlsym();
    if (!real_dlsym)
        return NULL;
    void *p = real_dlsym(handle, name);
    return name[0] == 'c' && name[1] == 'u' ? swap(p) : p;
}

EXPORT CUresult cuGetProcAddress_v2(const char *sym, void **pfn, int ver, unsigned long long flags,
                                    int *status) {
    CUresult r = DRV(cuGetProcAddress_v2)(sym, pfn, ver, flags, status);
    if (r == CUDA_SUCCESS && pfn)
        *pfn = swap(*pfn);
    return r;
}

EXPORT CUresult cuGetProcAddress(const char *sym, void **pfn, int ver, unsigned long long flags) {
    CUresult r = DRV(cuGetProcAddress)(sym, pfn, ver, flags);
    if (r == CUDA_SUCCESS && pfn)
        *pfn = swap(*pfn);
    return r;
}
