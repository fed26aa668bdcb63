/* LINEAR per-sample norms and clipped sums for f32 inputs on TF32 tensor
 * cores (mma.sync m16n8k8, f32 accumulation; the ghost form on wgmma where
 * it can run, norms_tma.cu): the path f32 inputs take by default, as
 * PyTorch's matmuls do with TF32 allowed. DPCLIP_CUDA_TF32=0 in the daemon's
 * environment keeps them on the exact CUDA-core kernels (norms_simt.cu) and
 * f32 cuBLAS.
 *
 * Operands go to the tensor cores as the f32 bits they are: the hardware
 * reads their top 19 bits (TF32, truncated toward zero). wgmma, which reads
 * shared memory itself, can do nothing else, and the mma.sync kernels do the
 * same so that a sum is clipped by the norm of exactly the values it adds
 * (a round-to-nearest norm beside a truncated sum could let a clipped
 * gradient exceed C by 2^-10); the bias's norm and clipped sum
 * (dcc_bias_clipped_sum) take g's TF32 values too. Error: each operand
 * loses less than 2^-10 of itself, each product less than 2^-9, so squared
 * norms stay within 2^-8 (3.9e-3) of the f32 result, plus f32 accumulation
 * (the tests allow 5e-3).
 *
 * Direct form: 128x128 tiles of g_b^T a_b over K = T in steps of 32; shared
 * tiles are [32 rows of T][128 features] padded to 136 floats, so that the
 * fragment reads (k = lane % 4, feature = lane / 4) hit 32 different banks.
 * The clipped sum runs the K loops of a group of samples back to back
 * through one pipeline on 128x256 tiles (warps of 64x64: half the shared
 * reads per MMA of 64x32, which bound the 128x128 form), weighting each
 * sample by Horner rescaling of the one accumulator (tf32_clipped).
 * Ghost form: pairs (t, s <= t) of 128-row blocks, Gram tiles over K = d
 * then p in steps of 32 features, rows padded to 36 floats (conflict-free
 * for the same reason). */
#include "dcc.h"
#include "dcc_device.cuh"
#include "dcc_util.cuh"

