/* LINEAR per-sample squared norms in the ghost form on Hopper's warpgroup
 * MMA (sm_90a), fed by TMA (the pipeline of dcc_tma.cuh): per sample, the
 * sum over the lower triangle of 128-row blocks (t, s) of <A_ts, G_ts>,
 * A = a_b a_b^T and G = g_b g_b^T (their Gram blocks over K = d and K = p,
 * K-major operands: 128 rows of a_b, then of g_b), twice off the diagonal,
 * plus, with a bias, the sum of G's blocks (the bias's norm). The work runs
 * as dcc_ghost_plan_get (direct_plan.cu) plans it: wide items (16-bit: a
 * row block against two column blocks), then pairs on persistent CTAs,
 * then a split tail. bf16, f16, and f32 on TF32 (whose wgmma takes K-major
 * operands, which the ghost form's are). Built only for sm_90a; elsewhere
 * the kernels compile empty and dcc_wgmma_available says 0. */
#include <type_traits>

#include "dcc.h"
#include "dcc_tma.cuh"
#include "dcc_util.cuh"

namespace {

#ifndef DCC_WG_EMPTY

/* The split ghost item's exchange (KS > 1; every thread of the CTA calls
 * it): each rank leaves its partial Gram blocks in its pipeline memory,
 * free once every stage is consumed, thread-major so that the reads are
 * contiguous (2 x 64 KiB of the 192); rank r then sums the r-th KS-th of
 * both blocks over the ranks and returns this thread's share of their
 * product's sum (and of g's block's: the bias's norm). The sum over the
 * block's entries splits by entries, so the exchange is spread over the
 * cluster instead of rank 0 reading every peer's blocks. */
template <int KS>
__device__ __forceinline__ float ghost_slice(const float (&ga)[1][64], const float (&gg)[1][64],
                                             unsigned char *smem, uint32_t sbase, int rank,
                                             int has_bias) {
    constexpr int N4 = 16 * 256; /* float4s of one block */
    const int t = (int)threadIdx.x;
    __syncthreads();
    float4 *x = (float4 *)(smem + (sbase - dcc_smem(smem)));
    if (t < 256) {
        split_stash(x, ga[0], 0);
        split_stash(x, gg[0], 1);
    }
    cluster_sync();
    uint32_t peer[KS];
    split_peers<KS>(sbase, peer);
    float part = 0.0f, gs = 0.0f;
    for (int f = N4 * rank / KS + t; f < N4 * (rank + 1) / KS; f += CT) {
        const float4 a = split_sum4<KS>(peer, f), g = split_sum4<KS>(peer, N4 + f);
        part = fmaf(a.x, g.x, fmaf(a.y, g.y, fmaf(a.z, g.z, fmaf(a.w, g.w, part))));
        gs += (g.x + g.y) + (g.z + g.w);
    }
    cluster_sync(); /* the peers' shared memory must outlive the reads */
    return has_bias ? part + gs : part;
}

/* Item it of the ghost form's pairs, numbered over samples: its sample b,
 * its blocks (ti, si) (dcc_tri_pair), whether it is on the diagonal. */
struct ghost_item {
    int b, ti, si;
    bool diag;
};
__device__ __forceinline__ ghost_item ghost_item_at(int it, int pairs) {
    ghost_item x;
    x.b = it / pairs;
    dcc_tri_pair(it % pairs, &x.ti, &x.si);
    x.diag = x.ti == x.si;
    return x;
}

/* The sum of n .* w over a consumer thread's share of two Gram blocks,
 * plus (with_w: the bias's norm) that of w. Four independent sums, as
 * acc_sq; w's sum is taken either way, so that no selector runs per
 * element in the epilogue, which holds up the tensor cores. */
__device__ __forceinline__ float ghost_dot(const float (&n)[64], const float (&w)[64],
                                           bool with_w) {
    float part[4] = {0.0f, 0.0f, 0.0f, 0.0f}, sum[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int i = 0; i < 64; i++) {
        part[i & 3] = fmaf(n[i], w[i], part[i & 3]);
        sum[i & 3] += w[i];
    }
    float x = (part[0] + part[1]) + (part[2] + part[3]);
    return with_w ? x + ((sum[0] + sum[1]) + (sum[2] + sum[3])) : x;
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
 *     takes one item, each rank 1/KS of both K ranges; the ranks exchange
 *     their partial Gram blocks through distributed shared memory (the
 *     blocks are sums over K; their product is not), each summing a KS-th
 *     of them (ghost_slice), so that a partial last wave of items fills KS
 *     times the SMs for 1/KS of an item's time. */
template <typename TI, int KS>
__global__ void __launch_bounds__(CT, 1)
    tma_ghost(const __grid_constant__ CUtensorMap ta, const __grid_constant__ CUtensorMap tg, int d,
              int p, int pairs, int it0, int n_items, int has_bias, float s2,
              float *__restrict__ n2) {
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
                const ghost_item x = ghost_item_at(it, pairs);
                for (int v = 0; v < na + ng; v++, u++) {
                    const int s = u % ST;
                    const uint32_t full = bars + 8u * (uint32_t)s, st = sbase + (uint32_t)(s * SB);
                    const CUtensorMap *map = v < na ? &ta : &tg;
                    const int c0 = (v < na ? a0 + v : g0 + v - na) * KB;
                    mbar_wait(bars + 8u * (uint32_t)(ST + s), (uint32_t)(((u / ST) & 1) ^ 1));
                    mbar_expect_tx(full, x.diag ? 2 * HALF : 4 * HALF);
                    tma_load3(st, map, full, c0, x.ti * 128, x.b);
                    if (!x.diag) tma_load3(st + 2 * HALF, map, full, c0, x.si * 128, x.b);
                }
            }
        }
        if (KS == 1) return; /* a split CTA's producer takes part in the exchange */
    }
    int u = 0;
    for (int it = first; it < end; it += step) {
        const ghost_item x = ghost_item_at(it, pairs);
        float ga[1][64], gg[1][64], x0 = 0.0f, x1 = 0.0f;
        if (threadIdx.x < 256) {
            consume<TI, false, 1, ST>(ga, sbase, bars, u, u + na, x.diag, false, x0, x1);
            consume<TI, false, 1, ST>(gg, sbase, bars, u + na, u + na + ng, x.diag, false, x0, x1);
            u += na + ng;
        }
        if constexpr (KS > 1) { /* one item a cluster */
            float v = dcc_warp_sum(ghost_slice<KS>(ga, gg, smem, sbase, rank, has_bias));
            if ((threadIdx.x & 31) == 0) atomicAdd(n2 + x.b, v * s2 * (x.diag ? 1.0f : 2.0f));
            break;
        }
        if (threadIdx.x >= 256) continue;
        /* the block's sum of ga .* gg (and of gg: the bias's norm), by warp:
         * the producer warp may have left */
        const float v = dcc_warp_sum(ghost_dot(ga[0], gg[0], has_bias));
        if ((threadIdx.x & 31) == 0) atomicAdd(n2 + x.b, v * s2 * (x.diag ? 1.0f : 2.0f));
    }
    grid_dep_wait(); /* after an overlapped launch: the work after this one waits for both */
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
 * narrow ones, 0 none (ghost_dot sums its second block: the product is
 * symmetric). One item a CTA: items take 1 or 2 narrow passes,
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
                                              mbar_wait(bars + 8u * (uint32_t)(ST + s),
                                                        (uint32_t)(((u / ST) & 1) ^ 1));
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
    /* the bias's block second (bias 2: the narrow one) */
    auto dot = [bias](const float(&nb)[64], const float(&wb)[64]) {
        return bias == 2 ? ghost_dot(wb, nb, true) : ghost_dot(nb, wb, bias == 1);
    };
    v = (float)w0 * dot(gn[0], gw[0]);
    if (w1) {
        consume<TI, false, 1, ST, false, SB>(gn, sbase, bars, u + kn, u + 2 * kn, s0 + 1 == ti,
                                             false, x0, x1);
        v += (float)w1 * dot(gn[0], gw[1]);
    }
    v = dcc_warp_sum(v); /* by warp: the producer warp has left */
    if ((threadIdx.x & 31) == 0) atomicAdd(n2 + b, v * s2);
}

