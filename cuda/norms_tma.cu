/* LINEAR norms on wgmma fed by the Tensor Memory Accelerator: the kernels of
 * norms_wgmma.cu with a warp-specialised pipeline instead of every thread
 * issuing cp.async and meeting at a CTA barrier per k-tile.
 *
 * A CTA is two consumer warpgroups (warps 0-7, the MMAs, exactly as in
 * norms_wgmma.cu) and one producer warp (warp 8) whose lane 0 issues
 * cp.async.bulk.tensor copies. Each stage has two mbarriers: `full` (the
 * producer arms it with the stage's byte count; TMA completes it) and
 * `empty` (each consumer warp arrives once the MMAs that read the stage are
 * done). Nobody else synchronises inside the K loop.
 *
 * Tensor maps view an operand as [B][T][width] (innermost first: width, T,
 * B) with 128B swizzle, so a box lands in shared memory in exactly the
 * layout the wgmma descriptors expect; rows past T and features past the
 * width are zero-filled by TMA, which is what the ragged tiles need. Boxes:
 *   direct: 64 features x 64 rows (A = g, B = a, both MN-major);
 *   ghost:  64 features x 128 rows (K-major).
 * The producer warp is one warp beside 256 consumer threads, so registers
 * suffice without setmaxnreg (<= 224 per thread for 288 threads).
 *
 * Direct tiles cannot be split along K through global memory (a tile must
 * be complete before it is squared), so when too few tiles would leave SMs
 * idle in the last wave, a cluster of two CTAs splits K instead and adds the
 * halves through distributed shared memory (KS = 2; the kernel takes any KS,
 * but clusters of 4 measured slower on an H100: 1.75-1.87x the GEMM against
 * 1.46x for 2 on the (2,8192,768,3072) shape). */
#include <stdlib.h>
#include <string.h>

#include <cudaTypedefs.h>

#include "dcc_wgmma.cuh"

namespace {

constexpr int CT = 288; /* 8 consumer warps + 1 producer warp */

template <int MI> __host__ __device__ constexpr int tma_direct_stages() { return MI == 1 ? 6 : 4; }
constexpr int TG_ST = 6;
template <int MI> __host__ __device__ constexpr int tma_direct_smem() {
    return tma_direct_stages<MI>() * stage_bytes<MI>() + 1024;
}
constexpr int TG_SMEM = TG_ST * stage_bytes<1>() + 1024;

/* The grouped book-keeping kernel's parameters (see tma_bk_grouped). */
constexpr int BK_MAXL = 10; /* 384 bytes each: parameters within the classic 4 KiB */
struct bk_entry {
    CUtensorMap tg, ta;
    const float *cs;
    float *w, *bias;
    int T, d, p, tiles_n, item0, pad_;
};
struct bk_params {
    bk_entry e[BK_MAXL];
    int n, items, B;
};
static_assert(sizeof(bk_params) <= 4096, "kernel parameters beyond 4 KiB need CUDA 12.1+");

#ifndef DCC_WG_EMPTY

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar),
                 "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
    asm volatile("{\n.reg .pred P1;\nLAB_WAIT:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n"
                 "@P1 bra DONE;\nbra LAB_WAIT;\nDONE:\n}\n" ::"r"(bar),
                 "r"(parity)
                 : "memory");
}
__device__ __forceinline__ void tma_load3(uint32_t dst, const CUtensorMap *map, uint32_t bar,
                                          int c0, int c1, int c2) {
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%3, %4, %5}], [%2];\n" ::"r"(dst),
                 "l"((uint64_t)map), "r"(bar), "r"(c0), "r"(c1), "r"(c2)
                 : "memory");
}

__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::
                     : "memory");
}
/* The address of the same shared-memory location in CTA `rank` of the cluster. */
__device__ __forceinline__ uint32_t map_rank(uint32_t addr, uint32_t rank) {
    uint32_t r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(addr), "r"(rank));
    return r;
}
__device__ __forceinline__ float4 ld_cluster4(uint32_t addr) {
    float4 v;
    asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "r"(addr)
                 : "memory");
    return v;
}
__device__ __forceinline__ float ld_cluster(uint32_t addr) {
    float v;
    asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(addr) : "memory");
    return v;
}