namespace {

constexpr int NT = 256; /* 8 warps: 2 (M) x 4 (N), 64x32 each (64x64: the clipped sum) */
constexpr int F_BM = 128, F_BN = 128, F_BK = 32, F_ST = 3, F_LD = F_BM + 8;
constexpr int F_TILE = F_BK * F_LD;           /* floats */
constexpr int F_SMEM = F_ST * 2 * F_TILE * 4; /* 102 KiB: two CTAs per SM */
constexpr int C_BN = 256, C_LD = C_BN + 8;    /* the clipped sum's B tile */
constexpr int C_STAGE = F_TILE + F_BK * C_LD; /* floats */
constexpr int C_SMEM = F_ST * C_STAGE * 4;    /* 150 KiB */
constexpr int Q_BT = 128, Q_BK = 32, Q_ST = 3, Q_LD = Q_BK + 4;
constexpr int Q_TILE = Q_BT * Q_LD;
constexpr int Q_SMEM = Q_ST * 2 * Q_TILE * 4; /* 108 KiB */

/* The operand as the tensor cores take it: its bits (see the top). */
__device__ __forceinline__ uint32_t to_tf32(float x) { return __float_as_uint(x); }

/* D += A * B for one m16n8k8 TF32 tile (a dcc_warp_mma step). */
struct tf32_mma {
    __device__ __forceinline__ void operator()(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                               uint32_t b1) const {
        asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, "
                     "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
};

/* One K step of F_BK for a warp's 64 x 8*NI tile of the direct form: A =
 * g^T and B = a, both stored [k][feature] (rows of lda / ldb floats), read
 * as fragments (k = lane % 4, feature = lane / 4): with row strides of 8
 * mod 32 floats the 32 lanes hit 32 banks. */
template <int NI>
__device__ __forceinline__ void mn_major_mma(float (&acc)[4][NI][4], const float *sA, int lda,
                                             const float *sB, int ldb, int wm, int wn, int gq,
                                             int tq) {
#pragma unroll
    for (int kk = 0; kk < F_BK; kk += 8) {
        uint32_t af[4][4], bf[NI][2];
#pragma unroll
        for (int mi = 0; mi < 4; mi++) {
            const float *pa = sA + (kk + tq) * lda + wm + mi * 16 + gq;
            af[mi][0] = to_tf32(pa[0]);
            af[mi][1] = to_tf32(pa[8]);
            af[mi][2] = to_tf32(pa[4 * lda]);
            af[mi][3] = to_tf32(pa[4 * lda + 8]);
        }
#pragma unroll
        for (int ni = 0; ni < NI; ni++) {
            const float *pb = sB + (kk + tq) * ldb + wn + ni * 8 + gq;
            bf[ni][0] = to_tf32(pb[0]);
            bf[ni][1] = to_tf32(pb[4 * ldb]);
        }
        dcc_warp_mma(acc, af, bf, tf32_mma{});
    }
}

/* Rows [r0, r0+ROWS) x columns [c0, c0+COLS) of a row-major f32 matrix
 * (nrows x ncols, leading dimension ld) into shared rows of LD floats, zero
 * outside the matrix. VEC: 16-byte cp.async (ld, c0, ncols multiples of 4,
 * 16-byte aligned base); else guarded element loads. */
template <int ROWS, int COLS, int LD, bool VEC>
__device__ __forceinline__ void f_load(float *s, const float *x, int64_t ld, int r0, int nrows,
                                       int c0, int ncols) {
    constexpr int CPR = COLS / 4, ITERS = ROWS * CPR / NT;
    static_assert(ITERS * NT == ROWS * CPR, "tile not a multiple of the block");
#pragma unroll
    for (int it = 0; it < ITERS; it++) {
        int i = (int)threadIdx.x + it * NT;
        int r = i / CPR, c = (i % CPR) * 4;
        int gr = r0 + r, gc = c0 + c;
        float *dst = s + r * LD + c;
        if (VEC) {
            bool ok = gr < nrows && gc < ncols;
            const float *src = ok ? x + (int64_t)gr * ld + gc : x;
            dcc_cp_async16(dcc_smem(dst), src, ok ? 16 : 0);
        } else {
            float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            if (gr < nrows) {
                const float *src = x + (int64_t)gr * ld;
#pragma unroll
                for (int j = 0; j < 4; j++)
                    if (gc + j < ncols) v[j] = src[gc + j];
            }
            *(float4 *)dst = make_float4(v[0], v[1], v[2], v[3]);
        }
    }
}

/* n2[blockIdx.y] += s2 * (||tile||^2 + bias part). */
template <bool VEC>
__global__ void __launch_bounds__(NT, 2)
    tf32_direct(const float *__restrict__ a, const float *__restrict__ g, int T, int d, int p,
                int tiles_n, int has_bias, float s2, float *__restrict__ n2) {
    extern __shared__ __align__(16) float fsm[];
    __shared__ float colsum[2][F_BM];
    const int tm = (int)blockIdx.x / tiles_n, tn = (int)blockIdx.x % tiles_n;
    const int m0 = tm * F_BM, n0 = tn * F_BN, b = (int)blockIdx.y;
    const int U = (T + F_BK - 1) / F_BK;
    const bool do_bias = has_bias && tn == 0;
    const int warp = (int)threadIdx.x >> 5, lane = (int)threadIdx.x & 31;
    const int wm = (warp >> 2) * 64, wn = (warp & 3) * 32, gq = lane >> 2, tq = lane & 3;
    float acc[4][4][4];
    float bsum = 0.0f;
    dcc_acc_zero(acc);

    auto load = [&](int u) {
        float *sA = fsm + (u % F_ST) * 2 * F_TILE;
        f_load<F_BK, F_BM, F_LD, VEC>(sA, g + (int64_t)b * T * p, p, u * F_BK, T, m0, p);
        f_load<F_BK, F_BN, F_LD, VEC>(sA + F_TILE, a + (int64_t)b * T * d, d, u * F_BK, T, n0, d);
    };
    dcc_cp_pipeline<F_ST>(U, load, [&](int u) {
        const float *sA = fsm + (u % F_ST) * 2 * F_TILE, *sB = sA + F_TILE;
        mn_major_mma<4>(acc, sA, F_LD, sB, F_LD, wm, wn, gq, tq);
        if (do_bias) { /* column c, rows of half h: f32 sums of g's TF32 values */
            const int c = (int)threadIdx.x & (F_BM - 1), h = (int)threadIdx.x >> 7;
#pragma unroll
            for (int r = h * (F_BK / 2); r < (h + 1) * (F_BK / 2); r++)
                bsum += dcc_tf32_trunc(sA[r * F_LD + c]);
        }
    });
    float sq = dcc_acc_sumsq(acc);
    if (do_bias) {
        colsum[threadIdx.x >> 7][threadIdx.x & (F_BM - 1)] = bsum;
        __syncthreads();
        if (threadIdx.x < F_BM) {
            float v = colsum[0][threadIdx.x] + colsum[1][threadIdx.x];
            sq += v * v;
        }
    }
    float tot_sq = dcc_block_sum(sq);
    if (threadIdx.x == 0) atomicAdd(n2 + b, tot_sq * s2);
}

/* w (+)= sum over the samples of blockIdx.y's group of cs[b] * g_b^T a_b on
 * 128 x 256 tiles (warps of 64 x 64). The samples run in ascending
 * coefficient order (perm, from dcc_bk_order) and the accumulator is
 * rescaled between them (Horner, as grouped_tma.cu: acc <- acc * fac[k] +
 * X_(k), every factor <= 1, the group's last coefficient applied at the
 * end), so one register tile holds the weighted total: a second one for it
 * would not fit beside a 64 x 64 accumulator. One group: plain stores;
 * several: atomicAdd into a zeroed w. */
template <bool VEC>
__global__ void __launch_bounds__(NT, 1)
    tf32_clipped(const float *__restrict__ a, const float *__restrict__ g, int B, int T, int d,
                 int p, int tiles_n, int per_group, const int *__restrict__ perm,
                 const float *__restrict__ fac, const float *__restrict__ cs,
                 float *__restrict__ w) {
    extern __shared__ __align__(16) float fsm[];
    const int tm = (int)blockIdx.x / tiles_n, tn = (int)blockIdx.x % tiles_n;
    const int m0 = tm * F_BM, n0 = tn * C_BN;
    const int k0 = (int)blockIdx.y * per_group, k1 = min(B, k0 + per_group);
    if (k0 >= k1) return; /* uniform per CTA, before any barrier */
    const int ktn = (T + F_BK - 1) / F_BK, U = (k1 - k0) * ktn;
    const int warp = (int)threadIdx.x >> 5, lane = (int)threadIdx.x & 31;
    const int wm = (warp >> 2) * 64, wn = (warp & 3) * 64, gq = lane >> 2, tq = lane & 3;
    float acc[4][8][4];
    dcc_acc_zero(acc);

    auto load = [&](int u) {
        const int b = perm[k0 + u / ktn], kr = (u % ktn) * F_BK;
        float *sA = fsm + (u % F_ST) * C_STAGE;
        f_load<F_BK, F_BM, F_LD, VEC>(sA, g + (int64_t)b * T * p, p, kr, T, m0, p);
        f_load<F_BK, C_BN, C_LD, VEC>(sA + F_TILE, a + (int64_t)b * T * d, d, kr, T, n0, d);
    };
    dcc_cp_pipeline<F_ST>(U, load, [&](int u) {
        if (u > 0 && u % ktn == 0) { /* the next sample: rescale to its coefficient */
            const float f = fac[k0 + u / ktn];
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 8; j++)
#pragma unroll
                    for (int k = 0; k < 4; k++) acc[i][j][k] *= f;
        }
        const float *sA = fsm + (u % F_ST) * C_STAGE;
        mn_major_mma<8>(acc, sA, F_LD, sA + F_TILE, C_LD, wm, wn, gq, tq);
    });

