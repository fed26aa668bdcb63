/* LINEAR per-sample squared norms on Hopper's warpgroup MMA (wgmma, sm_90a),
 * fed by the Tensor Memory Accelerator: the two forms of norms_linear.cu
 * with the tensor cores reading shared memory through matrix descriptors
 * instead of mma.sync's register fragments (about twice the rate on an
 * H100), and the clipped sum's direct form.
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
 * halves through distributed shared memory (KS = 2; the kernel takes any KS,
 * but clusters of 4 measured slower on an H100: 1.75-1.87x the GEMM against
 * 1.46x for 2 on the (2,8192,768,3072) shape, when every tile is split).
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

#include "dcc_path.h"
#include "dcc_tma.cuh"
#include "dcc_util.cuh"

namespace {

#ifndef DCC_WG_EMPTY

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

/* The end of a tail launch made with programmatic stream serialization
 * (launch_direct): it waits for the unsplit launch before it, so that work
 * queued after it is ordered after both (a no-op in other launches). */
__device__ __forceinline__ void grid_dep_wait() {
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
}

/* KS > 1: the KS CTAs of a cluster split the tile's K range; ranks > 0
 * hand their partial tiles (and bias column sums) to rank 0 through
 * distributed shared memory, and rank 0 squares the sum. */
template <typename TI, int MI, int KS>
__global__ void __launch_bounds__(CT, 1)
tma_direct(const __grid_constant__ CUtensorMap tg, const __grid_constant__ CUtensorMap ta, int T,
           int tiles_n, int tiles_b, int lin0, int has_bias, float s2, float *__restrict__ n2) {
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
    const bool do_bias = has_bias && tn == 0;
    const int ktn = (T + WBK - 1) / WBK;
    const int k0 = ktn * rank / KS, kn = ktn * (rank + 1) / KS - k0; /* this CTA's k-tiles */
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
        /* MI = 2: the wide form (dcc_wgmma.cuh), the tile transposed: squared and
         * summed, or added to a cluster peer's alike, its layout does not matter */
        consume<TI, true, MI, ST, MI == 2>(acc, sbase, bars, 0, kn, false, do_bias, bs0, bs1);
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
        if (rank > 0) {
            grid_dep_wait();
            return;
        }
    }
    float sq = threadIdx.x < 256 ? acc_sq(acc) : 0.0f;
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
    grid_dep_wait();
}

/* The split ghost item's exchange (KS > 1; every thread of the CTA calls
 * it): ranks > 0 leave their partial Gram blocks in their pipeline memory,
 * free once every stage is consumed, thread-major so that the reads are
 * contiguous (2 x 64 KiB of the 192); rank 0 adds them to its own. */
template <int KS>
__device__ __forceinline__ void ghost_gather(float (&ga)[1][64], float (&gg)[1][64],
                                             unsigned char *smem, uint32_t sbase, int rank) {
    const int t = (int)threadIdx.x;
    __syncthreads();
    float4 *x = (float4 *)(smem + (sbase - dcc_smem(smem)));
    if (rank > 0 && t < 256)
#pragma unroll
        for (int i = 0; i < 16; i++) {
            x[i * 256 + t] = make_float4(ga[0][4 * i], ga[0][4 * i + 1], ga[0][4 * i + 2],
                                         ga[0][4 * i + 3]);
            x[(16 + i) * 256 + t] = make_float4(gg[0][4 * i], gg[0][4 * i + 1],
                                                gg[0][4 * i + 2], gg[0][4 * i + 3]);
        }
    cluster_sync();
    if (rank == 0 && t < 256)
        for (int q = 1; q < KS; q++) {
            const uint32_t r = map_rank(sbase, (uint32_t)q);
#pragma unroll
            for (int i = 0; i < 32; i++) {
                float4 v = ld_cluster4(r + (uint32_t)((i * 256 + t) * 16));
                float *acc = i < 16 ? &ga[0][4 * i] : &gg[0][4 * (i - 16)];
                acc[0] += v.x;
                acc[1] += v.y;
                acc[2] += v.z;
                acc[3] += v.w;
            }
        }
    cluster_sync(); /* the peers' shared memory must outlive the reads */
}

