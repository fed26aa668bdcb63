/* Coefficients, the small clipped-sum kernels, noise, and the gated commit.
 *
 * Atomic outputs on one synchronisation per step: every output is computed
 * into an f32 staging area (as the CPU backend does in host memory), noised
 * and divided there by dcc_finalize, which also checks that each value is
 * finite in its output dtype; dcc_commit then copies staging into the
 * outputs only if the step's status word is still 0. The status word is set
 * on the device by dcc_coefs (bad inputs) and dcc_finalize (bad outputs), so
 * the host never waits in between.
 *
 * The one-pass variant (dcc_out_check / dcc_out_write / dcc_out_commit)
 * proves first that no output can overflow its dtype (a bound from max
 * |staging| per output and the largest possible draw), and then writes the
 * noised values straight into the outputs: one read of staging less, one
 * write less, and no commit pass. Steps that fail the bound (or a bad input)
 * fall back to the staged two-pass path inside the same kernels.
 *
 * Noise: dcc_noise.cuh (Philox4x32-10 and Box-Muller, bit for bit as
 * daemon/compute/noise.c). Outputs whose noise the sum of kept per-sample
 * gradients adds (dcc_out.noised, sgrad.cu), or the grouped clipped sum's
 * direct epilogue (grouped_tma.cu), get none here: those sums run after the
 * check, on a bound known before it (dcc_out.bound), and in the one-pass
 * mode write them themselves; the unstaged ones (dcc_out.unstaged) have no
 * staging at all, and their kernels check them in mode 0 and write them in
 * a commit launch.
 * Arithmetic that must round like the CPU's is written with __fmul_rn /
 * __fadd_rn / __fdiv_rn (no contraction to FMA). */
#include <float.h>

#include "dcc.h"
#include "dcc_out.cuh"
#include "dcc_util.cuh"

