/* Maps and helpers shared by the probe families (cuda.c, hip.c). bcc text: the UPPERCASE
 * placeholders RINGBUF_PAGES and API_DEFINES are filled by pos/tracer/probes.py (bpf_text) before
 * loading; comments keep them as they are. */
#include <uapi/linux/ptrace.h>
#include "events.h"

API_DEFINES

/* Events go out without waking the reader: it drains on a timer. A wake-up per event costs
 * about 5 us per call on the H100 machine (bench/results/README.md); the timer costs nothing
 * per event. */
#define POS_RB_FLAGS BPF_RB_NO_WAKEUP

BPF_RINGBUF_OUTPUT(events, RINGBUF_PAGES);
BPF_PERCPU_ARRAY(lost, u64, 1);
/* Captures (see `capture`) are paid from a credit of bytes that user space sets after each drain
 * (pos/tracer/session.py: CAPTURE_CREDIT): a storm of launches whose layout is late can never
 * hold more of the ring than about one credit (plus one largest capture per CPU taking it at
 * once), nor send user space more than one credit per drain. A launch that finds the credit
 * spent is still recorded, as slots, and counted in `captures_dropped`. */
BPF_ARRAY(capture_credit, s64, 1);
BPF_PERCPU_ARRAY(captures_dropped, u64, 1);
/* Layouts are not preallocated: PyTorch with cuDNN names well over 65536 kernels, and each
 * entry is 260 bytes; user space stops pushing (and says so) if a map is full. */
BPF_F_TABLE("hash", u64, struct pos_layout, layouts, 262144, BPF_F_NO_PREALLOC);
/* The same layouts keyed by the FNV-1a hash of the kernel's mangled name, pushed as soon as a
 * module is parsed: a lookup then gives its handle a layout in the kernel, before the launch
 * that typically follows within microseconds (a round trip through user space is too late). */
BPF_F_TABLE("hash", u64, struct pos_layout, named_layouts, 262144, BPF_F_NO_PREALLOC);

/* Arguments saved at entry for the return probe, per thread and API (calls may nest). */
struct pos_pkey {
    u32 tid;
    u32 api;
};
struct pos_pending {
    u64 out;  /* the out-parameter (where the driver writes the result) */
    u64 a;
    u64 b;
    u64 c;
};
BPF_HASH(pending, struct pos_pkey, struct pos_pending, 16384);

/* The memory around a launch's parameter array read in one go (see `span_u64`). */
#define POS_SPAN_BYTES 1024

struct pos_launch_scratch {
    struct pos_launch ev;
    u64 ptrs[POS_MAX_PARAMS];
    u8 span[POS_SPAN_BYTES + 8];   /* room so that offset + 8 always fits for the verifier */
};
BPF_PERCPU_ARRAY(launch_scratch, struct pos_launch_scratch, 1);
/* Handles whose lookup found no layout while one may still come (a module being parsed, the
 * mapped files being scanned): their launches keep a capture to be completed from later. The
 * probe marks a handle at its lookup, before the launch that follows; only user space, having
 * read that lookup, unmarks it (once it has the layout, or once nothing can bring one). A flag
 * for all handles, turned off by user space, raced: a lookup made between user space's drain
 * and its turning captures off had its launches go without one. The value is the hash of the
 * kernel's name (0: unknown), so that a launch, or cuKernelGetFunction's lookup, finds the
 * layout in `named_layouts` as soon as its module is parsed, before user space has read the
 * lookup and pushed the layout by handle. */
BPF_F_TABLE("lru_hash", u64, u64, awaiting, 65536, 0);
BPF_PERCPU_ARRAY(function_scratch, struct pos_function, 1);

#define ARG1 PT_REGS_PARM1(ctx)
#define ARG2 PT_REGS_PARM2(ctx)
#define ARG3 PT_REGS_PARM3(ctx)
#define ARG4 PT_REGS_PARM4(ctx)
#define ARG5 PT_REGS_PARM5(ctx)
#define ARG6 PT_REGS_PARM6(ctx)

