/* The checksum of GPU chunks and of an image's files, and the GPU image's chunk reader
 * (pos/image/checksum.py and gpu.py are their Python fronts, through ctypes, which lets go of
 * the GIL for each call).
 *
 * Why C and not numba: a restore must start filling the job's memory within a moment of the
 * job's release, and numba's import took 0.6-1.4 s of the GIL on the H100 host beside CRIU;
 * this library loads in a millisecond. Same hash as before, bit for bit (images stay readable).
 * The hash and its two kinds of chunk checksum are stated in hash.h, which the GPU's kernel
 * (blocks.cu) shares. */
#include <errno.h>
#include <sys/mman.h>
#include <unistd.h>

#include "hash.h"

#define EXPORT __attribute__((visibility("default")))

EXPORT const size_t pos_block = BLOCK; /* for the Python that launches the GPU's kernel */

/* Marks hits[j] = 1 for each of the k sorted, disjoint ranges [starts[j], ends[j]) that one of
 * the n words at p falls into: a buffer whose words point into others is usable only once
 * those are back too. */
EXPORT void pos_point(const unsigned char *p, size_t n, const uint64_t *starts,
                      const uint64_t *ends, size_t k, unsigned char *hits) {
    pos_point_words(p, n, starts, ends, k, hits);
}

/* One pass over `groups` groups at src: each group is copied to dst (when `copy`), folded into
 * the lanes, and its words checked against the ranges, while it is in registers. Three passes
 * (copy, hash, pointers) read the piece three times; this one reads it once, which is what
 * took the fill from 40 to 44-46 GB/s on the H100. Always inlined, so that `copy` is a
 * constant in each caller. */
static inline __attribute__((always_inline)) void
pass(unsigned char *dst, const unsigned char *src, size_t groups, int copy, uint64_t lanes[4],
     const uint64_t *starts, const uint64_t *ends, size_t k, unsigned char *hits) {
    uint64_t a = lanes[0], b = lanes[1], c = lanes[2], d = lanes[3], lo, span;
    pos_bounds(starts, ends, k, &lo, &span);
    for (size_t i = 0; i < groups; i++, src += GROUP, dst += GROUP) {
        uint64_t w[4];
        memcpy(w, src, sizeof(w));
        if (copy)
            memcpy(dst, w, sizeof(w));
        a = pos_lane(a, w[0]), b = pos_lane(b, w[1]), c = pos_lane(c, w[2]), d = pos_lane(d, w[3]);
        if (__builtin_expect((w[0] - lo < span) | (w[1] - lo < span) | (w[2] - lo < span) |
                                 (w[3] - lo < span), 0))
            for (int j = 0; j < 4; j++)
                if (w[j] - lo < span)
                    pos_mark(w[j], starts, ends, k, hits);
    }
    lanes[0] = a, lanes[1] = b, lanes[2] = c, lanes[3] = d;
}

/* The hash of buf's n bytes continuing from h (a chunk's checksum: h = n). */
EXPORT uint64_t pos_fold(const unsigned char *buf, size_t n, uint64_t h) {
    uint64_t lanes[4];
    pos_start(h, lanes);
    pass((unsigned char *)buf, buf, n / GROUP, 0, lanes, NULL, NULL, 0, NULL);
    return pos_close(lanes, buf + n / GROUP * GROUP, n);
}

/* pos_fold of a chunk taken piece by piece as it is read (an image's files, pos/image/filehash.py:
 * a small reusable buffer, not the whole chunk, in memory): the lanes started from h, each
 * piece's whole groups folded in (every piece but the last is a whole number of groups), then
 * closed over the last piece's rest (its bytes from the chunk's n / GROUP * GROUP on). Bit for
 * bit pos_fold(chunk, n, h). */
EXPORT void pos_fold_start(uint64_t h, uint64_t lanes[4]) {
    pos_start(h, lanes);
}

EXPORT void pos_fold_groups(const unsigned char *buf, size_t groups, uint64_t lanes[4]) {
    pass((unsigned char *)buf, buf, groups, 0, lanes, NULL, NULL, 0, NULL);
}

EXPORT uint64_t pos_fold_close(const uint64_t lanes[4], const unsigned char *rest, size_t n) {
    return pos_close(lanes, rest, n);
}

/* A chunk's checksum (pos_fold from n), marking hits[j] for each of the k sorted ranges its
 * words point into, in the same pass (copying src to dst as it goes, where `copy`): a
 * checkpoint learns, as it saves each buffer, which others a kernel could reach through the
 * addresses the buffer holds. */
static inline __attribute__((always_inline)) uint64_t
copy_fold_point(unsigned char *dst, const unsigned char *src, size_t n, int copy,
                const uint64_t *starts, const uint64_t *ends, size_t k, unsigned char *hits) {
    uint64_t lanes[4];
    size_t whole = n / GROUP * GROUP;
    pos_start(n, lanes);
    pass(dst, src, n / GROUP, copy, lanes, starts, ends, k, hits);
    if (copy)
        memcpy(dst + whole, src + whole, n - whole);
    pos_point(dst + whole, (n - whole) / 8, starts, ends, k, hits);
    return pos_close(lanes, dst + whole, n);
}

