/* LINEAR per-sample squared norms on tensor cores (bf16 / f16 inputs, f32
 * accumulation), and the dispatch between these kernels and the CUDA-core
 * ones (norms_simt.cu).
 *
 * Direct form: per sample b, G_b = g_b^T a_b (p x d, K = T) in 128x128 tiles;
 * each tile is squared and summed in registers and never leaves the SM.
 * Split-K is impossible (a tile must be complete before it is squared), so a
 * CTA runs the whole K loop of its tile. Bias: the CTAs of the first d-tile
 * also sum the g tile's columns from shared memory (sum_t g_t, complete over
 * T in that CTA), so the bias costs no extra pass over g.
 *
 * Ghost form: ||G_b||^2 = sum_{t,s} (a_t.a_s)(g_t.g_s). A CTA takes a pair of
 * 128-row blocks (t, s) with s <= t, computes both Gram tiles in registers
 * (K = d, then K = p) and sums their elementwise product, doubled off the
 * diagonal: half the Gram work, memory independent of T. Bias: ||sum_t g_t||^2
 * is the sum of all entries of g g^T, so it is the Gram tile's own sum.
 *
 * Tiles live in shared memory in 16-byte chunks swizzled by (chunk ^ row%8),
 * so that the ldmatrix reads of 8 rows hit 8 different bank groups. Operands
 * arrive through a multi-stage cp.async pipeline when rows are 16-byte
 * aligned, else through guarded element loads (odd feature sizes). */
#include "dcc.h"
#include "dcc_device.cuh"
#include "dcc_path.h"
#include "dcc_util.cuh"

