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

/* Two N(0,1) values from counter `pair` of the stream. u1 in (0, 1] so the
 * log is finite; u2 in [0, 1). Computed in double: the float result is then
 * correctly rounded from a value accurate far beyond f32. */
static inline void normal_pair(const uint32_t key[2], uint32_t ctr_hi[3], uint64_t pair,
                               float *z0, float *z1) {
    uint32_t ctr[4] = {(uint32_t)pair, ctr_hi[0], ctr_hi[1], ctr_hi[2]};
    uint32_t x[4];
    dc_philox4x32_10(ctr, key, x);
    uint64_t a = ((uint64_t)x[0] << 32 | x[1]) >> 11;
    uint64_t b = ((uint64_t)x[2] << 32 | x[3]) >> 11;
    const double inv53 = 1.0 / 9007199254740992.0; /* 2^-53 */
    double u1 = ((double)a + 1.0) * inv53;
    double u2 = (double)b * inv53;
    double r = sqrt(-2.0 * log(u1));
    double t = 6.283185307179586476925 * u2;
    *z0 = (float)(r * cos(t));
    *z1 = (float)(r * sin(t));
}

/* Shared body: out[i] = std * z_i (add == 0) or out[i] += std * z_i. */
static void fill(uint64_t key, uint64_t step, uint32_t stream, float std, int add, float *out,
                 size_t n) {
    uint32_t k[2] = {(uint32_t)key, (uint32_t)(key >> 32)};
    uint32_t hi[3] = {stream, (uint32_t)step, (uint32_t)(step >> 32)};
    size_t i = 0;
    for (uint64_t pair = 0; i < n; pair++) {
        float z0, z1;
        normal_pair(k, hi, pair, &z0, &z1);
        if (add) {
            out[i] += std * z0;
            if (i + 1 < n) out[i + 1] += std * z1;
        } else {
            out[i] = z0;
            if (i + 1 < n) out[i + 1] = z1;
        }
        i += 2;
    }
}

void dc_noise_normal(uint64_t key, uint64_t step, uint32_t stream, float *out, size_t n) {
    fill(key, step, stream, 1.0f, 0, out, n);
}

void dc_noise_add_normal(uint64_t key, uint64_t step, uint32_t stream, float std, float *out,
                         size_t n) {
    if (std == 0.0f) return;
    fill(key, step, stream, std, 1, out, n);
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