    /* C fragment: c0, c1 at row gq, columns 2*tq, +1; c2, c3 at row gq + 8 */
    const float cl = cs[perm[k1 - 1]];
    const bool atomic = gridDim.y > 1;
#pragma unroll
    for (int mi = 0; mi < 4; mi++)
#pragma unroll
        for (int ni = 0; ni < 8; ni++)
#pragma unroll
            for (int k = 0; k < 4; k++) {
                int m = m0 + wm + mi * 16 + gq + (k >= 2 ? 8 : 0);
                int n = n0 + wn + ni * 8 + 2 * tq + (k & 1);
                if (m < p && n < d) {
                    const float v = cl * acc[mi][ni][k];
                    if (atomic) atomicAdd(w + (int64_t)m * d + n, v);
                    else w[(int64_t)m * d + n] = v;
                }
            }
}

template <bool VEC>
__global__ void __launch_bounds__(NT, 1)
    tf32_ghost(const float *__restrict__ a, const float *__restrict__ g, int T, int d, int p,
               int has_bias, float s2, float *__restrict__ n2) {
    extern __shared__ __align__(16) float fsm[];
    const int b = blockIdx.y, idx = (int)blockIdx.x;
    int ti, si;
    dcc_tri_pair(idx, &ti, &si);
    const int t0 = ti * Q_BT, s0 = si * Q_BT;
    const float *ab = a + (int64_t)b * T * d, *gb = g + (int64_t)b * T * p;
    const int ka = (d + Q_BK - 1) / Q_BK, kg = (p + Q_BK - 1) / Q_BK, U = ka + kg;
    const int warp = (int)threadIdx.x >> 5, lane = (int)threadIdx.x & 31;
    const int wm = (warp >> 2) * 64, wn = (warp & 3) * 32, gq = lane >> 2, tq = lane & 3;
    float acc[4][4][4], ga[4][4][4];
    dcc_acc_zero(acc);
    dcc_acc_zero(ga);

    auto load = [&](int u) {
        const bool first = u < ka;
        const float *x = first ? ab : gb;
        const int K = first ? d : p, k0 = (first ? u : u - ka) * Q_BK;
        float *sX = fsm + (u % Q_ST) * 2 * Q_TILE;
        f_load<Q_BT, Q_BK, Q_LD, VEC>(sX, x, K, t0, T, k0, K);
        f_load<Q_BT, Q_BK, Q_LD, VEC>(sX + Q_TILE, x, K, s0, T, k0, K);
    };
    dcc_cp_pipeline<Q_ST>(U, load, [&](int u) {
        const float *sX = fsm + (u % Q_ST) * 2 * Q_TILE, *sY = sX + Q_TILE;
#pragma unroll
        for (int kk = 0; kk < Q_BK; kk += 8) {
            uint32_t af[4][4], bf[4][2];
#pragma unroll
            for (int mi = 0; mi < 4; mi++) {
                const float *pa = sX + (wm + mi * 16 + gq) * Q_LD + kk + tq;
                af[mi][0] = to_tf32(pa[0]);
                af[mi][1] = to_tf32(pa[8 * Q_LD]);
                af[mi][2] = to_tf32(pa[4]);
                af[mi][3] = to_tf32(pa[8 * Q_LD + 4]);
            }
#pragma unroll
            for (int ni = 0; ni < 4; ni++) {
                const float *pb = sY + (wn + ni * 8 + gq) * Q_LD + kk + tq;
                bf[ni][0] = to_tf32(pb[0]);
                bf[ni][1] = to_tf32(pb[4]);
            }
            dcc_warp_mma(acc, af, bf, tf32_mma{});
        }
        if (u == ka - 1) { /* the a Gram tile is complete: keep it, start g's */
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 4; j++)
#pragma unroll
                    for (int k = 0; k < 4; k++) {
                        ga[i][j][k] = acc[i][j][k];
                        acc[i][j][k] = 0.0f;
                    }
        }
    });
    float part = 0.0f, gsum = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int k = 0; k < 4; k++) {
                part += ga[i][j][k] * acc[i][j][k];
                gsum += acc[i][j][k];
            }
    if (has_bias) part += gsum;
    float tot = dcc_block_sum(part);
    if (threadIdx.x == 0) atomicAdd(n2 + b, tot * s2 * (ti == si ? 1.0f : 2.0f));
}

