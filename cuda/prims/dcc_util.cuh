/* Helpers the kernel files share on both sides: the ghost form's tile-pair
 * decode (device, and host for tests), the device's SM count and the
 * clipped sums' sample groups (host). */
#ifndef DC_DCC_UTIL_CUH
#define DC_DCC_UTIL_CUH

#include <math.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

/* The ghost form's CTAs each take one pair (ti, si), si <= ti, of row
 * blocks from the lower triangle, numbered row by row:
 * idx = ti (ti + 1) / 2 + si. The float square root lands within one of ti;
 * the loops correct it, in 64 bits (for idx near 2^30, (ti + 1) (ti + 2)
 * passes INT_MAX). */
__host__ __device__ __forceinline__ void dcc_tri_pair(int idx, int *ti, int *si) {
    int64_t t = (int64_t)((sqrtf(8.0f * (float)idx + 1.0f) - 1.0f) * 0.5f);
    while (t * (t + 1) / 2 > idx) t--;
    while ((t + 1) * (t + 2) / 2 <= idx) t++;
    *ti = (int)t;
    *si = (int)(idx - t * (t + 1) / 2);
}

/* The ghost form's wide items of one sample: row block ti against the 256
 * rows of blocks 2sj and 2sj + 1, sj <= ti / 2, numbered row-major as
 * dcc_tri_pair's pairs, so that wide item idx begins at pair
 * ti (ti + 1) / 2 + 2 sj. Row ti has ti / 2 + 1 of them: before row 2m
 * lie m (m + 1), before row 2m + 1, (m + 1)^2. */
__host__ __device__ __forceinline__ int64_t dcc_wide_count(int64_t nt) {
    const int64_t m = nt / 2;
    return nt % 2 ? (m + 1) * (m + 1) : m * (m + 1);
}
__host__ __device__ __forceinline__ void dcc_wide_pair(int idx, int *ti, int *sj) {
    int64_t m = (int64_t)((sqrtf(4.0f * (float)idx + 1.0f) - 1.0f) * 0.5f);
    while (m * (m + 1) > idx) m--;
    while ((m + 1) * (m + 2) <= idx) m++;
    const bool odd = idx >= (m + 1) * (m + 1);
    *ti = (int)(2 * m + (odd ? 1 : 0));
    *sj = (int)(idx - (odd ? (m + 1) * (m + 1) : m * (m + 1)));
}

/* The first pair (over all samples, dcc_tri_pair's numbering) of wide item
 * w (over all samples); pairs * B past the last. */
__host__ __device__ __forceinline__ int64_t dcc_wide_first_pair(int64_t w, int64_t per_b,
                                                                int64_t pairs) {
    int ti, sj;
    dcc_wide_pair((int)(w % per_b), &ti, &sj);
    return w / per_b * pairs + (int64_t)ti * (ti + 1) / 2 + 2 * sj;
}

/* The current device's SM count, for the grids of persistent and
 * wave-sized launches. A failed query is returned, never replaced by a
 * guess: launchers pass it on. */
static inline cudaError_t dcc_sm_count(int *sms) {
    int dev;
    cudaError_t e = cudaGetDevice(&dev);
    if (e == cudaSuccess) e = cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, dev);
    return e;
}

/* Sample groups of a clipped-sum launch of `tiles` output tiles at one CTA
 * per SM: enough groups for two waves (their tiles summed with atomics
 * into a zeroed output), at most B: *groups of *per samples (the last may
 * have fewer). */
static inline cudaError_t dcc_clip_groups(int tiles, int B, int *groups, int *per) {
    int sms;
    cudaError_t e = dcc_sm_count(&sms);
    if (e != cudaSuccess) return e;
    int n = (2 * sms + tiles - 1) / tiles;
    if (n > B) n = B;
    if (n < 1) n = 1;
    *per = (B + n - 1) / n;
    *groups = (B + *per - 1) / *per;
    return cudaSuccess;
}

#endif