namespace {

constexpr int NT = 256; /* 8 warps: 2 (M) x 4 (N), 64x32 each */

/* direct: tiles [BK rows of T][128 features], MN-major (transposed ldmatrix) */
constexpr int D_BM = 128, D_BN = 128, D_BK = 32, D_ST = 4;
constexpr int D_TILE = D_BK * D_BM * 2;
constexpr int D_SMEM = D_ST * 2 * D_TILE; /* 64 KiB */
/* ghost: tiles [128 rows of T][BK features], K-major */
constexpr int G_BT = 128, G_BK = 64, G_ST = 3;
constexpr int G_TILE = G_BT * G_BK * 2;
constexpr int G_SMEM = G_ST * 2 * G_TILE; /* 96 KiB */

template <typename TI, bool VEC>
__global__ void __launch_bounds__(NT, 2)
    direct_kernel(const uint16_t *__restrict__ a, const uint16_t *__restrict__ g, int T, int d,
                  int p, int tiles_n, int has_bias, float s2, float *__restrict__ n2) {
    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ float colsum[4][D_BM];
    const int b = blockIdx.y;
    const int tm = (int)blockIdx.x / tiles_n, tn = (int)blockIdx.x % tiles_n;
    const int m0 = tm * D_BM, n0 = tn * D_BN;
    const uint16_t *gb = g + (int64_t)b * T * p;
    const uint16_t *ab = a + (int64_t)b * T * d;
    const uint32_t sbase = dcc_smem(smem);
    const int warp = (int)threadIdx.x >> 5, lane = (int)threadIdx.x & 31;
    const int wm = (warp >> 2) * 64, wn = (warp & 3) * 32;
    const int q = lane >> 3, r8 = lane & 7;
    const bool do_bias = has_bias && tn == 0;
    const int kt_n = (T + D_BK - 1) / D_BK;
    float acc[4][4][4];
    dcc_acc_zero(acc);
    float bs0 = 0.0f, bs1 = 0.0f; /* bias: sums of columns 2*(tid%64), +1 */

    auto load = [&](int kt) {
        uint32_t sA = sbase + (uint32_t)((kt % D_ST) * 2 * D_TILE);
        dcc_load_tile<D_BK, D_BM, VEC, NT>(sA, gb, p, kt * D_BK, T, m0, p);
        dcc_load_tile<D_BK, D_BN, VEC, NT>(sA + D_TILE, ab, d, kt * D_BK, T, n0, d);
    };
    dcc_cp_pipeline<D_ST>(kt_n, load, [&](int kt) {
        const uint32_t sA = sbase + (uint32_t)((kt % D_ST) * 2 * D_TILE), sB = sA + D_TILE;
#pragma unroll
        for (int kk = 0; kk < D_BK; kk += 16) {
            uint32_t af[4][4], bf[4][2];
#pragma unroll
            for (int mi = 0; mi < 4; mi++) {
                int k = kk + r8 + ((q >> 1) << 3);
                int m = wm + mi * 16 + ((q & 1) << 3);
                dcc_ldsm4_t(sA + (uint32_t)(k * D_BM * 2) + (uint32_t)(((m >> 3) ^ (k & 7)) << 4),
                            af[mi]);
            }
#pragma unroll
            for (int nj = 0; nj < 2; nj++) {
                int k = kk + r8 + ((q & 1) << 3);
                int n = wn + nj * 16 + ((q >> 1) << 3);
                uint32_t t4[4];
                dcc_ldsm4_t(sB + (uint32_t)(k * D_BN * 2) + (uint32_t)(((n >> 3) ^ (k & 7)) << 4),
                            t4);
                bf[2 * nj][0] = t4[0];
                bf[2 * nj][1] = t4[1];
                bf[2 * nj + 1][0] = t4[2];
                bf[2 * nj + 1][1] = t4[3];
            }
            dcc_warp_mma(acc, af, bf, dcc_mma16<TI>{});
        }
        if (do_bias) {
            /* Column sums of this g tile: thread owns columns m, m+1 and a
             * quarter of the BK rows. */
            int m = ((int)threadIdx.x & 63) * 2, rq = ((int)threadIdx.x >> 6) * (D_BK / 4);
#pragma unroll
            for (int r = rq; r < rq + D_BK / 4; r++) {
                uint32_t w = dcc_lds32(sA + (uint32_t)(r * D_BM * 2) +
                                       (uint32_t)(((m >> 3) ^ (r & 7)) << 4) +
                                       (uint32_t)((m & 7) * 2));
                bs0 += dcc_lo((const TI *)nullptr, w);
                bs1 += dcc_hi((const TI *)nullptr, w);
            }
        }
    });

    float sq = dcc_acc_sumsq(acc);
    if (do_bias) {
        int m = ((int)threadIdx.x & 63) * 2, rq = (int)threadIdx.x >> 6;
        colsum[rq][m] = bs0;
        colsum[rq][m + 1] = bs1;
        __syncthreads();
        if (threadIdx.x < D_BM) {
            int c = (int)threadIdx.x;
            float v = colsum[0][c] + colsum[1][c] + colsum[2][c] + colsum[3][c];
            sq += v * v;
        }
    }
    float tot = dcc_block_sum(sq);
    if (threadIdx.x == 0) atomicAdd(n2 + b, tot * s2);
}

/* One Gram tile X[t0:t0+128] X[s0:s0+128]^T (K = ncols of X) into acc. */
template <typename TI, bool VEC>
__device__ __forceinline__ void gram_tile(float (&acc)[4][4][4], uint32_t sbase, const uint16_t *x,
                                          int K, int T, int t0, int s0) {
    const int warp = (int)threadIdx.x >> 5, lane = (int)threadIdx.x & 31;
    const int wm = (warp >> 2) * 64, wn = (warp & 3) * 32;
    const int q = lane >> 3, r8 = lane & 7;
    const int kt_n = (K + G_BK - 1) / G_BK;
    dcc_acc_zero(acc);

    auto load = [&](int kt) {
        uint32_t sA = sbase + (uint32_t)((kt % G_ST) * 2 * G_TILE);
        dcc_load_tile<G_BT, G_BK, VEC, NT>(sA, x, K, t0, T, kt * G_BK, K);
        dcc_load_tile<G_BT, G_BK, VEC, NT>(sA + G_TILE, x, K, s0, T, kt * G_BK, K);
    };
    dcc_cp_pipeline<G_ST>(kt_n, load, [&](int kt) {
        const uint32_t sA = sbase + (uint32_t)((kt % G_ST) * 2 * G_TILE), sB = sA + G_TILE;
#pragma unroll
        for (int kk = 0; kk < G_BK; kk += 16) {
            uint32_t af[4][4], bf[4][2];
#pragma unroll
            for (int mi = 0; mi < 4; mi++) {
                int row = wm + mi * 16 + (lane & 15);
                int col = kk + ((lane >> 4) << 3);
                dcc_ldsm4(sA + (uint32_t)(row * G_BK * 2) +
                              (uint32_t)(((col >> 3) ^ (row & 7)) << 4),
                          af[mi]);
            }
#pragma unroll
            for (int nj = 0; nj < 2; nj++) {
                int row = wn + nj * 16 + ((q >> 1) << 3) + r8;
                int col = kk + ((q & 1) << 3);
                uint32_t t4[4];
                dcc_ldsm4(sB + (uint32_t)(row * G_BK * 2) +
                              (uint32_t)(((col >> 3) ^ (row & 7)) << 4),
                          t4);
                bf[2 * nj][0] = t4[0];
                bf[2 * nj][1] = t4[1];
                bf[2 * nj + 1][0] = t4[2];
                bf[2 * nj + 1][1] = t4[3];
            }
            dcc_warp_mma(acc, af, bf, dcc_mma16<TI>{});
        }
    });
    /* Make the stages free for the next Gram tile. */
    __syncthreads();
}

template <typename TI, bool VEC>
__global__ void __launch_bounds__(NT, 1)
    ghost_kernel(const uint16_t *__restrict__ a, const uint16_t *__restrict__ g, int T, int d,
                 int p, int has_bias, float s2, float *__restrict__ n2) {
    extern __shared__ __align__(128) unsigned char smem[];
    const int b = blockIdx.y;
    int ti, si;
    dcc_tri_pair((int)blockIdx.x, &ti, &si);
    const uint32_t sbase = dcc_smem(smem);
    float ga[4][4][4], gg[4][4][4];
    gram_tile<TI, VEC>(ga, sbase, a + (int64_t)b * T * d, d, T, ti * G_BT, si * G_BT);
    gram_tile<TI, VEC>(gg, sbase, g + (int64_t)b * T * p, p, T, ti * G_BT, si * G_BT);
    float part = 0.0f, gsum = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int k = 0; k < 4; k++) {
                part += ga[i][j][k] * gg[i][j][k];
                gsum += gg[i][j][k];
            }
    if (has_bias) part += gsum;
    float tot = dcc_block_sum(part);
    if (threadIdx.x == 0) atomicAdd(n2 + b, tot * s2 * (ti == si ? 1.0f : 2.0f));
}

