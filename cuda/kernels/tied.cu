/* Tied parameters on the GPU: the shared weight of an embedding and a linear
 * layer (dc_layer.tie). Each use's norm comes from its own kernels (the
 * linear one without its bias); this adds the cross term and moves the
 * later layer's part to the owner:
 *
 *   n2o[b] += n2l[b] + s2 * 2 <G_emb,b, G_lin,b>,   n2l[b] = s2 ||bias_b||^2
 *
 * where <G_emb,b, G_lin,b> = sum_t sum_s g_b[s, i_t] (e_t . a_s): G_emb,b has
 * row i_t += e_t at each non-padding position t, G_lin,b = g_b^T a_b. The
 * Gram entries e_t . a_s are tiles of E_b A_b^T (64 x 64 per block, f32 on
 * CUDA cores), each weighted by the linear layer's output grad gathered at
 * the embedding's index, summed in double. Indices outside the vocabulary
 * (flagged by the embedding's own kernels, which fail the step) are skipped
 * here, never read through. */
#include "dcc.h"
#include "dcc_device.cuh"

namespace {

constexpr int TILE = 64; /* positions per tile side */
constexpr int KC = 16;   /* feature chunk */
constexpr int NT = 256;  /* 16 x 16 threads, 4 x 4 entries each */

/* grid (Te / TILE, Tl / TILE, B) */
template <typename TE, typename TA, typename TG, typename TI>
__global__ void __launch_bounds__(NT)
    tied_cross(const TE *__restrict__ e, const TA *__restrict__ a, const TG *__restrict__ g,
               const TI *__restrict__ idx, int Te, int Tl, int d, int64_t V, int64_t pad,
               double *__restrict__ cross) {
    __shared__ float Es[KC][TILE + 4];
    __shared__ float As[KC][TILE + 4];
    __shared__ int64_t tok[TILE];
    const int b = blockIdx.z, t0 = blockIdx.x * TILE, s0 = blockIdx.y * TILE;
    const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;
    const TE *eb = e + (int64_t)b * Te * d;
    const TA *ab = a + (int64_t)b * Tl * d;
    if (tid < TILE) {
        int t = t0 + tid;
        int64_t v = t < Te ? (int64_t)idx[(int64_t)b * Te + t] : -1;
        tok[tid] = (v < 0 || v >= V || v == pad) ? -1 : v;
    }
    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) acc[i][j] = 0.0f;
    for (int k0 = 0; k0 < d; k0 += KC) {
#pragma unroll
        for (int q = 0; q < TILE * KC / NT; q++) {
            int i = tid + q * NT, r = i / KC, c = i % KC, k = k0 + c;
            Es[c][r] = (t0 + r < Te && k < d) ? dcc_ld(eb, (int64_t)(t0 + r) * d + k) : 0.0f;
            As[c][r] = (s0 + r < Tl && k < d) ? dcc_ld(ab, (int64_t)(s0 + r) * d + k) : 0.0f;
        }
        __syncthreads();
#pragma unroll
        for (int c = 0; c < KC; c++) {
            float x[4], y[4];
#pragma unroll
            for (int i = 0; i < 4; i++) x[i] = Es[c][ty * 4 + i];
#pragma unroll
            for (int j = 0; j < 4; j++) y[j] = As[c][tx * 4 + j];
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 4; j++) acc[i][j] = fmaf(x[i], y[j], acc[i][j]);
        }
        __syncthreads();
    }
    double sum = 0.0;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        int64_t v = tok[ty * 4 + i];
        if (v < 0) continue;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            int s = s0 + tx * 4 + j;
            if (s < Tl) sum += (double)acc[i][j] * (double)dcc_ld(g, ((int64_t)b * Tl + s) * V + v);
        }
    }
    sum = dcc_block_sum_d(sum);
    if (tid == 0) atomicAdd(cross + b, sum);
}

/* n2o[b] += n2l[b] + s2 * 2 cross[b] (kept >= 0, NaN kept NaN: a bad input
 * must still fail the step); n2l[b] = 0 for the later layer's bias. */
__global__ void tied_combine(float *__restrict__ n2o, float *__restrict__ n2l,
                             const double *__restrict__ cross, float s2, int B) {
    int b = blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= B) return;
    double w = (double)n2o[b] + (double)n2l[b] + (double)s2 * 2.0 * cross[b];
    n2o[b] = (float)(w < 0.0 ? 0.0 : w);
    n2l[b] = 0.0f;
}

/* grid (p / NT, B): n2[b] += s2 * sum_j (sum_t g[b,t,j])^2 */
template <typename TG>
__global__ void bias_sq(const TG *__restrict__ g, int T, int p, float s2, float *__restrict__ n2) {
    int j = blockIdx.x * blockDim.x + threadIdx.x, b = blockIdx.y;
    float s = 0.0f;
    if (j < p)
        for (int t = 0; t < T; t++) s += dcc_ld(g, ((int64_t)b * T + t) * p + j);
    float sq = dcc_block_sum(s * s);
    if (threadIdx.x == 0) atomicAdd(n2 + b, s2 * sq);
}

template <typename Fn> cudaError_t with_index(dc_dtype t, Fn &&fn) {
    switch (t) {
    case DC_I32: return fn((const int32_t *)nullptr);
    case DC_I64: return fn((const int64_t *)nullptr);
    default: return cudaErrorInvalidValue;
    }
}

} // namespace

extern "C" cudaError_t dcc_tied_sqnorms(const dcc_embedding *E, const dcc_linear *N,
                                        bool later_bias, float s2, float *n2o, float *n2l,
                                        double *cross, cudaStream_t st) {
    if (E->B != N->B || E->d != N->d || E->vocab != (int64_t)N->p) return cudaErrorInvalidValue;
    const int B = N->B;
    cudaError_t err = cudaMemsetAsync(cross, 0, (size_t)B * sizeof *cross, st);
    if (err != cudaSuccess) return err;
    dim3 grid((unsigned)((E->T + TILE - 1) / TILE), (unsigned)((N->T + TILE - 1) / TILE),
              (unsigned)B);
    err = dcc_with_float(E->tg, [&](auto te) {
        return dcc_with_float(N->ta, [&](auto ta) {
            return dcc_with_float(N->tg, [&](auto tg) {
                return with_index(E->tidx, [&](auto ti) {
                    tied_cross<<<grid, NT, 0, st>>>((const DCC_TYPE_OF(te) *)E->g,
                                                    (const DCC_TYPE_OF(ta) *)N->a,
                                                    (const DCC_TYPE_OF(tg) *)N->g,
                                                    (const DCC_TYPE_OF(ti) *)E->idx, E->T, N->T,
                                                    N->d, E->vocab, E->padding_idx, cross);
                    return cudaGetLastError();
                });
            });
        });
    });
    if (err != cudaSuccess) return err;
    tied_combine<<<(B + 255) / 256, 256, 0, st>>>(n2o, n2l, cross, s2, B);
    if ((err = cudaGetLastError()) != cudaSuccess || !later_bias) return err;
    dim3 bgrid((unsigned)((N->p + NT - 1) / NT), (unsigned)B);
    return dcc_with_float(N->tg, [&](auto tg) {
        bias_sq<<<bgrid, NT, 0, st>>>((const DCC_TYPE_OF(tg) *)N->g, N->T, N->p, s2, n2l);
        return cudaGetLastError();
    });
}