namespace {

constexpr int NT = 256;

/* As dc_clip_coef (step.c), the same double arithmetic (no contraction)
 * rounded down to f32: min(1, C / (norm (1 + e) + 1e-6)), where norm (1 +
 * e) bounds the exact norm of what the sums release. A norm or e that is
 * not finite gives 0, never 1 (the status word already fails such a step;
 * this keeps the coefficient safe too). */
__device__ __forceinline__ float clip_coef(float C, double norm, double e) {
    if (!(norm >= 0.0 && norm <= DBL_MAX) || !(e >= 0.0 && e <= DBL_MAX) || !(C >= 0.0f))
        return 0.0f;
    const double c = __ddiv_rn((double)C, __dadd_rn(__dmul_rn(norm, __dadd_rn(1.0, e)), 1e-6));
    const float f = __double2float_rz(c);
    return f < 1.0f ? f : 1.0f;
}

__global__ void coefs_kernel(const float *__restrict__ n2, const uint32_t *__restrict__ flags,
                             const double *__restrict__ tot_in, const float *__restrict__ count,
                             int L, int B, int per_layer, float C, double e,
                             const float *__restrict__ layer_C, const double *__restrict__ layer_e,
                             float scale, float *__restrict__ norms, float *__restrict__ coefs,
                             float *__restrict__ lcoef, float *__restrict__ cs,
                             uint32_t *__restrict__ status) {
    for (int b = (int)(blockIdx.x * blockDim.x + threadIdx.x); b < B;
         b += (int)(gridDim.x * blockDim.x)) {
        double tot = 0.0;
        bool bad = false;
        for (int l = 0; l < L; l++) {
            float v = n2[(int64_t)l * B + b];
            /* count[l] 0: left out of the norm (a fused group step's layer
             * another member counts), its own norm still checked */
            if (!count || count[l] != 0.0f) tot += (double)v;
            bad |= !dcc_isfinite(v) || flags[(int64_t)l * B + b] != 0;
        }
        if (tot_in) { /* a norm group's total over every member's layers */
            tot = tot_in[b];
            bad |= !(fabs(tot) <= DBL_MAX);
        }
        const double nd = __dsqrt_rn(tot);
        float cb = per_layer ? 1.0f : clip_coef(C, nd, e);
        norms[b] = (float)nd;
        coefs[b] = cb;
        for (int l = 0; l < L; l++) {
            int64_t i = (int64_t)l * B + b;
            float c = cb;
            if (per_layer) {
                c = clip_coef(layer_C[l], __dsqrt_rn((double)n2[i]), layer_e[l]);
                lcoef[i] = c;
            }
            /* rounded down: a sum's multiplier never exceeds c times the
             * scale (dc_clip_scaled) */
            cs[i] = __fmul_rz(c, scale);
        }
        if (bad) atomicOr(status, DCC_STATUS_INPUT);
    }
}

/* Ascending coefficient order and Horner factors for the grouped
 * book-keeping (dcc_bk_order): one block per layer, ranks by counting
 * (B is a batch, so B^2 compares are cheap). NaN sorts last. */
__global__ void bk_order_kernel(const float *__restrict__ cs, int B, int *__restrict__ perm,
                                float *__restrict__ fac) {
    const int l = (int)blockIdx.x;
    const float *c = cs + (int64_t)l * B;
    int *pm = perm + (int64_t)l * B;
    float *f = fac + (int64_t)l * B;
    for (int b = (int)threadIdx.x; b < B; b += (int)blockDim.x) {
        float v = c[b];
        if (v != v) v = __int_as_float(0x7f800000);
        int rank = 0;
        for (int j = 0; j < B; j++) {
            float w = c[j];
            if (w != w) w = __int_as_float(0x7f800000);
            rank += w < v || (w == v && j < b);
        }
        pm[rank] = b;
    }
    __syncthreads();
    for (int k = (int)threadIdx.x; k < B; k += (int)blockDim.x) {
        if (k == 0) {
            f[0] = c[pm[B - 1]];
        } else {
            float den = c[pm[k]];
            f[k] = den > 0.0f ? __fdiv_rn(c[pm[k - 1]], den) : 0.0f;
        }
    }
}

constexpr int BIAS_ROWS = 128;

template <typename TG>
__global__ void bias_clipped(const TG *__restrict__ g, int T, int p, uint32_t mask,
                             const float *__restrict__ cs, float *__restrict__ out) {
    int j = (int)(blockIdx.x * blockDim.x + threadIdx.x);
    int b = (int)blockIdx.y;
    int t0 = (int)blockIdx.z * BIAS_ROWS, t1 = min(T, t0 + BIAS_ROWS);
    if (j >= p) return;
    float s = 0.0f;
    for (int t = t0; t < t1; t++)
        s += __uint_as_float(__float_as_uint(dcc_ld(g, ((int64_t)b * T + t) * p + j)) & mask);
    atomicAdd(out + j, cs[b] * s);
}

template <typename TA, typename TG>
__global__ void rows_f32(const TA *__restrict__ a, const TG *__restrict__ g, int T, int d, int p,
                         int64_t r0, int R, const float *__restrict__ cs, float *__restrict__ af,
                         float *__restrict__ gf) {
    int64_t na = (int64_t)R * d, ng = (int64_t)R * p;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < na + ng;
         i += (int64_t)gridDim.x * blockDim.x) {
        if (i < na) {
            af[i] = dcc_ld(a, r0 * d + i);
        } else {
            int64_t k = i - na, row = r0 + k / p;
            gf[k] = cs[row / T] * dcc_ld(g, r0 * p + k);
        }
    }
}

__global__ void finalize_kernel(const dcc_out *__restrict__ outs, float *__restrict__ staging,
                                float std, float divisor, uint32_t *__restrict__ status,
                                unsigned long long *__restrict__ bad, int noise) {
    const int oi = (int)blockIdx.y;
    const dcc_out o = outs[oi];
    if (o.unstaged) return; /* the kept sum checks it (sgrad.cu) */
    float *v = staging + o.off;
    uint64_t npairs = (o.n + 1) / 2;
    for (uint64_t pr = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; pr < npairs;
         pr += (uint64_t)gridDim.x * blockDim.x) {
        uint64_t i = 2 * pr;
        bool two = i + 1 < o.n;
        float v0 = v[i], v1 = two ? v[i + 1] : 0.0f;
        const bool n0 = dcc_noise_in(o, i), n1 = two && dcc_noise_in(o, i + 1);
        if (std != 0.0f && !o.noised && (n0 || n1)) {
            float z0, z1;
            draw_pair(noise, o.key, o.step, o.stream, pr, z0, z1);
            if (n0) v0 = dcc_noised(v0, std, z0);
            if (n1) v1 = dcc_noised(v1, std, z1);
        }
        if (divisor != 1.0f) {
            v0 = __fdiv_rn(v0, divisor);
            v1 = __fdiv_rn(v1, divisor);
        }
        v[i] = v0;
        if (two) v[i + 1] = v1;
        bool b0 = dcc_bad_as(v0, o.dtype), b1 = two && dcc_bad_as(v1, o.dtype);
        if (b0 || b1) {
            dcc_out_fail(status, bad, oi, b0 ? i : i + 1);
        }
    }
}