/* copy_fold_point in place. */
EXPORT uint64_t pos_fold_point(const unsigned char *buf, size_t n, const uint64_t *starts,
                               const uint64_t *ends, size_t k, unsigned char *hits) {
    return copy_fold_point((unsigned char *)buf, buf, n, 0, starts, ends, k, hits);
}

/* The checksum of kind `blocks` (hash.h) of the n bytes at buf, marking the ranges its words
 * point into: each BLOCK bytes as pos_fold_point, folded in order into n. */
EXPORT uint64_t pos_blocks_point(const unsigned char *buf, size_t n, const uint64_t *starts,
                                 const uint64_t *ends, size_t k, unsigned char *hits) {
    uint64_t h = n;
    for (size_t at = 0; at < n; at += BLOCK)
        h = pos_blocks_step(h, pos_fold_point(buf + at, n - at < BLOCK ? n - at : BLOCK, starts,
                                              ends, k, hits));
    return h;
}

/* The checksum of kind `blocks` of n bytes, from the hashes of its ceil(n / BLOCK) blocks (the
 * GPU's, pos/image/blocks.cu). */
EXPORT uint64_t pos_blocks_fold(const uint64_t *hashes, size_t n) {
    uint64_t h = n;
    for (size_t b = 0; b * BLOCK < n; b++)
        h = pos_blocks_step(h, hashes[b]);
    return h;
}

/* The driver's calls a fill makes, handed over by pos/driver.py (the one place that loads
 * libcuda): cuMemcpyHtoDAsync_v2, cuEventRecord, cuEventSynchronize. */
typedef int (*copy_fn)(uint64_t dst, const void *src, size_t n, void *stream);
typedef int (*record_fn)(void *event, void *stream);
typedef int (*wait_fn)(void *event);

/* A fill thread's ring of `depth` page-locked pieces: each piece is read, hashed and copied to
 * the device while the next is read. The copy's source is still in the CPU's cache, so the
 * host's memory carries the page cache's bytes once, not three times (read into staging,
 * written back, read again by the copy engine). */
struct pos_ring {
    unsigned char *slots;   /* depth * piece bytes, page-locked */
    size_t piece, depth;
    void **events;          /* one per slot: its last copy */
    unsigned char *pending; /* whether that event was recorded */
    void *stream;
    copy_fn copy;
    record_fn record;
    wait_fn wait;
    size_t next;            /* the slot the next piece goes into */
    int error;              /* the driver's code when a call failed */
};

static int read_all(int fd, unsigned char *out, size_t n, int64_t at) {
    for (size_t got = 0; got < n;) {
        ssize_t r = pread(fd, out + got, n - got, at + (int64_t)got);
        if (r <= 0)
            return -1;
        got += (size_t)r;
    }
    return 0;
}

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif

/* Map the pages of [p, p + n) of a file mapping in one call rather than a fault per 16 of
 * them. Non-zero when the kernel could not (an I/O error, a file shorter than its mapping);
 * a kernel older than 5.14 (EINVAL) leaves them to fault in as the copy touches them. */
static int populate(const unsigned char *p, size_t n) {
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE), a = (uintptr_t)p / page * page;
    return madvise((void *)a, (uintptr_t)p + n - a, MADV_POPULATE_READ) != 0 && errno != EINVAL;
}

/* The chunk of n bytes at file position `at` (read from fd, or copied from src, the file
 * mapped), piece by piece: into out (ring NULL), or through the ring's slots to the device at
 * dst. Each piece is hashed, and the ranges its words point
 * into marked, while it is in the CPU's cache. Returns the bytes read (fewer: the file ended or
 * a read failed), -1 for a piece that is no whole number of groups (of blocks for a checksum of
 * kind `blocks`), -2 when the driver failed (ring->error). *hash: the chunk's checksum, of kind
 * `blocks` where `blocks` is set (each block hashed as it lies in the piece), else `words`. */
