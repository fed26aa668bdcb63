#include "noise.h"

#include <errno.h>
#include <math.h>
#include <sys/random.h>

#include "dc_err.h"

/* Constants from Random123 (philox.h): multipliers and Weyl key bumps. */
#define PHILOX_M0 0xD2511F53u
#define PHILOX_M1 0xCD9E8D57u
#define PHILOX_W0 0x9E3779B9u
#define PHILOX_W1 0xBB67AE85u

static inline void philox_round(uint32_t c[4], const uint32_t k[2]) {
    uint64_t p0 = (uint64_t)PHILOX_M0 * c[0];
    uint64_t p1 = (uint64_t)PHILOX_M1 * c[2];
    uint32_t hi0 = (uint32_t)(p0 >> 32), lo0 = (uint32_t)p0;
    uint32_t hi1 = (uint32_t)(p1 >> 32), lo1 = (uint32_t)p1;
    uint32_t n0 = hi1 ^ c[1] ^ k[0];
    uint32_t n2 = hi0 ^ c[3] ^ k[1];
    c[0] = n0;
    c[1] = lo1;
    c[2] = n2;
    c[3] = lo0;
}

void dc_philox4x32_10(const uint32_t ctr[4], const uint32_t key[2], uint32_t out[4]) {
    uint32_t c[4] = {ctr[0], ctr[1], ctr[2], ctr[3]};
    uint32_t k[2] = {key[0], key[1]};
    for (int r = 0; r < 10; r++) {
        if (r) {
            k[0] += PHILOX_W0;
            k[1] += PHILOX_W1;
        }
        philox_round(c, k);
    }
    out[0] = c[0];
    out[1] = c[1];
    out[2] = c[2];
    out[3] = c[3];
}

/* Normals are made in blocks: Philox fills the uniforms first, then
 * Box-Muller runs as straight-line loops over the block that the compiler
 * vectorizes (with glibc's vector log/sin/cos). Element 2j and 2j+1 of a
 * stream come from counter j, whatever the block size. u1 in (0, 1] so the
 * log is finite; u2 in [0, 1); both carry 53 random bits and the transform
 * runs in double, so the float result is correctly rounded from a value
 * accurate far beyond f32. */
#define NOISE_BLOCK 64

static void normal_block(const uint32_t key[2], const uint32_t hi[3], uint64_t pair0, size_t npairs,
                         float *z) {
    double u1[NOISE_BLOCK], u2[NOISE_BLOCK], r[NOISE_BLOCK], t[NOISE_BLOCK];
    const double inv53 = 1.0 / 9007199254740992.0; /* 2^-53 */
    for (size_t j = 0; j < npairs; j++) {
        uint32_t ctr[4] = {(uint32_t)(pair0 + j), hi[0], hi[1], hi[2]};
        uint32_t x[4];
        dc_philox4x32_10(ctr, key, x);
        uint64_t a = ((uint64_t)x[0] << 32 | x[1]) >> 11;
        uint64_t b = ((uint64_t)x[2] << 32 | x[3]) >> 11;
        u1[j] = ((double)a + 1.0) * inv53;
        u2[j] = (double)b * inv53;
    }
    for (size_t j = 0; j < npairs; j++) {
        r[j] = sqrt(-2.0 * log(u1[j]));
        t[j] = 6.283185307179586476925 * u2[j];
    }
    for (size_t j = 0; j < npairs; j++) {
        z[2 * j] = (float)(r[j] * cos(t[j]));
        z[2 * j + 1] = (float)(r[j] * sin(t[j]));
    }
}

/* Shared body, over draws [first, first + n) of the stream: out[i] =
 * z_{first+i} (add == 0) or out[i] += std * z_{first+i}. An odd first
 * starts inside its pair: that pair's first normal is made and skipped. */
static void fill(uint64_t key, uint64_t step, uint32_t stream, float std, int add, float *out,
                 uint64_t first, size_t n) {
    uint32_t k[2] = {(uint32_t)key, (uint32_t)(key >> 32)};
    uint32_t hi[3] = {stream, (uint32_t)step, (uint32_t)(step >> 32)};
    float z[2 * NOISE_BLOCK];
    uint64_t pair = first / 2;
    size_t skip = (size_t)(first & 1);
    for (size_t i = 0; i < n; pair += NOISE_BLOCK) {
        size_t m = n - i + skip < 2 * NOISE_BLOCK ? n - i + skip : 2 * NOISE_BLOCK;
        normal_block(k, hi, pair, (m + 1) / 2, z);
        m -= skip;
        if (add)
            for (size_t e = 0; e < m; e++) out[i + e] += std * z[skip + e];
        else
            for (size_t e = 0; e < m; e++) out[i + e] = z[skip + e];
        i += m;
        skip = 0;
    }
}

void dc_noise_normal(uint64_t key, uint64_t step, uint32_t stream, float *out, size_t n) {
    fill(key, step, stream, 1.0f, 0, out, 0, n);
}

void dc_noise_add_normal(uint64_t key, uint64_t step, uint32_t stream, float std, float *out,
                         size_t n) {
    if (std == 0.0f) return;
    fill(key, step, stream, std, 1, out, 0, n);
}

void dc_noise_add_normal_at(uint64_t key, uint64_t step, uint32_t stream, float std, float *out,
                            uint64_t first, size_t n) {
    if (std == 0.0f) return;
    fill(key, step, stream, std, 1, out, first, n);
}

int dc_noise_seed(uint64_t *key) {
    uint64_t k;
    ssize_t got;
    /* 8 bytes from the blocking pool never return short except on EINTR. */
    do {
        got = getrandom(&k, sizeof k, 0);
    } while (got < 0 && errno == EINTR);
    if (got != (ssize_t)sizeof k) return DC_EINTERNAL;
    *key = k;
    return DC_OK;
}
