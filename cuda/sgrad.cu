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

#include "dcc_out.cuh"
#include "dcc_util.cuh"

namespace {

constexpr int SGMAXL = 80; /* layers a launch's parameters hold */

struct sg_entry {
    const uint4 *sg;
    const float *sgb, *cs;
    float *w, *bias;
    unsigned *amax_w, *amax_b;
    uint64_t key_w, step_w, key_b, step_b; /* the outputs' noise (dcc_out) */
    uint32_t stream_w, stream_b;
    void *dst_w, *dst_b; /* written in mode 1 */
    int32_t dtype_w, dtype_b;
    int d, p, tiles_n, tiles, tile0;
};
struct sg_params {
    sg_entry e[SGMAXL];
    const uint32_t *mode; /* dcc_out_check's; NULL: staging */
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

constexpr int SG_MAXB = 64; /* coefficients staged in shared memory a pass */

/* The pass is issue-bound on the draws as much as memory-bound: four CTAs an
 * SM (64 registers), with the next chunk's first four samples loading
 * while a chunk's draws are made, measured best on an H100 (the kept
 * phase of a Llama-1B-like step 7.4 -> 6.8 ms, GPT-2-small 1.00 -> 0.96;
 * no bound at 78 registers, 5 or 6 CTAs with or without the prefetch were
 * in between or worse). */
constexpr int SG_MIN_CTAS = 4;
template <int NOISE>
__global__ void __launch_bounds__(DCC_SG_THREADS, SG_MIN_CTAS)
    sgrad_sum(const __grid_constant__ sg_params P) {
    __shared__ float c[SG_MAXB];
    const sg_entry &E = P.e[sg_find(P, (int)blockIdx.x)];
    const int t = (int)blockIdx.x - E.tile0, tn = t % E.tiles_n;
    const int m0 = (t / E.tiles_n) * 256, n0 = tn * 128, B = P.B, d = E.d, p = E.p;
    const int tid = (int)threadIdx.x;
    const bool direct = P.mode && *P.mode != 0;
    const dcc_div div = dcc_div_make(P.divisor);
    /* the output's pairs (2q, 2q + 1) share a draw; a pair's two elements
     * are columns n, n + 1 of one row, held by lanes 4 apart: the lane with
     * the even column draws the pairs of its elements 0-3, its partner
     * those of its 4-7, and they swap the halves they do not keep */
    const bool even = ((tid >> 2) & 1) == 0;
    const int64_t per_sample = (int64_t)E.tiles * (DCC_SG_TILE / 8); /* uint4 */
    const uint4 *base = E.sg + (int64_t)t * (DCC_SG_TILE / 8) + tid;
    unsigned am = 0;
    /* a batch's coefficients fit once (the usual case): staged once, not per chunk */
    const bool once = B <= SG_MAXB;
    if (once) {
        if (tid < B) c[tid] = E.cs[tid];
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
                if (tid < nb) c[tid] = E.cs[b0 + tid];
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
                for (int u = 0; u < 4; u++) {
                    const float ck = c[k + u];
                    const uint32_t w[4] = {v[u].x, v[u].y, v[u].z, v[u].w};
#pragma unroll
                    for (int h = 0; h < 4; h++) {
                        acc[2 * h] = fmaf(ck, __uint_as_float(w[h] << 16), acc[2 * h]);
                        acc[2 * h + 1] =
                            fmaf(ck, __uint_as_float(w[h] & 0xffff0000u), acc[2 * h + 1]);
                    }
                }
            }
            for (; k < nb; k++) {
                const uint4 v =
                    ld_stream(base + (int64_t)(b0 + k) * per_sample + j * DCC_SG_THREADS);
                const float ck = c[k];
                const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
                for (int h = 0; h < 4; h++) {
                    acc[2 * h] = fmaf(ck, __uint_as_float(w[h] << 16), acc[2 * h]);
                    acc[2 * h + 1] = fmaf(ck, __uint_as_float(w[h] & 0xffff0000u), acc[2 * h + 1]);
                }
            }
        }
        /* the next chunk's first loads in flight during the draws */
        if (B >= 4 && j + 1 < DCC_SG_CHUNKS)
#pragma unroll
            for (int u = 0; u < 4; u++)
                pre[u] = ld_stream(base + (int64_t)u * per_sample + (j + 1) * DCC_SG_THREADS);
        if (P.std != 0.0f) {
            float z[8];
#pragma unroll
            for (int s = 0; s < 4; s++) {
                int ma, na, mb, nb;
                dcc_wide_at(8 * j + s, m0, n0, ma, na);
                dcc_wide_at(8 * j + 4 + s, m0, n0, mb, nb);
                const int m = even ? ma : mb, n = even ? na : nb;
                float z0, z1;
                draw_pair(NOISE, E.key_w, E.step_w, E.stream_w,
                          (uint64_t)(((int64_t)m * d + n) >> 1), z0, z1);
                const float keep = even ? z0 : z1;
                const float other = __shfl_xor_sync(0xffffffffu, even ? z1 : z0, 4);
                z[s] = even ? keep : other;
                z[4 + s] = even ? other : keep;
            }
#pragma unroll
            for (int k = 0; k < 8; k++) acc[k] = dcc_noised(acc[k], P.std, z[k]);
        }
#pragma unroll
        for (int k = 0; k < 8; k++) {
            int m, n;
            dcc_wide_at(8 * j + k, m0, n0, m, n);
            if (m < p && n < d) {
                const int64_t i = (int64_t)m * d + n;
                if (direct) {
                    dcc_store_as(E.dst_w, E.dtype_w, (uint64_t)i,
                                 P.divisor != 1.0f ? dcc_div_by(div, acc[k]) : acc[k]);
                } else {
                    E.w[i] = acc[k];
                    am = max(am, dcc_abs_bits(acc[k]));
                }
            }
        }
    }
    if (E.amax_w && !direct) dcc_warp_amax(E.amax_w, am);
    if (E.bias && tn == 0) {
        const int m = m0 + tid;
        float y = 0.0f;
        if (m < p)
            for (int b = 0; b < B; b++) y = fmaf(E.cs[b], E.sgb[(int64_t)b * p + m], y);
        if (P.std != 0.0f) { /* pairs of adjacent rows: each thread draws its own */
            float z0, z1;
            draw_pair(NOISE, E.key_b, E.step_b, E.stream_b, (uint64_t)(m >> 1), z0, z1);
            y = dcc_noised(y, P.std, (m & 1) ? z1 : z0);
        }
        if (direct) {
            if (m < p)
                dcc_store_as(E.dst_b, E.dtype_b, (uint64_t)m, P.divisor != 1.0f ? dcc_div_by(div, y) : y);
        } else {
            if (m < p) E.bias[m] = y;
            if (E.amax_b) dcc_warp_amax(E.amax_b, m < p ? dcc_abs_bits(y) : 0u);
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

extern "C" cudaError_t dcc_sgrad_sum(const dcc_sg_layer *ls, int n, int B, float std,
                                     float divisor, const uint32_t *mode, int noise,
                                     cudaStream_t st) {
    int i = 0;
    if (B <= 0) return cudaErrorInvalidValue;
    while (i < n) {
        sg_params P;
        memset(&P, 0, sizeof P);
        int64_t tiles = 0;
        int j = 0;
        for (; j < SGMAXL && i + j < n; j++) {
            const dcc_sg_layer *x = &ls[i + j];
            sg_entry &E = P.e[j];
            const int64_t tl = tiles_of(x->p, x->d);
            if (tiles + tl > INT32_MAX / 2) break;
            E.sg = (const uint4 *)x->sg;
            E.sgb = x->sgb;
            E.cs = x->cs;
            E.w = x->w;
            E.bias = x->sgb ? x->bias : nullptr;
            E.amax_w = x->amax_w;
            E.amax_b = x->amax_b;
            E.key_w = x->key_w;
            E.step_w = x->step_w;
            E.stream_w = x->stream_w;
            E.key_b = x->key_b;
            E.step_b = x->step_b;
            E.stream_b = x->stream_b;
            E.dst_w = x->dst_w;
            E.dst_b = x->sgb ? x->dst_b : nullptr;
            E.dtype_w = x->dtype_w;
            E.dtype_b = x->dtype_b;
            E.d = x->d;
            E.p = x->p;
            E.tiles_n = (x->d + 127) / 128;
            E.tiles = (int)tl;
            E.tile0 = (int)tiles;
            tiles += tl;
        }
        if (j == 0) return cudaErrorInvalidConfiguration;
        P.n = j;
        P.tiles = (int)tiles;
        P.B = B;
        P.std = std;
        P.divisor = divisor;
        P.mode = mode;
        auto kern = noise == DCC_NOISE_EXACT ? sgrad_sum<DCC_NOISE_EXACT>
                                             : sgrad_sum<DCC_NOISE_FAST>;
        kern<<<(unsigned)tiles, DCC_SG_THREADS, 0, st>>>(P);
        cudaError_t e = cudaGetLastError();
        if (e != cudaSuccess) return e;
        i += j;
    }
    return cudaSuccess;
}
