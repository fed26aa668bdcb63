/* LINEAR per-sample squared norms on Hopper's warpgroup MMA (wgmma, sm_90a),
 * fed by the Tensor Memory Accelerator: the two forms of norms_linear.cu
 * with the tensor cores reading shared memory through matrix descriptors
 * instead of mma.sync's register fragments (about twice the rate on an
 * H100), and the clipped sum's direct form. The ghost form's kernels are
 * in ghost_tma.cu, on the same pipeline (dcc_tma.cuh).
 *
 * A CTA is two consumer warpgroups (warps 0-7); each computes a 64*MI x 128
 * part of the CTA's f32 tile with m64n128k16 instructions (the direct norms'
 * 256-row tiles: 64 columns x 256 rows in m64n256k16, the wide form of
 * dcc_wgmma.cuh, whose squares sum alike). Tiles are
 * 128-byte rows with the 128B swizzle, the layout the descriptors name:
 *   direct: K = T; A = g_b^T and B = a_b both stored MN-major, [64 k][64
 *     features] blocks, transposed in the instruction;
 *   ghost: K = features; A and B are 128 rows of a_b (then g_b), K-major.
 * One producer warp (warp 8), lane 0, issues cp.async.bulk.tensor copies.
 * Each stage has two mbarriers: `full` (the producer arms it with the
 * stage's byte count; TMA completes it) and `empty` (each consumer warp
 * arrives once the MMAs that read the stage are done). Nobody else
 * synchronises inside the K loop.
 *
 * Tensor maps view an operand as [B][T][width] (innermost first: width, T,
 * B), so a box lands in shared memory in exactly the descriptors' layout;
 * rows past T and features past the width are zero-filled by TMA, which is
 * what the ragged tiles need. Boxes: direct 64 features x 64 rows, ghost 64
 * features x 128 rows. The producer warp is one warp beside 256 consumer
 * threads, so registers suffice without setmaxnreg: at most 168 a thread,
 * since three of the nine warps share each quarter of the register file
 * (tma_ghost_wide needs more, and has a producer warpgroup).
 *
 * Direct tiles cannot be split along K through global memory (a tile must
 * be complete before it is squared), so when too few tiles would leave SMs
 * idle in the last wave, a cluster of two CTAs splits K instead and adds the
 * halves through distributed shared memory (slice_sq; KS = 2; the kernel
 * takes any KS, but clusters of 4 measured slower on an H100: 1.75-1.87x
 * the GEMM against 1.46x for 2 on the (2,8192,768,3072) shape, when every
 * tile is split).
 * The hybrid plan splits only the last, partial wave: whole waves of tiles
 * run unsplit, then the tail on clusters of 2-6, which then have the GPU to
 * themselves (direct_plan.cu).
 *
 * Built only for sm_90a (the instructions do not exist elsewhere); on other
 * targets the kernels compile empty, dcc_wgmma_available says 0 and the
 * dispatcher uses the mma.sync kernels. An earlier cp.async-fed variant of
 * these kernels is gone: TMA serves every layer it served (16-byte rows,
 * bf16/f16), and tensor-map encoding only fails where it could not run. */
#include <stdlib.h>

#include <atomic>
#include <type_traits>

#include "dcc.h"
#include "dcc_path.h"
#include "dcc_tma.cuh"
#include "dcc_util.cuh"