#else

template <typename TI, int KS>
__global__ void tma_ghost(const __grid_constant__ CUtensorMap, const __grid_constant__ CUtensorMap,
                          int, int, int, int, int, int, float, float *) {}
template <typename TI>
__global__ void tma_ghost_wide(const __grid_constant__ CUtensorMap,
                               const __grid_constant__ CUtensorMap, int, int, int, int, float,
                               float *) {}

#endif

/* Items [it0, it0 + n) of the ghost form: KS = 1 on persistent CTAs, at
 * most one an SM; KS > 1 one item a cluster of KS. */
template <typename TI, int KS>
cudaError_t launch_ghost_ks(const dcc_linear *L, const CUtensorMap &ta, const CUtensorMap &tg,
                            int pairs, int64_t it0, int64_t n, bool after_unsplit, float s2,
                            float *n2, cudaStream_t st) {
    if (n <= 0) return cudaSuccess;
    int64_t ctas = n * KS;
    cudaError_t e;
    if (KS == 1) { /* persistent: at most one CTA an SM */
        int sms;
        if ((e = dcc_sm_count(&sms)) != cudaSuccess) return e;
        if (ctas > sms) ctas = sms;
    }
    cudaLaunchConfig_t cfg;
    cudaLaunchAttribute attr[2];
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
    cudaError_t e = tma_config(tma_ghost_wide<TI>, tma_direct_smem<2>(), 1, cfg, attr, (unsigned)n,
                               st, CT_WIDE);
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
template <typename TI>
cudaError_t launch_ghost(const dcc_linear *L, float s2, float *n2, cudaStream_t st) {
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
        return launch_ghost_ks<TI, K.value>(L, ta, tg, (int)pairs, full, items - full, full > 0, s2,
                                            n2, st);
    });
}

} // namespace

extern "C" cudaError_t dcc_ghost_wgmma(const dcc_linear *L, float s2, float *n2, cudaStream_t st) {
#ifdef DCC_WGMMA_BUILT
    switch (L->ta) {
    case DC_BF16: return launch_ghost<dcc_bf16>(L, s2, n2, st);
    case DC_F16: return launch_ghost<dcc_f16>(L, s2, n2, st);
    case DC_F32: /* the TF32 path asks without knowing whether wgmma runs */
        if (L->tg != DC_F32 || !dcc_wgmma_available(L->opt)) return cudaErrorNotSupported;
        return launch_ghost<float>(L, s2, n2, st);
    default: return cudaErrorInvalidValue;
    }
#else
    (void)L;
    (void)s2;
    (void)n2;
    (void)st;
    return cudaErrorNotSupported;
#endif
}

extern "C" cudaError_t dcc_linear_ghost_wgmma_tf32(const dcc_linear *L, float s2, float *n2,
                                                   cudaStream_t st) {
    if (L->ta != DC_F32 || L->tg != DC_F32) return cudaErrorNotSupported;
    return dcc_ghost_wgmma(L, s2, n2, st);
}
