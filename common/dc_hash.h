/* A keyed checksum of a tensor's bytes, for telling whether data is what it
 * was (a step's seal between its phases, step_run.h) or whether two copies
 * are the same (a norm group's replicated layers).
 *
 * The bytes are read as little-endian 32-bit words w (the tail
 * zero-padded) in blocks of DC_HASH_BLOCK words. Each block j is hashed by
 * NH under a key table K of DC_HASH_BLOCK words drawn from the key,
 *     y_j = sum_t (w[2t] + K[2t] mod 2^32) (w[2t+1] + K[2t+1] mod 2^32) mod 2^64,
 * which two different blocks of the same length share with probability at
 * most 2^-32 over the key (NH, as in UMAC: so a change chosen without the
 * key passes with about that probability), and the checksum is the sum
 * modulo 2^64 of the blocks' keyed mixes dc_hash_mix(y_j ^ dc_hash_mix(key
 * + j)), so that a block's place counts. Whoever does not know the key
 * cannot pick other bytes with the same checksum (norms, which a negated
 * copy keeps, are no such check). It is computed in any order, so the GPU's
 * parallel sum (cuda/kernels/hash.cu) equals the CPU's, and costs one
 * multiply per 8 bytes: a read of the data. The key is the daemon's, never
 * a client's. */
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

/* 32-bit words per NH block (1 KiB) */
#define DC_HASH_BLOCK 256

DC_HASH_FN uint64_t dc_hash_mix(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* Word t of the NH key table. */
DC_HASH_FN uint32_t dc_hash_key_word(uint64_t key, uint32_t t) {
    return (uint32_t)dc_hash_mix(dc_hash_mix(key) ^ (0x6a09e667f3bcc909ull + t));
}

/* Block j's term, from its NH value y. */
DC_HASH_FN uint64_t dc_hash_block_term(uint64_t key, uint64_t j, uint64_t y) {
    return dc_hash_mix(y ^ dc_hash_mix(key + j));
}

/* One NH pair. */
DC_HASH_FN uint64_t dc_hash_nh(uint32_t a, uint32_t ka, uint32_t b, uint32_t kb) {
    return (uint64_t)(uint32_t)(a + ka) * (uint64_t)(uint32_t)(b + kb);
}

#ifndef __CUDACC__
/* The checksum of bytes [p, p + n) under key (host memory). */
static inline uint64_t dc_hash_bytes(const void *p, size_t n, uint64_t key) {
    const unsigned char *b = (const unsigned char *)p;
    uint32_t K[DC_HASH_BLOCK];
    uint64_t sum = 0;
    for (uint32_t t = 0; t < DC_HASH_BLOCK; t++) K[t] = dc_hash_key_word(key, t);
    for (uint64_t j = 0; (size_t)j * 4 * DC_HASH_BLOCK < n; j++) {
        const size_t at = (size_t)j * 4 * DC_HASH_BLOCK;
        const size_t len = n - at < 4 * DC_HASH_BLOCK ? n - at : 4 * DC_HASH_BLOCK;
        uint32_t w[DC_HASH_BLOCK] = {0};
        uint64_t y = 0;
        memcpy(w, b + at, len); /* little-endian hosts (the daemon's) */
        for (uint32_t t = 0; t < DC_HASH_BLOCK; t += 2)
            y += dc_hash_nh(w[t], K[t], w[t + 1], K[t + 1]);
        sum += dc_hash_block_term(key, j, y);
    }
    return sum;
}
#endif

#endif
