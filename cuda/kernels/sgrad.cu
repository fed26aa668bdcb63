/* The clipped sum of the layers whose per-sample gradients the grouped norm
 * pass kept (dcc.h, "Per-sample gradients kept"): sum_b cs[b] * G_b as one
 * pass over memory. The norm pass computes every g_b^T a_b in registers to
 * square it; keeping it as bf16 costs one store of B * p * d * 2 bytes,
 * and the sum here one read, instead of the book-keeping GEMM over all B*T
 * rows that recomputes them (GPT-2-small's 72 layers, B = 8, T = 1024:
 * 2 GB each way against 3.6 ms of tensor-core time on an H100).
 *
 * A CTA takes one 256 x 128 tile of one layer; thread t reads, for each
 * sample, the 16 chunks of 8 values the norm kernel's consumer thread t
 * stored, so its sums land where that thread's accumulators map: the wide
 * form's register i is column n = 64 wg + 16 wq + lane/4 (+8 when i % 4 >=
 * 2) of a's, row m = 8 (i / 4) + 2 (lane % 4) + i % 2 of g's (grouped_tma.cu);
 * for one i a warp's stores fill four 32-byte sectors. The epilogue adds the
 * outputs' noise (the same draws the output pass would make: dcc_noise.cuh,
 * pair q of an output is its elements 2q, 2q + 1). It runs after the
 * output check, which took a bound for these outputs instead of their max
 * (dcc_out.bound): in mode 1 it divides and writes the outputs themselves
 * (dcc_out.cuh, as the output pass would), so their sums never go through
 * staging (GPT-2-small: 0.35 ms a step; a Llama-1B: 3 ms); otherwise it
 * writes staging and its max |.|, which the staged passes divide and
 * commit. The draws are issue-bound and this pass memory-bound, so here
 * they mostly fill idle issue slots. */
#include <string.h>

#include "dcc.h"
#include "dcc_out.cuh"
#include "dcc_util.cuh"

namespace {

constexpr int SGMAXL = 80; /* layers a launch's parameters hold */

struct sg_entry {
    dcc_sg_layer L;
    int tiles_n, tiles, tile0;
};
struct sg_params {
    sg_entry e[SGMAXL];
    const uint32_t *mode; /* dcc_out_check's; NULL: staging */
    uint32_t *status;     /* the step's: an unstaged value's check */
    unsigned long long *bad;
    int commit; /* dcc_sgrad_commit's launch: the unstaged layers, written */
    int acc;    /* DCC_SG_ACC_*: what the unstaged layers do with their accumulators */
    int n, tiles, B;
    float std; /* 0: no noise */
    float divisor;
};
static_assert(sizeof(sg_params) <= 32764, "the kernel parameter limit (CUDA 12.1+)");

__device__ __forceinline__ int sg_find(const sg_params &P, int tile) {
    return dcc_entry_of(P.n, tile, [&](int i) { return P.e[i].tile0; });
}

__device__ __forceinline__ uint4 ld_stream(const uint4 *p) { /* read once: spare L1 */
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

/* acc[0..7] += c * the eight bf16 values of v */
__device__ __forceinline__ void sg_fma8(float (&acc)[8], float c, const uint4 &v) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int h = 0; h < 4; h++) {
        acc[2 * h] = fmaf(c, __uint_as_float(w[h] << 16), acc[2 * h]);
        acc[2 * h + 1] = fmaf(c, __uint_as_float(w[h] & 0xffff0000u), acc[2 * h + 1]);
    }
}

constexpr int SG_MAXB = 64; /* coefficients staged in shared memory a pass */
constexpr int SG_ANY = -1;  /* a launch whose weight outputs' dtypes differ */