/* Adds one to the entry of a one-entry per-CPU counter map (`lost`, `captures_dropped`). */
static __always_inline void bump(u64 *n) {
    if (n)
        __sync_fetch_and_add(n, 1);
}

static __always_inline void count_lost(void) {
    int zero = 0;
    bump(lost.lookup(&zero));
}

static __always_inline void fill_hdr(struct pos_hdr *h, u16 kind, u16 api, u32 len) {
    u64 id = bpf_get_current_pid_tgid();
    h->ts_ns = bpf_ktime_get_ns();
    h->pid = id >> 32;
    h->tid = (u32)id;
    h->kind = kind;
    h->api = api;
    h->len = len;
}

/* The n-th (1-based, n >= 7) integer argument: on the stack above the return address. */
static __always_inline u64 stack_arg(struct pt_regs *ctx, int n) {
    u64 v = 0;
    bpf_probe_read_user(&v, sizeof(v), (void *)(PT_REGS_SP(ctx) + 8 * (n - 6)));
    return v;
}

static __always_inline int emit(struct pt_regs *ctx, u16 kind, u16 api, u64 a0, u64 a1, u64 a2,
                                u64 a3, u64 a4) {
    struct pos_small e = {};
    fill_hdr(&e.h, kind, api, sizeof(e));
    e.a[0] = a0;
    e.a[1] = a1;
    e.a[2] = a2;
    e.a[3] = a3;
    e.a[4] = a4;
    if (events.ringbuf_output(&e, sizeof(e), POS_RB_FLAGS) < 0)
        count_lost();
    return 0;
}

static __always_inline int stash(u16 api, u64 out, u64 a, u64 b, u64 c) {
    struct pos_pkey k = {.tid = (u32)bpf_get_current_pid_tgid(), .api = api};
    struct pos_pending v = {.out = out, .a = a, .b = b, .c = c};
    pending.update(&k, &v);
    return 0;
}

/* Takes what the entry probe saved; 0 when the call failed or nothing was saved. */
static __always_inline int take(struct pt_regs *ctx, u16 api, struct pos_pending *out) {
    struct pos_pkey k = {.tid = (u32)bpf_get_current_pid_tgid(), .api = api};
    struct pos_pending *v = pending.lookup(&k);
    if (!v)
        return 0;
    *out = *v;
    pending.delete(&k);
    return (int)PT_REGS_RC(ctx) == 0;
}

static __always_inline u64 read_u64(u64 addr) {
    u64 v = 0;
    bpf_probe_read_user(&v, sizeof(v), (void *)addr);
    return v;
}

/* Return of a module load: its image's layouts come once user space has parsed it. */
static __always_inline int module_ret(struct pt_regs *ctx, u16 api) {
    struct pos_pending p;
    if (!take(ctx, api, &p))
        return 0;
    return emit(ctx, POS_MODULE, api, read_u64(p.out), p.a, 0, 0, 0);
}

/* Return of an allocation whose out-parameter receives the pointer or handle. */
static __always_inline int alloc_ret(struct pt_regs *ctx, u16 api, u16 kind) {
    struct pos_pending p;
    if (!take(ctx, api, &p))
        return 0;
    return emit(ctx, kind, api, read_u64(p.out), p.a, p.b, 0, 0);
}

#define POS_FNV_OFFSET 0xcbf29ce484222325ULL
#define POS_FNV_PRIME 0x100000001b3ULL

/* FNV-1a over a NUL-terminated name (pos/tracer/session.py: name_hash computes the same). */
static __always_inline u64 name_hash(const char *name) {
    u64 h = POS_FNV_OFFSET;
#pragma clang loop unroll(disable)
    for (int i = 0; i < POS_NAME_LEN; i++) {
        u8 c = name[i];
        if (!c)
            break;
        h = (h ^ c) * POS_FNV_PRIME;
    }
    return h;
}