/* The ghost form. An item is (sample b, tile pair (ti, si)) of the lower
 * triangle, numbered sample-major: two short GEMMs, the Gram blocks of a
 * over K = d, then of g over K = p (24-160 k-steps at the benchmark's
 * widths), and the sum of their product.
 *   KS = 1: persistent; each CTA takes items it0 + blockIdx, + G, ... with
 *     one stage ring across them, so that the next pair's loads run during
 *     a pair's epilogue (a CTA a pair paid its setup, fill and epilogue with
 *     the tensor cores idle).
 *   KS > 1: the hybrid's tail (dcc_ghost_plan_get): a cluster of KS CTAs
 *     takes one item, each rank 1/KS of both K ranges; ranks > 0 hand their
 *     partial Gram blocks to rank 0 through distributed shared memory (the
 *     blocks are sums over K; their product is not), so that a partial last
 *     wave of items fills KS times the SMs for 1/KS of an item's time. */
template <typename TI, int KS>
__global__ void __launch_bounds__(CT, 1)
tma_ghost(const __grid_constant__ CUtensorMap ta, const __grid_constant__ CUtensorMap tg, int d,
          int p, int pairs, int it0, int n_items, int has_bias, float s2, float *__restrict__ n2) {
    constexpr int ST = TG_ST, SB = stage_bytes<1>();
    extern __shared__ unsigned char smem[];
    __shared__ __align__(8) uint64_t bar_mem[2 * ST];
    const uint32_t sbase = (dcc_smem(smem) + 1023u) & ~1023u;
    constexpr int KB = stage_k<TI>();
    const int ka = (d + KB - 1) / KB, kg = (p + KB - 1) / KB;
    const int rank = KS > 1 ? (int)blockIdx.x % KS : 0;
    /* this CTA's k-steps: [a0, a0 + na) of a's, then [g0, g0 + ng) of g's */
    const int a0 = ka * rank / KS, na = ka * (rank + 1) / KS - a0;
    const int g0 = kg * rank / KS, ng = kg * (rank + 1) / KS - g0;
    const int first = it0 + (int)blockIdx.x / KS, step = (int)gridDim.x / KS, end = it0 + n_items;
    /* the plan's next launch may start on the SMs this launch frees */
    if (KS == 1) asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
    const uint32_t bars = init_bars<ST>(bar_mem);

    if (threadIdx.x >= 256) { /* producer warp */
        if (threadIdx.x == 256) {
            int u = 0;
            for (int it = first; it < end; it += step) {
                const int b = it / pairs;
                int ti, si;
                dcc_tri_pair(it % pairs, &ti, &si);
                const bool diag = ti == si;
                for (int v = 0; v < na + ng; v++, u++) {
                    const int s = u % ST;
                    const uint32_t full = bars + 8u * (uint32_t)s, st = sbase + (uint32_t)(s * SB);
                    const CUtensorMap *map = v < na ? &ta : &tg;
                    const int c0 = (v < na ? a0 + v : g0 + v - na) * KB;
                    mbar_wait(bars + 8u * (uint32_t)(ST + s), (uint32_t)(((u / ST) & 1) ^ 1));
                    mbar_expect_tx(full, diag ? 2 * HALF : 4 * HALF);
                    tma_load3(st, map, full, c0, ti * 128, b);
                    if (!diag) tma_load3(st + 2 * HALF, map, full, c0, si * 128, b);
                }
            }
        }
        if (KS == 1) return; /* a split CTA's producer takes part in the exchange */
    }
    int u = 0;
    for (int it = first; it < end; it += step) {
        const int b = it / pairs;
        int ti, si;
        dcc_tri_pair(it % pairs, &ti, &si);
        const bool diag = ti == si;
        float ga[1][64], gg[1][64], x0 = 0.0f, x1 = 0.0f;
        if (threadIdx.x < 256) {
            consume<TI, false, 1, ST>(ga, sbase, bars, u, u + na, diag, false, x0, x1);
            consume<TI, false, 1, ST>(gg, sbase, bars, u + na, u + na + ng, diag, false, x0, x1);
            u += na + ng;
        }
        if constexpr (KS > 1) { /* one item a cluster */
            ghost_gather<KS>(ga, gg, smem, sbase, rank);
            if (rank > 0) break;
        }
        if (threadIdx.x >= 256) continue;
        /* the block's sum of ga .* gg (and of gg: the bias's norm); four
         * independent sums, as acc_sq */
        float part[4] = {0.0f, 0.0f, 0.0f, 0.0f}, gsum[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int i = 0; i < 64; i++) {
            part[i & 3] = fmaf(ga[0][i], gg[0][i], part[i & 3]);
            gsum[i & 3] += gg[0][i];
        }
        float v = (part[0] + part[1]) + (part[2] + part[3]);
        if (has_bias) v += (gsum[0] + gsum[1]) + (gsum[2] + gsum[3]);
        v = dcc_warp_sum(v); /* by warp: the producer warp may have left */
        if ((threadIdx.x & 31) == 0) atomicAdd(n2 + b, v * s2 * (diag ? 1.0f : 2.0f));
    }
    grid_dep_wait(); /* after an overlapped launch: the work after this one waits for both */
}

