/* The keyed checksum of a tensor in device memory (common/dc_hash.h): one
 * pass, each thread summing its words' terms, a warp sum, one atomic add a
 * warp (modulo 2^64, so the order of the adds does not matter and the sum
 * equals the host's). */
#include "dc_hash.h"
#include "dcc.h"
#include "dcc_util.cuh"

namespace {

constexpr int HASH_NT = 256;

__global__ void hash_kernel(const unsigned char *__restrict__ p, uint64_t n, uint64_t key,
                            unsigned long long *__restrict__ out) {
    const uint64_t words = (n + 7) / 8;
    uint64_t sum = 0;
    for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < words;
         i += (uint64_t)gridDim.x * blockDim.x) {
        uint64_t w = 0;
        const uint64_t at = 8 * i;
        if (at + 8 <= n && ((uintptr_t)(p + at) & 7) == 0) {
            w = *(const uint64_t *)(p + at);
        } else {
            for (uint64_t k = 0; k < 8 && at + k < n; k++) w |= (uint64_t)p[at + k] << (8 * k);
        }
        sum += dc_hash_term(key, i, w);
    }
    for (int o = 16; o > 0; o /= 2) sum += __shfl_down_sync(0xffffffffu, sum, o);
    if ((threadIdx.x & 31) == 0) atomicAdd(out, (unsigned long long)sum);
}

} // namespace

extern "C" cudaError_t dcc_tensor_hash(const void *p, uint64_t n, uint64_t key,
                                       unsigned long long *out, cudaStream_t st) {
    uint64_t words = (n + 7) / 8, blocks = (words + HASH_NT - 1) / HASH_NT;
    if (blocks < 1) blocks = 1;
    if (blocks > 4096) blocks = 4096;
    hash_kernel<<<(unsigned)blocks, HASH_NT, 0, st>>>((const unsigned char *)p, n, key, out);
    return cudaGetLastError();
}