/* The layout of an awaited handle by its kernel's name hash (`awaiting`), once the name's
 * module is parsed; 0 before, or when the name is unknown. `*awaited` says whether the handle
 * is awaited, and `*hash` (when given) receives the hash. */
static __always_inline struct pos_layout *named_layout_of(u64 handle, int *awaited, u64 *hash) {
    u64 *h = awaiting.lookup(&handle);
    *awaited = h != 0;
    if (!h || !*h)
        return 0;
    u64 key = *h;
    if (hash)
        *hash = key;
    return named_layouts.lookup(&key);
}

/* The new handle's layout, known in the kernel: by its name when the lookup has one, else the
 * layout of the handle it was made from (cuKernelGetFunction: the CUkernel), by handle or, while
 * that one is awaited, by its name. Without one, the handle is awaited under the name's hash. */
static __always_inline void inherit_layout(struct pos_function *f) {
    struct pos_layout *lay;
    u64 h = 0;
    if (f->name[0]) {
        h = name_hash(f->name);
        lay = named_layouts.lookup(&h);
    } else {
        lay = layouts.lookup(&f->module);
        int awaited;
        if (!lay)
            lay = named_layout_of(f->module, &awaited, &h);
    }
    if (lay)
        layouts.update(&f->handle, lay);
    else
        awaiting.update(&f->handle, &h);
}

/* Return of a module/function lookup that names its result: the name is read now. */
static __always_inline int function_ret(struct pt_regs *ctx, u16 api) {
    struct pos_pending p;
    if (!take(ctx, api, &p))
        return 0;
    int zero = 0;
    struct pos_function *f = function_scratch.lookup(&zero);
    if (!f)
        return 0;
    f->handle = read_u64(p.out);
    f->module = p.a;
    int n = 0;
    if (p.b)
        n = bpf_probe_read_user_str(f->name, sizeof(f->name), (void *)p.b);
    if (n < 1) {
        f->name[0] = 0;
        n = 1;
    }
    inherit_layout(f);
    u32 len = offsetof(struct pos_function, name) + (n & (POS_NAME_LEN - 1));
    if (len > sizeof(*f))
        len = sizeof(*f);
    fill_hdr(&f->h, POS_FUNCTION, api, len);
    if (events.ringbuf_output(f, len, POS_RB_FLAGS) < 0)
        count_lost();
    return 0;
}

/* The capture of a launch whose recorded bytes already lie as its layout will say (the packed
 * buffer of the `extra` form, or no parameters): 8 zero bytes alone, after those bytes. */
static __always_inline u32 laid_out(struct pos_launch *e, u32 at) {
    if (at > POS_PARAM_BYTES)
        return 0;
    *(u64 *)&e->params[at & (2 * POS_PARAM_BYTES - 1)] = 0;
    return 8;
}

/* What a capture costs at most: count, addresses, windows' starts and lengths, memory. */
#define POS_CAPTURE_COST (8 + 8 * POS_CAPTURE_ADDRS + 16 * POS_CAPTURE_WINDOWS + \
                          POS_CAPTURE_WINDOWS * POS_CAPTURE_SPAN)

/* The credit when it holds a capture of the largest size, else 0; the capture then pays what it
 * cost. Check and subtraction are not one step: CPUs racing past the check overdraw by at most
 * one capture each. */
static __always_inline s64 *capture_credit_left(void) {
    int zero = 0;
    s64 *credit = capture_credit.lookup(&zero);
    return credit && *credit >= POS_CAPTURE_COST ? credit : 0;
}

/* A stretch of memory a capture keeps: from its lowest parameter's address to POS_CAPTURE_TAIL
 * bytes past its highest one's. */
struct pos_window {
    u64 lo;
    u64 hi;   /* 0: unused */
};

/* Widens the window to the parameter at p, unless it would span more than POS_CAPTURE_SPAN;
 * whether it did. */
