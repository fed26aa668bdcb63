/* The step's noise on the device, for the output pass (clip.cu) and the sum
 * of kept per-sample gradients (sgrad.cu), which must draw the same bits for
 * the same element of an output: pair j of an output (elements 2j, 2j+1)
 * is Philox counter (j, stream, step lo, step hi) under key noise_key.
 *
 * Philox4x32-10 and Box-Muller as daemon/compute/noise.c defines them
 * (uniforms with 53-bit mantissas). DCC_NOISE_EXACT does Box-Muller in
 * double as the CPU (libm ulps apart); DCC_NOISE_FAST (the default) does
 * the same formula in f32 from the same Philox words: ln u1 as logf of its
 * rounded top bits plus the exact remainder's first-order term, the angle
 * split into its octant (exact, the top three bits) and a remainder for two
 * short polynomials, so every draw stays within 6e-7 * r + 1e-7 of the
 * double one (r = sqrt(-2 ln u1) <= 8.58) at a fraction of the FP64 cost.
 * Arithmetic that must round like the CPU's is written with __fmul_rn /
 * __fadd_rn (no contraction to FMA). */
#ifndef DC_DCC_NOISE_CUH
#define DC_DCC_NOISE_CUH

#include "dcc_device.cuh"

__device__ __forceinline__ void philox10(uint32_t (&c)[4], uint32_t k0, uint32_t k1) {
#pragma unroll
    for (int r = 0; r < 10; r++) {
        if (r) {
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        uint32_t lo0 = 0xD2511F53u * c[0], hi0 = __umulhi(0xD2511F53u, c[0]);
        uint32_t lo1 = 0xCD9E8D57u * c[2], hi1 = __umulhi(0xCD9E8D57u, c[2]);
        uint32_t n0 = hi1 ^ c[1] ^ k0, n2 = hi0 ^ c[3] ^ k1;
        c[0] = n0;
        c[1] = lo1;
        c[2] = n2;
        c[3] = lo0;
    }
}

/* Box-Muller from one Philox output c, in double (DCC_NOISE_EXACT). */
__device__ __forceinline__ void box_muller_exact(const uint32_t (&c)[4], float &z0, float &z1) {
    uint64_t a = ((uint64_t)c[0] << 32 | c[1]) >> 11;
    uint64_t b = ((uint64_t)c[2] << 32 | c[3]) >> 11;
    const double inv53 = 1.0 / 9007199254740992.0;
    double u1 = __dmul_rn(__dadd_rn((double)a, 1.0), inv53);
    double u2 = __dmul_rn((double)b, inv53);
    double r = sqrt(__dmul_rn(-2.0, log(u1)));
    double t = __dmul_rn(6.283185307179586476925, u2);
    z0 = (float)__dmul_rn(r, cos(t));
    z1 = (float)__dmul_rn(r, sin(t));
}

/* 1/x to about an ulp (one MUFU op), for x a normal float. */
__device__ __forceinline__ float rcp_approx(float x) {
    float y;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

/* The same draws in f32 (DCC_NOISE_FAST); see the comment at the top of this file. Few
 * instructions per draw matter here: the output pass is issue-bound. */
__device__ __forceinline__ void box_muller_fast(const uint32_t (&c)[4], float &z0, float &z1) {
    /* u1 = N / 2^53 in (0, 1], N = a + 1. Above 2^-12, u1 = hi + lo with hi
     * = n1 / 2^24 its top bits rounded (exact in f32) and |lo| <= half an
     * ulp of hi, so ln u1 = logf(hi) + lo / hi (the dropped lo^2 / 2hi^2 <
     * 2^-25) stays relatively accurate up to u1 = 1 without log1pf: when
     * the two terms cancel, ln(hi) is at least twice lo / hi. Below 2^-12
     * (one draw in 4096, so warps rarely diverge) f32 u1 is accurate enough
     * for its large log. */
    const uint64_t N = (((uint64_t)c[0] << 21) | (c[1] >> 11)) + 1;
    float ln;
    if (N >= (uint64_t)1 << 41) {
        const uint32_t n1 = (uint32_t)((N + ((uint64_t)1 << 28)) >> 29); /* [2^12, 2^24] */
        const int32_t lo = (int32_t)((int64_t)N - ((int64_t)n1 << 29));  /* |lo| <= 2^28 */
        const float hi = (float)n1 * 0x1p-24f;
        ln = logf(hi) + (float)lo * 0x1p-53f * rcp_approx(hi);
    } else {
        ln = logf(__ull2float_rn(N) * 0x1p-53f);
    }
    /* sqrt.approx (one MUFU op, relative error about 2^-23) instead of the
     * correctly rounded sqrtf's refinement and slow-path test: r's error
     * budget is 6e-7 r. .ftz drops the scaling of subnormal inputs, which
     * cannot occur: -2 ln u1 is 0 or at least 2^-52 */
    float r;
    asm("sqrt.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(-2.0f * ln));
    /* angle 2 pi b / 2^53 = octant o * pi/4 + pi/4 * f, f = the next 29 bits
     * / 2^29 (the lower ones move it < 2^-29 of an octant). On [0, pi/4]
     * Taylor polynomials in x = f / 4 (or (1 - f) / 4 in odd octants, whose
     * sine and cosine swap) are good to 2e-9. */
    const uint32_t o = c[2] >> 29, m = c[2] & 0x1fffffffu;
    const float x = (float)((o & 1) ? 0x20000000u - m : m) * 0x1p-31f, x2 = x * x;
    const float s = x * fmaf(fmaf(fmaf(fmaf(8.214588661e-02f, x2, -5.992645293e-01f), x2,
                                       2.550164040e+00f),
                                  x2, -5.167712780e+00f),
                             x2, 3.141592654e+00f);
    const float k = fmaf(
        fmaf(fmaf(fmaf(fmaf(-2.580689139e-02f, x2, 2.353306304e-01f), x2, -1.335262769e+00f), x2,
                  4.058712126e+00f),
             x2, -4.934802201e+00f),
        x2, 1.0f);
    const float sn = (o & 1) ? k : s, cn = (o & 1) ? s : k;
    const uint32_t q = o >> 1;
    const float cq = q == 0 ? cn : q == 1 ? -sn : q == 2 ? -cn : sn;
    const float sq = q == 0 ? sn : q == 1 ? cn : q == 2 ? -sn : -cn;
    z0 = __fmul_rn(r, cq);
    z1 = __fmul_rn(r, sq);
}

/* Box-Muller as `noise` says (DCC_NOISE_*). */
__device__ __forceinline__ void box_muller(int noise, const uint32_t (&c)[4], float &z0,
                                           float &z1) {
    if (noise == DCC_NOISE_EXACT) box_muller_exact(c, z0, z1);
    else box_muller_fast(c, z0, z1);
}

__device__ __forceinline__ void draw_pair(int noise, uint64_t key, uint64_t step, uint32_t stream,
                                          uint64_t pair, float &z0, float &z1) {
    uint32_t c[4] = {(uint32_t)pair, stream, (uint32_t)step, (uint32_t)(step >> 32)};
    philox10(c, (uint32_t)key, (uint32_t)(key >> 32));
    box_muller(noise, c, z0, z1);
}

/* An element's noised value, as every path adds it: v + std * z, rounded
 * twice (never contracted), so that the paths agree bit for bit. */
__device__ __forceinline__ float dcc_noised(float v, float std, float z) {
    return __fadd_rn(v, __fmul_rn(std, z));
}

#endif
