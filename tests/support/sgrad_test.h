/* Helpers of the tests of kept per-sample gradients (test_cuda_sgrad.c: a
 * whole step's; test_cuda_kept.c: a norm group's phases): bf16 LINEAR
 * layers on the device with host twins, and the outputs a flat SUM step
 * releases when some layers' per-sample gradients are kept as bf16, from
 * the double-precision per-sample reference (ref.h). */
#ifndef DC_SGRAD_TEST_H
#define DC_SGRAD_TEST_H

#include "cuda_test.h"

enum { NL = 16 };

/* x as the kernel keeps it: rounded to f32, then to bf16 (nearest even) */
static inline double bf16_round(double x) {
    return (double)dc_bf16_to_f32(dc_f32_to_bf16((float)x));
}

static inline size_t al256(size_t x) { return (x + 255) & ~(size_t)255; }

static inline dcc_linear lin(const dc_layer *l, uint32_t B) {
    return (dcc_linear){l->input.data, l->grad.data, l->input.dtype, l->grad.dtype,
                        (int)B,        (int)l->T,    (int)l->d,      (int)l->p,
                        l->has_bias,   false,        NULL,           NULL};
}

/* The expected outputs of a flat SUM step in which the layers kept[l] != 0
 * are kept: w[l], b[l] (numel of their outputs), norms[B]; *C, the
 * threshold, is set between the smallest and the largest norm, so that the
 * step clips some samples and not others. */
static inline void expected(dc_layer *h, int n, uint32_t B, double *C, const int *kept, double e,
                            double **w, double **bo, double *norms) {
    double *sq = calloc(B, sizeof *sq), *c = calloc(B, sizeof *c);
    double **gw = calloc((size_t)n * B, sizeof *gw), **gb = calloc((size_t)n * B, sizeof *gb);
    assert_non_null(sq);
    assert_non_null(c);
    for (int l = 0; l < n; l++) {
        size_t nw = (size_t)h[l].p * (size_t)h[l].d, nb = h[l].has_bias ? (size_t)h[l].p : 1;
        for (uint32_t b = 0; b < B; b++) {
            double *x = gw[l * B + b] = calloc(nw, sizeof *x);
            double *y = gb[l * B + b] = calloc(nb, sizeof *y);
            assert_non_null(x);
            assert_non_null(y);
            dc_ref_layer_sample_grad(&h[l], b, 1.0, x, h[l].has_bias ? y : NULL);
            for (size_t i = 0; i < nw; i++) {
                if (kept[l]) x[i] = bf16_round(x[i]);
                sq[b] += x[i] * x[i];
            }
            if (h[l].has_bias)
                for (size_t i = 0; i < nb; i++) sq[b] += y[i] * y[i];
        }
    }
    double lo = INFINITY, hi = 0.0;
    for (uint32_t b = 0; b < B; b++) {
        norms[b] = sqrt(sq[b]);
        lo = fmin(lo, norms[b]);
        hi = fmax(hi, norms[b]);
    }
    *C = (double)(float)sqrt(lo * hi); /* the f32 the step carries */
    for (uint32_t b = 0; b < B; b++) c[b] = fmin(1.0, *C / (norms[b] * (1.0 + e) + 1e-6));
    for (int l = 0; l < n; l++) {
        size_t nw = (size_t)h[l].p * (size_t)h[l].d;
        memset(w[l], 0, nw * sizeof *w[l]);
        if (h[l].has_bias) memset(bo[l], 0, (size_t)h[l].p * sizeof *bo[l]);
        for (uint32_t b = 0; b < B; b++) {
            for (size_t i = 0; i < nw; i++) w[l][i] += c[b] * gw[l * B + b][i];
            if (h[l].has_bias)
                for (int64_t i = 0; i < h[l].p; i++) bo[l][i] += c[b] * gb[l * B + b][i];
            free(gw[l * B + b]);
            free(gb[l * B + b]);
        }
    }
    free(gw);
    free(gb);
    free(sq);
    free(c);
}

static inline double rel_l2_d(const float *got, const double *want, int64_t n) {
    double num = 0.0, den = 0.0;
    for (int64_t i = 0; i < n; i++) {
        double e = (double)got[i] - want[i];
        num += e * e;
        den += want[i] * want[i];
    }
    return sqrt(num / (den > 0.0 ? den : 1.0));
}

static inline void make(dc_layer *h, dc_layer *d, int n, uint32_t B, int64_t (*shape)[3],
                        uint64_t seed) {
    dc_test_rng r;
    dc_test_rng_seed(&r, seed);
    for (int l = 0; l < n; l++) {
        dc_dtype dt = l % 5 == 2 ? DC_F16 : DC_BF16;
        dc_test_layer_spec sp = {DC_LAYER_LINEAR,
                                 B,
                                 shape[l][0],
                                 shape[l][1],
                                 shape[l][2],
                                 dt,
                                 l % 3 != 1,
                                 DC_ALGO_DIRECT,
                                 1,
                                 0};
        dc_test_layer_make(&h[l], &sp, &r);
        d[l] = dev_layer(&h[l]);
    }
}

static inline void release(dc_layer *h, dc_layer *d, int n) {
    for (int l = 0; l < n; l++) {
        dev_layer_free(&d[l]);
        dc_test_layer_free(&h[l]);
    }
}

#endif
