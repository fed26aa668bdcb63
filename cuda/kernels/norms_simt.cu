/* LINEAR per-sample squared norms on CUDA cores: f32 inputs (tensor cores
 * would round them to tf32, too coarse for the f32 error bound) and mixed
 * input/grad dtypes; plus the rank-one T == 1 formula for every dtype.
 *
 * Same decomposition as the tensor-core kernels (norms_linear.cu), with
 * 64x64 tiles and 4x4 outputs per thread: direct tiles of g_b^T a_b squared
 * in registers (bias from the first d-tile's column sums), ghost pairs of
 * Gram tiles on the lower triangle (bias = sum of the g Gram tile). */
#include "dcc.h"
#include "dcc_device.cuh"
#include "dcc_util.cuh"

namespace {

constexpr int S_T = 64, S_K = 16, S_NT = 256;

template <typename TA, typename TG>
__global__ void __launch_bounds__(S_NT)
    simt_direct(const TA *__restrict__ a, const TG *__restrict__ g, int T, int d, int p,
                int tiles_n, int has_bias, float s2, float *__restrict__ n2) {
    __shared__ float As[S_K][S_T + 4]; /* g tile [t][m] */
    __shared__ float Bs[S_K][S_T + 4]; /* a tile [t][n] */
    const int b = blockIdx.y;
    const int tm = (int)blockIdx.x / tiles_n, tn = (int)blockIdx.x % tiles_n;
    const int m0 = tm * S_T, n0 = tn * S_T;
    const int tid = (int)threadIdx.x, ty = tid >> 4, tx = tid & 15;
    const TG *gb = g + (int64_t)b * T * p;
    const TA *ab = a + (int64_t)b * T * d;
    const bool do_bias = has_bias && tn == 0;
    float acc[4][4] = {};
    float bsum = 0.0f;
    for (int k0 = 0; k0 < T; k0 += S_K) {
#pragma unroll
        for (int it = 0; it < S_K * S_T / S_NT; it++) {
            int i = tid + it * S_NT, r = i / S_T, c = i % S_T, t = k0 + r;
            As[r][c] = (t < T && m0 + c < p) ? dcc_ld(gb, (int64_t)t * p + m0 + c) : 0.0f;
            Bs[r][c] = (t < T && n0 + c < d) ? dcc_ld(ab, (int64_t)t * d + n0 + c) : 0.0f;
        }
        __syncthreads();
        if (do_bias && tid < S_T)
#pragma unroll
            for (int r = 0; r < S_K; r++) bsum += As[r][tid];
#pragma unroll
        for (int k = 0; k < S_K; k++) {
            float av[4], bv[4];
#pragma unroll
            for (int i = 0; i < 4; i++) av[i] = As[k][ty + 16 * i];
#pragma unroll
            for (int j = 0; j < 4; j++) bv[j] = Bs[k][tx + 16 * j];
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 4; j++) acc[i][j] += av[i] * bv[j];
        }
        __syncthreads();
    }
    float sq = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) sq += acc[i][j] * acc[i][j];
    if (do_bias && tid < S_T) sq += bsum * bsum;
    float tot = dcc_block_sum(sq);
    if (tid == 0) atomicAdd(n2 + b, tot * s2);
}

/* acc = X[t0:t0+64] X[s0:s0+64]^T over K columns. */
template <typename TX>
__device__ __forceinline__ void simt_gram(float (&acc)[4][4], float (*Xs)[S_T + 4],
                                          float (*Ys)[S_T + 4], const TX *x, int K, int T, int t0,
                                          int s0) {
    const int tid = (int)threadIdx.x, ty = tid >> 4, tx = tid & 15;
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) acc[i][j] = 0.0f;
    for (int k0 = 0; k0 < K; k0 += S_K) {
#pragma unroll
        for (int it = 0; it < S_K * S_T / S_NT; it++) {
            int i = tid + it * S_NT, r = i / S_K, c = i % S_K, k = k0 + c;
            Xs[c][r] = (t0 + r < T && k < K) ? dcc_ld(x, (int64_t)(t0 + r) * K + k) : 0.0f;
            Ys[c][r] = (s0 + r < T && k < K) ? dcc_ld(x, (int64_t)(s0 + r) * K + k) : 0.0f;
        }
        __syncthreads();
#pragma unroll
        for (int k = 0; k < S_K; k++) {
            float av[4], bv[4];
#pragma unroll
            for (int i = 0; i < 4; i++) av[i] = Xs[k][ty + 16 * i];
#pragma unroll
            for (int j = 0; j < 4; j++) bv[j] = Ys[k][tx + 16 * j];
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 4; j++) acc[i][j] += av[i] * bv[j];
        }
        __syncthreads();
    }
}