template <typename TI, bool VEC>
cudaError_t launch_tc(const dcc_linear *L, dc_algo algo, float s2, float *n2, cudaStream_t st) {
    const uint16_t *a = (const uint16_t *)L->a, *g = (const uint16_t *)L->g;
    cudaError_t e;
    if (algo == DC_ALGO_DIRECT) {
        int tiles_m = (L->p + D_BM - 1) / D_BM, tiles_n = (L->d + D_BN - 1) / D_BN;
        if ((int64_t)tiles_m * tiles_n > INT32_MAX) return cudaErrorInvalidConfiguration;
        e = cudaFuncSetAttribute(direct_kernel<TI, VEC>,
                                 cudaFuncAttributeMaxDynamicSharedMemorySize, D_SMEM);
        if (e != cudaSuccess) return e;
        dim3 grid((unsigned)(tiles_m * tiles_n), (unsigned)L->B);
        direct_kernel<TI, VEC>
            <<<grid, NT, D_SMEM, st>>>(a, g, L->T, L->d, L->p, tiles_n, L->has_bias, s2, n2);
    } else {
        int64_t nt = (L->T + G_BT - 1) / G_BT;
        int64_t pairs = nt * (nt + 1) / 2;
        if (pairs > INT32_MAX / 2) return cudaErrorInvalidConfiguration;
        e = cudaFuncSetAttribute(ghost_kernel<TI, VEC>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 G_SMEM);
        if (e != cudaSuccess) return e;
        dim3 grid((unsigned)pairs, (unsigned)L->B);
        ghost_kernel<TI, VEC>
            <<<grid, NT, G_SMEM, st>>>(a, g, L->T, L->d, L->p, L->has_bias, s2, n2);
    }
    return cudaGetLastError();
}

bool aligned16(const void *p) { return ((uintptr_t)p & 15u) == 0; }

} // namespace

/* direct_rate: how much faster the direct form runs than the ghost form
 * per unit of the work below. The coefficients' rounding bounds (step.c,
 * gpu_forms) count both forms wherever a rate between 0.25 and 4 could
 * pick either: keep the rates inside that band, or widen it there. */