static __always_inline int widen(struct pos_window *w, u64 p) {
    u64 lo = p < w->lo ? p : w->lo;
    u64 hi = p + POS_CAPTURE_TAIL > w->hi ? p + POS_CAPTURE_TAIL : w->hi;
    if (hi - lo > POS_CAPTURE_SPAN)
        return 0;
    w->lo = lo;
    w->hi = hi;
    return 1;
}

/* Reads a window's memory to out; returns the bytes read: all of it or, where the memory ends
 * within it (a thread's stack ends a few KiB above its first frames), up to the end of the page
 * of its start or of the next one; 0 when none of it is readable. */
/* A kernel may have more parameters than the slots that placed the windows (cuBLASLt's
 * splitKreduce has 21: on the H100 its last ones lay 40 bytes below the window): each window
 * starts up to POS_CAPTURE_HEAD bytes lower, within the page of its lowest parameter (the page
 * below may not be mapped) and within the span. */
static __always_inline void lower(struct pos_window *w) {
    u64 lo = w->lo - POS_CAPTURE_HEAD;
    u64 page = w->lo & ~4095ull;
    if (lo < page)
        lo = page;
    if (w->hi - lo <= POS_CAPTURE_SPAN)
        w->lo = lo;
}

static __always_inline u32 read_window(u8 *out, struct pos_window *w) {
    /* 1 to POS_CAPTURE_SPAN, as `widen` keeps it, in a form the verifier sees bounded */
    u32 size = ((w->hi - w->lo - 1) & (POS_CAPTURE_SPAN - 1)) + 1;
    if (bpf_probe_read_user(out, size, (void *)w->lo) == 0)
        return size;
    u32 first_page = ((4095 - (w->lo & 4095)) & 4095) + 1;
    u32 two_pages = first_page + 4096;
    if (two_pages < size && bpf_probe_read_user(out, two_pages, (void *)w->lo) == 0)
        return two_pages;
    if (first_page < size && bpf_probe_read_user(out, first_page, (void *)w->lo) == 0)
        return first_page;
    return 0;
}

/* While its layout may still come (`awaiting`), a launch without one also keeps, after its n
 * slots, the capture that user space completes it from once the layout is known
 * (pos/tracer/late.py): the count k and the first k entries of the kernel's parameter array
 * (POS_CAPTURE_ADDRS when readable, else the n slots' addresses: a kernel may have more
 * parameters than slots), the start and length of each window (length 0: unused), and the
 * windows' memory. The first window holds the first parameter, and every other one that keeps
 * it within POS_CAPTURE_SPAN; the next parameter that does not (a by-value struct on the heap,
 * or in a frame far above) opens the second. A window reaches POS_CAPTURE_TAIL past its highest
 * parameter, so that a large by-value struct lying above the others (ATen's 3 KiB
 * TensorListMetadata in its caller's frame) is kept whole. Read in the same instant as the
 * slots, the bytes are what a known layout would have copied. Returns its size. */
