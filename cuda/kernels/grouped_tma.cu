/* Persistent kernels over many LINEAR layers at once (bf16/f16, sm_90a):
 * the direct-form norms and the book-keeping clipped sums of a whole step in
 * a few launches, instead of one or more launches per layer whose last
 * waves leave SMs idle (72 layers of GPT-2-small: 10-20% of each launch).
 *
 * Both run the TMA-fed pipeline of dcc_tma.cuh with 256x128 tiles, in the
 * wide form (dcc_wgmma.cuh: the tile transposed, each consumer warpgroup 64
 * of its columns against its 256 rows in m64n256 instructions, which read
 * less shared memory per MMA than m64n128 pairs: 3-6% faster on
 * GPT-2-small's step, the tensor pipes 86% busy instead of 84-85%). Work
 * items (layer, tile[, sample]) are dealt round robin to a grid of one CTA
 * per SM; the producer and the consumers walk the same item sequence, so
 * one stage counter runs across items and the pipeline never drains
 * between them. The tensor maps of up
 * to GMAXL layers travel in the kernel parameters (__grid_constant__, read
 * by TMA in place; 384 bytes a layer, within the 32 KiB CUDA 12.1 allows).
 * One launch covers a whole model where it can: a clipped-sum item is a
 * tile over all B*T rows (~0.15 ms on an H100), so every launch's last
 * partial wave costs a fraction of a wave; at 10 layers a launch, GPT-2-small
 * spent 33 waves where 20 would do. (Clusters of
 * two CTAs sharing the g tile by TMA multicast, a third less L2 traffic per
 * CTA, measured no faster on an H100 for GPT-2-small's layers: the loads
 * are not what limits these kernels.)
 *
 * Norms: an item is (layer, sample, tile) with K = T; the tile is squared in
 * registers and each warp adds its part to n2[b] (no CTA barrier), the
 * first column of tiles also the bias sums. Items of one sample are
 * adjacent, so the CTAs of a wave share that sample's rows in L2.
 *
 * Clipped sums: an item is (layer, tile) with K = B*T; the weight tile
 * sum_b c_b g_b^T a_b is stored once, plain (no atomics, no zeroing), the
 * bias sums by the first column. The per-sample coefficient cannot scale the
 * operands (they are the client's tensors, and rounding a scaled copy to
 * bf16 would cost accuracy), and a second register tile for the weighted
 * total does not fit beside a 256-row accumulator; so the accumulator is
 * rescaled between samples (Horner): with the samples in ascending
 * coefficient order c_(1) <= ... <= c_(B),
 *     acc <- acc * c_(k-1) / c_(k) + X_(k),   result = c_(B) * acc,
 * which is sum_k c_(k) X_(k). Every factor is <= 1, so the accumulator never
 * exceeds sum_k |X_(k)| (no overflow a plain sum would not have), and each
 * sample adds one f32 rounding per element. dcc_bk_order (clip.cu) gives
 * the order and the factors on the device. The epilogue also keeps the max
 * |.| of the outputs it writes whole, so that the output check need not
 * read them again (dcc_out.amax_found). */
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "dcc.h"
#include "dcc_out.cuh"
#include "dcc_path.h"
#include "dcc_tma.cuh"
#include "dcc_util.cuh"

