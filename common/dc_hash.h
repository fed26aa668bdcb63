/* A keyed checksum of a tensor's bytes, for telling whether two copies of
 * data are the same (a norm group's replicated layers): the sum, modulo
 * 2^64, of splitmix64(word_i ^ splitmix64(key + i)) over the data's 8-byte
 * words (the tail zero-padded). A sum of independent keyed mixes: whoever
 * does not know the key cannot pick other bytes with the same sum (norms,
 * which a negated copy keeps, are no such check), and it is computed in any
 * order, so the GPU's parallel sum (cuda/kernels/hash.cu) equals the CPU's. The
 * key is the daemon's, per group step, never a client's. */
#ifndef DC_HASH_H
#define DC_HASH_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#ifdef __CUDACC__
#define DC_HASH_FN __host__ __device__ static inline
#else
#define DC_HASH_FN static inline
#endif

DC_HASH_FN uint64_t dc_hash_mix(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* Word i's term. */
DC_HASH_FN uint64_t dc_hash_term(uint64_t key, uint64_t i, uint64_t word) {
    return dc_hash_mix(word ^ dc_hash_mix(key + i));
}

#ifndef __CUDACC__
/* The checksum of bytes [p, p + n) under key (host memory). */
static inline uint64_t dc_hash_bytes(const void *p, size_t n, uint64_t key) {
    const unsigned char *b = (const unsigned char *)p;
    uint64_t sum = 0, i = 0;
    for (; n >= 8; n -= 8, b += 8, i++) {
        uint64_t w;
        memcpy(&w, b, 8);
        sum += dc_hash_term(key, i, w);
    }
    if (n) {
        uint64_t w = 0;
        memcpy(&w, b, n);
        sum += dc_hash_term(key, i, w);
    }
    return sum;
}
#endif

#endif