bool vec_ok(const dcc_linear *L) {
    return ((uintptr_t)L->a & 15u) == 0 && ((uintptr_t)L->g & 15u) == 0 && L->d % 4 == 0 &&
           L->p % 4 == 0;
}

template <bool VEC>
cudaError_t launch_norms(const dcc_linear *L, dc_algo algo, float s2, float *n2, cudaStream_t st) {
    cudaError_t e;
    if (algo == DC_ALGO_DIRECT) {
        int tiles_m = (L->p + F_BM - 1) / F_BM, tiles_n = (L->d + F_BN - 1) / F_BN;
        if ((int64_t)tiles_m * tiles_n > INT32_MAX) return cudaErrorInvalidConfiguration;
        auto kern = tf32_direct<VEC>;
        if ((e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, F_SMEM)))
            return e;
        dim3 grid((unsigned)(tiles_m * tiles_n), (unsigned)L->B);
        kern<<<grid, NT, F_SMEM, st>>>((const float *)L->a, (const float *)L->g, L->T, L->d, L->p,
                                       tiles_n, L->has_bias, s2, n2);
    } else {
        if (VEC) {
            if ((e = dcc_linear_ghost_wgmma_tf32(L, s2, n2, st)) != cudaErrorNotSupported) return e;
            (void)cudaGetLastError(); /* no tensor map: mma.sync */
        }
        int64_t nt = (L->T + Q_BT - 1) / Q_BT, pairs = nt * (nt + 1) / 2;
        if (pairs > INT32_MAX / 2) return cudaErrorInvalidConfiguration;
        if ((e = cudaFuncSetAttribute(tf32_ghost<VEC>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      Q_SMEM)))
            return e;
        dim3 grid((unsigned)pairs, (unsigned)L->B);
        tf32_ghost<VEC><<<grid, NT, Q_SMEM, st>>>((const float *)L->a, (const float *)L->g, L->T,
                                                  L->d, L->p, L->has_bias, s2, n2);
    }
    return cudaGetLastError();
}

