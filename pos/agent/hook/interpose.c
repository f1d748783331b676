/* Interposing the lookups. Calls reach the driver three ways: direct linking (this library's
 * exported symbols come first), dlsym on libcuda (ours replaces the libc one) and
 * cuGetProcAddress (runtimes and frameworks: the pointer it returns is named with dladdr and
 * swapped for our wrapper of it, whose driver slot it fills). An entry point of gated.h's
 * families that has no wrapper here, and that the gate does not let through, is kept
 * (ungated_lookup) when the job looks it up, or links to it (scan_linked): the gate cannot see
 * its calls. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <elf.h>
#include <link.h>
#include <string.h>

#include "agent.h"
#include "gated.h"

struct entry {
    const char *name;
    void *wrapper;
    void *volatile *real;
};
#define ENTRY(name, params, args, tch, after) {#name, (void *)name, &real_##name},
#define ENTRY_OWN(name, params) {#name, (void *)name, &real_##name},
static const struct entry entries[] = {HOOKS(ENTRY) OWN_WRAPPERS(ENTRY_OWN)};

/* The entry of our wrapper of the driver's `name`, or NULL. */
static const struct entry *entry_of(const char *name) {
    for (size_t i = 0; i < sizeof(entries) / sizeof(*entries); i++)
        if (!strcmp(entries[i].name, name))
            return &entries[i];
    return NULL;
}

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
        const struct entry *e = entry_of(name);
        if (e) {
            if (!*e->real)
                *e->real = p;
            return e->wrapper;
        }
    }
    if (p && name && needs_gate(name))
        ungated_lookup(name);
    return p;
}

/* ---- the job's links to the driver: its objects' undefined symbols ------------------------- */
/* The dynamic linker binds a name the job's code calls to this library's wrapper, or, where
 * there is none, to libcuda's function, which no lookup of ours sees. So the undefined symbols
 * of every loaded object are read (those the GNU hash table leaves out, which are all of them,
 * or every symbol where there is only the SysV table) whenever the loaded set has changed. */
static ElfW(Addr) dyn_ptr(const struct dl_phdr_info *o, ElfW(Addr) p) {
    return p < o->dlpi_addr ? p + o->dlpi_addr : p; /* relocated by ld.so, or not (vdso) */
}

/* The first of the object's undefined symbols that needs the gate and has no wrapper, into
 * `found` (sizeof(ungated) bytes) unless it holds one already. */
static int scan_object(struct dl_phdr_info *o, size_t size, void *found) {
    (void)size;
    const ElfW(Dyn) *dyn = NULL;
    for (int i = 0; i < o->dlpi_phnum && !dyn; i++)
        if (o->dlpi_phdr[i].p_type == PT_DYNAMIC)
            dyn = (const ElfW(Dyn) *)(o->dlpi_addr + o->dlpi_phdr[i].p_vaddr);
    const ElfW(Sym) *sym = NULL;
    const char *str = NULL;
    size_t n = 0;
    for (; dyn && dyn->d_tag != DT_NULL; dyn++) {
        if (dyn->d_tag == DT_SYMTAB)
            sym = (const ElfW(Sym) *)dyn_ptr(o, dyn->d_un.d_ptr);
        else if (dyn->d_tag == DT_STRTAB)
            str = (const char *)dyn_ptr(o, dyn->d_un.d_ptr);
        else if (dyn->d_tag == DT_GNU_HASH) /* nbuckets, symoffset: the unhashed come first */
            n = ((const uint32_t *)dyn_ptr(o, dyn->d_un.d_ptr))[1];
        else if (dyn->d_tag == DT_HASH && !n) /* nbucket, nchain: every symbol */
            n = ((const uint32_t *)dyn_ptr(o, dyn->d_un.d_ptr))[1];
    }
    for (size_t i = 1; sym && str && i < n && !*(char *)found; i++) {
        const char *name = str + sym[i].st_name;
        if (sym[i].st_shndx == SHN_UNDEF && name[0] == 'c' && name[1] == 'u' &&
            needs_gate(name) && !entry_of(name))
            snprintf(found, sizeof(ungated), "%s", name);
    }
    return 0;
}

static int adds_now(struct dl_phdr_info *o, size_t size, void *out) {
    (void)size;
    *(unsigned long long *)out = o->dlpi_adds;
    return 1;
}

void scan_linked(void) {
    static unsigned long long scanned; /* the loaded set last read (dlpi_adds) */
    unsigned long long adds = 0;
    dl_iterate_phdr(adds_now, &adds);
    if (adds == scanned)
        return;
    char found[sizeof(ungated)] = "";
    dl_iterate_phdr(scan_object, found);
    scanned = adds;
    if (*found) /* kept once the loader's lock is let go: the gate's lock is taken after it */
        ungated_lookup(found);
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