/* The pass is issue-bound on the draws as much as memory-bound: four CTAs an
 * SM (64 registers), with the next chunk's first four samples loading
 * while a chunk's draws are made, measured best on an H100 (the kept
 * phase of a Llama-1B-like step 7.4 -> 6.8 ms, GPT-2-small 1.00 -> 0.96;
 * no bound at 78 registers, 5 or 6 CTAs with or without the prefetch were
 * in between or worse; after the cut below, 3 and 5 again lost: the Llama's
 * kept phase 5.22-5.27 ms at 4, 5.38-5.42 at 3, 5.39-5.51 at 5). For the
 * same reason the weight's stores know their dtype at compile time (DT;
 * SG_ANY: each layer's own) and the element offsets are made once a chunk:
 * the store path was a quarter of the pass's instructions. */
constexpr int SG_MIN_CTAS = 4;
template <int NOISE, int DT>
__global__ void __launch_bounds__(DCC_SG_THREADS, SG_MIN_CTAS)
    sgrad_sum(const __grid_constant__ sg_params P) {
    __shared__ float c[SG_MAXB];
    const sg_entry &E = P.e[sg_find(P, (int)blockIdx.x)];
    const dcc_sg_layer &L = E.L;
    const int t = (int)blockIdx.x - E.tile0, tn = t % E.tiles_n;
    const int m0 = (t / E.tiles_n) * 256, n0 = tn * 128, B = P.B, d = L.d, p = L.p;
    const int tid = (int)threadIdx.x;
    /* mode 0 with an unstaged layer: its values checked here, and written
     * by the commit launch once every output is checked (and none failed);
     * a step already failed writes nothing (zeros: dcc_out_commit) */
    const bool staged_mode = !(P.mode && *P.mode != 0);
    const bool run = P.commit ? staged_mode && *P.status == 0
                              : !(staged_mode && L.unstaged && *P.status != 0);
    if (!run) return; /* uniform over the CTA: one layer's tile */
    const bool direct = P.commit || !staged_mode, divide = P.divisor != 1.0f;
    /* an unstaged layer's micro-batch: its sums into its accumulators */
    const bool to_acc = !direct && L.unstaged &&
                        (P.acc == DCC_SG_ACC_STORE || P.acc == DCC_SG_ACC_ADD);
    const bool check = !direct && L.unstaged && !to_acc;
    const bool fold = L.unstaged && P.acc == DCC_SG_ACC_FOLD; /* a commit's: + accumulators */
    const dcc_div div = dcc_div_make(P.divisor);
    /* where the accumulators land: register 0's element (mt, nt) by
     * dcc_wide_at, and register k of chunk j (register 8 j + k) at row mt +
     * 16 j + 8 (k / 4) + k % 2, column nt (+ 8 when k % 4 >= 2) */
    int mt, nt;
    dcc_wide_at(0, m0, n0, mt, nt);
    const bool col_ok[2] = {nt < d, nt + 8 < d};
    /* the weight's noise has a range (a pass's sums step): checked per element */
    const bool ranged = L.out_w.nz_mod != 0 || L.out_w.nz_lo != 0 || L.out_w.nz_hi != UINT64_MAX;
    const int64_t per_sample = (int64_t)E.tiles * (DCC_SG_TILE / 8); /* uint4 */
    const uint4 *base = (const uint4 *)L.sg + (int64_t)t * (DCC_SG_TILE / 8) + tid;
    unsigned am = 0;
    /* a batch's coefficients fit once (the usual case): staged once, not per chunk */
    const bool once = B <= SG_MAXB;
    if (once) {
        if (tid < B) c[tid] = L.cs[tid];
        __syncthreads();
    }
    uint4 pre[4]; /* chunk j's first four samples, loaded early (B >= 4) */
    if (B >= 4)
#pragma unroll
        for (int u = 0; u < 4; u++) pre[u] = ld_stream(base + (int64_t)u * per_sample);
#pragma unroll 1
    for (int j = 0; j < DCC_SG_CHUNKS; j++) {
        float acc[8];
#pragma unroll
        for (int k = 0; k < 8; k++) acc[k] = 0.0f;
        for (int b0 = 0; b0 < B; b0 += SG_MAXB) {
            const int nb = B - b0 < SG_MAXB ? B - b0 : SG_MAXB;
            if (!once) {
                __syncthreads();
                if (tid < nb) c[tid] = L.cs[b0 + tid];
                __syncthreads();
            }
            int k = 0;
            for (; k + 4 <= nb; k += 4) { /* four samples' loads in flight */
                uint4 v[4];
                if (b0 + k == 0) {
#pragma unroll
                    for (int u = 0; u < 4; u++) v[u] = pre[u];
                } else
#pragma unroll
                    for (int u = 0; u < 4; u++)
                        v[u] = ld_stream(base + (int64_t)(b0 + k + u) * per_sample +
                                         j * DCC_SG_THREADS);
#pragma unroll
                for (int u = 0; u < 4; u++) sg_fma8(acc, c[k + u], v[u]);
            }
            for (; k < nb; k++)
                sg_fma8(acc, c[k],
                        ld_stream(base + (int64_t)(b0 + k) * per_sample + j * DCC_SG_THREADS));
        }
        /* the next chunk's first loads in flight during the draws */
        if (B >= 4 && j + 1 < DCC_SG_CHUNKS)
#pragma unroll
            for (int u = 0; u < 4; u++)
                pre[u] = ld_stream(base + (int64_t)u * per_sample + (j + 1) * DCC_SG_THREADS);
        const int mj = mt + 16 * j;
        const int64_t ij = (int64_t)mj * d + nt; /* register 0's element */
        /* a sums step's range (the rows its rank owns): only those
         * elements get their draw; a warp with none in range draws nothing
         * (uniform: its lanes swap draws) */
        unsigned in = 0xffu;
        if (P.std != 0.0f && ranged) {
            in = 0;
#pragma unroll
            for (int k = 0; k < 8; k++) {
                const int64_t i = ij + (int64_t)(8 * (k >> 2) + (k & 1)) * d + ((k & 2) ? 8 : 0);
                in |=
                    (unsigned)dcc_span_in(L.out_w.nz_mod, L.out_w.nz_lo, L.out_w.nz_hi, (uint64_t)i)
                    << k;
            }
        }
        if (P.std != 0.0f && __any_sync(0xffffffffu, in != 0)) {
            float z[8];
            dcc_wide_draw8<NOISE>(L.out_w, ij, d, z);
#pragma unroll
            for (int k = 0; k < 8; k++)
                if (in & (1u << k)) acc[k] = dcc_noised(acc[k], P.std, z[k]);
        }
        if (fold)
#pragma unroll
            for (int k = 0; k < 8; k++) {
                const int dr = 8 * (k >> 2) + (k & 1);
                if (mj + dr < p && col_ok[(k >> 1) & 1])
                    acc[k] = __fadd_rn(acc[k], L.acc_w[ij + (int64_t)dr * d + ((k & 2) ? 8 : 0)]);
            }
        /* one branch a chunk, not one an element: direct or staged, divided or not */
        if (to_acc) {
#pragma unroll
            for (int k = 0; k < 8; k++) {
                const int dr = 8 * (k >> 2) + (k & 1);
                float *a = L.acc_w + ij + (int64_t)dr * d + ((k & 2) ? 8 : 0);
                if (mj + dr < p && col_ok[(k >> 1) & 1])
                    *a = P.acc == DCC_SG_ACC_ADD ? __fadd_rn(*a, acc[k]) : acc[k];
            }
        } else if (direct) {
            if (divide && div.pow2) /* dcc_div_by's own first case, tested once */
#pragma unroll
                for (int k = 0; k < 8; k++) acc[k] = __fmul_rn(acc[k], div.y);
            else if (divide)
#pragma unroll
                for (int k = 0; k < 8; k++) acc[k] = dcc_div_by(div, acc[k]);
            void *dst = L.out_w.dst;
            const int dt = DT != SG_ANY ? DT : L.out_w.dtype;
#pragma unroll
            for (int k = 0; k < 8; k++) {
                const int dr = 8 * (k >> 2) + (k & 1);
                if (mj + dr < p && col_ok[(k >> 1) & 1])
                    dcc_store_as(dst, dt, (uint64_t)(ij + (int64_t)dr * d + ((k & 2) ? 8 : 0)),
                                 acc[k]);
            }
        } else if (check) {
            const int dt = DT != SG_ANY ? DT : L.out_w.dtype;
            int64_t first = INT64_MAX;
#pragma unroll
            for (int k = 0; k < 8; k++) {
                const int dr = 8 * (k >> 2) + (k & 1);
                const int64_t i = ij + (int64_t)dr * d + ((k & 2) ? 8 : 0);
                if (mj + dr < p && col_ok[(k >> 1) & 1] &&
                    dcc_bad_as(divide ? dcc_div_by(div, acc[k]) : acc[k], dt) && i < first)
                    first = i;
            }
            if (first != INT64_MAX) dcc_out_fail(P.status, P.bad, L.oi_w, (uint64_t)first);
        } else {
#pragma unroll
            for (int k = 0; k < 8; k++) {
                const int dr = 8 * (k >> 2) + (k & 1);
                if (mj + dr < p && col_ok[(k >> 1) & 1]) {
                    L.w[ij + (int64_t)dr * d + ((k & 2) ? 8 : 0)] = acc[k];
                    am = max(am, dcc_abs_bits(acc[k]));
                }
            }
        }
    }
    if (L.amax_w && !direct && !check && !to_acc) dcc_warp_amax(L.amax_w, am);
    if (L.bias && tn == 0) {
        const int m = m0 + tid;
        float y = 0.0f;
        if (m < p)
            for (int b = 0; b < B; b++) y = fmaf(L.cs[b], L.sgb[(int64_t)b * p + m], y);
        if (P.std != 0.0f && dcc_span_in(L.out_b.nz_mod, L.out_b.nz_lo, L.out_b.nz_hi,
                                         (uint64_t)m)) { /* pairs of adjacent rows: each its own */
            float z0, z1;
            draw_pair(NOISE, L.out_b.key, L.out_b.step, L.out_b.stream, (uint64_t)(m >> 1), z0, z1);
            y = dcc_noised(y, P.std, (m & 1) ? z1 : z0);
        }
        if (fold && m < p) y = __fadd_rn(y, L.acc_b[m]);
        if (to_acc) {
            if (m < p) L.acc_b[m] = P.acc == DCC_SG_ACC_ADD ? __fadd_rn(L.acc_b[m], y) : y;
        } else if (direct) {
            if (m < p)
                dcc_store_as(L.out_b.dst, L.out_b.dtype, (uint64_t)m,
                             divide ? dcc_div_by(div, y) : y);
        } else if (check) {
            if (m < p && dcc_bad_as(divide ? dcc_div_by(div, y) : y, L.out_b.dtype))
                dcc_out_fail(P.status, P.bad, L.oi_b, (uint64_t)m);
        } else {
            if (m < p) L.bias[m] = y;
            if (L.amax_b) dcc_warp_amax(L.amax_b, m < p ? dcc_abs_bits(y) : 0u);
        }
    }
}

