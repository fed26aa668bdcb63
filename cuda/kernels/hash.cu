/* The keyed checksum of a tensor in device memory (common/dc_hash.h): a warp
 * per 1 KiB block, each lane 32 contiguous bytes (two 16-byte loads where
 * aligned), the block's NH summed over the warp, lane 0 adding the block's
 * term; one atomic add a warp (modulo 2^64, so the order of the adds does
 * not matter and the sum equals the host's). */
#include "dc_hash.h"
#include "dcc.h"
#include "dcc_util.cuh"

namespace {

constexpr int HASH_NT = DC_HASH_BLOCK; /* one key word per thread */
constexpr int HASH_WARPS = HASH_NT / 32;
constexpr uint64_t HASH_BLOCK_BYTES = 4 * DC_HASH_BLOCK;

__global__ void hash_kernel(const unsigned char *__restrict__ p, uint64_t n, uint64_t key,
                            unsigned long long *__restrict__ out) {
    __shared__ uint32_t K[DC_HASH_BLOCK];
    K[threadIdx.x] = dc_hash_key_word(key, threadIdx.x);
    __syncthreads();
    const unsigned lane = threadIdx.x & 31;
    const uint64_t blocks = (n + HASH_BLOCK_BYTES - 1) / HASH_BLOCK_BYTES;
    /* every lane's bytes are 16-aligned where the tensor is */
    const bool aligned = ((uintptr_t)p & 15) == 0;
    uint64_t sum = 0;
    for (uint64_t j = (uint64_t)blockIdx.x * HASH_WARPS + (threadIdx.x >> 5); j < blocks;
         j += (uint64_t)gridDim.x * HASH_WARPS) {
        const uint64_t at = j * HASH_BLOCK_BYTES + 32 * lane;
        uint32_t w[8];
        if (aligned && at + 32 <= n) {
            const uint4 a = __ldg((const uint4 *)(p + at)), b = __ldg((const uint4 *)(p + at + 16));
            w[0] = a.x, w[1] = a.y, w[2] = a.z, w[3] = a.w;
            w[4] = b.x, w[5] = b.y, w[6] = b.z, w[7] = b.w;
        } else {
            for (int k = 0; k < 8; k++) {
                uint32_t v = 0;
                for (int c = 0; c < 4; c++)
                    if (at + 4 * k + c < n) v |= (uint32_t)p[at + 4 * k + c] << (8 * c);
                w[k] = v;
            }
        }
        const uint32_t *kk = K + 8 * lane;
        uint64_t y = dc_hash_nh(w[0], kk[0], w[1], kk[1]) + dc_hash_nh(w[2], kk[2], w[3], kk[3]) +
                     dc_hash_nh(w[4], kk[4], w[5], kk[5]) + dc_hash_nh(w[6], kk[6], w[7], kk[7]);
        for (int o = 16; o > 0; o /= 2) y += __shfl_down_sync(0xffffffffu, y, o);
        if (lane == 0) sum += dc_hash_block_term(key, j, y);
    }
    if (lane == 0 && sum) atomicAdd(out, (unsigned long long)sum);
}

} // namespace

extern "C" cudaError_t dcc_tensor_hash(const void *p, uint64_t n, uint64_t key,
                                       unsigned long long *out, cudaStream_t st) {
    uint64_t blocks = (n + HASH_BLOCK_BYTES - 1) / HASH_BLOCK_BYTES,
             grid = (blocks + HASH_WARPS - 1) / HASH_WARPS;
    if (grid < 1) grid = 1;
    if (grid > 2048) grid = 2048;
    hash_kernel<<<(unsigned)grid, HASH_NT, 0, st>>>((const unsigned char *)p, n, key, out);
    return cudaGetLastError();
}