template <typename TA, typename TG>
__global__ void __launch_bounds__(S_NT)
    simt_ghost(const TA *__restrict__ a, const TG *__restrict__ g, int T, int d, int p,
               int has_bias, float s2, float *__restrict__ n2) {
    __shared__ float Xs[S_K][S_T + 4];
    __shared__ float Ys[S_K][S_T + 4];
    const int b = blockIdx.y, idx = (int)blockIdx.x;
    int ti, si;
    dcc_tri_pair(idx, &ti, &si);
    float ga[4][4], gg[4][4];
    simt_gram(ga, Xs, Ys, a + (int64_t)b * T * d, d, T, ti * S_T, si * S_T);
    simt_gram(gg, Xs, Ys, g + (int64_t)b * T * p, p, T, ti * S_T, si * S_T);
    float part = 0.0f, gsum = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) {
            part += ga[i][j] * gg[i][j];
            gsum += gg[i][j];
        }
    if (has_bias) part += gsum;
    float tot = dcc_block_sum(part);
    if (threadIdx.x == 0) atomicAdd(n2 + b, tot * s2 * (ti == si ? 1.0f : 2.0f));
}

/* T == 1: G_b = g_b a_b^T has ||G_b||^2 = ||a_b||^2 ||g_b||^2; bias ||g_b||^2. */
template <typename TA, typename TG>
__global__ void __launch_bounds__(S_NT)
    rank1_kernel(const TA *__restrict__ a, const TG *__restrict__ g, int d, int p, int has_bias,
                 float s2, float *__restrict__ n2) {
    const int b = blockIdx.x;
    float sa = 0.0f, sg = 0.0f;
    for (int j = (int)threadIdx.x; j < d; j += S_NT) {
        float v = dcc_ld(a, (int64_t)b * d + j);
        sa += v * v;
    }
    for (int j = (int)threadIdx.x; j < p; j += S_NT) {
        float v = dcc_ld(g, (int64_t)b * p + j);
        sg += v * v;
    }
    sa = dcc_block_sum(sa);
    sg = dcc_block_sum(sg);
    if (threadIdx.x == 0) atomicAdd(n2 + b, s2 * (sa * sg + (has_bias ? sg : 0.0f)));
}

} // namespace

extern "C" cudaError_t dcc_linear_simt(const dcc_linear *L, dc_algo algo, float s2, float *n2,
                                       cudaStream_t st) {
    return dcc_with_float(L->ta, [&](auto ta) {
        return dcc_with_float(L->tg, [&](auto tg) {
            using TA = DCC_TYPE_OF(ta);
            using TG = DCC_TYPE_OF(tg);
            const TA *a = (const TA *)L->a;
            const TG *g = (const TG *)L->g;
            if (algo == DC_ALGO_DIRECT) {
                int tiles_m = (L->p + S_T - 1) / S_T, tiles_n = (L->d + S_T - 1) / S_T;
                if ((int64_t)tiles_m * tiles_n > INT32_MAX) return cudaErrorInvalidConfiguration;
                dim3 grid((unsigned)(tiles_m * tiles_n), (unsigned)L->B);
                simt_direct<TA, TG>
                    <<<grid, S_NT, 0, st>>>(a, g, L->T, L->d, L->p, tiles_n, L->has_bias, s2, n2);
            } else {
                int64_t nt = (L->T + S_T - 1) / S_T, pairs = nt * (nt + 1) / 2;
                if (pairs > INT32_MAX / 2) return cudaErrorInvalidConfiguration;
                dim3 grid((unsigned)pairs, (unsigned)L->B);
                simt_ghost<TA, TG>
                    <<<grid, S_NT, 0, st>>>(a, g, L->T, L->d, L->p, L->has_bias, s2, n2);
            }
            return cudaGetLastError();
        });
    });
}

extern "C" cudaError_t dcc_linear_rank1(const dcc_linear *L, float s2, float *n2, cudaStream_t st) {
    return dcc_with_float(L->ta, [&](auto ta) {
        return dcc_with_float(L->tg, [&](auto tg) {
            using TA = DCC_TYPE_OF(ta);
            using TG = DCC_TYPE_OF(tg);
            rank1_kernel<TA, TG><<<(unsigned)L->B, S_NT, 0, st>>>((const TA *)L->a,
                                                                  (const TG *)L->g, L->d, L->p,
                                                                  L->has_bias, s2, n2);
            return cudaGetLastError();
        });
    });
}
