/* What every path does to an output value between its sum and the
 * client's memory, written once so that the output passes (clip.cu) and the
 * sum of kept per-sample gradients, which writes its outputs itself when it
 * can (sgrad.cu), round alike: the noise (dcc_noise.cuh), the division by
 * the step's divisor, and the store in the output's dtype. */
#ifndef DC_DCC_OUT_CUH
#define DC_DCC_OUT_CUH

#include "dcc_noise.cuh"

/* x / d as __fdiv_rn rounds it, with d's reciprocal made once per thread
 * instead of once per element: the refined reciprocal and the two FMAs
 * are __fdiv_rn's own fast path, exact (correctly rounded) while x, d, the
 * quotient and the remainder stay normal, so x and d are kept within
 * 2^+-60 and everything else (zeros, tiny or huge values, non-finite)
 * takes __fdiv_rn itself. A power of two whose reciprocal is a normal
 * float (a MEAN step's expected batch often is) divides as one multiply:
 * x * 2^-k is the exact quotient, rounded once, whatever x is. */
struct dcc_div {
    float d, y;
    bool fast, pow2;
};

__device__ __forceinline__ dcc_div dcc_div_make(float d) {
    dcc_div f;
    f.d = d;
    f.fast = fabsf(d) >= 0x1p-60f && fabsf(d) <= 0x1p60f;
    const uint32_t e = (__float_as_uint(d) >> 23) & 0xffu;
    f.pow2 = (__float_as_uint(d) & 0x7fffffu) == 0 && e >= 1 && e <= 253;
    const float y0 = rcp_approx(d);
    f.y = f.pow2 ? __uint_as_float((__float_as_uint(d) & 0x80000000u) | (254u - e) << 23)
                 : __fmaf_rn(y0, __fmaf_rn(y0, -d, 1.0f), y0);
    return f;
}

__device__ __forceinline__ float dcc_div_by(const dcc_div &f, float x) {
    if (f.pow2) return __fmul_rn(x, f.y);
    const float ax = fabsf(x);
    if (!(f.fast && ax >= 0x1p-60f && ax <= 0x1p60f)) return __fdiv_rn(x, f.d);
    const float q = __fmul_rn(x, f.y);
    return __fmaf_rn(__fmaf_rn(-q, f.d, x), f.y, q);
}

/* Whether element i of an output with noise range (mod, lo, hi) gets
 * noise (dcc_out.nz_*: a sums step noises the part of its outputs its rank
 * owns); of output o (dcc_noise_in). */
__device__ __forceinline__ bool dcc_span_in(uint64_t mod, uint64_t lo, uint64_t hi, uint64_t i) {
    const uint64_t k = mod ? i % mod : i;
    return k >= lo && k < hi;
}
__device__ __forceinline__ bool dcc_noise_in(const dcc_out &o, uint64_t i) {
    return dcc_span_in(o.nz_mod, o.nz_lo, o.nz_hi, i);
}

__device__ __forceinline__ void dcc_store_as(void *dst, int dtype, uint64_t i, float v) {
    switch (dtype) {
    case DC_F32: ((float *)dst)[i] = v; break;
    case DC_BF16: ((__nv_bfloat16 *)dst)[i] = __float2bfloat16_rn(v); break;
    case DC_F16: ((__half *)dst)[i] = __float2half_rn(v); break;
    default: break;
    }
}

/* The draws of chunk j of a wide-form accumulator (dcc_wide_at: register
 * 8 j + k at row mt + 16 j + 8 (k / 4) + k % 2, column nt, + 8 when k % 4
 * >= 2), ij the element index of its register 0 in a [p][d] output: z[k]
 * for register k. An output's pairs (2q, 2q + 1) share a draw; a pair's
 * two elements are columns n, n + 1 of one row (d even), held by lanes 4
 * apart: the lane with the even column draws the pairs of its registers
 * 0-3, its partner those of its 4-7, and they swap the halves they do not
 * keep. Every lane of the warp calls it. o: the output's noise source
 * (dcc_out or dcc_out_sink), read where the draws need it (a copy held in
 * registers across the kept sum's chunks spilled it at 64 registers). The
 * kept sum (sgrad.cu) and the grouped clipped sum's direct epilogue
 * (grouped_tma.cu) draw through it. */
template <int NOISE, typename Out>
__device__ __forceinline__ void dcc_wide_draw8(const Out &o, int64_t ij, int d, float (&z)[8]) {
    const bool even = ((threadIdx.x >> 2) & 1) == 0;
    const int64_t ie = ij + (even ? 0 : 8 * (int64_t)d); /* the drawing half's */
#pragma unroll
    for (int s = 0; s < 4; s++) {
        float z0, z1;
        const int64_t i = ie + ((s & 1) ? d : 0) + ((s & 2) ? 8 : 0);
        draw_pair(NOISE, o.key, o.step, o.stream, (uint64_t)(i >> 1), z0, z1);
        const float keep = even ? z0 : z1;
        const float other = __shfl_xor_sync(0xffffffffu, even ? z1 : z0, 4);
        z[s] = even ? keep : other;
        z[4 + s] = even ? other : keep;
    }
}

/* Whether no value of an output of dtype whose sums are bounded by m can
 * leave the dtype once noised with std and divided by divisor: |z| <=
 * sqrt(-2 ln 2^-53) = 8.5718 for every draw, with a little slack for the
 * roundings of the sum and the division. The output check's test
 * (clip.cu, out_decide_kernel), and the host's forecast of it that plans
 * the direct sums (backend_int.h, bound_fits). */
__host__ __device__ inline bool dcc_fits_dtype(double m, int dtype, float std, float divisor) {
    const double b = (m + 8.6 * (double)std) * 1.0001 / (double)divisor;
    const double lim = dtype == DC_F16 ? 65504.0 : dtype == DC_BF16 ? 3.38e38 : 3.4e38;
    return b < lim;
}

/* Element i of output oi is not finite in its dtype: the step fails, and
 * *bad keeps the first such element (oi above bit 40, as the host's
 * diagnosis reads it). */
__device__ __forceinline__ void dcc_out_fail(uint32_t *status, unsigned long long *bad, int oi,
                                             uint64_t i) {
    atomicOr(status, DCC_STATUS_OUTPUT);
    atomicMin(bad, ((unsigned long long)oi << 40) | (unsigned long long)i);
}

/* Whether v is not finite in dtype (an output value the step may not
 * write: the output passes' and the kept sum's check). */
__device__ __forceinline__ bool dcc_bad_as(float v, int dtype) {
    if (!dcc_isfinite(v)) return true;
    if (dtype == DC_F16) return (__half_as_ushort(__float2half_rn(v)) & 0x7c00u) == 0x7c00u;
    if (dtype == DC_BF16)
        return (__bfloat16_as_ushort(__float2bfloat16_rn(v)) & 0x7f80u) == 0x7f80u;
    return false;
}

#endif