/* zero != 0: a failed step writes zeros (a step with an early notice, whose
 * outputs the client may already consume). */
__global__ void commit_kernel(const dcc_out *__restrict__ outs, const float *__restrict__ staging,
                              const uint32_t *__restrict__ status, int zero) {
    const bool ok = *status == 0;
    if (!ok && !zero) return;
    const dcc_out o = outs[blockIdx.y];
    if (ok && o.unstaged) return; /* the kept sum writes it (dcc_sgrad_commit) */
    const float *v = staging + o.off;
    for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < o.n;
         i += (uint64_t)gridDim.x * blockDim.x) {
        const float x = ok ? v[i] : 0.0f;
        switch (o.dtype) {
        case DC_F32: ((float *)o.dst)[i] = x; break;
        case DC_BF16: ((__nv_bfloat16 *)o.dst)[i] = __float2bfloat16_rn(x); break;
        case DC_F16: ((__half *)o.dst)[i] = __float2half_rn(x); break;
        default: break;
        }
    }
}

__global__ void commit_vec_kernel(const uint32_t *__restrict__ status,
                                  const float *__restrict__ norms, float *__restrict__ norms_out,
                                  const float *__restrict__ coefs, float *__restrict__ coefs_out,
                                  int B, int zero) {
    const bool ok = *status == 0;
    if (!ok && !zero) return;
    for (int b = (int)(blockIdx.x * blockDim.x + threadIdx.x); b < B;
         b += (int)(gridDim.x * blockDim.x)) {
        if (norms_out) norms_out[b] = ok ? norms[b] : 0.0f;
        if (coefs_out) coefs_out[b] = ok ? coefs[b] : 0.0f;
    }
}

template <typename TX>
__global__ void find_bad_float(const TX *__restrict__ x, uint64_t n,
                               unsigned long long *__restrict__ first) {
    for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (uint64_t)gridDim.x * blockDim.x)
        if (!dcc_isfinite(dcc_ld(x, (int64_t)i))) atomicMin(first, (unsigned long long)i);
}

template <typename TI>
__global__ void find_bad_index(const TI *__restrict__ x, uint64_t n, int64_t vocab,
                               unsigned long long *__restrict__ first) {
    for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (uint64_t)gridDim.x * blockDim.x) {
        int64_t v = (int64_t)x[i];
        if (v < 0 || v >= vocab) atomicMin(first, (unsigned long long)i);
    }
}

__global__ void noise_kernel(uint64_t key, uint64_t step, uint32_t stream, float *out, uint64_t n,
                             int noise) {
    uint64_t npairs = (n + 1) / 2;
    for (uint64_t pr = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; pr < npairs;
         pr += (uint64_t)gridDim.x * blockDim.x) {
        float z0, z1;
        draw_pair(noise, key, step, stream, pr, z0, z1);
        out[2 * pr] = z0;
        if (2 * pr + 1 < n) out[2 * pr + 1] = z1;
    }
}

/* Box-Muller alone, from given Philox words (4 per pair): lets a test
 * reach the transform's edges (u1 near 0 and 1, octant borders) that random
 * counters would take billions of draws to hit. */
__global__ void box_muller_kernel(const uint32_t *__restrict__ words, float *__restrict__ out,
                                  uint64_t npairs, int noise) {
    for (uint64_t pr = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; pr < npairs;
         pr += (uint64_t)gridDim.x * blockDim.x) {
        const uint32_t c[4] = {words[4 * pr], words[4 * pr + 1], words[4 * pr + 2],
                               words[4 * pr + 3]};
        box_muller(noise, c, out[2 * pr], out[2 * pr + 1]);
    }
}

__global__ void fdiv_kernel(const float *__restrict__ x, float *__restrict__ out, uint64_t n,
                            float d) {
    const dcc_div f = dcc_div_make(d);
    for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (uint64_t)gridDim.x * blockDim.x) {
        out[2 * i] = dcc_div_by(f, x[i]);
        out[2 * i + 1] = __fdiv_rn(x[i], d);
    }
}

/* --- the one-pass output path --------------------------------------------- */