/* The sum of n .* w over a consumer thread's share of two Gram blocks, plus
 * that of w (bias 1) or n (bias 2): the bias's norm. Four independent sums,
 * as acc_sq. */
__device__ __forceinline__ float ghost_dot(const float (&n)[64], const float (&w)[64], int bias) {
    float part[4] = {0.0f, 0.0f, 0.0f, 0.0f}, sum[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int i = 0; i < 64; i++) {
        part[i & 3] = fmaf(n[i], w[i], part[i & 3]);
        sum[i & 3] += bias == 1 ? w[i] : n[i];
    }
    float x = (part[0] + part[1]) + (part[2] + part[3]);
    return bias ? x + ((sum[0] + sum[1]) + (sum[2] + sum[3])) : x;
}

/* The ghost form's wide items (dcc_wide_pair): row block ti (128 rows)
 * against the 256 rows of blocks s0 = 2 sj and s0 + 1, so that the Gram
 * block of the operand with more k-steps (tw, kw of them) runs in m64n256
 * instructions: a third fewer operand bytes a flop than tma_ghost's 128 x
 * 128 blocks, whose operand loads kept the tensor cores waiting. The other
 * operand's Gram blocks (tn, kn) follow in two m64n128 halves, one per
 * column block, each summed against its half of the wide block at once, so
 * that at most 192 accumulators are live. Block s0 + 1 may lie past T
 * (zero-filled) or above the diagonal: its half then counts 0 times, a
 * diagonal block once and one below it twice (the lower triangle). bias:
 * 1 the bias's norm is the sum of the wide Gram blocks (g is tw), 2 of the
 * narrow ones, 0 none. One item a CTA: items take 1 or 2 narrow passes,
 * and the scheduler evens that out. The 192 live accumulators need more
 * registers than a CTA of 9 warps may hold (168: three warps share each
 * quarter of the register file), so the producer is a whole warpgroup that
 * gives its registers to the consumers (setmaxnreg). */
