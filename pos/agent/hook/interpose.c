/* Interposing the lookups. Calls reach the driver three ways: direct linking (this library's
 * exported symbols come first), dlsym on libcuda (ours replaces the libc one) and
 * cuGetProcAddress (runtimes and frameworks: the pointer it returns is named with dladdr and
 * swapped for our wrapper of it, whose driver slot it fills). A looked-up entry point of
 * gated.h's families that has no wrapper here, and that the gate does not let through, is kept
 * (ungated_lookup): the gate cannot see its calls. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <string.h>

#include "agent.h"
#include "gated.h"

struct entry {
    const char *name;
    void *wrapper;
    void *volatile *real;
};
#define ENTRY(name, params, args, tch, after) {#name, (void *)name, &real_##name},
#define ENTRY_OWN(name) {#name, (void *)name, &real_##name},
static const struct entry entries[] = {HOOKS(ENTRY) OWN_WRAPPERS(ENTRY_OWN)};

#define NAME(name) #name,
static const char *const families[] = {FAMILIES(NAME)};
static const char *const passes[] = {PASSES(NAME)};

/* Whether the driver's entry point `name`, not wrapped, reads or writes device memory (or
 * makes or unmakes it) and is not one the gate lets through. */
static int needs_gate(const char *name) {
    int family = 0;
    for (size_t i = 0; i < sizeof(families) / sizeof(*families) && !family; i++)
        family = !strncmp(name, families[i], strlen(families[i]));
    for (size_t i = 0; i < sizeof(passes) / sizeof(*passes) && family; i++)
        family = strcmp(name, passes[i]) != 0;
    return family;
}

/* `p`, the driver's function looked up as `asked`, or our wrapper of it (whose real slot is
 * filled). `driver`: p comes from the driver's own lookup (cuGetProcAddress), so a pointer
 * dladdr cannot name as one of libcuda's symbols is still the driver's, known by `asked`. */
static void *swap(void *p, const char *asked, int driver) {
    for (size_t i = 0; i < sizeof(entries) / sizeof(*entries); i++)
        if (p == entries[i].wrapper) /* our dlsym's answer, passed on by the driver's lookup */
            return p;
    Dl_info info;
    const char *name = driver ? asked : NULL;
    if (p && dladdr(p, &info) && info.dli_sname && info.dli_saddr == p && info.dli_fname &&
        strstr(info.dli_fname, "libcuda")) {
        name = info.dli_sname;
        for (size_t i = 0; i < sizeof(entries) / sizeof(*entries); i++)
            if (!strcmp(entries[i].name, name)) {
                if (!*entries[i].real)
                    *entries[i].real = p;
                return entries[i].wrapper;
            }
    }
    if (p && name && needs_gate(name))
        ungated_lookup(name);
    return p;
}

EXPORT void *dlsym(void *handle, const char *name) {
    find_real_dlsym();
    if (!real_dlsym)
        return NULL;
    void *p = real_dlsym(handle, name);
    return name[0] == 'c' && name[1] == 'u' ? swap(p, name, 0) : p;
}

EXPORT CUresult cuGetProcAddress_v2(const char *sym, void **pfn, int ver, unsigned long long flags,
                                    int *status) {
    CUresult r = DRV(cuGetProcAddress_v2)(sym, pfn, ver, flags, status);
    if (r == CUDA_SUCCESS && pfn && sym)
        *pfn = swap(*pfn, sym, 1);
    return r;
}

EXPORT CUresult cuGetProcAddress(const char *sym, void **pfn, int ver, unsigned long long flags) {
    CUresult r = DRV(cuGetProcAddress)(sym, pfn, ver, flags);
    if (r == CUDA_SUCCESS && pfn && sym)
        *pfn = swap(*pfn, sym, 1);
    return r;
}