/* The one-pass kernels walk the chunk grid grid-stride: block b takes the
 * chunks c = b (mod G) of every output that `skip` does not say this pass
 * leaves alone, so that a pass costs its work, not a block for every chunk
 * of every output (a Llama-1B-like step has 139K chunks, nearly all of
 * them kept sums' outputs that the passes skip: its write pass took 0.48
 * ms, 0.30-0.32 without them, its commit 0.094 ms, 0.005). The block's
 * threads look at NT outputs at once and list those it has a chunk of, so
 * a block that has none costs one round of loads, not a walk of the table
 * (which took GPT-2-small's write pass, 144 outputs all skipped, to 0.051
 * ms; the list to 0.006). `body(oi, o, i0, i1)` gets output oi's elements
 * [i0, i1); it runs for the whole block, so it may synchronise it. */
template <typename Skip, typename Body>
__device__ __forceinline__ void out_chunks(const dcc_out *__restrict__ outs, int n_out, Skip skip,
                                           Body body) {
    __shared__ int work[NT];
    __shared__ int n_work;
    const uint64_t G = gridDim.x, b = blockIdx.x;
    for (int base = 0; base < n_out; base += NT) {
        if (threadIdx.x == 0) n_work = 0;
        __syncthreads();
        const int oi = base + (int)threadIdx.x;
        if (oi < n_out) {
            const uint64_t c0 = outs[oi].chunk0, n = outs[oi].n;
            const uint64_t first = c0 + (b + G - c0 % G) % G; /* = b (mod G) */
            if ((first - c0) * DCC_OUT_CHUNK < n && !skip(outs[oi]))
                work[atomicAdd(&n_work, 1)] = oi; /* any order: chunks are independent */
        }
        __syncthreads();
        const int nw = n_work;
        for (int w = 0; w < nw; w++) {
            const dcc_out o = outs[work[w]];
            for (uint64_t c = o.chunk0 + (b + G - o.chunk0 % G) % G;
                 (c - o.chunk0) * DCC_OUT_CHUNK < o.n; c += G) {
                const uint64_t i0 = (c - o.chunk0) * DCC_OUT_CHUNK;
                body(work[w], o, i0, i0 + DCC_OUT_CHUNK < o.n ? i0 + DCC_OUT_CHUNK : o.n);
            }
        }
        __syncthreads(); /* the list is read before the next round writes it */
    }
}