static __always_inline u32 capture(struct pos_launch_scratch *s, int n, u64 params) {
    if (n < 1)
        return laid_out(&s->ev, 0);
    struct pos_window w0 = {s->ptrs[0], s->ptrs[0] + POS_CAPTURE_TAIL}, w1 = {};
#pragma clang loop unroll(disable)
    for (int i = 1; i < POS_SLOTS; i++) {
        if (i >= n)
            break;
        u64 p = s->ptrs[i];
        if (widen(&w0, p))
            continue;
        if (w1.hi) {
            widen(&w1, p);   /* else it lies outside the capture (late.py says how far) */
        } else {
            w1.lo = p;
            w1.hi = p + POS_CAPTURE_TAIL;
        }
    }
    lower(&w0);
    if (w1.hi)
        lower(&w1);
    u8 *out = s->ev.params;
    u32 at = 8 * n;   /* after the slots: at most 8 * POS_SLOTS */
    u32 k = POS_CAPTURE_ADDRS;
    if (bpf_probe_read_user(&out[(at + 8) & (POS_PARAM_BYTES - 1)], 8 * POS_CAPTURE_ADDRS,
                            (void *)params) < 0) {
        k = n;   /* the array ends within the window (a stack's end): the slots' addresses */
#pragma clang loop unroll(disable)
        for (int i = 0; i < POS_SLOTS; i++) {
            if (i >= n)
                break;
            *(u64 *)&out[(at + 8 + 8 * i) & (POS_PARAM_BYTES - 1)] = s->ptrs[i];
        }
    }
    *(u64 *)&out[at & (POS_PARAM_BYTES - 1)] = k;
    u32 windows = (at + 8 + 8 * k) & (POS_PARAM_BYTES - 1);
    u32 head = 8 + 8 * k + 16 * POS_CAPTURE_WINDOWS;
    u32 m = (at + head) & (POS_PARAM_BYTES / 4 - 1);   /* at most 128 + 552 */
    u32 len0 = read_window(&out[m], &w0);
    u32 len1 = w1.hi ? read_window(&out[(m + len0) & (2 * POS_CAPTURE_SPAN - 1)], &w1) : 0;
    *(u64 *)&out[windows] = w0.lo;
    *(u64 *)&out[windows + 8] = len0;
    *(u64 *)&out[windows + 16] = w1.lo;
    *(u64 *)&out[windows + 24] = len1;
    return head + len0 + len1;
}

/* The parameter array and the values it points to usually lie together (the launch stub's
 * frame): `launch` reads the POS_SPAN_BYTES around the array at once (the span; not where that
 * memory ends, as at a stack's top), and takes the array's entries and each value of up to 8
 * bytes from it as words -- instead of a helper call for each (about 60 ns apiece). */
static __always_inline u64 span_u64(struct pos_launch_scratch *s, u32 at) {
    return *(u64 *)&s->span[at & (POS_SPAN_BYTES - 1)];
}

/* Writes 8 bytes to out: the value of `size` (<= 8) bytes at user address p, from the span when
 * it lies there (the word's extra bytes fall on the next parameter, copied after it, on padding,
 * or past the recorded bytes), else by a read of its own; < 0 when p is unreadable. */
static __always_inline int read_value(struct pos_launch_scratch *s, int span, u64 lo, u64 p,
                                      u8 *out, u32 size) {
    u64 at = p - lo;
    if (span && at <= POS_SPAN_BYTES - 8) {
        *(u64 *)out = span_u64(s, at);
        return 0;
    }
    return bpf_probe_read_user(out, size & 15, (void *)p);
}

/* A launch: copies every parameter's bytes to its layout offset, or 8-byte slots when the
 * layout is unknown, or the packed buffer of the `extra` form (CU_LAUNCH_PARAM_BUFFER_POINTER). */
