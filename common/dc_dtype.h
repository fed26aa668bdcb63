/* Element types shared by the daemon, the client and the backends, with the
 * scalar conversions the CPU paths use. Values match proto DType. */
#ifndef DC_DTYPE_H
#define DC_DTYPE_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef enum dc_dtype {
    DC_DTYPE_NONE = 0,
    DC_F32 = 1,
    DC_BF16 = 2,
    DC_F16 = 3,
    DC_I32 = 4,
    DC_I64 = 5
} dc_dtype;

static inline size_t dc_dtype_size(dc_dtype t) {
    switch (t) {
    case DC_F32:
    case DC_I32: return 4;
    case DC_BF16:
    case DC_F16: return 2;
    case DC_I64: return 8;
    default: return 0;
    }
}

static inline int dc_dtype_is_float(dc_dtype t) {
    return t == DC_F32 || t == DC_BF16 || t == DC_F16;
}

static inline const char *dc_dtype_name(dc_dtype t) {
    switch (t) {
    case DC_F32: return "f32";
    case DC_BF16: return "bf16";
    case DC_F16: return "f16";
    case DC_I32: return "i32";
    case DC_I64: return "i64";
    default: return "unspecified";
    }
}

static inline float dc_bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Round to nearest even; NaN stays NaN (quiet). */
static inline uint16_t dc_f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float dc_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    uint32_t u;
    if (exp == 0) {
        if (man == 0) {
            u = sign;
        } else { /* subnormal: normalize */
            int e = -1;
            do {
                man <<= 1;
                e++;
            } while (!(man & 0x400u));
            man &= 0x3ffu;
            u = sign | ((uint32_t)(127 - 15 - e) << 23) | (man << 13);
        }
    } else if (exp == 31) {
        u = sign | 0x7f800000u | (man << 13);
    } else {
        u = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Round to nearest even, overflow to inf, NaN preserved. */
static inline uint16_t dc_f32_to_f16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* >= 65520 rounds to inf */
    if (a < 0x38800000u) {                          /* below f16 normal range: subnormal or zero */
        if (a < 0x33000000u) return (uint16_t)sign; /* < 2^-25 rounds to 0 */
        uint32_t e = a >> 23;
        uint32_t m = (a & 0x7fffffu) | 0x800000u;
        uint32_t shift = 126 - e; /* 14..24 */
        uint32_t half = 1u << (shift - 1);
        uint32_t rem = m & ((1u << shift) - 1);
        uint32_t r = m >> shift;
        if (rem > half || (rem == half && (r & 1u))) r++;
        return (uint16_t)(sign | r);
    }
    uint32_t r = ((a >> 13) - (112u << 10));
    uint32_t rem = a & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) r++;
    return (uint16_t)(sign | r);
}

/* Load element i of a float tensor of dtype t as f32. */
static inline float dc_load_f32(const void *p, dc_dtype t, size_t i) {
    switch (t) {
    case DC_F32: return ((const float *)p)[i];
    case DC_BF16: return dc_bf16_to_f32(((const uint16_t *)p)[i]);
    case DC_F16: return dc_f16_to_f32(((const uint16_t *)p)[i]);
    default: return 0.0f;
    }
}

static inline void dc_store_f32(void *p, dc_dtype t, size_t i, float v) {
    switch (t) {
    case DC_F32: ((float *)p)[i] = v; break;
    case DC_BF16: ((uint16_t *)p)[i] = dc_f32_to_bf16(v); break;
    case DC_F16: ((uint16_t *)p)[i] = dc_f32_to_f16(v); break;
    default: break;
    }
}

#endif