__global__ void out_amax_kernel(const dcc_out *__restrict__ outs, int n_out,
                                const float *__restrict__ staging, unsigned *__restrict__ amax,
                                const uint32_t *__restrict__ status) {
    __shared__ unsigned part[NT / 32];
    if (*status != 0) return; /* nothing will be written: skip the pass */
    /* the grouped clipped sum's epilogue found it, or (noised) its bound
     * stands for it: the kept sum has not run yet */
    auto skip = [](const dcc_out &o) { return o.amax_found || o.noised; };
    out_chunks(outs, n_out, skip, [&](int oi, const dcc_out &o, uint64_t i0, uint64_t i1) {
        const float *v = staging + o.off; /* 16-byte aligned, as are the chunks */
        unsigned m = 0;
        static_assert(DCC_OUT_CHUNK == 8 * 4 * NT, "a chunk is 8 float4 per thread");
        float4 q[8];
#pragma unroll
        for (int k = 0; k < 8; k++) { /* all loads in flight before the first use */
            uint64_t i = i0 + 4 * (threadIdx.x + (uint64_t)k * NT);
            if (i + 4 <= i1) {
                q[k] = *(const float4 *)(v + i);
            } else {
                float t[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
                for (int j = 0; j < 4; j++)
                    if (i + j < i1) t[j] = v[i + j];
                q[k] = make_float4(t[0], t[1], t[2], t[3]);
            }
        }
#pragma unroll
        for (int k = 0; k < 8; k++)
            m = max(max(m, max(dcc_abs_bits(q[k].x), dcc_abs_bits(q[k].y))),
                    max(dcc_abs_bits(q[k].z), dcc_abs_bits(q[k].w)));
        m = dcc_warp_max(m);
        if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = m;
        __syncthreads();
        if (threadIdx.x == 0) {
            for (int w = 1; w < NT / 32; w++) m = max(m, part[w]);
            atomicMax(amax + oi, m);
        }
        __syncthreads(); /* part is read before the next chunk writes it */
    });
}

__global__ void out_decide_kernel(const dcc_out *__restrict__ outs, int n_out,
                                  const unsigned *__restrict__ amax, float std, float divisor,
                                  const uint32_t *__restrict__ status,
                                  uint32_t *__restrict__ mode) {
    bool ok = true;
    for (int oi = (int)threadIdx.x; oi < n_out; oi += (int)blockDim.x) {
        /* a noised output's sum is made after this check (the kept
         * gradients' pass, which writes it itself in mode 1): its bound
         * stands for its max, and 0 (none known) fails the test */
        const bool noised = outs[oi].noised != 0;
        float m = noised ? (outs[oi].bound > 0.0f ? outs[oi].bound : __int_as_float(0x7fc00000))
                         : __uint_as_float(amax[oi]);
        if (!(dcc_isfinite(m) && dcc_fits_dtype(m, outs[oi].dtype, std, divisor))) ok = false;
    }
    ok = __syncthreads_and(ok);
    if (threadIdx.x == 0) *mode = ok && *status == 0 ? 1u : 0u;
}

/* Output oi's elements [i0, i1) (one chunk), four elements (two draws:
 * pairs (2j, 2j+1) of the output share one, as in finalize_kernel) per
 * thread and step, with 16-byte staging loads (offsets and chunks are
 * multiples of 4). Mode 1 (direct): straight into dst (vector stores where
 * dst is aligned); mode 0: back into staging with the dtype check
 * (dcc_out_commit converts later). */
template <int NOISE>
__device__ __forceinline__ void write_chunk(int oi, const dcc_out &o, uint64_t i0, uint64_t i1,
                                            float *__restrict__ staging, float std,
                                            const dcc_div &div, bool direct,
                                            uint32_t *__restrict__ status,
                                            unsigned long long *__restrict__ bad) {
    float *v = staging + o.off;
    const bool vec_dst = ((uintptr_t)o.dst & (uintptr_t)(o.dtype == DC_F32 ? 15 : 7)) == 0;
    /* a sums step's noise range (dcc_out.nz_*), per chunk: every element
     * in (always without a range: the draws as they were), none in, or
     * decided per element */
    const bool rows = o.nz_mod == 0;
    const bool all_in = rows && i0 >= o.nz_lo && i1 <= o.nz_hi;
    const bool none_in = rows && (i1 <= o.nz_lo || i0 >= o.nz_hi);
    for (uint64_t i = i0 + 4 * threadIdx.x; i < i1; i += 4 * NT) {
        const int cnt = i + 4 <= i1 ? 4 : (int)(i1 - i);
        float x[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        if (cnt == 4) {
            float4 q = *(const float4 *)(v + i);
            x[0] = q.x;
            x[1] = q.y;
            x[2] = q.z;
            x[3] = q.w;
        } else { /* constant indices keep x in registers */
#pragma unroll
            for (int j = 0; j < 4; j++)
                if (j < cnt) x[j] = v[i + j];
        }
        if (std != 0.0f && !o.noised && all_in) {
            float z[4];
            draw_pair(NOISE, o.key, o.step, o.stream, i / 2, z[0], z[1]);
            if (cnt > 2) draw_pair(NOISE, o.key, o.step, o.stream, i / 2 + 1, z[2], z[3]);
            else z[2] = z[3] = 0.0f;
#pragma unroll
            for (int j = 0; j < 4; j++) x[j] = dcc_noised(x[j], std, z[j]);
        } else if (std != 0.0f && !o.noised && !none_in) {
            bool in[4];
#pragma unroll
            for (int j = 0; j < 4; j++) in[j] = j < cnt && dcc_noise_in(o, i + (uint64_t)j);
            float z[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            if (in[0] || in[1]) draw_pair(NOISE, o.key, o.step, o.stream, i / 2, z[0], z[1]);
            if (in[2] || in[3]) draw_pair(NOISE, o.key, o.step, o.stream, i / 2 + 1, z[2], z[3]);
#pragma unroll
            for (int j = 0; j < 4; j++)
                if (in[j]) x[j] = dcc_noised(x[j], std, z[j]);
        }
        if (div.d != 1.0f)
#pragma unroll
            for (int j = 0; j < 4; j++) x[j] = dcc_div_by(div, x[j]);
        if (direct) {
            if (cnt == 4 && vec_dst) {
                if (o.dtype == DC_F32) {
                    *(float4 *)((float *)o.dst + i) = make_float4(x[0], x[1], x[2], x[3]);
                } else {
                    uint32_t w[2];
                    for (int h = 0; h < 2; h++) {
                        uint16_t lo, hi;
                        if (o.dtype == DC_BF16) {
                            lo = __bfloat16_as_ushort(__float2bfloat16_rn(x[2 * h]));
                            hi = __bfloat16_as_ushort(__float2bfloat16_rn(x[2 * h + 1]));
                        } else {
                            lo = __half_as_ushort(__float2half_rn(x[2 * h]));
                            hi = __half_as_ushort(__float2half_rn(x[2 * h + 1]));
                        }
                        w[h] = (uint32_t)lo | (uint32_t)hi << 16;
                    }
                    *(uint2 *)((uint16_t *)o.dst + i) = make_uint2(w[0], w[1]);
                }
            } else {
#pragma unroll
                for (int j = 0; j < 4; j++)
                    if (j < cnt) dcc_store_as(o.dst, o.dtype, i + j, x[j]);
            }
            continue;
        }
        int first = -1;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            if (j >= cnt) break;
            v[i + j] = x[j];
            if (first < 0 && dcc_bad_as(x[j], o.dtype)) first = j;
        }
        if (first >= 0) {
            dcc_out_fail(status, bad, oi, i + (uint64_t)first);
        }
    }
}

template <int NOISE> /* a kernel per noise kind: one inlined Box-Muller each */
__global__ void out_write_kernel(const dcc_out *__restrict__ outs, int n_out,
                                 float *__restrict__ staging, float std, float divisor,
                                 const uint32_t *__restrict__ mode, uint32_t *__restrict__ status,
                                 unsigned long long *__restrict__ bad) {
    const bool direct = *mode != 0;
    if (!direct && (*status & DCC_STATUS_INPUT)) return; /* the step fails anyway */
    /* mode 1: the kept sum wrote the noised outputs (sgrad.cu); mode 0:
     * it checked the unstaged ones */
    auto skip = [direct](const dcc_out &o) { return o.noised && (direct || o.unstaged); };
    const dcc_div div = dcc_div_make(divisor); /* once a block: the step's one divisor */
    out_chunks(outs, n_out, skip, [&](int oi, const dcc_out &o, uint64_t i0, uint64_t i1) {
        write_chunk<NOISE>(oi, o, i0, i1, staging, std, div, direct, status, bad);
    });
}

__global__ void out_commit_kernel(const dcc_out *__restrict__ outs, int n_out,
                                  const float *__restrict__ staging,
                                  const uint32_t *__restrict__ mode,
                                  const uint32_t *__restrict__ status, int zero) {
    /* mode 1 wrote the outputs already. It fails only where a direct sum
     * (grouped_tma.cu) read a client's buffers rewritten since the check:
     * then, as in mode 0, zeros everywhere with zero_on_fail instead of a
     * step's part written */
    if ((*mode != 0 && *status == 0) || (*status != 0 && !zero)) return;
    const bool ok = *status == 0;
    /* the unstaged outputs' values are the kept sum's to write
     * (dcc_sgrad_commit); their zeros are this pass's */
    out_chunks(
        outs, n_out, [ok](const dcc_out &o) { return ok && o.unstaged; },
        [&](int, const dcc_out &o, uint64_t i0, uint64_t i1) {
            for (uint64_t i = i0 + threadIdx.x; i < i1; i += NT)
                dcc_store_as(o.dst, o.dtype, i, ok ? staging[o.off + i] : 0.0f);
        });
}

unsigned blocks_for(uint64_t n, unsigned cap) {
    uint64_t b = (n + NT - 1) / NT;
    if (b < 1) b = 1;
    return b > cap ? cap : (unsigned)b;
}

} // namespace

extern "C" cudaError_t dcc_coefs(const float *n2, const uint32_t *flags, const float *count, int L,
                                 int B, bool per_layer, float C, double e, const float *layer_C,
                                 const double *layer_e, float grad_scale, float *norms,
                                 float *coefs, float *lcoef, float *cs, uint32_t *status,
                                 cudaStream_t st) {
    coefs_kernel<<<blocks_for((uint64_t)B, 1024), NT, 0, st>>>(n2, flags, NULL, count, L, B,
                                                               per_layer, C, e, layer_C, layer_e,
                                                               grad_scale, norms, coefs, lcoef, cs,
                                                               status);
    return cudaGetLastError();
}

extern "C" cudaError_t dcc_coefs_tot(const float *n2, const uint32_t *flags, const double *tot,
                                     int L, int B, float C, double e, float grad_scale,
                                     float *norms, float *coefs, float *cs, uint32_t *status,
                                     cudaStream_t st) {
    coefs_kernel<<<blocks_for((uint64_t)B, 1024), NT, 0, st>>>(n2, flags, tot, NULL, L, B, 0, C, e,
                                                               NULL, NULL, grad_scale, norms, coefs,
                                                               NULL, cs, status);
    return cudaGetLastError();
}

extern "C" cudaError_t dcc_bk_order(const float *cs, int L, int B, int *perm, float *fac,
                                    cudaStream_t st) {
    if (L <= 0 || B <= 0) return cudaSuccess;
    /* clang-format 14 takes `B < 1024` inside <<<...>>> for a template */
    /* clang-format off */
    bk_order_kernel<<<(unsigned)L, B < 1024 ? (unsigned)((B + 31) / 32 * 32) : 1024u, 0, st>>>(
        cs, B, perm, fac);
    /* clang-format on */
    return cudaGetLastError();
}

extern "C" cudaError_t dcc_bias_clipped_sum(const void *g, dc_dtype tg, int B, int T, int p,
                                            bool tf32, const float *cs, float *out,
                                            cudaStream_t st) {
    const uint32_t mask = tf32 && tg == DC_F32 ? DCC_TF32_MASK : 0xffffffffu;
    return dcc_with_float(tg, [&](auto t) {
        using TG = DCC_TYPE_OF(t);
        dim3 grid((unsigned)((p + NT - 1) / NT), (unsigned)B,
                  (unsigned)((T + BIAS_ROWS - 1) / BIAS_ROWS));
        bias_clipped<TG><<<grid, NT, 0, st>>>((const TG *)g, T, p, mask, cs, out);
        return cudaGetLastError();
    });
}

extern "C" cudaError_t dcc_rows_to_f32(const void *a, dc_dtype ta, const void *g, dc_dtype tg,
                                       int T, int d, int p, int64_t r0, int R, const float *cs,
                                       float *af, float *gf, cudaStream_t st) {
    return dcc_with_float(ta, [&](auto xa) {
        return dcc_with_float(tg, [&](auto xg) {
            using TA = DCC_TYPE_OF(xa);
            using TG = DCC_TYPE_OF(xg);
            rows_f32<TA, TG><<<blocks_for((uint64_t)R * (uint64_t)(d + p), 4096), NT, 0, st>>>(
                (const TA *)a, (const TG *)g, T, d, p, r0, R, cs, af, gf);
            return cudaGetLastError();
        });
    });
}

extern "C" cudaError_t dcc_finalize(const dcc_out *outs, int n_out, uint64_t max_n, float *staging,
                                    float std, float divisor, uint32_t *status,
                                    unsigned long long *bad, int noise, cudaStream_t st) {
    if (n_out <= 0) return cudaSuccess;
    if (n_out > 65535) return cudaErrorInvalidValue;
    dim3 grid(blocks_for((max_n + 1) / 2, 2048), (unsigned)n_out);
    finalize_kernel<<<grid, NT, 0, st>>>(outs, staging, std, divisor, status, bad, noise);
    return cudaGetLastError();
}

/* A grid-stride pass's blocks (out_chunks): as many as an SM holds (2048
 * threads) on every SM, or max_blocks when positive; at most a block per
 * chunk. (Not the kernel's occupancy query: one more driver call a pass and
 * step, where a second partial wave costs nothing here.) */
extern "C" cudaError_t dcc_out_grid(uint64_t n_chunks, int max_blocks, unsigned *grid) {
    int sms = 0;
    cudaError_t e = max_blocks > 0 ? cudaSuccess : dcc_sm_count(&sms);
    if (e != cudaSuccess) return e;
    const uint64_t full = max_blocks > 0 ? (uint64_t)max_blocks
                                         : (uint64_t)(sms > 0 ? sms : 1) * (2048 / NT);
    *grid = (unsigned)(n_chunks < full ? (n_chunks > 0 ? n_chunks : 1) : full);
    return cudaSuccess;
}

extern "C" cudaError_t dcc_out_check(const dcc_out *outs, int n_out, unsigned grid,
                                     const float *staging, float std, float divisor, float *amax,
                                     bool scan, const uint32_t *status, uint32_t *mode,
                                     cudaStream_t st) {
    if (n_out <= 0) return cudaSuccess;
    if (scan) {
        out_amax_kernel<<<grid, NT, 0, st>>>(outs, n_out, staging, (unsigned *)amax, status);
        cudaError_t e = cudaGetLastError();
        if (e != cudaSuccess) return e;
    }
    out_decide_kernel<<<1, 1024, 0, st>>>(outs, n_out, (const unsigned *)amax, std, divisor, status,
                                          mode);
    return cudaGetLastError();
}

extern "C" cudaError_t dcc_out_write(const dcc_out *outs, int n_out, unsigned grid, float *staging,
                                     float std, float divisor, const uint32_t *mode,
                                     uint32_t *status, unsigned long long *bad, int noise,
                                     cudaStream_t st) {
    if (n_out <= 0) return cudaSuccess;
    auto kern = noise == DCC_NOISE_EXACT ? out_write_kernel<DCC_NOISE_EXACT>
                                         : out_write_kernel<DCC_NOISE_FAST>;
    kern<<<grid, NT, 0, st>>>(outs, n_out, staging, std, divisor, mode, status, bad);
    return cudaGetLastError();
}

extern "C" cudaError_t dcc_out_commit(const dcc_out *outs, int n_out, unsigned grid,
                                      const float *staging, const uint32_t *mode,
                                      const uint32_t *status, int zero_on_fail, cudaStream_t st) {
    if (n_out <= 0) return cudaSuccess;
    out_commit_kernel<<<grid, NT, 0, st>>>(outs, n_out, staging, mode, status, zero_on_fail);
    return cudaGetLastError();
}

extern "C" cudaError_t dcc_commit(const dcc_out *outs, int n_out, uint64_t max_n,
                                  const float *staging, const uint32_t *status, const float *norms,
                                  float *norms_out, const float *coefs, float *coefs_out, int B,
                                  int zero_on_fail, cudaStream_t st) {
    if (n_out > 65535) return cudaErrorInvalidValue;
    if (n_out > 0) {
        dim3 grid(blocks_for(max_n, 2048), (unsigned)n_out);
        commit_kernel<<<grid, NT, 0, st>>>(outs, staging, status, zero_on_fail);
        cudaError_t e = cudaGetLastError();
        if (e != cudaSuccess) return e;
    }
    if (norms_out || coefs_out) {
        commit_vec_kernel<<<blocks_for((uint64_t)B, 64), NT, 0, st>>>(status, norms, norms_out,
                                                                      coefs, coefs_out, B,
                                                                      zero_on_fail);
        return cudaGetLastError();
    }
    return cudaSuccess;
}

extern "C" cudaError_t dcc_find_bad(const void *p, dc_dtype t, uint64_t n, int64_t vocab,
                                    unsigned long long *first, cudaStream_t st) {
    unsigned blocks = blocks_for(n, 4096);
    if (t == DC_I32) {
        find_bad_index<int32_t><<<blocks, NT, 0, st>>>((const int32_t *)p, n, vocab, first);
        return cudaGetLastError();
    }
    if (t == DC_I64) {
        find_bad_index<int64_t><<<blocks, NT, 0, st>>>((const int64_t *)p, n, vocab, first);
        return cudaGetLastError();
    }
    return dcc_with_float(t, [&](auto x) {
        using TX = DCC_TYPE_OF(x);
        find_bad_float<TX><<<blocks, NT, 0, st>>>((const TX *)p, n, first);
        return cudaGetLastError();
    });
}

extern "C" cudaError_t dcc_noise_box_muller(const uint32_t *words, float *out, uint64_t npairs,
                                            int noise, cudaStream_t st) {
    if (npairs == 0) return cudaSuccess;
    box_muller_kernel<<<blocks_for(npairs, 4096), NT, 0, st>>>(words, out, npairs, noise);
    return cudaGetLastError();
}

extern "C" cudaError_t dcc_test_fdiv(const float *x, float *out, uint64_t n, float d,
                                     cudaStream_t st) {
    if (n == 0) return cudaSuccess;
    fdiv_kernel<<<blocks_for(n, 4096), NT, 0, st>>>(x, out, n, d);
    return cudaGetLastError();
}

extern "C" cudaError_t dcc_noise_normal(uint64_t key, uint64_t step, uint32_t stream, float *out,
                                        uint64_t n, int noise, cudaStream_t st) {
    if (n == 0) return cudaSuccess;
    noise_kernel<<<blocks_for((n + 1) / 2, 4096), NT, 0, st>>>(key, step, stream, out, n, noise);
    return cudaGetLastError();
}
