/* Gaussian noise for the clipped sums, from a counter-based generator.
 *
 * Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2,
 * 3", SC'11) maps (counter, key) to 128 random bits with no state, so the
 * value drawn for element i of tensor s in step n depends only on (key, n, s,
 * i): not on thread scheduling, chunking, or which backend draws it. The CPU
 * and CUDA backends can therefore produce the same stream.
 *
 * Counter layout: word0 = element pair index (low 32 bits), word1 = stream
 * (the tensor's serial within the step), words 2..3 = the step number. The key
 * is the daemon's 64-bit secret seed. Each counter yields two normals through
 * Box-Muller on two 64-bit uniforms (53-bit mantissas, so the tails reach
 * about 8.5 sigma), so one stream holds at most DC_NOISE_MAX_N values. */
#ifndef DC_NOISE_H
#define DC_NOISE_H

#include <stddef.h>
#include <stdint.h>

#define DC_NOISE_MAX_N ((uint64_t)1 << 33)
/* Streams from here on are a norm group's replicated layers (2 per layer,
 * under the group's key); a step's own outputs use 2 * layer + k, below it
 * (limits.max_layers <= 2^20). */
#define DC_NOISE_STREAM_REPLICATED ((uint32_t)1 << 30)

/* The raw block function: out = Philox4x32-10(ctr, key). */
void dc_philox4x32_10(const uint32_t ctr[4], const uint32_t key[2], uint32_t out[4]);

/* out[i] = N(0,1) draw i of stream (key, step, stream), for i in [0, n).
 * n must be <= DC_NOISE_MAX_N (callers check). */
void dc_noise_normal(uint64_t key, uint64_t step, uint32_t stream, float *out, size_t n);

/* out[i] += std * (draw i of the stream): the same values dc_noise_normal
 * gives, without a scratch buffer. std == 0 draws nothing. */
void dc_noise_add_normal(uint64_t key, uint64_t step, uint32_t stream, float std, float *out,
                         size_t n);

/* out[i] += std * (draw first + i of the stream), for i in [0, n): the
 * draws of elements [first, first + n) exactly as a whole stream gives them
 * (a sums step noising only the rows its rank owns). std == 0 draws
 * nothing. first + n must be <= DC_NOISE_MAX_N. */
void dc_noise_add_normal_at(uint64_t key, uint64_t step, uint32_t stream, float std, float *out,
                            uint64_t first, size_t n);

/* A fresh secret key from getrandom(); returns 0 or DC_EINTERNAL. */
int dc_noise_seed(uint64_t *key);

#endif
