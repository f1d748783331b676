/* The whole contract between the probes (cuda.c, hip.c) and their decoder (pos/tracer/events.py).
 * Every event starts with struct pos_hdr; `kind` says which body follows. Change a layout here and
 * in events.py together: tests/tracer/test_events.py compiles this header and compares sizes. */
#ifndef POS_EVENTS_H
#define POS_EVENTS_H

#define POS_MAX_PARAMS 64      /* parameters a layout in the `layouts` map can describe */
#define POS_PARAM_BYTES 4096   /* parameter bytes copied per launch; more sets `truncated` */
#define POS_SLOTS 16           /* 8-byte slots captured when a launch's layout is unknown */
#define POS_CAPTURE_ADDRS 64   /* parameter addresses a capture keeps (kernels up to 64 params) */
#define POS_CAPTURE_WINDOWS 2  /* stretches of memory around the parameters a capture keeps */
#define POS_CAPTURE_TAIL 4096  /* bytes a window keeps from a parameter's address on: a parameter
                                * passed by value may be that large (CUDA's limit before 12.1) */
#define POS_CAPTURE_SPAN 8192  /* bytes of one window at most */
#define POS_CAPTURE_HEAD 512   /* bytes a window keeps below its lowest parameter (see `lower`) */
#define POS_NAME_LEN 1024      /* bytes of a kernel's mangled name */

enum pos_kind {
    POS_ALLOC = 1,      /* a: ptr, size, stream-or-VMM-handle */
    POS_FREE = 2,       /* a: ptr, size (0 when unknown), stream */
    POS_LAUNCH = 3,     /* struct pos_launch */
    POS_MEMCPY = 4,     /* a: dst, src, size, stream, direction */
    POS_MEMSET = 5,     /* a: dst, bytes, value, stream, element size */
    POS_SYNC = 6,       /* a: handle (stream, event, 0 = context), stream (event record) */
    POS_MODULE = 7,     /* a: handle, image address, result */
    POS_FUNCTION = 8,   /* struct pos_function */
    POS_RESERVE = 9,    /* a: ptr, size (virtual address range, not yet backed) */
    POS_UNRESERVE = 10, /* a: ptr, size */
    POS_CREATE = 11,    /* a: VMM handle, size (physical memory, not yet mapped) */
    POS_RELEASE = 12,   /* a: VMM handle */
};

enum pos_direction { POS_HTOD = 1, POS_DTOH = 2, POS_DTOD = 3, POS_HTOH = 4, POS_DEFAULT = 5 };

struct pos_hdr {
    u64 ts_ns;  /* bpf_ktime_get_ns: CLOCK_MONOTONIC */
    u32 pid;
    u32 tid;
    u16 kind;
    u16 api;    /* index into the probe table of pos/tracer/probes.py */
    u32 len;    /* bytes of the whole event */
};

struct pos_small {
    struct pos_hdr h;
    u64 a[5];
};

struct pos_launch {
    struct pos_hdr h;
    u64 function;  /* CUfunction or CUkernel handle */
    u64 stream;
    u32 grid[3];
    u32 block[3];
    u32 shared_mem;
    u16 nbytes;       /* bytes of params that follow; then, to the event's end (h.len), the capture:
                       * u64 k, k parameter addresses, POS_CAPTURE_WINDOWS times u64 start and
                       * u64 length, the windows' bytes (pos/tracer/late.py); or 8 zero bytes
                       * when params are laid out already */
    u8 layout_known;  /* params laid out at the layout's offsets; else 8-byte slots */
    u8 truncated;     /* some parameter lay beyond POS_PARAM_BYTES */
    /* room so that offset + size always fits for the verifier: a parameter at offset < 4096,
     * of size < 4096; a capture's second window at offset < 2 spans, of size <= 1 span */
    u8 params[3 * POS_CAPTURE_SPAN];
};

struct pos_function {
    struct pos_hdr h;
    u64 handle;  /* CUfunction, CUkernel or hipFunction_t */
    u64 module;  /* CUmodule / CUlibrary; for cuKernelGetFunction the CUkernel */
    char name[POS_NAME_LEN];
};

/* A kernel's parameter layout, pushed by user space into the `layouts` map keyed by handle. */
struct pos_layout {
    u16 count;
    u16 total;
    u16 offset[POS_MAX_PARAMS];
    u16 size[POS_MAX_PARAMS];
};

#endif