template <typename TI>
__global__ void __launch_bounds__(CT_WIDE, 1)
tma_ghost_wide(const __grid_constant__ CUtensorMap tw, const __grid_constant__ CUtensorMap tn,
               int kw, int kn, int per_b, int bias, float s2, float *__restrict__ n2) {
    constexpr int ST = tma_direct_stages<2>(), SB = stage_bytes<2>();
    extern __shared__ unsigned char smem[];
    __shared__ __align__(8) uint64_t bar_mem[2 * ST];
    const uint32_t sbase = (dcc_smem(smem) + 1023u) & ~1023u;
    constexpr int KB = stage_k<TI>();
    const int b = (int)blockIdx.x / per_b;
    int ti, sj;
    dcc_wide_pair((int)blockIdx.x % per_b, &ti, &sj);
    const int s0 = 2 * sj;
    const int w0 = s0 < ti ? 2 : 1, w1 = s0 + 1 < ti ? 2 : s0 + 1 == ti ? 1 : 0;
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory"); /* the pairs' launch */
    const uint32_t bars = init_bars<ST>(bar_mem);

    if (threadIdx.x >= 256) { /* producer warpgroup */
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
        if (threadIdx.x == 256) {
            int u = 0;
            auto next = [&](uint32_t bytes) { /* the next stage, armed */
                const int s = u % ST;
                mbar_wait(bars + 8u * (uint32_t)(ST + s), (uint32_t)(((u / ST) & 1) ^ 1));
                mbar_expect_tx(bars + 8u * (uint32_t)s, bytes);
                u++;
                return s;
            };
            for (int v = 0; v < kw; v++) { /* [256 rows of s0, s0 + 1][128 rows of ti] */
                const int s = next(6 * HALF);
                const uint32_t full = bars + 8u * (uint32_t)s, st = sbase + (uint32_t)(s * SB);
                tma_load3(st, &tw, full, v * KB, s0 * 128, b);
                tma_load3(st + 2 * HALF, &tw, full, v * KB, s0 * 128 + 128, b);
                tma_load3(st + 4 * HALF, &tw, full, v * KB, ti * 128, b);
            }
            for (int h = 0; h < 2; h++) { /* [128 rows of ti][128 rows of s0 + h] */
                if (h == 1 && !w1) break;
                const bool diag = s0 + h == ti;
                for (int v = 0; v < kn; v++) {
                    const int s = next(diag ? 2 * HALF : 4 * HALF);
                    const uint32_t full = bars + 8u * (uint32_t)s, st = sbase + (uint32_t)(s * SB);
                    tma_load3(st, &tn, full, v * KB, ti * 128, b);
                    if (!diag) tma_load3(st + 2 * HALF, &tn, full, v * KB, (s0 + h) * 128, b);
                }
            }
        }
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
    float gw[2][64], gn[1][64], x0 = 0.0f, x1 = 0.0f, v = 0.0f;
    consume<TI, false, 2, ST, true>(gw, sbase, bars, 0, kw, false, false, x0, x1);
    const int u = kw;
    consume<TI, false, 1, ST, false, SB>(gn, sbase, bars, u, u + kn, s0 == ti, false, x0, x1);
    v = (float)w0 * ghost_dot(gn[0], gw[0], bias);
    if (w1) {
        consume<TI, false, 1, ST, false, SB>(gn, sbase, bars, u + kn, u + 2 * kn, s0 + 1 == ti,
                                             false, x0, x1);
        v += (float)w1 * ghost_dot(gn[0], gw[1], bias);
    }
    v = dcc_warp_sum(v); /* by warp: the producer warp has left */
    if ((threadIdx.x & 31) == 0) atomicAdd(n2 + b, v * s2);
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


#else

template <typename TI, int MI, int KS>
__global__ void tma_direct(const __grid_constant__ CUtensorMap, const __grid_constant__ CUtensorMap,
                           int, int, int, int, int, float, float *) {}
template <typename TI, int KS>
__global__ void tma_ghost(const __grid_constant__ CUtensorMap, const __grid_constant__ CUtensorMap,
                          int, int, int, int, int, int, float, float *) {}
template <typename TI>
__global__ void tma_ghost_wide(const __grid_constant__ CUtensorMap,
                               const __grid_constant__ CUtensorMap, int, int, int, int, float,
                               float *) {}
template <typename TI>
__global__ void tma_clipped(const __grid_constant__ CUtensorMap, const __grid_constant__ CUtensorMap,
                            int, int, int, int, int, int, const float *, float *) {}

#endif

/* The launch of `ctas` CTAs of `kernel` with `smem` bytes of dynamic shared
 * memory in clusters of ks (attr[0] holds the cluster shape; the caller may
 * add attributes after cfg.numAttrs), that shared memory allowed first. */
template <typename K>
cudaError_t tma_config(K kernel, int smem, int ks, cudaLaunchConfig_t &cfg,
                       cudaLaunchAttribute *attr, unsigned ctas, cudaStream_t st,
                       int threads = CT) {
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess) return e;
    cfg = {};
    cfg.gridDim = dim3(ctas);
    cfg.blockDim = dim3((unsigned)threads);
    cfg.dynamicSmemBytes = (size_t)smem;
    cfg.stream = st;
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = (unsigned)ks;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = ks > 1 ? 1 : 0;
    return cudaSuccess;
}

/* A split tail's launch may start as the unsplit launch before it frees
 * SMs, not after its last CTA (its kernel's griddepcontrol.wait keeps the
 * order for the work after it). */
void allow_overlap(const dcc_linear *L, cudaLaunchConfig_t &cfg, cudaLaunchAttribute *attr) {
    if (!dcc_pdl_on(L->opt)) return;
    attr[cfg.numAttrs].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[cfg.numAttrs].val.programmaticStreamSerializationAllowed = 1;
    cfg.numAttrs++;
}

template <typename TI, int MI, int KS>
cudaError_t direct_config(cudaLaunchConfig_t &cfg, cudaLaunchAttribute *attr, unsigned ctas,
                          cudaStream_t st) {
    return tma_config(tma_direct<TI, MI, KS>, tma_direct_smem<MI>(), KS, cfg, attr, ctas, st);
}

/* Tiles [lin0, lin0 + n) of the (sample, tile) numbering, KS CTAs each. */
template <typename TI, int MI, int KS>
cudaError_t launch_direct(const dcc_linear *L, float s2, float *n2, cudaStream_t st,
                          int64_t lin0, int64_t n, bool after_unsplit) {
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
    cudaError_t e = direct_config<TI, MI, KS>(cfg, attr, (unsigned)(n * KS), st);
    if (e != cudaSuccess) return e;
    if (after_unsplit) allow_overlap(L, cfg, attr);
    e = cudaLaunchKernelEx(&cfg, tma_direct<TI, MI, KS>, tg, ta, L->T, tiles_n, tiles_m * tiles_n, (int)lin0,
                           (int)L->has_bias, s2, n2);
    if (e != cudaSuccess) return e;
    return cudaGetLastError();
}

/* f(std::integral_constant<int, KS>()) for KS = ks, one of the tail
 * cluster sizes direct_plan.cu plans (DIRECT_KS), else for KS = 1. */
template <typename F> auto with_ks(int ks, F f) {
    switch (ks) {
    case 6: return f(std::integral_constant<int, 6>());
    case 4: return f(std::integral_constant<int, 4>());
    case 3: return f(std::integral_constant<int, 3>());
    case 2: return f(std::integral_constant<int, 2>());
    default: return f(std::integral_constant<int, 1>());
    }
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
        cudaOccupancyMaxActiveClusters(&n, tma_direct<dcc_bf16, MI, KS>, &cfg) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return n;
}

/* The direct form by its plan: every tile split alike, or the first `full`
 * tiles (whole waves) unsplit and the rest, a partial wave, split tail_ks
 * ways so that it takes a fraction of a wave's time. */
template <typename TI, int MI>
cudaError_t launch_direct_plan(const dcc_linear *L, const dcc_direct_plan *pl, float s2,
                               float *n2, cudaStream_t st) {
    int64_t total = (int64_t)((L->p + 128 * MI - 1) / (128 * MI)) * ((L->d + 127) / 128) * L->B;
    if (pl->tail_ks < 2)
        return launch_direct_ks<TI, MI>(L, s2, n2, st, pl->split, 0, total, false);
    int64_t full = pl->full < 0 ? 0 : pl->full > total ? total : pl->full;
    cudaError_t e = launch_direct_ks<TI, MI>(L, s2, n2, st, 1, 0, full, false);
    if (e != cudaSuccess) return e;
    return launch_direct_ks<TI, MI>(L, s2, n2, st, pl->tail_ks, full, total - full, full > 0);
}

/* Items [it0, it0 + n) of the ghost form: KS = 1 on persistent CTAs, at
 * most one an SM; KS > 1 one item a cluster of KS. */
template <typename TI, int KS>
cudaError_t launch_ghost_ks(const dcc_linear *L, const CUtensorMap &ta, const CUtensorMap &tg,
                            int pairs, int64_t it0, int64_t n, bool after_unsplit, float s2,
                            float *n2, cudaStream_t st) {
    if (n <= 0) return cudaSuccess;
    int sms;
    cudaError_t e = dcc_sm_count(&sms);
    if (e != cudaSuccess) return e;
    cudaLaunchConfig_t cfg;
    cudaLaunchAttribute attr[2];
    const int64_t ctas = KS == 1 ? (n < sms ? n : sms) : n * KS;
    e = tma_config(tma_ghost<TI, KS>, TG_SMEM, KS, cfg, attr, (unsigned)ctas, st);
    if (e != cudaSuccess) return e;
    if (after_unsplit) allow_overlap(L, cfg, attr);
    e = cudaLaunchKernelEx(&cfg, tma_ghost<TI, KS>, ta, tg, L->d, L->p, pairs, (int)it0, (int)n,
                           (int)L->has_bias, s2, n2);
    if (e != cudaSuccess) return e;
    return cudaGetLastError();
}

/* The first n wide items of the ghost form, one a CTA. The operand with
 * more k-steps takes the wide Gram blocks. */
template <typename TI>
cudaError_t launch_ghost_wide(const dcc_linear *L, int64_t n, float s2, float *n2,
                              cudaStream_t st) {
    if (n <= 0) return cudaSuccess;
    constexpr int KB = stage_k<TI>();
    const int ka = (L->d + KB - 1) / KB, kg = (L->p + KB - 1) / KB;
    const bool g_wide = kg >= ka;
    CUtensorMap tw, tn;
    if (!make_map(&tw, g_wide ? L->g : L->a, g_wide ? L->tg : L->ta, L->B, L->T,
                  g_wide ? L->p : L->d, 128) ||
        !make_map(&tn, g_wide ? L->a : L->g, g_wide ? L->ta : L->tg, L->B, L->T,
                  g_wide ? L->d : L->p, 128))
        return cudaErrorNotSupported;
    cudaLaunchConfig_t cfg;
    cudaLaunchAttribute attr[1];
    cudaError_t e = tma_config(tma_ghost_wide<TI>, tma_direct_smem<2>(), 1, cfg, attr,
                               (unsigned)n, st, CT_WIDE);
    if (e != cudaSuccess) return e;
    e = cudaLaunchKernelEx(&cfg, tma_ghost_wide<TI>, tw, tn, g_wide ? kg : ka, g_wide ? ka : kg,
                           (int)dcc_wide_count((L->T + 127) / 128),
                           L->has_bias ? (g_wide ? 1 : 2) : 0, s2, n2);
    if (e != cudaSuccess) return e;
    return cudaGetLastError();
}

/* The ghost form by its plan (dcc_ghost_plan_get): wide items, then pairs
 * on persistent CTAs, then a split tail, each launch free to start on the
 * SMs the one before it frees. */
template <typename TI> cudaError_t launch_ghost(const dcc_linear *L, float s2, float *n2, cudaStream_t st) {
    CUtensorMap ta, tg;
    if (!make_map(&ta, L->a, L->ta, L->B, L->T, L->d, 128) ||
        !make_map(&tg, L->g, L->tg, L->B, L->T, L->p, 128))
        return cudaErrorNotSupported;
    int64_t nt = (L->T + 127) / 128, pairs = nt * (nt + 1) / 2, items = pairs * L->B;
    if (items > INT32_MAX / 6) return cudaErrorInvalidConfiguration; /* CTAs of a 6-way tail */
    dcc_ghost_plan pl;
    dcc_ghost_plan_get(L, &pl);
    cudaError_t e = cudaSuccess;
    if constexpr (sizeof(TI) == 2) e = launch_ghost_wide<TI>(L, pl.wide, s2, n2, st);
    if (e != cudaSuccess) return e;
    const int64_t first = pl.first, full = pl.full < first ? first : pl.full;
    e = launch_ghost_ks<TI, 1>(L, ta, tg, (int)pairs, first, full - first, first > 0, s2, n2, st);
    if (e != cudaSuccess || full >= items) return e;
    return with_ks(pl.tail_ks, [&](auto K) {
        return launch_ghost_ks<TI, K.value>(L, ta, tg, (int)pairs, full, items - full, full > 0,
                                            s2, n2, st);
    });
}

template <typename TI>
cudaError_t launch(const dcc_linear *L, dc_algo algo, float s2, float *n2, cudaStream_t st) {
    if (algo == DC_ALGO_DIRECT) {
        dcc_direct_plan pl;
        dcc_direct_plan_get(L, &pl);
        return pl.rows == 256 ? launch_direct_plan<TI, 2>(L, &pl, s2, n2, st)
                              : launch_direct_plan<TI, 1>(L, &pl, s2, n2, st);
    }
    return launch_ghost<TI>(L, s2, n2, st);
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
    tma_clipped<TI><<<grid, CT, tma_direct_smem<1>(), st>>>(tg, ta, L->B, L->T, L->d, L->p,
                                                           tiles_n, per, cs, w);
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

extern "C" cudaError_t dcc_linear_clipped_tc(const dcc_linear *L, const float *cs, float *w,
                                             cudaStream_t st) {
#ifdef DCC_WGMMA_BUILT
    if (L->T < WBK || dcc_linear_path(L) != DCC_PATH_WGMMA)
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

extern "C" cudaError_t dcc_linear_ghost_wgmma_tf32(const dcc_linear *L, float s2, float *n2,
                                                   cudaStream_t st) {
#ifdef DCC_WGMMA_BUILT
    if (L->ta != DC_F32 || L->tg != DC_F32 || !dcc_wgmma_available(L->opt))
        return cudaErrorNotSupported;
    return launch_ghost<float>(L, s2, n2, st);
#else
    (void)L;
    (void)s2;
    (void)n2;
    (void)st;
    return cudaErrorNotSupported;
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