/* 256 x 128 tiles of a [p][d] weight */
int64_t tiles_of(int p, int d) { return (int64_t)((p + 255) / 256) * ((d + 127) / 128); }

} // namespace

/* An H100 SXM does ~660 dense bf16 TFLOP/s against 3.35 TB/s of HBM3:
 * about 200 flops in the time of a byte, which the norms' store and the sum's
 * read each move 2 d p of a sample. So a direct-form layer pays from T ~ 400
 * on (GPT-2-small's T = 1024: 3.7 -> 1.05 ms for its 72 layers' clipped
 * sums, B = 8); a ghost-form one when its ghost work exceeds the bytes'
 * time (then its norms run direct, and the saved GEMM pays for that). */
constexpr double FLOPS_PER_BYTE = 200.0;

extern "C" bool dcc_sgrad_worth(int T, int d, int p, dc_algo norm_algo) {
    const double dp = (double)d * (double)p, bytes = 4.0 * dp;
    const double gemm = 2.0 * (double)T * dp;
    const double extra = norm_algo == DC_ALGO_GHOST
                             ? gemm - 2.0 * (double)T * (double)T * ((double)d + (double)p)
                             : 0.0; /* the direct norms' work over the ghost's */
    return gemm - (extra > 0.0 ? extra : 0.0) > FLOPS_PER_BYTE * bytes;
}