template <bool VEC>
cudaError_t launch_clip(const dcc_linear *L, const float *cs, int *perm, float *fac, float *w,
                        cudaStream_t st) {
    cudaError_t e = dcc_bk_order(cs, 1, L->B, perm, fac, st);
    if (e != cudaSuccess) return e;
    /* on wgmma where it runs */
    if (VEC && (e = dcc_tf32_clipped_wgmma(L, cs, perm, fac, w, st)) != cudaErrorNotSupported)
        return e;
    (void)cudaGetLastError();
    int tiles_m = (L->p + F_BM - 1) / F_BM, tiles_n = (L->d + C_BN - 1) / C_BN;
    if ((int64_t)tiles_m * tiles_n > INT32_MAX / 2) return cudaErrorInvalidConfiguration;
    int groups, per;
    if ((e = dcc_clip_groups(tiles_m * tiles_n, L->B, &groups, &per))) return e;
    if (groups > 1 && (e = cudaMemsetAsync(w, 0, (size_t)L->p * L->d * sizeof(float), st)))
        return e;
    auto kern = tf32_clipped<VEC>;
    if ((e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, C_SMEM)))
        return e;
    dim3 grid((unsigned)(tiles_m * tiles_n), (unsigned)groups);
    kern<<<grid, NT, C_SMEM, st>>>((const float *)L->a, (const float *)L->g, L->B, L->T, L->d, L->p,
                                   tiles_n, per, perm, fac, cs, w);
    return cudaGetLastError();
}

} // namespace

extern "C" cudaError_t dcc_linear_tf32(const dcc_linear *L, dc_algo algo, float s2, float *n2,
                                       cudaStream_t st) {
    if (L->ta != DC_F32 || L->tg != DC_F32) return cudaErrorInvalidValue;
    return vec_ok(L) ? launch_norms<true>(L, algo, s2, n2, st)
                     : launch_norms<false>(L, algo, s2, n2, st);
}

extern "C" cudaError_t dcc_linear_clipped_tf32(const dcc_linear *L, const float *cs, int *perm,
                                               float *fac, float *w, cudaStream_t st) {
    if (L->ta != DC_F32 || L->tg != DC_F32 || L->B <= 0 || L->T <= 0 || L->d <= 0 || L->p <= 0)
        return cudaErrorInvalidValue;
    return vec_ok(L) ? launch_clip<true>(L, cs, perm, fac, w, st)
                     : launch_clip<false>(L, cs, perm, fac, w, st);
}