static int64_t pieces(int fd, const unsigned char *src, unsigned char *out,
                      struct pos_ring *ring, uint64_t dst, size_t n, int64_t at, size_t piece,
                      int blocks, const uint64_t *starts, const uint64_t *ends, size_t k,
                      unsigned char *hits, uint64_t *hash) {
    if (piece == 0 || piece % (blocks ? BLOCK : GROUP))
        return -1;
    uint64_t lanes[4], h = n;      /* kind `words`: the lanes; kind `blocks`: h */
    pos_start(n, lanes);
    size_t whole = n / GROUP * GROUP, words = n / 8 * 8, done = 0;
    const unsigned char *rest = out;
    if (src && n && populate(src + at, n))
        src = NULL;   /* pages the kernel could not map (an I/O error): read them, no SIGBUS */
    while (done < n) {
        size_t end = done + piece < n ? done + piece : n, slot = 0;
        unsigned char *p = out + done;
        if (ring) {
            slot = ring->next;
            ring->next = (slot + 1) % ring->depth;
            p = ring->slots + slot * ring->piece;
            if (ring->pending[slot] && (ring->error = ring->wait(ring->events[slot])) != 0)
                return -2;
            ring->pending[slot] = 0;
        }
        /* the piece's whole groups, then (last piece only) the words that made no group
         * and the tail; `done` is a multiple of the piece, so never past `whole` */
        size_t grouped = (end < whole ? end : whole) - done;
        size_t loose = (end < words ? end : words) - done - grouped;
        if (blocks) {   /* whole blocks but the chunk's last, each hashed from its length */
            if (!src && read_all(fd, p, end - done, at + (int64_t)done))
                return (int64_t)done;
            for (size_t b = 0; b < end - done; b += BLOCK) {
                size_t len = end - done - b < BLOCK ? end - done - b : BLOCK;
                h = pos_blocks_step(h, src ? copy_fold_point(p + b, src + at + done + b, len, 1,
                                                             starts, ends, k, hits)
                                           : copy_fold_point(p + b, p + b, len, 0, starts,
                                                             ends, k, hits));
            }
        } else if (src) {
            pass(p, src + at + done, grouped / GROUP, 1, lanes, starts, ends, k, hits);
            memcpy(p + grouped, src + at + done + grouped, end - done - grouped);
        } else if (read_all(fd, p, end - done, at + (int64_t)done)) {
            return (int64_t)done;
        } else {
            pass(p, p, grouped / GROUP, 0, lanes, starts, ends, k, hits);
        }
        if (!blocks)
            pos_point(p + grouped, loose / 8, starts, ends, k, hits);
        if (end == n)
            rest = p + (whole - done);   /* the last piece starts at or below `whole` */
        if (ring) {   /* on failure the caller waits for the ring's stream before anything */
            if ((ring->error = ring->copy(dst + done, p, end - done, ring->stream)) != 0 ||
                (ring->error = ring->record(ring->events[slot], ring->stream)) != 0)
                return -2;
            ring->pending[slot] = 1;
        }
        done = end;
    }
    *hash = blocks ? h : pos_close(lanes, rest, n);
    return (int64_t)n;
}

/* Read n bytes at file position `at` of fd into out, `piece` bytes at a time (a multiple of
 * GROUP, or of BLOCK for a checksum of kind `blocks`); see `pieces`. */
EXPORT int64_t pos_read_chunk(int fd, unsigned char *out, size_t n, int64_t at, size_t piece,
                              int blocks, const uint64_t *starts, const uint64_t *ends, size_t k,
                              unsigned char *hits, uint64_t *hash) {
    return pieces(fd, NULL, out, NULL, 0, n, at, piece, blocks, starts, ends, k, hits, hash);
}

/* Write the chunk of n bytes at buf to fd (at its offset), `piece` bytes at a time (a multiple
 * of GROUP), each piece hashed, and the ranges its words point into marked, just before its
 * write, while it is in the CPU's cache: hashing a whole 64 MiB chunk and then writing it read
 * it from memory twice, beside the copy engine writing the next ones into it. Returns 0,
 * -EINVAL for a piece that is no whole number of groups, or -errno of the write that failed.
 * *hash: the chunk's checksum (pos_fold_point's, bit for bit). */
EXPORT int64_t pos_write_chunk(int fd, const unsigned char *buf, size_t n, size_t piece,
                               const uint64_t *starts, const uint64_t *ends, size_t k,
                               unsigned char *hits, uint64_t *hash) {
    if (piece == 0 || piece % GROUP)
        return -EINVAL;
    uint64_t lanes[4];
    pos_start(n, lanes);
    size_t whole = n / GROUP * GROUP;
    for (size_t done = 0; done < n;) {
        size_t end = done + piece < n ? done + piece : n;
        size_t grouped = (end < whole ? end : whole) - done;
        pass((unsigned char *)buf + done, buf + done, grouped / GROUP, 0, lanes, starts, ends, k,
             hits);
        for (size_t put = done; put < end;) {
            ssize_t w = write(fd, buf + put, end - put);
            if (w < 0 && errno == EINTR)
                continue;
            if (w <= 0)
                return w < 0 ? -(int64_t)errno : -(int64_t)EIO;
            put += (size_t)w;
        }
        done = end;
    }
    pos_point(buf + whole, (n - whole) / 8, starts, ends, k, hits);
    *hash = pos_close(lanes, buf + whole, n);
    return 0;
}

/* Fill n bytes of device memory at dst from position `at` of a data file through the ring (its
 * piece size a multiple of GROUP, or of BLOCK for a checksum of kind `blocks`): read from fd, or
 * copied from `mapped` (the whole file mapped read-only, at least at + n bytes long; NULL:
 * read); see `pieces`. The caller waits for the ring's stream before it tells anyone the memory
 * is back, and only if the checksum matched. */
EXPORT int64_t pos_fill_chunk(struct pos_ring *ring, int fd, const unsigned char *mapped,
                              uint64_t dst, size_t n, int64_t at, int blocks,
                              const uint64_t *starts, const uint64_t *ends, size_t k,
                              unsigned char *hits, uint64_t *hash) {
    return pieces(fd, mapped, NULL, ring, dst, n, at, ring->piece, blocks, starts, ends, k, hits,
                  hash);
}