namespace {

#ifndef DCC_WG_EMPTY

/* The bias's column sums spread over a row block's tiles (tma_direct with
 * bw): each tile sums the bias rows of every tiles_n-th k-tile, so that no
 * tile carries them all (the tiles of column 0 did, and ran a sixth longer
 * than the others: ncu, (1,16384,2048,2048), where that was the kernel's
 * time). This CTA's partial sums (bs0, bs1, as stage_issue leaves them)
 * are added into bw[b][m0 + c] (zeroed before the launch); done counts the
 * row block's k-tiles as its CTAs finish, and the CTA that completes
 * `total` reads the sums and adds their squares to n2[b]. Every thread of
 * the CTA calls it. */
template <int MI>
__device__ void bias_spread(float *colsum, float bs0, float bs1, bool summed, float *bw,
                            unsigned *done, int b, int m0, int p, int kn, int total, float s2,
                            float *n2) {
    constexpr int NC = 128 * MI;
    __shared__ int last;
    const int t = (int)threadIdx.x;
    if (summed) {
        if (t < 256) colsum_put<MI>(colsum, bs0, bs1);
        __syncthreads();
        if (t < NC && m0 + t < p)
            atomicAdd(bw + (int64_t)b * p + m0 + t, colsum_col<MI>(colsum, t));
    }
    __syncthreads();
    if (t == 0) {
        __threadfence(); /* the CTA's sums (ordered by the barrier) before its count */
        const unsigned old = atomicAdd(done, (unsigned)kn);
        last = kn > 0 && old + (unsigned)kn == (unsigned)total;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    float sq = 0.0f;
    if (t < NC && m0 + t < p) {
        const float v = __ldcg(bw + (int64_t)b * p + m0 + t);
        sq = v * v;
    }
    sq = dcc_block_sum(sq);
    if (t == 0) atomicAdd(n2 + b, sq * s2);
}

/* The sum of squares of this rank's KS-th of a tile split over a cluster:
 * each CTA's partial tile lies at x (shared memory, MI * 4096 float4s), and
 * every thread of the CTA takes a share of the rank's float4s, summed over
 * the KS ranks' copies. */
template <int MI, int KS> __device__ __forceinline__ float slice_sq(uint32_t x, int rank) {
    constexpr int N4 = MI * 16 * 256;
    uint32_t peer[KS];
    split_peers<KS>(x, peer);
    float s = 0.0f;
    for (int f = N4 * rank / KS + (int)threadIdx.x; f < N4 * (rank + 1) / KS; f += CT) {
        const float4 v = split_sum4<KS>(peer, f);
        s = fmaf(v.x, v.x, fmaf(v.y, v.y, fmaf(v.z, v.z, fmaf(v.w, v.w, s))));
    }
    return s;
}

/* KS > 1: the KS CTAs of a cluster split the tile's K range and exchange
 * their partial tiles through distributed shared memory: rank r sums the
 * r-th KS-th of the tile (slice_sq) and squares it; rank 0 also gathers the
 * bias column sums. SPREAD (with a bias and bw): the bias's sums spread
 * over the tiles (bias_spread); a template parameter, so that the kernels
 * without it are as they were. */
template <typename TI, int MI, int KS, bool SPREAD>
__global__ void __launch_bounds__(CT, 1)
    tma_direct(const __grid_constant__ CUtensorMap tg, const __grid_constant__ CUtensorMap ta,
               int T, int tiles_n, int tiles_b, int lin0, int has_bias, float s2,
               float *__restrict__ n2, float *bw, unsigned *bdone, int p) {
    constexpr int ST = tma_direct_stages<MI>(), SB = stage_bytes<MI>(), CW = 64 * MI;
    extern __shared__ unsigned char smem[];
    __shared__ __align__(8) uint64_t bar_mem[2 * ST];
    __shared__ __align__(16) float colsum[512];
    const uint32_t sbase = (dcc_smem(smem) + 1023u) & ~1023u;
    /* tiles are numbered over (sample, tile) from lin0, so that a launch can
     * take any run of them (the unsplit waves, then a split tail) */
    const int lin = lin0 + (int)blockIdx.x / KS, rank = (int)blockIdx.x % KS;
    const int b = lin / tiles_b, tile = lin % tiles_b;
    const int tm = tile / tiles_n, tn = tile % tiles_n;
    const int m0 = tm * 128 * MI, n0 = tn * 128;
    /* the bias's columns: summed by the tiles of column 0, or spread */
    constexpr bool spread = SPREAD;
    const bool do_bias = has_bias && !spread && tn == 0;
    const int ktn = (T + WBK - 1) / WBK;
    const int k0 = ktn * rank / KS, kn = ktn * (rank + 1) / KS - k0; /* this CTA's k-tiles */
    /* spread: how many of them are this tile's share of the bias's rows
     * (index tn modulo tiles_n) */
    auto below = [&](int k) { return k > tn ? (k - tn + tiles_n - 1) / tiles_n : 0; };
    const bool summed = spread && below(k0 + kn) > below(k0);
    (void)bw;
    /* A hybrid's tail launch may start on the SMs this launch frees (it
     * adds to n2 only, as this one does) once every CTA here has started. */
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
    const uint32_t bars = init_bars<ST>(bar_mem);
    float acc[MI][64];
    float bs0 = 0.0f, bs1 = 0.0f;

    if (threadIdx.x >= 256) { /* producer warp */
        if (threadIdx.x == 256) {
            for (int u = 0; u < kn; u++) {
                const int s = u % ST, kr = (k0 + u) * WBK;
                const uint32_t full = bars + 8u * (uint32_t)s, st = sbase + (uint32_t)(s * SB);
                mbar_wait(bars + 8u * (uint32_t)(ST + s), (uint32_t)(((u / ST) & 1) ^ 1));
                load_direct_stage<MI>(st, &tg, &ta, full, m0, n0, kr, b);
            }
        }
    } else {
        /* MI = 2: the wide form (dcc_wgmma.cuh), the tile transposed: squared and
         * summed, or added to a cluster peer's alike, its layout does not matter */
        consume<TI, true, MI, ST, MI == 2>(acc, sbase, bars, 0, kn, false, do_bias || summed, bs0,
                                           bs1, false, spread ? tiles_n : 1, spread ? tn : 0, k0);
    }
    if constexpr (spread)
        bias_spread<MI>(colsum, bs0, bs1, summed, bw, bdone + lin / tiles_n, b, m0, p, kn,
                        tiles_n * ktn, s2, n2);
    if (do_bias && threadIdx.x < 256) colsum_put<MI>(colsum, bs0, bs1);
    float sq;
    if constexpr (KS > 1) {
        /* every stage has been consumed: the pipeline memory holds each
         * rank's partial tile, thread-major; rank r then sums the r-th
         * KS-th of the tile over the ranks and squares it (the norm is a
         * sum over the tile's entries), so that the exchange is spread over
         * the cluster instead of rank 0 reading every peer's tile */
        __syncthreads();
        float4 *x = (float4 *)(smem + (sbase - dcc_smem(smem)));
        if (threadIdx.x < 256)
#pragma unroll
            for (int j = 0; j < MI; j++) split_stash(x, acc[j], j);
        cluster_sync();
        sq = slice_sq<MI, KS>(sbase, rank);
        if (rank == 0 && do_bias)
            for (int q = 1; q < KS; q++) {
                uint32_t r = map_rank(dcc_smem(colsum), (uint32_t)q);
                for (int i = (int)threadIdx.x; i < 512; i += CT)
                    colsum[i] += ld_cluster(r + 4u * (uint32_t)i);
            }
        cluster_sync(); /* the other ranks' shared memory must outlive the reads */
    } else {
        sq = threadIdx.x < 256 ? acc_sq(acc) : 0.0f;
    }
    if (do_bias && rank == 0) {
        __syncthreads();
        if ((int)threadIdx.x < 2 * CW) {
            const float x = colsum_col<MI>(colsum, (int)threadIdx.x);
            sq += x * x;
        }
    }
    float tot = dcc_block_sum(sq);
    if (threadIdx.x == 0) atomicAdd(n2 + b, tot * s2);
    grid_dep_wait();
}

/* Book-keeping for a LINEAR weight: w[p][d] (+)= sum_b cs[b] * g_b^T a_b,
 * the direct form's tiles and pipeline with the K loop running over the
 * samples [b0, b1) of blockIdx.y's group. Each sample's tile is folded into
 * an f32 total with its coefficient once its MMAs are complete, so the
 * per-sample scaling is exact and the client's tensors are read in place.
 * One group: plain stores; several: atomicAdd into a zeroed w. */
template <typename TI>
__global__ void __launch_bounds__(CT, 1)
    tma_clipped(const __grid_constant__ CUtensorMap tg, const __grid_constant__ CUtensorMap ta,
                int B, int T, int d, int p, int tiles_n, int per_group,
                const float *__restrict__ cs, float *__restrict__ w) {
    constexpr int ST = tma_direct_stages<1>(), SB = stage_bytes<1>();
    extern __shared__ unsigned char smem[];
    __shared__ __align__(8) uint64_t bar_mem[2 * ST];
    const uint32_t sbase = (dcc_smem(smem) + 1023u) & ~1023u;
    const int tm = (int)blockIdx.x / tiles_n, tn = (int)blockIdx.x % tiles_n;
    const int m0 = tm * 128, n0 = tn * 128;
    const int b0 = (int)blockIdx.y * per_group, b1 = min(B, b0 + per_group);
    const int ktn = (T + WBK - 1) / WBK;
    const uint32_t bars = init_bars<ST>(bar_mem);
    if (b0 >= b1) return; /* uniform per CTA, after the only CTA-wide barrier */

    if (threadIdx.x >= 256) {
        if (threadIdx.x == 256) {
            for (int u = 0; u < (b1 - b0) * ktn; u++) {
                const int s = u % ST, b = b0 + u / ktn, kr = (u % ktn) * WBK;
                const uint32_t full = bars + 8u * (uint32_t)s, st = sbase + (uint32_t)(s * SB);
                mbar_wait(bars + 8u * (uint32_t)(ST + s), (uint32_t)(((u / ST) & 1) ^ 1));
                load_direct_stage<1>(st, &tg, &ta, full, m0, n0, kr, b);
            }
        }
        return;
    }
    float acc[1][64], tot[64], x0 = 0.0f, x1 = 0.0f;
#pragma unroll
    for (int i = 0; i < 64; i++) tot[i] = 0.0f;
    for (int b = b0; b < b1; b++) {
        const int u0 = (b - b0) * ktn;
        consume<TI, true, 1, ST>(acc, sbase, bars, u0, u0 + ktn, false, false, x0, x1);
        const float c = cs[b];
#pragma unroll
        for (int i = 0; i < 64; i++) tot[i] += c * acc[0][i];
    }
    /* wgmma accumulator layout: warp w of the warpgroup holds rows 16w..+15;
     * register i is row lane/4 (+8 when i%4 >= 2), column 8*(i/4) +
     * 2*(lane%4) + i%2 */
    const int wg = (int)threadIdx.x >> 7, wq = ((int)threadIdx.x >> 5) & 3;
    const int lane = (int)threadIdx.x & 31;
    const bool atomic = gridDim.y > 1;
#pragma unroll
    for (int i = 0; i < 64; i++) {
        int m = m0 + wg * 64 + wq * 16 + (lane >> 2) + ((i & 2) ? 8 : 0);
        int n = n0 + (i >> 2) * 8 + (lane & 3) * 2 + (i & 1);
        if (m < p && n < d) {
            if (atomic) atomicAdd(w + (int64_t)m * d + n, tot[i]);
            else w[(int64_t)m * d + n] = tot[i];
        }
    }
}

#else

template <typename TI, int MI, int KS, bool SPREAD>
__global__ void tma_direct(const __grid_constant__ CUtensorMap, const __grid_constant__ CUtensorMap,
                           int, int, int, int, int, float, float *, float *, unsigned *, int) {}
template <typename TI>
__global__ void tma_clipped(const __grid_constant__ CUtensorMap,
                            const __grid_constant__ CUtensorMap, int, int, int, int, int, int,
                            const float *, float *) {}

#endif

/* The occupancy query's launch (max_clusters): the kernel without the
 * spread, whose resources the spread one shares. */
template <typename TI, int MI, int KS>
cudaError_t direct_config(cudaLaunchConfig_t &cfg, cudaLaunchAttribute *attr, unsigned ctas,
                          cudaStream_t st) {
    return tma_config(tma_direct<TI, MI, KS, false>, tma_direct_smem<MI>(), KS, cfg, attr, ctas,
                      st);
}

/* The spread bias's scratch (dcc_linear.bias_ws): [B][p] f32 sums, then a
 * count for each row block of 128-row tiles (256-row tiles use the first
 * half of theirs). */
size_t bias_sums_bytes(const dcc_linear *L) {
    return ((size_t)L->B * (size_t)L->p * 4 + 255) & ~(size_t)255;
}

/* Tiles [lin0, lin0 + n) of the (sample, tile) numbering, KS CTAs each. */
template <typename TI, int MI, int KS>
cudaError_t launch_direct(const dcc_linear *L, float s2, float *n2, cudaStream_t st, int64_t lin0,
                          int64_t n, bool after_unsplit) {
    CUtensorMap tg, ta;
    if (n <= 0) return cudaSuccess;
    if (!make_map(&tg, L->g, L->tg, L->B, L->T, L->p, 64) ||
        !make_map(&ta, L->a, L->ta, L->B, L->T, L->d, 64))
        return cudaErrorNotSupported;
    int tiles_m = (L->p + 128 * MI - 1) / (128 * MI), tiles_n = (L->d + 127) / 128;
    if ((int64_t)tiles_m * tiles_n * L->B > INT32_MAX || (lin0 + n) * KS > INT32_MAX)
        return cudaErrorInvalidConfiguration;
    cudaLaunchConfig_t cfg;
    cudaLaunchAttribute attr[2];
    float *bw = L->has_bias ? (float *)L->bias_ws : nullptr;
    unsigned *done = bw ? (unsigned *)((char *)bw + bias_sums_bytes(L)) : nullptr;
    auto kern = bw ? tma_direct<TI, MI, KS, true> : tma_direct<TI, MI, KS, false>;
    cudaError_t e = tma_config(kern, tma_direct_smem<MI>(), KS, cfg, attr, (unsigned)(n * KS), st);
    if (e != cudaSuccess) return e;
    if (after_unsplit) allow_overlap(L, cfg, attr);
    e = cudaLaunchKernelEx(&cfg, kern, tg, ta, L->T, tiles_n, tiles_m * tiles_n, (int)lin0,
                           (int)L->has_bias, s2, n2, bw, done, L->p);
    if (e != cudaSuccess) return e;
    return cudaGetLastError();
}

template <typename TI, int MI>
cudaError_t launch_direct_ks(const dcc_linear *L, float s2, float *n2, cudaStream_t st, int ks,
                             int64_t lin0, int64_t n, bool after_unsplit) {
    return with_ks(ks, [&](auto K) {
        return launch_direct<TI, MI, K.value>(L, s2, n2, st, lin0, n, after_unsplit);
    });
}

/* How many clusters of KS CTAs of the direct kernel fit the current device
 * at once (0 where it cannot be asked, or KS is 1). */
template <int MI, int KS> int max_clusters() {
    cudaLaunchConfig_t cfg;
    cudaLaunchAttribute attr[1];
    int n = 0;
    /* f16's resources are bf16's; a failed call's error is not left for the
     * next launch to report */
    if (KS < 2 || direct_config<dcc_bf16, MI, KS>(cfg, attr, KS, 0) != cudaSuccess ||
        cudaOccupancyMaxActiveClusters(&n, tma_direct<dcc_bf16, MI, KS, false>, &cfg) !=
            cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return n;
}

/* The direct form by its plan: every tile split alike, or the first `full`
 * tiles (whole waves) unsplit and the rest, a partial wave, split tail_ks
 * ways so that it takes a fraction of a wave's time. */
template <typename TI, int MI>
cudaError_t launch_direct_plan(const dcc_linear *L, const dcc_direct_plan *pl, float s2, float *n2,
                               cudaStream_t st) {
    int64_t total = (int64_t)((L->p + 128 * MI - 1) / (128 * MI)) * ((L->d + 127) / 128) * L->B;
    int sms;
    cudaError_t e = dcc_sm_count(&sms);
    if (e != cudaSuccess) return e;
    /* The bias's sums spread over the tiles only where its column-0 tiles
     * would set the launch's time: one wave, no tail. In longer launches
     * the scheduler absorbs them, and the spread's epilogue (its fence and
     * count at every tile's end) cost more: (8,2048,768,3072) 0.123-0.126
     * -> 0.133-0.135 ms spread, where (1,16384,2048,2048) went 0.228-0.230
     * -> 0.195-0.202 ms (H100). */
    dcc_linear Ls = *L;
    if (!(L->has_bias && L->bias_ws && pl->tail_ks < 2 && total * pl->split <= sms))
        Ls.bias_ws = nullptr;
    else if ((e = cudaMemsetAsync(L->bias_ws, 0, dcc_linear_bias_ws_bytes(L), st)))
        return e; /* its sums and counts start at 0 */
    L = &Ls;
    if (pl->tail_ks < 2) return launch_direct_ks<TI, MI>(L, s2, n2, st, pl->split, 0, total, false);
    int64_t full = pl->full < 0 ? 0 : pl->full > total ? total : pl->full;
    /* a persistent plan's whole waves: the grouped kernel's, 256-row tiles */
    e = pl->persist && MI == 2 ? dcc_linear_sqnorms_waves(L, full, s2, n2, st)
                               : launch_direct_ks<TI, MI>(L, s2, n2, st, 1, 0, full, false);
    if (e != cudaSuccess) return e;
    return launch_direct_ks<TI, MI>(L, s2, n2, st, pl->tail_ks, full, total - full, full > 0);
}

template <typename TI>
cudaError_t launch(const dcc_linear *L, dc_algo algo, float s2, float *n2, cudaStream_t st) {
    if (algo == DC_ALGO_DIRECT) {
        dcc_direct_plan pl;
        dcc_direct_plan_get(L, &pl);
        return pl.rows == 256 ? launch_direct_plan<TI, 2>(L, &pl, s2, n2, st)
                              : launch_direct_plan<TI, 1>(L, &pl, s2, n2, st);
    }
    return dcc_ghost_wgmma(L, s2, n2, st);
}

template <typename TI>
cudaError_t launch_clipped(const dcc_linear *L, const float *cs, float *w, cudaStream_t st) {
    CUtensorMap tg, ta;
    if (!make_map(&tg, L->g, L->tg, L->B, L->T, L->p, 64) ||
        !make_map(&ta, L->a, L->ta, L->B, L->T, L->d, 64))
        return cudaErrorNotSupported;
    int tiles_m = (L->p + 127) / 128, tiles_n = (L->d + 127) / 128, tiles = tiles_m * tiles_n;
    int groups, per;
    cudaError_t e = dcc_clip_groups(tiles, L->B, &groups, &per);
    if (e != cudaSuccess) return e;
    if (groups > 1 && (e = cudaMemsetAsync(w, 0, (size_t)L->p * L->d * sizeof(float), st)))
        return e;
    e = cudaFuncSetAttribute(tma_clipped<TI>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             tma_direct_smem<1>());
    if (e != cudaSuccess) return e;
    dim3 grid((unsigned)tiles, (unsigned)groups);
    tma_clipped<TI><<<grid, CT, tma_direct_smem<1>(), st>>>(tg, ta, L->B, L->T, L->d, L->p, tiles_n,
                                                            per, cs, w);
    return cudaGetLastError();
}

} // namespace

/* Cached per device, since the plan asks at every per-layer launch. */
extern "C" int dcc_direct_max_clusters(int rows, int ks) {
#ifdef DCC_WGMMA_BUILT
    enum { DEVS = 16, KSN = 7 };
    static std::atomic<int> cache[DEVS][2][KSN]; /* the count + 1; 0: not asked yet */
    int dev = 0;
    if (ks < 2 || ks >= KSN || cudaGetDevice(&dev) != cudaSuccess) return 0;
    std::atomic<int> *c = dev < DEVS ? &cache[dev][rows == 256][ks] : nullptr;
    if (int v = c ? c->load(std::memory_order_relaxed) : 0) return v - 1;
    const int n = with_ks(ks, [&](auto K) {
        return rows == 256 ? max_clusters<2, K.value>() : max_clusters<1, K.value>();
    });
    if (c) c->store(n + 1, std::memory_order_relaxed);
    return n;
#else
    (void)rows;
    (void)ks;
    return 0;
#endif
}

extern "C" size_t dcc_linear_bias_ws_bytes(const dcc_linear *L) {
    return bias_sums_bytes(L) + (size_t)L->B * (size_t)((L->p + 127) / 128) * 4;
}

extern "C" cudaError_t dcc_linear_clipped_tc(const dcc_linear *L, const float *cs, float *w,
                                             cudaStream_t st) {
#ifdef DCC_WGMMA_BUILT
    if (L->T < WBK || dcc_linear_path(L) != DCC_PATH_WGMMA) return cudaErrorNotSupported;
    if (L->ta == DC_BF16) return launch_clipped<dcc_bf16>(L, cs, w, st);
    return launch_clipped<dcc_f16>(L, cs, w, st);
#else
    (void)L;
    (void)cs;
    (void)w;
    (void)st;
    return cudaErrorNotSupported;
#endif
}

/* The wgmma kernels need sm_90a code, a device of compute capability 9.0
 * and the driver's tensor-map encoder; o->wgmma false selects the mma.sync
 * kernels (A/B checks). */
extern "C" int dcc_wgmma_available(const dcc_options *o) {
#ifdef DCC_WGMMA_BUILT
    int dev, major = 0, minor = 0;
    if ((o && !o->wgmma) || cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess)
        return 0;
    return major == 9 && minor == 0 && encode_fn() != nullptr;
#else
    (void)o;
    return 0;
#endif
}

extern "C" cudaError_t dcc_linear_wgmma(const dcc_linear *L, dc_algo algo, float s2, float *n2,
                                        cudaStream_t st) {
#ifdef DCC_WGMMA_BUILT
    if (L->ta == DC_BF16) return launch<dcc_bf16>(L, algo, s2, n2, st);
    if (L->ta == DC_F16) return launch<dcc_f16>(L, algo, s2, n2, st);
    return cudaErrorInvalidValue;
#else
    (void)L;
    (void)algo;
    (void)s2;
    (void)n2;
    (void)st;
    return cudaErrorNotSupported;
#endif
}