/* Stage barriers live in static shared memory: full[s] at bars + 8s,
 * empty[s] at bars + 8(ST + s). */
template <int ST> __device__ __forceinline__ uint32_t init_bars(uint64_t *bars) {
    uint32_t b0 = dcc_smem(bars);
    if (threadIdx.x == 0) {
        for (int s = 0; s < ST; s++) {
            mbar_init(b0 + 8u * (uint32_t)s, 1);             /* the producer's arrive */
            mbar_init(b0 + 8u * (uint32_t)(ST + s), 8);      /* one per consumer warp */
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    return b0;
}

/* Consumer side: MMAs over k-tiles [u0, u1) of the CTA's stream into acc;
 * each tile's stage is released once its MMAs are known complete. DIRECT
 * with colsum: the bias column sums, as in norms_wgmma.cu. */
template <typename TI, bool DIRECT, int MI, int ST>
__device__ __forceinline__ void consume(float (&acc)[MI][64], uint32_t sbase, uint32_t bars,
                                        int u0, int u1, bool same_b, bool colsum, float &bs0,
                                        float &bs1) {
    constexpr int SB = stage_bytes<MI>(), CW = 64 * MI, RG = WBK / (4 / MI);
    const int wg = (int)threadIdx.x >> 7, lane = (int)threadIdx.x & 31;
#pragma unroll
    for (int j = 0; j < MI; j++)
#pragma unroll
        for (int i = 0; i < 64; i++) acc[j][i] = 0.0f;
    for (int u = u0; u < u1; u++) {
        const int s = u % ST;
        mbar_wait(bars + 8u * (uint32_t)s, (uint32_t)((u / ST) & 1));
        const uint32_t sA = sbase + (uint32_t)(s * SB);
        const uint32_t sB = same_b ? sA : sA + 2 * MI * HALF;
        acc_fence<MI>(acc);
        wg_fence();
        stage_mma<TI, DIRECT, MI>(acc, sA, sB, wg);
        wg_commit();
        acc_fence<MI>(acc);
        if (DIRECT && colsum) {
            int m = ((int)threadIdx.x % CW) * 2, rq = ((int)threadIdx.x / CW) * RG;
            uint32_t base = sA + (uint32_t)((m >> 6) * HALF);
            int ml = m & 63;
#pragma unroll
            for (int r = rq; r < rq + RG; r++) {
                uint32_t w = dcc_lds32(base + (uint32_t)(r * 128) +
                                       (uint32_t)((((ml >> 3) ^ (r & 7))) << 4) +
                                       (uint32_t)((ml & 7) * 2));
                bs0 += dcc_lo((const TI *)nullptr, w);
                bs1 += dcc_hi((const TI *)nullptr, w);
            }
        }
        wg_wait<1>();
        acc_fence<MI>(acc);
        __syncwarp();
        if (u > u0 && lane == 0) mbar_arrive(bars + 8u * (uint32_t)(ST + (u - 1) % ST));
    }
    wg_wait<0>();
    acc_fence<MI>(acc);
    __syncwarp();
    if (u1 > u0 && lane == 0) mbar_arrive(bars + 8u * (uint32_t)(ST + (u1 - 1) % ST));
}

/* KS > 1: the KS CTAs of a cluster split the tile's K range; ranks > 0
 * hand their partial tiles (and bias column sums) to rank 0 through
 * distributed shared memory, and rank 0 squares the sum. */
template <typename TI, int MI, int KS>
__global__ void __launch_bounds__(CT, 1)
tma_direct(const __grid_constant__ CUtensorMap tg, const __grid_constant__ CUtensorMap ta, int T,
           int tiles_n, int has_bias, float s2, float *__restrict__ n2) {
    constexpr int ST = tma_direct_stages<MI>(), SB = stage_bytes<MI>(), CW = 64 * MI;
    extern __shared__ unsigned char smem[];
    __shared__ __align__(8) uint64_t bar_mem[2 * ST];
    __shared__ __align__(16) float colsum[512];
    const uint32_t sbase = (dcc_smem(smem) + 1023u) & ~1023u;
    const int b = blockIdx.y, tile = (int)blockIdx.x / KS, rank = (int)blockIdx.x % KS;
    const int tm = tile / tiles_n, tn = tile % tiles_n;
    const int m0 = tm * 128 * MI, n0 = tn * 128;
    const bool do_bias = has_bias && tn == 0;
    const int ktn = (T + WBK - 1) / WBK;
    const int k0 = ktn * rank / KS, kn = ktn * (rank + 1) / KS - k0; /* this CTA's k-tiles */
    const uint32_t bars = init_bars<ST>(bar_mem);
    float acc[MI][64];
    float bs0 = 0.0f, bs1 = 0.0f;

    if (threadIdx.x >= 256) { /* producer warp */
        if (threadIdx.x == 256) {
            for (int u = 0; u < kn; u++) {
                const int s = u % ST, kr = (k0 + u) * WBK;
                const uint32_t full = bars + 8u * (uint32_t)s, st = sbase + (uint32_t)(s * SB);
                mbar_wait(bars + 8u * (uint32_t)(ST + s), (uint32_t)(((u / ST) & 1) ^ 1));
                mbar_expect_tx(full, SB);
#pragma unroll
                for (int h = 0; h < 2 * MI; h++)
                    tma_load3(st + (uint32_t)(h * HALF), &tg, full, m0 + 64 * h, kr, b);
#pragma unroll
                for (int h = 0; h < 2; h++)
                    tma_load3(st + (uint32_t)((2 * MI + h) * HALF), &ta, full, n0 + 64 * h, kr, b);
            }
        }
    } else {
        consume<TI, true, MI, ST>(acc, sbase, bars, 0, kn, false, do_bias, bs0, bs1);
    }
    if (do_bias && threadIdx.x < 256) {
        int m = ((int)threadIdx.x % CW) * 2, rq = (int)threadIdx.x / CW;
        colsum[rq * 2 * CW + m] = bs0;
        colsum[rq * 2 * CW + m + 1] = bs1;
    }
    if (KS > 1) {
        /* every stage has been consumed: the pipeline memory of ranks > 0
         * holds their partial tiles, thread-major so the reads are
         * contiguous; rank 0 adds them all */
        __syncthreads();
        float4 *x = (float4 *)(smem + (sbase - dcc_smem(smem)));
        if (rank > 0 && threadIdx.x < 256)
#pragma unroll
            for (int j = 0; j < MI; j++)
#pragma unroll
                for (int i = 0; i < 16; i++)
                    x[(j * 16 + i) * 256 + threadIdx.x] = make_float4(
                        acc[j][4 * i], acc[j][4 * i + 1], acc[j][4 * i + 2], acc[j][4 * i + 3]);
        cluster_sync();
        if (rank == 0) {
            for (int q = 1; q < KS; q++) {
                if (threadIdx.x < 256) {
                    uint32_t r = map_rank(sbase, (uint32_t)q);
#pragma unroll
                    for (int j = 0; j < MI; j++)
#pragma unroll
                        for (int i = 0; i < 16; i++) {
                            float4 v = ld_cluster4(
                                r + (uint32_t)(((j * 16 + i) * 256 + threadIdx.x) * 16));
                            acc[j][4 * i] += v.x;
                            acc[j][4 * i + 1] += v.y;
                            acc[j][4 * i + 2] += v.z;
                            acc[j][4 * i + 3] += v.w;
                        }
                }
                if (do_bias) {
                    uint32_t r = map_rank(dcc_smem(colsum), (uint32_t)q);
                    for (int i = (int)threadIdx.x; i < 512; i += CT)
                        colsum[i] += ld_cluster(r + 4u * (uint32_t)i);
                }
            }
        }
        cluster_sync(); /* the other ranks' shared memory must outlive the reads */
        if (rank > 0) return;
    }
    float sq = 0.0f;
    if (threadIdx.x < 256)
#pragma unroll
        for (int j = 0; j < MI; j++)
#pragma unroll
            for (int i = 0; i < 64; i++) sq += acc[j][i] * acc[j][i];
    if (do_bias) {
        __syncthreads();
        if ((int)threadIdx.x < 2 * CW) {
            float x = 0.0f;
#pragma unroll
            for (int q = 0; q < 4 / MI; q++) x += colsum[q * 2 * CW + (int)threadIdx.x];
            sq += x * x;
        }
    }
    float tot = dcc_block_sum(sq);
    if (threadIdx.x == 0) atomicAdd(n2 + b, tot * s2);
}

template <typename TI>
__global__ void __launch_bounds__(CT, 1)
tma_ghost(const __grid_constant__ CUtensorMap ta, const __grid_constant__ CUtensorMap tg, int d,
          int p, int has_bias, float s2, float *__restrict__ n2) {
    constexpr int ST = TG_ST, SB = stage_bytes<1>();
    extern __shared__ unsigned char smem[];
    __shared__ __align__(8) uint64_t bar_mem[2 * ST];
    const uint32_t sbase = (dcc_smem(smem) + 1023u) & ~1023u;
    const int b = blockIdx.y, idx = (int)blockIdx.x;
    int ti = (int)((sqrtf(8.0f * (float)idx + 1.0f) - 1.0f) * 0.5f);
    while (ti * (ti + 1) / 2 > idx) ti--;
    while ((ti + 1) * (ti + 2) / 2 <= idx) ti++;
    const int si = idx - ti * (ti + 1) / 2;
    const bool diag = ti == si;
    const int ka = (d + WBK - 1) / WBK, kg = (p + WBK - 1) / WBK;
    const uint32_t bars = init_bars<ST>(bar_mem);
    float part = 0.0f;

    if (threadIdx.x >= 256) {
        if (threadIdx.x == 256) {
            for (int u = 0; u < ka + kg; u++) {
                const int s = u % ST;
                const uint32_t full = bars + 8u * (uint32_t)s, st = sbase + (uint32_t)(s * SB);
                const CUtensorMap *map = u < ka ? &ta : &tg;
                const int c0 = (u < ka ? u : u - ka) * WBK;
                mbar_wait(bars + 8u * (uint32_t)(ST + s), (uint32_t)(((u / ST) & 1) ^ 1));
                mbar_expect_tx(full, diag ? 2 * HALF : 4 * HALF);
                tma_load3(st, map, full, c0, ti * 128, b);
                if (!diag) tma_load3(st + 2 * HALF, map, full, c0, si * 128, b);
            }
        }
    } else {
        float ga[1][64], gg[1][64], x0 = 0.0f, x1 = 0.0f;
        consume<TI, false, 1, ST>(ga, sbase, bars, 0, ka, diag, false, x0, x1);
        consume<TI, false, 1, ST>(gg, sbase, bars, ka, ka + kg, diag, false, x0, x1);
        float gsum = 0.0f;
#pragma unroll
        for (int i = 0; i < 64; i++) {
            part += ga[0][i] * gg[0][i];
            gsum += gg[0][i];
        }
        if (has_bias) part += gsum;
    }
    float tot = dcc_block_sum(part);
    if (threadIdx.x == 0) atomicAdd(n2 + b, tot * s2 * (diag ? 1.0f : 2.0f));
}

/* Book-keeping for a LINEAR weight: w[p][d] (+)= sum_b cs[b] * g_b^T a_b,
 * the direct form's tiles and pipeline with the K loop running over the
 * samples [b0, b1) of blockIdx.y's group. Each sample's tile is folded into
 * an f32 total with its coefficient once its MMAs are complete, so the
 * per-sample scaling is exact and the client's tensors are read in place.
 * One group: plain stores; several: atomicAdd into a zeroed w. */
template <typename TI>
__global__ void __launch_bounds__(CT, 1)
tma_clipped(const __grid_constant__ CUtensorMap tg, const __grid_constant__ CUtensorMap ta, int B,
            int T, int d, int p, int tiles_n, int per_group, const float *__restrict__ cs,
            float *__restrict__ w) {
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
                mbar_expect_tx(full, SB);
                tma_load3(st, &tg, full, m0, kr, b);
                tma_load3(st + HALF, &tg, full, m0 + 64, kr, b);
                tma_load3(st + 2 * HALF, &ta, full, n0, kr, b);
                tma_load3(st + 3 * HALF, &ta, full, n0 + 64, kr, b);
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


/* Grouped book-keeping (dcc_linear_clipped_grouped): the tensor maps of up to
 * BK_MAXL layers travel in the kernel parameters (__grid_constant__, so TMA
 * reads them in place); a persistent grid walks the work items
 * (layer, tile) in order, CTA i taking items i, i + grid, ... The producer
 * and consumers walk the same sequence, so one stage counter u runs across
 * items and the pipeline never drains between them: the producer already
 * loads the next item while the consumers store the last. */

__device__ __forceinline__ int bk_find(const bk_params &P, int item) {
    int lo = 0, hi = P.n - 1; /* last entry with item0 <= item */
    while (lo < hi) {
        int mid = (lo + hi + 1) >> 1;
        if (P.e[mid].item0 <= item) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

__device__ __forceinline__ void consumer_bar() { /* the 256 consumer threads only */
    asm volatile("bar.sync 1, 256;\n" ::: "memory");
}

template <typename TI>
__global__ void __launch_bounds__(CT, 1) tma_bk_grouped(const __grid_constant__ bk_params P) {
    constexpr int ST = tma_direct_stages<1>(), SB = stage_bytes<1>();
    extern __shared__ unsigned char smem[];
    __shared__ __align__(8) uint64_t bar_mem[2 * ST];
    __shared__ __align__(16) float colsum[4][128];
    const uint32_t sbase = (dcc_smem(smem) + 1023u) & ~1023u;
    const uint32_t bars = init_bars<ST>(bar_mem);
    const int B = P.B;

    if (threadIdx.x >= 256) { /* producer warp */
        if (threadIdx.x == 256) {
            int u = 0;
            for (int it = (int)blockIdx.x; it < P.items; it += (int)gridDim.x) {
                const bk_entry &E = P.e[bk_find(P, it)];
                const int tile = it - E.item0;
                const int m0 = (tile / E.tiles_n) * 128, n0 = (tile % E.tiles_n) * 128;
                const int ktn = (E.T + WBK - 1) / WBK;
                for (int b = 0; b < B; b++)
                    for (int kt = 0; kt < ktn; kt++, u++) {
                        const int s = u % ST, kr = kt * WBK;
                        const uint32_t full = bars + 8u * (uint32_t)s;
                        const uint32_t st = sbase + (uint32_t)(s * SB);
                        mbar_wait(bars + 8u * (uint32_t)(ST + s), (uint32_t)(((u / ST) & 1) ^ 1));
                        mbar_expect_tx(full, SB);
                        tma_load3(st, &E.tg, full, m0, kr, b);
                        tma_load3(st + HALF, &E.tg, full, m0 + 64, kr, b);
                        tma_load3(st + 2 * HALF, &E.ta, full, n0, kr, b);
                        tma_load3(st + 3 * HALF, &E.ta, full, n0 + 64, kr, b);
                    }
            }
        }
        return;
    }
    const int wg = (int)threadIdx.x >> 7, wq = ((int)threadIdx.x >> 5) & 3;
    const int lane = (int)threadIdx.x & 31;
    int u = 0;
    for (int it = (int)blockIdx.x; it < P.items; it += (int)gridDim.x) {
        const bk_entry &E = P.e[bk_find(P, it)];
        const int tile = it - E.item0, tn = tile % E.tiles_n;
        const int m0 = (tile / E.tiles_n) * 128, n0 = tn * 128;
        const int ktn = (E.T + WBK - 1) / WBK, d = E.d, p = E.p;
        const bool do_bias = E.bias != nullptr && tn == 0;
        float acc[1][64], tot[64], bt0 = 0.0f, bt1 = 0.0f;
#pragma unroll
        for (int i = 0; i < 64; i++) tot[i] = 0.0f;
        for (int b = 0; b < B; b++) {
            float bs0 = 0.0f, bs1 = 0.0f;
            consume<TI, true, 1, ST>(acc, sbase, bars, u, u + ktn, false, do_bias, bs0, bs1);
            u += ktn;
            const float c = E.cs[b];
#pragma unroll
            for (int i = 0; i < 64; i++) tot[i] += c * acc[0][i];
            bt0 += c * bs0;
            bt1 += c * bs1;
        }
        /* accumulator layout as in tma_clipped; register pairs (i, i+1) are
         * adjacent columns, stored as float2 (d is a multiple of 8) */
        float *w = E.w;
#pragma unroll
        for (int i = 0; i < 64; i += 2) {
            int m = m0 + wg * 64 + wq * 16 + (lane >> 2) + ((i & 2) ? 8 : 0);
            int n = n0 + (i >> 2) * 8 + (lane & 3) * 2;
            if (m < p && n < d)
                *(float2 *)(w + (int64_t)m * d + n) = make_float2(tot[i], tot[i + 1]);
        }
        if (do_bias) {
            /* column sums: thread owns columns 2*(tid%64), +1 of row quarter tid/64 */
            int m = ((int)threadIdx.x & 63) * 2, rq = (int)threadIdx.x >> 6;
            colsum[rq][m] = bt0;
            colsum[rq][m + 1] = bt1;
            consumer_bar();
            if (threadIdx.x < 128 && m0 + (int)threadIdx.x < p) {
                int c = (int)threadIdx.x;
                E.bias[m0 + c] = colsum[0][c] + colsum[1][c] + colsum[2][c] + colsum[3][c];
            }
            consumer_bar(); /* colsum is free for the next item */
        }
    }
}

#else

template <typename TI, int MI, int KS>
__global__ void tma_direct(const __grid_constant__ CUtensorMap, const __grid_constant__ CUtensorMap,
                           int, int, int, float, float *) {}
template <typename TI>
__global__ void tma_ghost(const __grid_constant__ CUtensorMap, const __grid_constant__ CUtensorMap,
                          int, int, int, float, float *) {}
template <typename TI>
__global__ void tma_clipped(const __grid_constant__ CUtensorMap, const __grid_constant__ CUtensorMap,
                            int, int, int, int, int, int, const float *, float *) {}
template <typename TI> __global__ void tma_bk_grouped(const __grid_constant__ bk_params) {}

#endif

PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
    /* resolved once through the runtime, so nothing links libcuda */
    static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
        void *p = nullptr;
        cudaDriverEntryPointQueryResult q;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000,
                                             cudaEnableDefault, &q) != cudaSuccess ||
            q != cudaDriverEntryPointSuccess) {
            (void)cudaGetLastError();
            p = nullptr;
        }
        return (PFN_cuTensorMapEncodeTiled_v12000)p;
    }();
    return fn;
}

/* [B][T][w] 16-bit tensor, boxes of 64 features x rows. */
bool make_map(CUtensorMap *m, const void *base, dc_dtype t, int B, int T, int w, int rows) {
    PFN_cuTensorMapEncodeTiled_v12000 fn = encode_fn();
    if (!fn) return false;
    cuuint64_t dims[3] = {(cuuint64_t)w, (cuuint64_t)T, (cuuint64_t)B};
    cuuint64_t strides[2] = {(cuuint64_t)w * 2, (cuuint64_t)w * (cuuint64_t)T * 2};
    cuuint32_t box[3] = {64, (cuuint32_t)rows, 1};
    cuuint32_t es[3] = {1, 1, 1};
    return fn(m, t == DC_BF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
              3, (void *)base, dims, strides, box, es, CU_TENSOR_MAP_INTERLEAVE_NONE,
              CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
              CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

template <typename TI, int MI, int KS>
cudaError_t launch_direct(const dcc_linear *L, float s2, float *n2, cudaStream_t st) {
    CUtensorMap tg, ta;
    if (!make_map(&tg, L->g, L->tg, L->B, L->T, L->p, 64) ||
        !make_map(&ta, L->a, L->ta, L->B, L->T, L->d, 64))
        return cudaErrorNotSupported;
    int tiles_m = (L->p + 128 * MI - 1) / (128 * MI), tiles_n = (L->d + 127) / 128;
    if ((int64_t)tiles_m * tiles_n * KS > INT32_MAX) return cudaErrorInvalidConfiguration;
    auto kern = tma_direct<TI, MI, KS>;
    cudaError_t e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         tma_direct_smem<MI>());
    if (e != cudaSuccess) return e;
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute attr[1];
    cfg.gridDim = dim3((unsigned)(tiles_m * tiles_n * KS), (unsigned)L->B);
    cfg.blockDim = dim3(CT);
    cfg.dynamicSmemBytes = tma_direct_smem<MI>();
    cfg.stream = st;
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = KS;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = KS > 1 ? 1 : 0;
    e = cudaLaunchKernelEx(&cfg, kern, tg, ta, L->T, tiles_n, (int)L->has_bias, s2, n2);
    if (e != cudaSuccess) return e;
    return cudaGetLastError();
}

template <typename TI>
cudaError_t launch(const dcc_linear *L, dc_algo algo, float s2, float *n2, cudaStream_t st) {
    if (algo == DC_ALGO_DIRECT) {
        int split = dcc_direct_split(L), rows = dcc_direct_tile_rows(L);
        if (rows == 256)
            return split == 2 ? launch_direct<TI, 2, 2>(L, s2, n2, st)
                              : launch_direct<TI, 2, 1>(L, s2, n2, st);
        return split == 2 ? launch_direct<TI, 1, 2>(L, s2, n2, st)
                          : launch_direct<TI, 1, 1>(L, s2, n2, st);
    }
    CUtensorMap ta, tg;
    if (!make_map(&ta, L->a, L->ta, L->B, L->T, L->d, 128) ||
        !make_map(&tg, L->g, L->tg, L->B, L->T, L->p, 128))
        return cudaErrorNotSupported;
    int64_t nt = (L->T + 127) / 128, pairs = nt * (nt + 1) / 2;
    if (pairs > INT32_MAX / 2) return cudaErrorInvalidConfiguration;
    cudaError_t e =
        cudaFuncSetAttribute(tma_ghost<TI>, cudaFuncAttributeMaxDynamicSharedMemorySize, TG_SMEM);
    if (e != cudaSuccess) return e;
    dim3 grid((unsigned)pairs, (unsigned)L->B);
    tma_ghost<TI><<<grid, CT, TG_SMEM, st>>>(ta, tg, L->d, L->p, L->has_bias, s2, n2);
    return cudaGetLastError();
}

template <typename TI>
cudaError_t launch_clipped(const dcc_linear *L, const float *cs, float *w, cudaStream_t st) {
    CUtensorMap tg, ta;
    if (!make_map(&tg, L->g, L->tg, L->B, L->T, L->p, 64) ||
        !make_map(&ta, L->a, L->ta, L->B, L->T, L->d, 64))
        return cudaErrorNotSupported;
    int dev = 0, sms = 132;
    if (cudaGetDevice(&dev) == cudaSuccess)
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    int tiles_m = (L->p + 127) / 128, tiles_n = (L->d + 127) / 128, tiles = tiles_m * tiles_n;
    /* enough CTAs for two waves: groups of samples, summed with atomics */
    int groups = (2 * sms + tiles - 1) / tiles;
    if (groups > L->B) groups = L->B;
    if (groups < 1) groups = 1;
    int per = (L->B + groups - 1) / groups;
    groups = (L->B + per - 1) / per;
    cudaError_t e;
    if (groups > 1 && (e = cudaMemsetAsync(w, 0, (size_t)L->p * L->d * sizeof(float), st)))
        return e;
    e = cudaFuncSetAttribute(tma_clipped<TI>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             tma_direct_smem<1>());
    if (e != cudaSuccess) return e;
    dim3 grid((unsigned)tiles, (unsigned)groups);
    tma_clipped<TI><<<grid, CT, tma_direct_smem<1>(), st>>>(tg, ta, L->B, L->T, L->d, L->p,
                                                           tiles_n, per, cs, w);
    return cudaGetLastError();
}


int sms_now() {
    int dev = 0, sms = 132;
    if (cudaGetDevice(&dev) == cudaSuccess)
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    return sms;
}

template <typename TI>
cudaError_t launch_grouped(const dcc_bk_layer *ls, int n, cudaStream_t st) {
    bk_params P; /* the launch copies it */
    cudaError_t e = cudaFuncSetAttribute(tma_bk_grouped<TI>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         tma_direct_smem<1>());
    if (e != cudaSuccess) return e;
    memset(&P, 0, sizeof P);
    int64_t items = 0;
    for (int i = 0; i < n; i++) {
        const dcc_linear *L = &ls[i].L;
        bk_entry &E = P.e[i];
        if (!make_map(&E.tg, L->g, L->tg, L->B, L->T, L->p, 64) ||
            !make_map(&E.ta, L->a, L->ta, L->B, L->T, L->d, 64))
            return cudaErrorNotSupported;
        E.cs = ls[i].cs;
        E.w = ls[i].w;
        E.bias = ls[i].bias;
        E.T = L->T;
        E.d = L->d;
        E.p = L->p;
        E.tiles_n = (L->d + 127) / 128;
        E.item0 = (int)items;
        items += (int64_t)((L->p + 127) / 128) * E.tiles_n;
        if (items > INT32_MAX / 2) return cudaErrorInvalidConfiguration;
    }
    P.n = n;
    P.items = (int)items;
    P.B = ls[0].L.B;
    if (items == 0) return cudaSuccess;
    int sms = sms_now();
    unsigned grid = (unsigned)(items < sms ? items : sms);
    tma_bk_grouped<TI><<<grid, CT, tma_direct_smem<1>(), st>>>(P);
    return cudaGetLastError();
}

} // namespace

extern "C" cudaError_t dcc_linear_clipped_tc(const dcc_linear *L, const float *cs, float *w,
                                             cudaStream_t st) {
#ifdef DCC_WGMMA_BUILT
    if (L->T < WBK || dcc_linear_path(L) != 3 || !dcc_tma_available())
        return cudaErrorNotSupported;
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

extern "C" int dcc_bk_grouped_ok(const dcc_linear *L) {
#ifdef DCC_WGMMA_BUILT
    return L->T >= WBK && L->ta == L->tg && dcc_linear_path(L) == 3 && dcc_tma_available();
#else
    (void)L;
    return 0;
#endif
}

extern "C" cudaError_t dcc_linear_clipped_grouped(const dcc_bk_layer *ls, int n,
                                                  cudaStream_t st) {
#ifdef DCC_WGMMA_BUILT
    for (int i = 0; i < n; i++)
        if (!dcc_bk_grouped_ok(&ls[i].L) || ls[i].L.B != ls[0].L.B || !ls[i].w)
            return cudaErrorNotSupported;
    /* chunks of at most BK_MAXL layers of one dtype */
    int i = 0;
    while (i < n) {
        int j = 1;
        while (j < BK_MAXL && i + j < n && ls[i + j].L.ta == ls[i].L.ta) j++;
        cudaError_t e = ls[i].L.ta == DC_BF16 ? launch_grouped<dcc_bf16>(ls + i, j, st)
                                              : launch_grouped<dcc_f16>(ls + i, j, st);
        if (e != cudaSuccess) return e;
        i += j;
    }
    return cudaSuccess;
#else
    (void)ls;
    (void)n;
    (void)st;
    return cudaErrorNotSupported;
#endif
}

extern "C" int dcc_tma_available(void) {
#ifdef DCC_WGMMA_BUILT
    static const int env = [] { /* DPCLIP_CUDA_TMA=0 selects the cp.async feed */
        const char *s = getenv("DPCLIP_CUDA_TMA");
        return !(s && s[0] == '0');
    }();
    return env && encode_fn() != nullptr;
#else
    return 0;
#endif
}

extern "C" cudaError_t dcc_linear_tma(const dcc_linear *L, dc_algo algo, float s2, float *n2,
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
