/* Data checks the validator cannot do without touching the data: finite
 * floats and in-range embedding indices. They run over every layer before any
 * arithmetic, so a bad step costs one read of its inputs and writes nothing.
 * Indices are copied into daemon memory as they are checked (the copy is
 * what the norms and the clipped sum read); floats decide no address, and a
 * float changed after its check is caught by the finite checks on the norms
 * and the outputs. */
#include <stdio.h>
#include <string.h>

#include "cpu.h"

/* The exponent-all-ones test on the raw bits: no conversion, and a block is
 * scanned branch-free (vectorizable) before the exact element is located. */
#define SCAN_BLOCK 1024

static inline uint32_t f32_bits(const float *p, size_t i) {
    uint32_t u; /* memcpy: reading a float's bits without breaking aliasing rules */
    memcpy(&u, p + i, sizeof u);
    return u;
}

static int64_t find_f32(const float *p, size_t n) {
    for (size_t i0 = 0; i0 < n; i0 += SCAN_BLOCK) {
        size_t e = n - i0 < SCAN_BLOCK ? n : i0 + SCAN_BLOCK;
        uint32_t bad = 0;
        for (size_t i = i0; i < e; i++) bad |= (f32_bits(p, i) & 0x7f800000u) == 0x7f800000u;
        if (bad)
            for (size_t i = i0; i < e; i++)
                if ((f32_bits(p, i) & 0x7f800000u) == 0x7f800000u) return (int64_t)i;
    }
    return -1;
}

static int64_t find_16(const uint16_t *p, size_t n, uint16_t mask) {
    for (size_t i0 = 0; i0 < n; i0 += SCAN_BLOCK) {
        size_t e = n - i0 < SCAN_BLOCK ? n : i0 + SCAN_BLOCK;
        unsigned bad = 0;
        for (size_t i = i0; i < e; i++) bad |= (uint16_t)(p[i] & mask) == mask;
        if (bad)
            for (size_t i = i0; i < e; i++)
                if ((uint16_t)(p[i] & mask) == mask) return (int64_t)i;
    }
    return -1;
}

int64_t dc_cpu_find_nonfinite(const void *p, dc_dtype t, size_t n) {
    switch (t) {
    case DC_F32: return find_f32(p, n);
    case DC_BF16: return find_16(p, n, 0x7f80u);
    case DC_F16: return find_16(p, n, 0x7c00u);
    default: return -1;
    }
}

/* Reports a float tensor [B, T, w] of the layer with a non-finite value. */
static int check_floats(const dc_layer *l, const dc_tensor *t, const char *what, uint32_t B,
                        int64_t w, dc_err *err) {
    size_t n = (size_t)B * (size_t)l->T * (size_t)w;
    int64_t i = dc_cpu_find_nonfinite(t->data, t->dtype, n);
    char f[128];
    if (i < 0) return 0;
    int64_t row = i / w, col = i % w;
    snprintf(f, sizeof f, "%s.%s", l->name, what);
    return dc_err_set(err, DC_ENONFINITE, f,
                      "non-finite value %g in %s of sample %lld (position %lld, feature %lld)",
                      (double)dc_load_f32(t->data, t->dtype, (size_t)i), what,
                      (long long)(row / l->T), (long long)(row % l->T), (long long)col);
}

/* Copies the indices into daemon memory, reading each once, and checks the
 * copies: the client can rewrite its shared memory at any time, so an index
 * that decides an address must never be read from it a second time. */
static int check_indices(const dc_layer *l, uint32_t B, int64_t *copy, dc_err *err) {
    size_t n = (size_t)B * (size_t)l->T;
    char f[128];
    if (l->input.dtype == DC_I32) {
        const volatile int32_t *src = l->input.data; /* volatile: one load each */
        for (size_t i = 0; i < n; i++) copy[i] = src[i];
    } else {
        const volatile int64_t *src = l->input.data;
        for (size_t i = 0; i < n; i++) copy[i] = src[i];
    }
    for (size_t i = 0; i < n; i++) {
        int64_t v = copy[i];
        if (v < 0 || v >= l->vocab) {
            snprintf(f, sizeof f, "%s.indices", l->name);
            return dc_err_set(err, DC_EINVAL, f,
                              "index %lld of sample %lld (position %lld) is outside [0, %lld)",
                              (long long)v, (long long)(i / (size_t)l->T),
                              (long long)(i % (size_t)l->T), (long long)l->vocab);
        }
    }
    return 0;
}

int dc_cpu_check_layer(const dc_layer *l, uint32_t B, dc_layer *safe, int64_t *idx, dc_err *err) {
    int rc;
    *safe = *l;
    switch (l->kind) {
    case DC_LAYER_LINEAR:
        if ((rc = check_floats(l, &l->input, "activations", B, l->d, err))) return rc;
        return check_floats(l, &l->grad, "output_grad", B, l->p, err);
    case DC_LAYER_EMBEDDING:
        if ((rc = check_indices(l, B, idx, err))) return rc;
        safe->input.data = idx;
        safe->input.dtype = DC_I64;
        return check_floats(l, &l->grad, "output_grad", B, l->d, err);
    case DC_LAYER_LAYERNORM:
    case DC_LAYER_RMSNORM:
        if ((rc = check_floats(l, &l->input, "input", B, l->d, err))) return rc;
        return check_floats(l, &l->grad, "output_grad", B, l->d, err);
    }
    return dc_err_set(err, DC_EINVAL, l->name, "unknown layer kind %d", (int)l->kind);
}
