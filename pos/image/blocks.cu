/* The checksum of kind `blocks` (hash.h) and the pointer scan of a chunk of device memory, on
 * the GPU that holds it: a thread per BLOCK bytes, so that the checkpoint's savers on the CPU
 * only write the chunk (pos/concurrent/gpuhash.py launches it; blocks.ptx is what nvcc makes of
 * this file, `python -m pos.native --ptx`). */
#include "hash.h"

/* hashes[b]: block b's hash, for each of the ceil(n / BLOCK) blocks of the n bytes at src;
 * hits[j] = 1 for each of the k sorted ranges [starts[j], ends[j]) a whole word points into. */
extern "C" __global__ void pos_blocks(const unsigned char *src, uint64_t n, uint64_t *hashes,
                                      const uint64_t *starts, const uint64_t *ends, uint64_t k,
                                      unsigned char *hits) {
    uint64_t b = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    uint64_t at = b * BLOCK;
    if (at >= n)
        return;
    size_t len = n - at < BLOCK ? (size_t)(n - at) : BLOCK;
    hashes[b] = pos_hash_point(src + at, len, starts, ends, k, hits);
}
