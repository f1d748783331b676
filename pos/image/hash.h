/* pos's 64-bit word hash, shared by the CPU (chunks.c) and the GPU (blocks.cu), so that a
 * chunk hashed on the GPU at its checkpoint is checked bit for bit on the CPU at its restore.
 *
 * The hash of n bytes from h: four lanes of 64-bit words, each lane (lane ^ word) * P1, then
 * ^ >> 29; then folded with the word count and the words that made no group of four, then the
 * zero-padded tail of 1-7 bytes hashed as one more word. A chunk's checksum of kind `words`
 * is that hash from the chunk's length.
 *
 * Kind `blocks`: the chunk's BLOCK-byte blocks each hashed so (from the block's length), and
 * the block hashes folded in order into the chunk's length (pos_blocks_step). The GPU hashes a
 * 64 MiB chunk with a thread per block, where the lanes of kind `words` run the whole chunk in
 * order. */
#ifndef POS_HASH_H
#define POS_HASH_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#ifdef __CUDACC__
#define POS_FN __host__ __device__ static inline
#else
#define POS_FN static inline
#endif

#define P1 0x9E3779B97F4A7C15ull
#define P2 0xC2B2AE3D27D4EB4Full
#define GROUP 32        /* bytes the four lanes take per round */
#define BLOCK 4096      /* bytes of a block of kind `blocks` (a multiple of GROUP) */

/* The 8 bytes at p (8-aligned on the GPU: a block starts a multiple of BLOCK into a chunk, and
 * a chunk a multiple of the chunk's size into an allocation). */
POS_FN uint64_t pos_load(const unsigned char *p) {
#ifdef __CUDA_ARCH__
    return *(const uint64_t *)p;
#else
    uint64_t w;
    memcpy(&w, p, 8);
    return w;
#endif
}

/* The group of four words at p (16-aligned on the GPU: two 16-byte loads). */
POS_FN void pos_load_group(const unsigned char *p, uint64_t w[4]) {
#ifdef __CUDA_ARCH__
    ulonglong2 a = ((const ulonglong2 *)p)[0], b = ((const ulonglong2 *)p)[1];
    w[0] = a.x, w[1] = a.y, w[2] = b.x, w[3] = b.y;
#else
    memcpy(w, p, 4 * 8);
#endif
}

POS_FN void pos_start(uint64_t h, uint64_t lanes[4]) {
    for (int j = 0; j < 4; j++)
        lanes[j] = h ^ (P2 * (uint64_t)(j + 1));
}

POS_FN uint64_t pos_lane(uint64_t lane, uint64_t w) {
    lane = (lane ^ w) * P1;
    return lane ^ (lane >> 29);
}

/* The lanes folded, after n_words words of which the last `nrest` (< 4), at `rest`, made no
 * group. */
POS_FN uint64_t pos_finish(const uint64_t lanes[4], uint64_t n_words, const unsigned char *rest,
                           size_t nrest) {
    uint64_t out = n_words * P2;
    for (int j = 0; j < 4; j++)
        out = (out ^ lanes[j]) * P1;
    for (size_t i = 0; i < nrest; i++) {
        out = (out ^ pos_load(rest + 8 * i)) * P2;
        out ^= out >> 31;
    }
    return out;
}

/* The lanes finished over n bytes, their whole groups passed already; `rest` points at byte
 * n / GROUP * GROUP (the words that made no group, then the tail). */
POS_FN uint64_t pos_close(const uint64_t lanes[4], const unsigned char *rest, size_t n) {
    size_t words = n / 8, whole = n / GROUP * GROUP;
    uint64_t out = pos_finish(lanes, words, rest, words - whole / 8);
    if (n % 8) {
        unsigned char tail[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (size_t i = 0; i < n % 8; i++)
            tail[i] = rest[words * 8 - whole + i];
        uint64_t t[4];
        pos_start(out, t);
        out = pos_finish(t, 1, tail, 1);
    }
    return out;
}

/* Marks the one of the k sorted, disjoint ranges [starts[j], ends[j]) that w falls into, if
 * any; the caller has checked that w lies between the first start and the last end. */
POS_FN void pos_mark(uint64_t w, const uint64_t *starts, const uint64_t *ends, size_t k,
                     unsigned char *hits) {
    size_t a = 0, b = k; /* the last range starting at or below w */
    while (b - a > 1) {
        size_t m = (a + b) / 2;
        if (starts[m] <= w)
            a = m;
        else
            b = m;
    }
    if (w < ends[a])
        hits[a] = 1;
}

/* The span [lo, lo + span) that holds every range (span 0: no ranges), so that a word outside
 * all of them costs one subtraction and one compare. */
POS_FN void pos_bounds(const uint64_t *starts, const uint64_t *ends, size_t k, uint64_t *lo,
                       uint64_t *span) {
    *lo = k ? starts[0] : 0;
    *span = k ? ends[k - 1] - starts[0] : 0;
}

/* Marks the ranges that each of the n words at p (8-aligned on the GPU) points into. */
POS_FN void pos_point_words(const unsigned char *p, size_t n, const uint64_t *starts,
                            const uint64_t *ends, size_t k, unsigned char *hits) {
    uint64_t lo, span;
    pos_bounds(starts, ends, k, &lo, &span);
    for (size_t i = 0; i < n; i++) {
        uint64_t w = pos_load(p + 8 * i);
        if (w - lo < span)
            pos_mark(w, starts, ends, k, hits);
    }
}

/* One block's hash folded into the chunk's (which starts from the chunk's length). */
POS_FN uint64_t pos_blocks_step(uint64_t h, uint64_t block_hash) {
    h = (h ^ block_hash) * P1;
    return h ^ (h >> 31);
}

/* The hash of the n bytes at p from n, marking the ranges its whole words point into: plainly,
 * a group at a time, as a GPU thread takes its block (chunks.c's `pass` is the CPU's). */
POS_FN uint64_t pos_hash_point(const unsigned char *p, size_t n, const uint64_t *starts,
                               const uint64_t *ends, size_t k, unsigned char *hits) {
    uint64_t lanes[4], lo, span;
    size_t whole = n / GROUP * GROUP;
    pos_bounds(starts, ends, k, &lo, &span);
    pos_start(n, lanes);
    uint64_t a = lanes[0], b = lanes[1], c = lanes[2], d = lanes[3];
    for (size_t at = 0; at < whole; at += GROUP) {
        uint64_t w[4];
        pos_load_group(p + at, w);
        a = pos_lane(a, w[0]), b = pos_lane(b, w[1]), c = pos_lane(c, w[2]), d = pos_lane(d, w[3]);
        for (int j = 0; j < 4; j++)
            if (w[j] - lo < span)
                pos_mark(w[j], starts, ends, k, hits);
    }
    lanes[0] = a, lanes[1] = b, lanes[2] = c, lanes[3] = d;
    pos_point_words(p + whole, (n - whole) / 8, starts, ends, k, hits); /* made no group */
    return pos_close(lanes, p + whole, n);
}

#endif