namespace {

constexpr int GMAXL = 80;
struct g_entry {
    CUtensorMap tg, ta;
    const int *perm;           /* clipped: samples in ascending coefficient order */
    const float *fac;          /* clipped: Horner factors; fac[0] = the last coefficient */
    float *out;                /* clipped: w [p][d]; norms: n2 of this layer [B] */
    uint4 *sg;                 /* norms: the kept per-sample gradients (sgrad.cu), or NULL */
    float *sgb;                /* norms: their bias sums [B][p], or NULL */
    float *bias;               /* clipped: bias [p] or NULL */
    unsigned *amax_w, *amax_b; /* clipped: their max |.| (dcc_bk_layer); NULL: none */
    int T, d, p, tiles_n, item0, has_bias;
    int oi_w, oi_b; /* direct: the outputs in g_direct.outs (-1: none) */
};
/* The direct epilogue's step-wide part (dcc_linear_clipped_direct): the
 * step's output table on the device, the output check's mode, the status
 * word and first bad element, the noise and the divisor. */
struct g_direct {
    const dcc_out *outs;
    const uint32_t *mode;
    uint32_t *status;
    unsigned long long *bad;
    float std, divisor;
    int commit;
};
/* N: the most layers a launch takes; a lone layer's launch (1) passes
 * 400 bytes of parameters instead of 32 KiB, which the driver copies at
 * every launch (several microseconds on a 0.1 ms kernel). */
template <int N> struct g_params_n {
    g_entry e[N];
    int n, items, B;
    float s2;
    g_direct dir;
};
using g_params = g_params_n<GMAXL>;
static_assert(sizeof(g_params) <= 32764, "the kernel parameter limit (CUDA 12.1+)");

constexpr int GMI = 2, GST = tma_direct_stages<GMI>(), GSB = stage_bytes<GMI>();

#ifndef DCC_WG_EMPTY

template <typename PT> __device__ __forceinline__ int g_find(const PT &P, int item) {
    return dcc_entry_of(P.n, item, [&](int i) { return P.e[i].item0; });
}

__device__ __forceinline__ void consumer_bar() { /* the 256 consumer threads only */
    asm volatile("bar.sync 1, 256;\n" ::: "memory");
}

/* Bias column sums of a 256-row tile (colsum_put, colsum_col): the
 * complete sum of column t (t < 256) after two consumer barriers. */
__device__ __forceinline__ float colsum_total(float *cs, float bs0, float bs1) {
    colsum_put<GMI>(cs, bs0, bs1);
    consumer_bar();
    const float v = colsum_col<GMI>(cs, (int)threadIdx.x);
    consumer_bar(); /* cs is free for the next item */
    return v;
}

/* A persistent CTA's items: round k is items k G .. k G + G - 1 (a wave,
 * whose CTAs share operands in L2), of which the CTA takes the k-th after
 * its own when ROTATE, so that it does not take the same tile column round
 * after round. The norms rotate: with G a multiple of a layer's tile
 * columns (132 CTAs, 6 columns), blockIdx + k G gave a sixth of the CTAs
 * every bias tile, whose column sums cost more, and GPT-2-small's grouped
 * norms ran on one SM 20% past the others (ncu: active cycles 4.8M-6.0M,
 * 5.0M on average; rotated 4.99M-5.03M, the norms 4.0 -> 3.3 ms). The
 * clipped sums do not: their items are long (every sample of a tile) and
 * share operands only while their CTAs keep step, which the rotation's
 * mixed item lengths undo (GPT-2-small's 3.69-3.77 -> 4.10-4.21 ms
 * rotated, same run). ITEM_END past the last round; ITEM_NONE where the
 * last round, shorter than G, has no item for the CTA. */
constexpr int ITEM_NONE = -1, ITEM_END = -2;
template <bool ROTATE> __device__ __forceinline__ int round_item(int k, int items) {
    const int G = (int)gridDim.x;
    if ((int64_t)k * G >= items) return ITEM_END;
    const int it = k * G + (ROTATE ? ((int)blockIdx.x + k) % G : (int)blockIdx.x);
    return it < items ? it : ITEM_NONE;
}

/* Work item geometry, the same for producer and consumers. */
struct item_at {
    int m0, n0, tn, b;
};

__device__ __forceinline__ item_at norms_item(const g_entry &E, int it) {
    const int tiles = ((E.p + 255) / 256) * E.tiles_n, r = it - E.item0, t = r % tiles;
    item_at x;
    x.b = r / tiles; /* sample-major: a wave's CTAs share the sample's rows in L2 */
    x.tn = t % E.tiles_n;
    x.m0 = (t / E.tiles_n) * 256;
    x.n0 = x.tn * 128;
    return x;
}

__device__ __forceinline__ item_at clipped_item(const g_entry &E, int it) {
    const int t = it - E.item0;
    item_at x;
    x.b = 0;
    x.tn = t % E.tiles_n;
    x.m0 = (t / E.tiles_n) * 256;
    x.n0 = x.tn * 128;
    return x;
}

template <typename TI, typename PT>
__global__ void __launch_bounds__(CT, 1) norms_grouped(const __grid_constant__ PT P) {
    extern __shared__ unsigned char smem[];
    __shared__ __align__(8) uint64_t bar_mem[2 * GST];
    __shared__ __align__(16) float cs[512];
    const uint32_t sbase = (dcc_smem(smem) + 1023u) & ~1023u;
    const uint32_t bars = init_bars<GST>(bar_mem);
    /* A lone layer's split tail (dcc_linear_sqnorms_waves) may take the SMs
     * this launch frees; its griddepcontrol.wait orders what follows. */
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");

    if (threadIdx.x >= 256) { /* producer warp */
        if (threadIdx.x == 256) {
            int u = 0;
            for (int r = 0, it; (it = round_item<true>(r, P.items)) != ITEM_END; r++) {
                if (it == ITEM_NONE) continue; /* the last round has fewer items than CTAs */
                const g_entry &E = P.e[g_find(P, it)];
                const item_at x = norms_item(E, it);
                const int ktn = (E.T + WBK - 1) / WBK;
                for (int kt = 0; kt < ktn; kt++, u++) {
                    const int s = u % GST;
                    mbar_wait(bars + 8u * (uint32_t)(GST + s), (uint32_t)(((u / GST) & 1) ^ 1));
                    load_direct_stage<GMI>(sbase + (uint32_t)(s * GSB), &E.tg, &E.ta,
                                           bars + 8u * (uint32_t)s, x.m0, x.n0, kt * WBK, x.b);
                }
            }
        }
        return;
    }
    const int lane = (int)threadIdx.x & 31;
    int u = 0;
    for (int r = 0, it; (it = round_item<true>(r, P.items)) != ITEM_END; r++) {
        if (it == ITEM_NONE) continue; /* the last round has fewer items than CTAs */
        const g_entry &E = P.e[g_find(P, it)];
        const item_at x = norms_item(E, it);
        const int ktn = (E.T + WBK - 1) / WBK;
        const bool do_bias = E.has_bias && x.tn == 0;
        float acc[GMI][64], bs0 = 0.0f, bs1 = 0.0f;
        consume<TI, true, GMI, GST, true>(acc, sbase, bars, u, u + ktn, false, do_bias, bs0, bs1);
        u += ktn;
        /* the tile transposed (the wide form): its squares the same. The
         * epilogue holds up the tensor cores (both consumer warpgroups end a
         * tile together), so it is kept short: independent sums (acc_sq),
         * and each kept pair packed once and read back with a shift and a
         * mask, 5 instructions a pair */
        float sq;
        if (E.sg) {
            const float(&all)[128] = *reinterpret_cast<const float(*)[128]>(&acc[0][0]);
            float sq4[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            /* kept as bf16 in tile order (dcc.h): item r of the layer is
             * sample r / tiles's tile r % tiles, so its block is the r-th;
             * the norm is the kept values', which the clipped sum adds */
            uint4 *dst = E.sg + (int64_t)(it - E.item0) * (DCC_SG_TILE / 8) + threadIdx.x;
#pragma unroll
            for (int j = 0; j < DCC_SG_CHUNKS; j++) {
                uint32_t w[4];
#pragma unroll
                for (int h = 0; h < 4; h++) {
                    w[h] = pack_bf16x2(all[8 * j + 2 * h], all[8 * j + 2 * h + 1]);
                    const float lo = __uint_as_float(w[h] << 16);
                    const float hi = __uint_as_float(w[h] & 0xffff0000u);
                    sq4[h] = fmaf(hi, hi, fmaf(lo, lo, sq4[h]));
                }
                dst[j * DCC_SG_THREADS] = make_uint4(w[0], w[1], w[2], w[3]);
            }
            sq = (sq4[0] + sq4[1]) + (sq4[2] + sq4[3]);
        } else {
            sq = acc_sq(acc);
        }
        if (do_bias) {
            float v = colsum_total(cs, bs0, bs1);
            sq += v * v;
            if (E.sgb && x.m0 + (int)threadIdx.x < E.p)
                E.sgb[(int64_t)x.b * E.p + x.m0 + (int)threadIdx.x] = v;
        }
        sq = dcc_warp_sum(sq);
        if (lane == 0) atomicAdd(E.out + x.b, sq * P.s2);
    }
}

/* The clipped sums' epilogues: into f32 staging with the max |.| (STAGE),
 * or (DIRECT: dcc_linear_clipped_direct) noised, divided and checked as
 * the output pass would (clip.cu's write_chunk: the same draws, the same
 * roundings, bit for bit), then stored in the output's dtype. */
enum { CG_STAGE = 0, CG_DIRECT_FAST = 1, CG_DIRECT_EXACT = 2 };

/* The weight tile at (m0, n0) of the direct epilogue: sixteen chunks of the
 * wide form's eight registers each (dcc_wide_draw8), v = (cl acc + std z)
 * / divisor, checked and (store) written. A loop, not unrolled: sixteen
 * copies of the draws were 150 KB of code, which the instruction cache
 * did not hold (the clipped sums 50% slower); the accumulators move down
 * a chunk each round instead, so that every index stays static and all[]
 * in registers. */
template <int NOISE>
__device__ __forceinline__ void cg_direct_w(const g_direct &D, const g_entry &E, float cl,
                                            float (&all)[128], int m0, int n0, bool store) {
    const dcc_out &o = D.outs[E.oi_w];
    void *const dst = o.dst;
    const int d = E.d, p = E.p, dt = o.dtype;
    const dcc_div div = dcc_div_make(D.divisor);
    const bool divide = D.divisor != 1.0f, noise = D.std != 0.0f;
    int mt, nt;
    dcc_wide_at(0, m0, n0, mt, nt);
    const bool col_ok[2] = {nt < d, nt + 8 < d};
    int64_t first = INT64_MAX;
#pragma unroll 1
    for (int j = 0; j < 16; j++) {
        float v[8];
#pragma unroll
        for (int k = 0; k < 8; k++) v[k] = cl * all[k];
#pragma unroll
        for (int k = 0; k < 120; k++) all[k] = all[k + 8];
        const int mj = mt + 16 * j;
        const int64_t ij = (int64_t)mj * d + nt; /* register 8 j's element */
        if (noise) {
            float z[8];
            dcc_wide_draw8<NOISE>(o, ij, d, z);
#pragma unroll
            for (int k = 0; k < 8; k++) v[k] = dcc_noised(v[k], D.std, z[k]);
        }
        if (divide)
#pragma unroll
            for (int k = 0; k < 8; k++) v[k] = dcc_div_by(div, v[k]);
#pragma unroll
        for (int k = 0; k < 8; k++) {
            const int dr = 8 * (k >> 2) + (k & 1);
            if (mj + dr >= p || !col_ok[(k >> 1) & 1]) continue;
            const int64_t i = ij + (int64_t)dr * d + ((k & 2) ? 8 : 0);
            if (dcc_bad_as(v[k], dt) && i < first) first = i;
            if (store) dcc_store_as(dst, dt, (uint64_t)i, v[k]);
        }
    }
    if (first != INT64_MAX) dcc_out_fail(D.status, D.bad, E.oi_w, (uint64_t)first);
}

/* The bias rows of the direct epilogue: this thread's row m (< 256 a tile),
 * y its clipped sum; pairs of adjacent rows share a draw. */
template <int NOISE>
__device__ __forceinline__ void cg_direct_b(const g_direct &D, const g_entry &E, int m, float y,
                                            bool store) {
    if (m >= E.p) return;
    const dcc_out &o = D.outs[E.oi_b];
    if (D.std != 0.0f) {
        float z0, z1;
        draw_pair(NOISE, o.key, o.step, o.stream, (uint64_t)(m >> 1), z0, z1);
        y = dcc_noised(y, D.std, (m & 1) ? z1 : z0);
    }
    if (D.divisor != 1.0f) y = dcc_div_by(dcc_div_make(D.divisor), y);
    if (dcc_bad_as(y, o.dtype)) dcc_out_fail(D.status, D.bad, E.oi_b, (uint64_t)m);
    if (store) dcc_store_as(o.dst, o.dtype, (uint64_t)m, y);
}

/* Threads of a clipped-sum launch: the direct epilogue's draws need more
 * registers beside the 128 accumulators than a CTA of 9 warps may hold
 * (168, as for tma_ghost_wide), so its producer is a whole warpgroup that
 * gives its registers to the consumers (setmaxnreg). */
template <int EPI> constexpr int cg_threads() { return EPI == CG_STAGE ? CT : CT_WIDE; }

template <typename TI, int EPI>
__global__ void __launch_bounds__(cg_threads<EPI>(), 1)
    clipped_grouped(const __grid_constant__ g_params P) {
    extern __shared__ unsigned char smem[];
    __shared__ __align__(8) uint64_t bar_mem[2 * GST];
    __shared__ __align__(16) float cs[512];
    constexpr int NOISE = EPI == CG_DIRECT_EXACT ? DCC_NOISE_EXACT : DCC_NOISE_FAST;
    /* Direct: after the output check. Mode 1 writes the outputs; mode 0
     * (some output might leave its dtype) with status 0 only checks them,
     * and the commit launch, once every output is checked and none failed,
     * makes the sums again and writes them; a failed step runs neither. */
    bool store = true;
    if (EPI != CG_STAGE) {
        const bool m1 = *P.dir.mode == 1u, ok = *P.dir.status == 0u;
        if (P.dir.commit ? m1 || !ok : !m1 && !ok) return; /* uniform over the grid */
        store = P.dir.commit || m1;
    }
    const uint32_t sbase = (dcc_smem(smem) + 1023u) & ~1023u;
    const uint32_t bars = init_bars<GST>(bar_mem);
    const int B = P.B;

    if (threadIdx.x >= 256) { /* producer warp (direct: warpgroup) */
        if (EPI != CG_STAGE) asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
        if (threadIdx.x == 256) {
            int u = 0;
            for (int r = 0, it; (it = round_item<false>(r, P.items)) != ITEM_END; r++) {
                if (it == ITEM_NONE) continue; /* the last round has fewer items than CTAs */
                const g_entry &E = P.e[g_find(P, it)];
                const item_at x = clipped_item(E, it);
                const int ktn = (E.T + WBK - 1) / WBK;
                for (int k = 0; k < B; k++) {
                    const int b = E.perm[k];
                    for (int kt = 0; kt < ktn; kt++, u++) {
                        const int s = u % GST;
                        mbar_wait(bars + 8u * (uint32_t)(GST + s), (uint32_t)(((u / GST) & 1) ^ 1));
                        load_direct_stage<GMI>(sbase + (uint32_t)(s * GSB), &E.tg, &E.ta,
                                               bars + 8u * (uint32_t)s, x.m0, x.n0, kt * WBK, b);
                    }
                }
            }
        }
        return;
    }
    if (EPI != CG_STAGE) asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
    int u = 0;
    for (int r = 0, it; (it = round_item<false>(r, P.items)) != ITEM_END; r++) {
        if (it == ITEM_NONE) continue; /* the last round has fewer items than CTAs */
        const g_entry &E = P.e[g_find(P, it)];
        const item_at x = clipped_item(E, it);
        const int ktn = (E.T + WBK - 1) / WBK, d = E.d, p = E.p, m0 = x.m0, n0 = x.n0;
        const bool do_bias = (EPI == CG_STAGE ? E.bias != nullptr : E.oi_b >= 0) && x.tn == 0;
        float acc[GMI][64], bs0 = 0.0f, bs1 = 0.0f;
        for (int k = 0; k < B; k++) {
            if (k > 0) { /* Horner: rescale to the next (larger) coefficient */
                const float f = E.fac[k];
#pragma unroll
                for (int j = 0; j < GMI; j++)
#pragma unroll
                    for (int i = 0; i < 64; i++) acc[j][i] *= f;
                bs0 *= f;
                bs1 *= f;
            }
            consume<TI, true, GMI, GST, true>(acc, sbase, bars, u, u + ktn, false, do_bias, bs0,
                                              bs1, k > 0);
            u += ktn;
        }
        const float cl = E.fac[0];
        if (EPI != CG_STAGE) {
            float(&all)[128] = *reinterpret_cast<float(*)[128]>(&acc[0][0]);
            if (E.oi_w >= 0) cg_direct_w<NOISE>(P.dir, E, cl, all, m0, n0, store);
            if (do_bias)
                cg_direct_b<NOISE>(P.dir, E, m0 + (int)threadIdx.x, cl * colsum_total(cs, bs0, bs1),
                                   store);
            continue;
        }
        const float(&all)[128] = *reinterpret_cast<const float(*)[128]>(&acc[0][0]);
        float *w = E.out;
        /* accumulator: the wide form's (dcc_wide_at); the max |.| as bits
         * (NaN above all) into *amax_w */
        unsigned am = 0;
#pragma unroll
        for (int i = 0; i < 128; i++) {
            int m, n;
            dcc_wide_at(i, m0, n0, m, n);
            if (m < p && n < d) {
                const float v = cl * all[i];
                w[(int64_t)m * d + n] = v;
                am = max(am, dcc_abs_bits(v));
            }
        }
        if (E.amax_w) dcc_warp_amax(E.amax_w, am);
        if (do_bias) {
            const float v = colsum_total(cs, bs0, bs1);
            const int m = m0 + (int)threadIdx.x;
            const float y = cl * v;
            if (m < p) E.bias[m] = y;
            if (E.amax_b) dcc_warp_amax(E.amax_b, m < p ? dcc_abs_bits(y) : 0u);
        }
    }
}

#else

template <typename TI, typename PT> __global__ void norms_grouped(const __grid_constant__ PT) {}
template <typename TI, int EPI> __global__ void clipped_grouped(const __grid_constant__ g_params) {}

#endif

/* One persistent launch over P's layers: a CTA per SM at most. */
template <typename PT>
cudaError_t launch(void (*kern)(PT), const PT &P, cudaStream_t st, int threads = CT) {
    if (P.items == 0) return cudaSuccess;
    const int smem = tma_direct_smem<GMI>();
    cudaError_t e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    int sms;
    if (e != cudaSuccess || (e = dcc_sm_count(&sms)) != cudaSuccess) return e;
    unsigned grid = (unsigned)(P.items < sms ? P.items : sms);
    kern<<<grid, threads, smem, st>>>(P);
    return cudaGetLastError();
}

/* An entry's geometry and tensor maps; false where the driver refuses a map. */
bool entry_init(g_entry &E, const dcc_linear *L, int64_t item0) {
    if (!make_map(&E.tg, L->g, L->tg, L->B, L->T, L->p, 64) ||
        !make_map(&E.ta, L->a, L->ta, L->B, L->T, L->d, 64))
        return false;
    E.T = L->T;
    E.d = L->d;
    E.p = L->p;
    E.tiles_n = (L->d + 127) / 128;
    E.has_bias = L->has_bias;
    E.item0 = (int)item0;
    return true;
}

/* Chunks of at most max_layers layers (1 to GMAXL: their tensor maps fill
 * the kernel parameters) of one dtype; Ls(i) is layer i, and fill(i,
 * entry) sets its entry. Every chunk's tensor maps are made before the
 * first launch, so that a map the driver refuses (cudaErrorNotSupported)
 * means nothing ran: the per-layer fallback then cannot add a second time
 * into n2 rows an earlier chunk already added to. */
/* What run_chunks launches: the norms, or the clipped sums with an
 * epilogue (CG_*) */
enum { RC_NORMS = -1 };

template <typename Lin, typename Fill>
cudaError_t run_chunks(Lin Ls, int n, int B, float s2, int kind, const g_direct *dir,
                       int max_layers, Fill fill, cudaStream_t st) {
    const bool clipped = kind != RC_NORMS;
    const int per = max_layers < 1 ? 1 : max_layers < GMAXL ? max_layers : GMAXL;
    /* a launch takes up to `per` consecutive layers of one input dtype */
    auto len = [&](int i) {
        int j = 1;
        while (j < per && i + j < n && Ls(i + j)->ta == Ls(i)->ta) j++;
        return j;
    };
    int chunks = 0;
    for (int i = 0; i < n; chunks++) i += len(i);
    g_params *all = (g_params *)calloc((size_t)chunks, sizeof *all);
    if (!all) return cudaErrorMemoryAllocation;
    cudaError_t e = cudaSuccess;
    for (int c = 0, i = 0; c < chunks && e == cudaSuccess; c++) {
        g_params &P = all[c];
        const int j = len(i);
        int64_t items = 0;
        for (int k = 0; k < j; k++) {
            g_entry &E = P.e[k];
            const dcc_linear *L = Ls(i + k);
            if (!entry_init(E, L, items)) {
                e = cudaErrorNotSupported;
                break;
            }
            int64_t tiles = (int64_t)((L->p + 255) / 256) * E.tiles_n;
            items += clipped ? tiles : tiles * L->B;
            if (items > INT32_MAX / 2) {
                e = cudaErrorInvalidConfiguration;
                break;
            }
            fill(i + k, E);
        }
        P.n = j;
        P.items = (int)items;
        P.B = B;
        P.s2 = s2;
        if (dir) P.dir = *dir;
        i += j;
    }
    for (int c = 0, i = 0; c < chunks && e == cudaSuccess; c++) {
        const bool bf = Ls(i)->ta == DC_BF16;
        void (*k)(g_params);
        switch (kind) {
        case RC_NORMS:
            k = bf ? norms_grouped<dcc_bf16, g_params> : norms_grouped<dcc_f16, g_params>;
            break;
        case CG_DIRECT_FAST:
            k = bf ? clipped_grouped<dcc_bf16, CG_DIRECT_FAST>
                   : clipped_grouped<dcc_f16, CG_DIRECT_FAST>;
            break;
        case CG_DIRECT_EXACT:
            k = bf ? clipped_grouped<dcc_bf16, CG_DIRECT_EXACT>
                   : clipped_grouped<dcc_f16, CG_DIRECT_EXACT>;
            break;
        default: k = bf ? clipped_grouped<dcc_bf16, CG_STAGE> : clipped_grouped<dcc_f16, CG_STAGE>;
        }
        e = launch(k, all[c], st, kind == CG_DIRECT_FAST || kind == CG_DIRECT_EXACT ? CT_WIDE : CT);
        i += all[c].n;
    }
    free(all);
    return e;
}

/* A clipped-sum entry from its layer (the geometry and maps: entry_init). */
void bk_fill(g_entry &E, const dcc_bk_layer &l) {
    E.perm = l.perm;
    E.fac = l.fac;
    E.out = l.w;
    E.bias = l.bias;
    E.amax_w = l.amax_w;
    E.amax_b = l.bias ? l.amax_b : nullptr;
    E.oi_w = l.oi_w;
    E.oi_b = l.oi_b;
}

bool qualifies(const dcc_linear *L) {
    return L->ta == L->tg && dcc_linear_path(L) == DCC_PATH_WGMMA;
}

} // namespace

extern "C" int dcc_bk_grouped_ok(const dcc_linear *L) {
#ifdef DCC_WGMMA_BUILT
    return L->T >= WBK && qualifies(L);
#else
    (void)L;
    return 0;
#endif
}

extern "C" cudaError_t dcc_linear_clipped_grouped(const dcc_bk_layer *ls, int n, int max_layers,
                                                  cudaStream_t st) {
#ifdef DCC_WGMMA_BUILT
    if (n <= 0) return cudaSuccess;
    for (int i = 0; i < n; i++)
        if (!dcc_bk_grouped_ok(&ls[i].L) || ls[i].L.B != ls[0].L.B || !ls[i].w)
            return cudaErrorNotSupported;
    return run_chunks([&](int i) { return &ls[i].L; }, n, ls[0].L.B, 1.0f, CG_STAGE, nullptr,
                      max_layers, [&](int i, g_entry &E) { bk_fill(E, ls[i]); }, st);
#else
    (void)ls;
    (void)n;
    (void)max_layers;
    (void)st;
    return cudaErrorNotSupported;
#endif
}

extern "C" cudaError_t dcc_linear_clipped_direct(const dcc_bk_layer *ls, int n, int max_layers,
                                                 const dcc_out *outs, float std, float divisor,
                                                 const uint32_t *mode, uint32_t *status,
                                                 unsigned long long *bad, int commit, int noise,
                                                 cudaStream_t st) {
#ifdef DCC_WGMMA_BUILT
    if (n <= 0) return cudaSuccess;
    for (int i = 0; i < n; i++)
        if (!dcc_bk_grouped_ok(&ls[i].L) || ls[i].L.B != ls[0].L.B) return cudaErrorNotSupported;
    const g_direct dir = {outs, mode, status, bad, std, divisor, commit};
    return run_chunks([&](int i) { return &ls[i].L; }, n, ls[0].L.B, 1.0f,
                      noise == DCC_NOISE_EXACT ? CG_DIRECT_EXACT : CG_DIRECT_FAST, &dir, max_layers,
                      [&](int i, g_entry &E) { bk_fill(E, ls[i]); }, st);
#else
    (void)ls;
    (void)n;
    (void)max_layers;
    (void)outs;
    (void)std;
    (void)divisor;
    (void)mode;
    (void)status;
    (void)bad;
    (void)commit;
    (void)noise;
    (void)st;
    return cudaErrorNotSupported;
#endif
}

extern "C" int dcc_norms_grouped_ok(const dcc_linear *L, dc_algo algo) {
#ifdef DCC_WGMMA_BUILT
    return algo == DC_ALGO_DIRECT && qualifies(L);
#else
    (void)L;
    (void)algo;
    return 0;
#endif
}

extern "C" int64_t dcc_norms_grouped_items(const dcc_linear *L) {
    return (int64_t)((L->p + 255) / 256) * ((L->d + 127) / 128) * L->B;
}

extern "C" cudaError_t dcc_linear_sqnorms_grouped(const dcc_norm_layer *ls, int n, float s2,
                                                  int max_layers, cudaStream_t st) {
#ifdef DCC_WGMMA_BUILT
    if (n <= 0) return cudaSuccess;
    for (int i = 0; i < n; i++)
        if (!qualifies(&ls[i].L) || ls[i].L.B != ls[0].L.B) return cudaErrorNotSupported;
    return run_chunks([&](int i) { return &ls[i].L; }, n, ls[0].L.B, s2, RC_NORMS, nullptr,
                      max_layers,
                      [&](int i, g_entry &E) {
                          E.out = ls[i].n2;
                          E.sg = (uint4 *)ls[i].sg;
                          E.sgb = ls[i].sg ? ls[i].sgb : nullptr;
                      },
                      st);
#else
    (void)ls;
    (void)n;
    (void)s2;
    (void)max_layers;
    (void)st;
    return cudaErrorNotSupported;
#endif
}

extern "C" int dcc_grouped_min_items(const dcc_options *o) {
    if (o && o->grouped_min >= 0) return o->grouped_min; /* tests: 0 groups every step */
    /* a device that cannot be asked groups nothing: the per-layer launches
     * then report its error */
    int sms;
    return dcc_sm_count(&sms) == cudaSuccess ? 4 * sms : INT_MAX;
}

/* The first `items` 256-row tiles of a lone layer's direct form, in the
 * per-layer kernel's numbering (sample-major), on persistent CTAs: one fill
 * for all their waves instead of one a tile. */
extern "C" cudaError_t dcc_linear_sqnorms_waves(const dcc_linear *L, int64_t items, float s2,
                                                float *n2, cudaStream_t st) {
#ifdef DCC_WGMMA_BUILT
    if (items <= 0) return cudaSuccess;
    if (!qualifies(L) || items > dcc_norms_grouped_items(L) || items > INT32_MAX / 2)
        return cudaErrorNotSupported;
    g_params_n<1> P = {};
    if (!entry_init(P.e[0], L, 0)) return cudaErrorNotSupported;
    P.e[0].out = n2;
    P.n = 1;
    P.items = (int)items;
    P.B = L->B;
    P.s2 = s2;
    return launch(L->ta == DC_BF16 ? norms_grouped<dcc_bf16, g_params_n<1>>
                                   : norms_grouped<dcc_f16, g_params_n<1>>,
                  P, st);
#else
    (void)L;
    (void)items;
    (void)s2;
    (void)n2;
    (void)st;
    return cudaErrorNotSupported;
#endif
}