extern "C" size_t dcc_sgrad_bias_off(const dcc_linear *L) {
    return (size_t)L->B * (size_t)tiles_of(L->p, L->d) * DCC_SG_TILE * 2;
}

extern "C" size_t dcc_sgrad_bytes(const dcc_linear *L) {
    return dcc_sgrad_bias_off(L) + (L->has_bias ? (size_t)L->B * (size_t)L->p * 4 : 0);
}

/* The kernel for a launch: its weight outputs' dtype fixed when they share
 * one (the FAST draws only: EXACT is for checking, not speed). */
using sg_kernel = void (*)(sg_params);
sg_kernel sg_pick(int noise, int dt) {
    if (noise == DCC_NOISE_EXACT) return sgrad_sum<DCC_NOISE_EXACT, SG_ANY>;
    switch (dt) {
    case DC_F32: return sgrad_sum<DCC_NOISE_FAST, DC_F32>;
    case DC_BF16: return sgrad_sum<DCC_NOISE_FAST, DC_BF16>;
    case DC_F16: return sgrad_sum<DCC_NOISE_FAST, DC_F16>;
    default: return sgrad_sum<DCC_NOISE_FAST, SG_ANY>;
    }
}

/* The launches over layers ls (commit: the unstaged ones only). */
static cudaError_t sg_launch(const dcc_sg_layer *ls, int n, int B, float std, float divisor,
                             const uint32_t *mode, uint32_t *status, unsigned long long *bad,
                             int commit, int acc, int noise, cudaStream_t st) {
    if (B <= 0) return cudaErrorInvalidValue;
    int i = 0;
    for (;;) {
        while (i < n && commit && !ls[i].unstaged) i++;
        if (i == n) return cudaSuccess;
        sg_params P;
        memset(&P, 0, sizeof P);
        int64_t tiles = 0;
        int j = 0, dt = ls[i].out_w.dtype;
        for (; j < SGMAXL && i < n; i++) {
            const dcc_sg_layer *x = &ls[i];
            if (commit && !x->unstaged) continue;
            const int64_t tl = tiles_of(x->p, x->d);
            if (tiles + tl > INT32_MAX / 2) break;
            sg_entry &E = P.e[j++];
            E.L = *x;
            if (!x->sgb) { /* no bias output */
                E.L.bias = nullptr;
                E.L.out_b.dst = nullptr;
            }
            E.tiles_n = (x->d + 127) / 128;
            E.tiles = (int)tl;
            E.tile0 = (int)tiles;
            tiles += tl;
            if (x->out_w.dtype != dt) dt = SG_ANY;
        }
        if (j == 0) return cudaErrorInvalidConfiguration;
        P.n = j;
        P.tiles = (int)tiles;
        P.B = B;
        P.std = std;
        P.divisor = divisor;
        P.mode = mode;
        P.status = status;
        P.bad = bad;
        P.commit = commit;
        P.acc = acc;
        sg_pick(noise, dt)<<<(unsigned)tiles, DCC_SG_THREADS, 0, st>>>(P);
        cudaError_t e = cudaGetLastError();
        if (e != cudaSuccess) return e;
    }
}

extern "C" cudaError_t dcc_sgrad_sum(const dcc_sg_layer *ls, int n, int B, float std, float divisor,
                                     const uint32_t *mode, uint32_t *status,
                                     unsigned long long *bad, int acc, int noise, cudaStream_t st) {
    return sg_launch(ls, n, B, std, divisor, mode, status, bad, 0, acc, noise, st);
}

extern "C" cudaError_t dcc_sgrad_commit(const dcc_sg_layer *ls, int n, int B, float std,
                                        float divisor, const uint32_t *mode, uint32_t *status,
                                        int acc, int noise, cudaStream_t st) {
    return sg_launch(ls, n, B, std, divisor, mode, status, NULL, 1, acc, noise, st);
}
