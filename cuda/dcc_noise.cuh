/* The noise draws of daemon/compute/noise.c, bit for bit (Philox4x32-10
 * and Box-Muller; clip.cu's top comment explains the fast variant), for the
 * kernels that add noise: clip.cu's output passes and the grouped clipped
 * sum's epilogue (grouped_tma.cu). File-local to each includer. */
#ifndef DC_DCC_NOISE_CUH
#define DC_DCC_NOISE_CUH

#include "dcc_device.cuh"

namespace {

/* |x| as ordered bits: NaN sorts above +Inf, so a NaN anywhere wins a max
 * (an output's amax, which decides how it is written). */
__device__ __forceinline__ unsigned dcc_abs_bits(float x) {
    return __float_as_uint(x) & 0x7fffffffu;
}

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

__device__ __forceinline__ void normal_pair(uint64_t key, uint64_t step, uint32_t stream,
                                            uint64_t pair, float &z0, float &z1) {
    uint32_t c[4] = {(uint32_t)pair, stream, (uint32_t)step, (uint32_t)(step >> 32)};
    philox10(c, (uint32_t)key, (uint32_t)(key >> 32));
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

/* The same draws in f32 (DCC_NOISE_FAST); see the comment at the top. */
__device__ __forceinline__ void normal_pair_fast(uint64_t key, uint64_t step, uint32_t stream,
                                                 uint64_t pair, float &z0, float &z1) {
    uint32_t c[4] = {(uint32_t)pair, stream, (uint32_t)step, (uint32_t)(step >> 32)};
    philox10(c, (uint32_t)key, (uint32_t)(key >> 32));
    uint64_t a = ((uint64_t)c[0] << 32 | c[1]) >> 11;
    uint64_t b = ((uint64_t)c[2] << 32 | c[3]) >> 11;
    /* u1 = (a + 1) / 2^53 in (0, 1] */
    float ln;
    if (a < ((uint64_t)1 << 52)) ln = logf(__ull2float_rn(a + 1) * 0x1p-53f);
    else ln = log1pf(-(__ull2float_rn(((uint64_t)1 << 53) - 1 - a) * 0x1p-53f));
    float r = sqrtf(-2.0f * ln);
    /* angle 2 pi b / 2^53 = quadrant q * pi/2 + pi * x, x = (b mod 2^51) / 2^52 */
    uint32_t q = (uint32_t)(b >> 51);
    float x = __ull2float_rn(b & (((uint64_t)1 << 51) - 1)) * 0x1p-52f, sn, cn;
    sincospif(x, &sn, &cn);
    float cq = q == 0 ? cn : q == 1 ? -sn : q == 2 ? -cn : sn;
    float sq = q == 0 ? sn : q == 1 ? cn : q == 2 ? -sn : -cn;
    z0 = __fmul_rn(r, cq);
    z1 = __fmul_rn(r, sq);
}

__device__ __forceinline__ void draw_pair(int noise, uint64_t key, uint64_t step,
                                          uint32_t stream, uint64_t pair, float &z0, float &z1) {
    if (noise == DCC_NOISE_EXACT) normal_pair(key, step, stream, pair, z0, z1);
    else normal_pair_fast(key, step, stream, pair, z0, z1);
}

} // namespace

#endif