static dc_algo pick(int T, int d, int p, dc_algo requested, double direct_rate) {
    if (requested != DC_ALGO_AUTO) return requested;
    if (T == 1) return DC_ALGO_GHOST; /* the rank-one formula */
    /* Work the kernels really do, padding to their tiles included. Direct:
     * 128x128 output tiles over K = T in steps of 32. Ghost: the lower
     * triangle of 128x128 (t, s) tiles, each two Gram tiles over K = d and p
     * in steps of 64. */
    double tm = (double)((p + 127) / 128), tn = (double)((d + 127) / 128);
    double direct = tm * tn * 128.0 * 128.0 * 32.0 * (double)((T + 31) / 32);
    double nt = (double)((T + 127) / 128);
    double ghost = nt * (nt + 1.0) * 0.5 * 128.0 * 128.0 * 64.0 *
                   (double)((d + 63) / 64 + (p + 63) / 64);
    return direct <= ghost * direct_rate ? DC_ALGO_DIRECT : DC_ALGO_GHOST;
}

/* Layer by layer both forms run the same mma loop at about the same rate. */
extern "C" dc_algo dcc_linear_pick(int T, int d, int p, dc_algo requested) {
    return pick(T, d, p, requested, 1.0);
}

/* f32 on TF32: the ghost form runs on wgmma at about twice the rate of the
 * direct form's mma.sync (TF32 wgmma takes K-major operands only, which the
 * direct form's are not). */
constexpr double TF32_DIRECT_RATE = 0.5;

extern "C" dc_algo dcc_linear_pick_for(const dcc_linear *L, dc_algo requested) {
    const bool tf32_wg = dcc_linear_path(L) == DCC_PATH_TF32 && dcc_wgmma_available(L->opt) &&
                         aligned16(L->a) && aligned16(L->g) && L->d % 4 == 0 && L->p % 4 == 0;
    return pick(L->T, L->d, L->p, requested, tf32_wg ? TF32_DIRECT_RATE : 1.0);
}

/* In the grouped launch the direct form runs persistent, with no partial
 * last wave, at about the cuBLAS GEMM's rate. Measured on an H100: GPT-2-
 * small's MLP layers (B=8, T=1024; direct 1.07x the ghost work) ran faster
 * there than in per-layer ghost launches, Llama-1B's (B=4, T=2048; 1.51x)
 * slower; 1.25 sits between the two. */
extern "C" dc_algo dcc_linear_pick_grouped(int T, int d, int p, dc_algo requested) {
    return pick(T, d, p, requested, 1.25);
}

extern "C" dcc_path dcc_linear_path(const dcc_linear *L) {
    if (L->tf32 && L->ta == DC_F32 && L->tg == DC_F32) return DCC_PATH_TF32;
    if (L->ta != L->tg || (L->ta != DC_BF16 && L->ta != DC_F16)) return DCC_PATH_SIMT;
    if (!(aligned16(L->a) && aligned16(L->g) && L->d % 8 == 0 && L->p % 8 == 0))
        return DCC_PATH_MMA_ELEM;
    return dcc_wgmma_available(L->opt) ? DCC_PATH_WGMMA : DCC_PATH_MMA_VEC;
}

extern "C" cudaError_t dcc_linear_sqnorms(const dcc_linear *L, dc_algo algo, float s2, float *n2,
                                          cudaStream_t st) {
    if (L->B <= 0 || L->T <= 0 || L->d <= 0 || L->p <= 0) return cudaErrorInvalidValue;
    algo = dcc_linear_pick_for(L, algo);
    if (L->T == 1 && algo == DC_ALGO_GHOST) return dcc_linear_rank1(L, s2, n2, st);
    cudaError_t e;
    switch (dcc_linear_path(L)) {
    case DCC_PATH_TF32: return dcc_linear_tf32(L, algo, s2, n2, st);
    case DCC_PATH_WGMMA:
        e = dcc_linear_wgmma(L, algo, s2, n2, st);
        if (e != cudaErrorNotSupported) return e;
        (void)cudaGetLastError(); /* no tensor map for this layer: mma.sync */
        return L->ta == DC_BF16 ? launch_tc<dcc_bf16, true>(L, algo, s2, n2, st)
                                : launch_tc<dcc_f16, true>(L, algo, s2, n2, st);
    case DCC_PATH_MMA_VEC:
        return L->ta == DC_BF16 ? launch_tc<dcc_bf16, true>(L, algo, s2, n2, st)
                                : launch_tc<dcc_f16, true>(L, algo, s2, n2, st);
    case DCC_PATH_MMA_ELEM:
        return L->ta == DC_BF16 ? launch_tc<dcc_bf16, false>(L, algo, s2, n2, st)
                                : launch_tc<dcc_f16, false>(L, algo, s2, n2, st);
    case DCC_PATH_SIMT: break;
    }
    return dcc_linear_simt(L, algo, s2, n2, st);
}