static __always_inline int launch(struct pt_regs *ctx, u16 api, u64 func, u64 stream, u32 gx,
                                  u32 gy, u32 gz, u32 bx, u32 by, u32 bz, u32 shmem, u64 params,
                                  u64 extra) {
    int zero = 0;
    struct pos_launch_scratch *s = launch_scratch.lookup(&zero);
    if (!s)
        return 0;
    struct pos_launch *e = &s->ev;
    e->function = func;
    e->stream = stream;
    e->grid[0] = gx;
    e->grid[1] = gy;
    e->grid[2] = gz;
    e->block[0] = bx;
    e->block[1] = by;
    e->block[2] = bz;
    e->shared_mem = shmem;
    e->truncated = 0;
    u32 nbytes = 0, capture_len = 0;
    u64 lo = params - POS_SPAN_BYTES / 2;
    int span = params && bpf_probe_read_user(s->span, POS_SPAN_BYTES, (void *)lo) == 0;
    struct pos_layout *lay = layouts.lookup(&func);
    int awaited = 0;
    if (!lay) {   /* its name's layout may have come since the lookup: taken over by handle */
        struct pos_layout *named = named_layout_of(func, &awaited, 0);
        if (named && layouts.update(&func, named) == 0)
            lay = layouts.lookup(&func);
    }
    e->layout_known = lay != 0;
    if (params && lay) {
        u32 n = lay->count;
        if (n > POS_MAX_PARAMS)
            n = POS_MAX_PARAMS;
        /* More parameters than the span holds: the array is read alone. */
        int in_span = span && n <= POS_SPAN_BYTES / 16 - 1;
        if (!in_span)
            bpf_probe_read_user(s->ptrs, (n * 8) & (sizeof(s->ptrs) * 2 - 1) & ~7u,
                                (void *)params);
#pragma clang loop unroll(disable)
        for (int i = 0; i < POS_MAX_PARAMS; i++) {
            if (i >= n)
                break;
            u32 off = lay->offset[i];
            u32 size = lay->size[i];
            if (off + size > POS_PARAM_BYTES) {
                e->truncated = 1;
                continue;
            }
            u64 p = in_span ? span_u64(s, POS_SPAN_BYTES / 2 + 8 * i) : s->ptrs[i];
            u8 *out = &e->params[off & (POS_PARAM_BYTES - 1)];
            if (size <= 8)
                read_value(s, span, lo, p, out, size);
            else
                bpf_probe_read_user(out, size & (POS_PARAM_BYTES - 1), (void *)p);
        }
        nbytes = lay->total;
    } else if (params) {
        int n = 0;
#pragma clang loop unroll(disable)
        for (int i = 0; i < POS_SLOTS; i++) {
            u64 p = 0;
            if (span)
                p = span_u64(s, POS_SPAN_BYTES / 2 + 8 * i);
            else if (bpf_probe_read_user(&p, 8, (void *)(params + 8 * i)) < 0)
                break;
            u8 *out = &e->params[(8 * i) & (POS_PARAM_BYTES - 1)];
            if (!p || read_value(s, span, lo, p, out, 8) < 0)
                break;
            s->ptrs[i & (POS_MAX_PARAMS - 1)] = p;
            n = i + 1;
        }
        nbytes = 8 * n;
        if (awaited) {
            s64 *credit = capture_credit_left();
            if (credit) {
                capture_len = capture(s, n, params);
                __sync_fetch_and_add(credit, -(s64)capture_len);
            } else {
                bump(captures_dropped.lookup(&zero));
            }
        }
    } else if (extra) {
        u64 x[6] = {};
        bpf_probe_read_user(x, 40, (void *)extra);
        u64 buf = 0, size = 0;
#pragma clang loop unroll(full)
        for (int i = 0; i < 3; i++) {
            if (x[2 * i] == 1)
                buf = x[2 * i + 1];
            else if (x[2 * i] == 2)
                size = read_u64(x[2 * i + 1]);
        }
        if (size > POS_PARAM_BYTES) {
            size = POS_PARAM_BYTES;
            e->truncated = 1;
        }
        if (buf && size) {
            bpf_probe_read_user(e->params, size & (2 * POS_PARAM_BYTES - 1), (void *)buf);
            nbytes = size;
        }
    }
    if (!params && !lay && awaited)
        capture_len = laid_out(e, nbytes);
    if (nbytes > POS_PARAM_BYTES) {
        nbytes = POS_PARAM_BYTES;
        e->truncated = 1;
    }
    e->nbytes = nbytes;
    /* slots and capture: at most 8 * POS_SLOTS + POS_CAPTURE_COST, within params */
    u32 len = offsetof(struct pos_launch, params) +
              ((nbytes + capture_len) & (4 * POS_CAPTURE_SPAN - 1));
    if (len > sizeof(*e))
        len = sizeof(*e);
    fill_hdr(&e->h, POS_LAUNCH, api, len);
    if (events.ringbuf_output(e, len, POS_RB_FLAGS) < 0)
        count_lost();
    return 0;
}
