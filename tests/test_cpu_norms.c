/* cpu_norms.c: every per-sample norm formula against the naive reference
 * (tests/support/ref.c), which forms each per-sample gradient explicitly. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "cpu.h"
#include "ref.h"

static const dc_dtype dtypes[] = {DC_F32, DC_BF16, DC_F16};
static const dc_algo algos[] = {DC_ALGO_AUTO, DC_ALGO_DIRECT, DC_ALGO_GHOST};

/* Runs the backend's norms for l and compares with the reference, for the
 * SUM scale (1) and the MEAN scale (B). Returns the worst relative error. */
static double compare_layer(const dc_layer *l, uint32_t B, dc_dtype dt, const char *what) {
    dc_cpu_scratch s;
    dc_err e;
    double *got = calloc(B, sizeof *got), *want = calloc(B, sizeof *want);
    double worst = 0.0;
    float scales[2] = {1.0f, (float)B};
    memset(&s, 0, sizeof s);
    assert_non_null(got);
    assert_non_null(want);
    int64_t *idx = calloc((size_t)B * (size_t)l->T, sizeof *idx);
    dc_layer safe;
    assert_non_null(idx);
    for (int k = 0; k < 2; k++) {
        assert_int_equal(dc_cpu_check_layer(l, B, &safe, idx, &e), 0);
        /* the norms read the checked copy of the indices */
        assert_int_equal(dc_cpu_layer_sqnorms(&s, &safe, B, scales[k], got, &e), 0);
        dc_ref_layer_sqnorms(l, B, scales[k], want);
        uint32_t positive = 0;
        for (uint32_t b = 0; b < B; b++) {
            if (want[b] == 0.0) { /* e.g. a sample made only of padding */
                assert_true(got[b] == 0.0);
                continue;
            }
            positive++;
            double rel = fabs(got[b] - want[b]) / want[b];
            if (rel > worst) worst = rel;
        }
        assert_true(positive > 0); /* the data is not degenerate */
    }
    if (worst > dc_test_rtol(dt))
        print_message("%s (%s): relative error %.3g > %.3g\n", what, dc_dtype_name(dt), worst,
                      dc_test_rtol(dt));
    assert_true(worst <= dc_test_rtol(dt));
    dc_cpu_scratch_free(&s);
    free(got);
    free(idx);
    free(want);
    return worst;
}

typedef struct lin_shape {
    uint32_t B;
    int64_t T, d, p; /* T = 0: 2D input */
} lin_shape;

static void test_linear(void **state) {
    (void)state;
    static const lin_shape shapes[] = {
        {4, 0, 16, 8},                    /* 2D input, T = 1 */
        {4, 1, 16, 8},                    /* 3D input with T = 1 */
        {7, 13, 5, 6},                    /* odd sizes */
        {3, 7, 13, 5},  {2, 33, 17, 9},   /* T > d*p/(d+p): AUTO picks direct */
        {5, 16, 64, 3}, {2, 3, 2048, 70}, /* direct path spans several tiles with a remainder */
        {1, 40, 1, 1},
    };
    int n = 0;
    for (size_t i = 0; i < sizeof shapes / sizeof *shapes; i++)
        for (int bias = 0; bias < 2; bias++)
            for (size_t a = 0; a < 3; a++)
                for (size_t t = 0; t < 3; t++)
                    for (uint64_t seed = 1; seed <= 3; seed++) {
                        const lin_shape *sh = &shapes[i];
                        dc_test_layer_spec sp = {DC_LAYER_LINEAR, sh->B, sh->T,    sh->d, sh->p,
                                                 dtypes[t],       bias,  algos[a], 0,     0};
                        dc_test_rng r;
                        dc_layer l;
                        char what[96];
                        dc_test_rng_seed(&r, seed * 1000 + i);
                        dc_test_layer_make(&l, &sp, &r);
                        assert_int_equal(l.T, sh->T ? sh->T : 1);
                        snprintf(what, sizeof what, "linear B%u T%lld d%lld p%lld bias%d algo%d",
                                 sh->B, (long long)sh->T, (long long)sh->d, (long long)sh->p, bias,
                                 (int)algos[a]);
                        compare_layer(&l, sh->B, dtypes[t], what);
                        dc_test_layer_free(&l);
                        n++;
                    }
    assert_int_equal(n, 8 * 2 * 3 * 3 * 3);
}

/* Inputs far from 1 whose per-sample gradients are ordinary: activations
 * ~1e19 with output grads ~1e-19 overflow an f32 Gram a a^T (the ghost form
 * once gave Inf - Inf = NaN here), and ~1e-25 with ~1e25 underflow it to 0.
 * Both forms and T = 1 must match the double reference. One sample is
 * scaled and the others not, so the scaling is per sample. */
static void test_linear_extreme_range(void **state) {
    (void)state;
    static const double sa[] = {1e19, 1e-25, 3e30};
    static const int64_t Ts[] = {24, 1};
    for (size_t k = 0; k < sizeof sa / sizeof sa[0]; k++)
        for (size_t ti = 0; ti < 2; ti++) {
            int64_t T = Ts[ti];
            dc_test_layer_spec sp = {DC_LAYER_LINEAR, 3, T, 40, 30, DC_F32, 1, DC_ALGO_AUTO, 0, 0};
            dc_test_rng r;
            dc_layer l;
            dc_cpu_scratch s;
            double got[3], want[3];
            memset(&s, 0, sizeof s);
            dc_test_rng_seed(&r, 90 + k);
            dc_test_layer_make(&l, &sp, &r);
            float *a = l.input.data, *g = l.grad.data;
            for (int64_t i = 0; i < 2 * T * 40; i++) a[i] *= (float)sa[k]; /* samples 0, 1 */
            for (int64_t i = 0; i < 2 * T * 30; i++) g[i] *= (float)(1.0 / sa[k]);
            dc_ref_layer_sqnorms(&l, 3, 1.0, want);
            for (size_t al = 0; al < 3; al++) {
                assert_int_equal(
                    dc_cpu_linear_sqnorms(&s, a, g, 3, T, 40, 30, true, algos[al], got), 0);
                for (int b = 0; b < 3; b++) {
                    assert_true(isfinite(want[b]) && want[b] > 0.0);
                    if (!(fabs(got[b] - want[b]) <= 1e-4 * want[b]))
                        print_message("scale %g T %lld algo %zu sample %d: %g vs %g\n", sa[k],
                                      (long long)T, al, b, got[b], want[b]);
                    assert_true(fabs(got[b] - want[b]) <= 1e-4 * want[b]);
                }
            }
            dc_cpu_scratch_free(&s);
            dc_test_layer_free(&l);
        }
}

/* A tied pair's shared-weight norm (cross term included) through
 * dc_cpu_tie_sqnorms, against the reference, at ordinary scale and where
 * the products e_t . a_s of the cross term's Gram leave f32's range
 * (samples 0 and 1 scaled by 1e25: range-scaled like the linear norms). */
static void test_tied_pair(void **state) {
    (void)state;
    static const double sa[] = {1.0, 1e25, 1e-24};
    for (size_t k = 0; k < sizeof sa / sizeof sa[0]; k++)
        for (int first = 0; first < 2; first++) {
            dc_layer ls[2], safe[2];
            dc_test_rng r;
            dc_cpu_scratch s;
            dc_err e;
            const uint32_t B = 3;
            double got[6], want[6];
            int64_t idx[3 * 9];
            memset(&s, 0, sizeof s);
            dc_test_rng_seed(&r, 300 + 2 * k + (uint64_t)first);
            dc_test_tied_pair(ls, 0, B, 9, 7, 16, 11, DC_F32, 1, first, &r);
            dc_layer *emb = ls[first ? 0 : 1].kind == DC_LAYER_EMBEDDING ? &ls[first ? 0 : 1]
                                                                         : &ls[first ? 1 : 0];
            dc_layer *lin = emb == &ls[0] ? &ls[1] : &ls[0];
            float *eg = emb->grad.data, *a = lin->input.data, *g = lin->grad.data;
            for (int64_t i = 0; i < 2 * 9 * 16; i++) eg[i] *= (float)sa[k];
            for (int64_t i = 0; i < 2 * 7 * 16; i++) a[i] *= (float)sa[k];
            for (int64_t i = 0; i < 2 * 7 * 11; i++) g[i] *= (float)(1.0 / sa[k]);
            dc_step st = {.batch = B,
                          .n_layers = 2,
                          .layers = ls,
                          .mode = DC_CLIP_FLAT,
                          .max_grad_norm = 1.0f,
                          .reduction = DC_REDUCTION_SUM,
                          .expected_batch = B,
                          .device = -1};
            dc_ref_step(&st, NULL, NULL, want, NULL, NULL, NULL);
            for (int l = 0; l < 2; l++) {
                assert_int_equal(dc_cpu_check_layer(&ls[l], B, &safe[l], idx, &e), 0);
                assert_int_equal(dc_cpu_layer_sqnorms(&s, &safe[l], B, 1.0f, got + l * B, &e), 0);
            }
            assert_int_equal(dc_cpu_tie_sqnorms(&s, safe, 1, B, 1.0f, got, &e), 0);
            for (int i = 0; i < 6; i++) {
                double tol = 1e-4 * fmax(want[i], want[i % 3]) + 1e-300;
                if (!(fabs(got[i] - want[i]) <= tol))
                    print_message("scale %g first %d value %d: %g vs %g\n", sa[k], first, i, got[i],
                                  want[i]);
                assert_true(isfinite(got[i]) && fabs(got[i] - want[i]) <= tol);
            }
            assert_true(want[0] > 0.0 && (want[3] > 0.0) == (first == 1)); /* a bias or none */
            dc_cpu_scratch_free(&s);
            dc_test_layer_free(&ls[0]);
            dc_test_layer_free(&ls[1]);
        }
}

/* The unscaled entry point the benchmark uses: direct and ghost agree with
 * the reference on the same f32 data. */
static void test_linear_entry_point(void **state) {
    (void)state;
    dc_test_layer_spec sp = {DC_LAYER_LINEAR, 6, 24, 40, 30, DC_F32, 1, DC_ALGO_AUTO, 0, 0};
    dc_test_rng r;
    dc_layer l;
    dc_cpu_scratch s;
    double got[6], want[6];
    memset(&s, 0, sizeof s);
    dc_test_rng_seed(&r, 77);
    dc_test_layer_make(&l, &sp, &r);
    dc_ref_layer_sqnorms(&l, 6, 1.0, want);
    for (size_t a = 0; a < 3; a++) {
        assert_int_equal(dc_cpu_linear_sqnorms(&s, l.input.data, l.grad.data, 6, 24, 40, 30, true,
                                               algos[a], got),
                         0);
        for (int b = 0; b < 6; b++) assert_true(fabs(got[b] - want[b]) <= 1e-4 * want[b]);
    }
    dc_cpu_scratch_free(&s);
    dc_test_layer_free(&l);
}

/* i64 -> i32 copy of an embedding's indices. */
static void to_i32(dc_layer *l) {
    if (l->input.dtype == DC_I32) return;
    int64_t n = dc_test_tensor_numel(&l->input);
    dc_tensor t = dc_test_tensor_new(DC_I32, l->input.ndim, l->input.shape[0], l->input.shape[1],
                                     0);
    for (int64_t i = 0; i < n; i++) ((int32_t *)t.data)[i] = (int32_t)((int64_t *)l->input.data)[i];
    dc_test_tensor_free(&l->input);
    l->input = t;
}

/* Does some sample use one (non-padding) index twice? */
static int has_collision(const dc_layer *l, uint32_t B) {
    for (uint32_t b = 0; b < B; b++)
        for (int64_t t = 0; t < l->T; t++)
            for (int64_t u = t + 1; u < l->T; u++) {
                int64_t x = dc_cpu_index(&l->input, (size_t)b * l->T + t);
                int64_t y = dc_cpu_index(&l->input, (size_t)b * l->T + u);
                if (x == y && !(l->has_padding_idx && x == l->padding_idx)) return 1;
            }
    return 0;
}

static void test_embedding(void **state) {
    (void)state;
    for (int distinct = 0; distinct < 2; distinct++)
        for (int pad = 0; pad < 2; pad++)
            for (int i32 = 0; i32 < 2; i32++)
                for (size_t t = 0; t < 3; t++)
                    for (int twod = 0; twod < 2; twod++)
                        for (uint64_t seed = 1; seed <= 3; seed++) {
                            uint32_t B = 5;
                            int64_t T = twod ? 20 : 0;
                            dc_test_layer_spec sp = {
                                DC_LAYER_EMBEDDING, B, T,       12, 50, dtypes[t], 0,
                                DC_ALGO_AUTO,       0, distinct};
                            dc_test_rng r;
                            dc_layer l;
                            dc_test_rng_seed(&r, seed * 7919 + (uint64_t)(distinct * 4 + pad));
                            dc_test_layer_make(&l, &sp, &r);
                            if (i32) to_i32(&l);
                            l.has_padding_idx = pad;
                            if (pad) { /* make sure padding occurs, but not everywhere */
                                l.padding_idx = dc_cpu_index(&l.input, 0);
                                if (l.T > 1 && dc_cpu_index(&l.input, 1) == l.padding_idx)
                                    l.padding_idx = (l.padding_idx + 1) % l.vocab;
                            }
                            if (twod) assert_int_equal(has_collision(&l, B), !distinct);
                            compare_layer(&l, B, dtypes[t],
                                          distinct ? "embedding distinct" : "embedding repeats");
                            dc_test_layer_free(&l);
                        }
}

/* Padding positions contribute nothing: a sample that is all padding has
 * norm 0 and the others match the reference. */
static void test_embedding_all_padding(void **state) {
    (void)state;
    dc_test_layer_spec sp = {DC_LAYER_EMBEDDING, 3, 8, 4, 10, DC_F32, 0, DC_ALGO_AUTO, 0, 0};
    dc_test_rng r;
    dc_layer l;
    dc_cpu_scratch s;
    dc_err e;
    double got[3], want[3];
    memset(&s, 0, sizeof s);
    dc_test_rng_seed(&r, 5);
    dc_test_layer_make(&l, &sp, &r);
    l.has_padding_idx = true;
    l.padding_idx = 9;
    for (int t = 0; t < 8; t++) {
        if (l.input.dtype == DC_I32) ((int32_t *)l.input.data)[8 + t] = 9;
        else ((int64_t *)l.input.data)[8 + t] = 9;
    }
    assert_int_equal(dc_cpu_layer_sqnorms(&s, &l, 3, 1.0f, got, &e), 0);
    dc_ref_layer_sqnorms(&l, 3, 1.0, want);
    assert_true(got[1] == 0.0);
    assert_true(want[1] == 0.0);
    for (int b = 0; b < 3; b += 2) assert_true(fabs(got[b] - want[b]) <= 1e-4 * want[b]);
    dc_cpu_scratch_free(&s);
    dc_test_layer_free(&l);
}

static void test_norm_layers(void **state) {
    (void)state;
    static const lin_shape shapes[] = {{4, 0, 16, 0}, {3, 9, 24, 0}, {2, 5, 7, 0}, {6, 1, 33, 0}};
    for (int kind = DC_LAYER_LAYERNORM; kind <= DC_LAYER_RMSNORM; kind++)
        for (size_t i = 0; i < sizeof shapes / sizeof *shapes; i++)
            for (int bias = 0; bias < 2; bias++)
                for (size_t t = 0; t < 3; t++)
                    for (uint64_t seed = 1; seed <= 3; seed++) {
                        const lin_shape *sh = &shapes[i];
                        dc_test_layer_spec sp = {
                            (dc_layer_kind)kind, sh->B, sh->T,        sh->d, 0,
                            dtypes[t],           bias,  DC_ALGO_AUTO, 0,     0};
                        dc_test_rng r;
                        dc_layer l;
                        dc_test_rng_seed(&r, seed * 31 + i);
                        dc_test_layer_make(&l, &sp, &r);
                        assert_int_equal(l.has_bias, kind == DC_LAYER_LAYERNORM && bias);
                        compare_layer(&l, sh->B, dtypes[t],
                                      kind == DC_LAYER_LAYERNORM ? "layernorm" : "rmsnorm");
                        dc_test_layer_free(&l);
                    }
}

/* The bias term is really counted: the same data with and without bias
 * differ by exactly ||scale * sum_t g_t||^2. */
static void test_linear_bias_term(void **state) {
    (void)state;
    dc_test_layer_spec sp = {DC_LAYER_LINEAR, 4, 6, 10, 7, DC_F32, 1, DC_ALGO_GHOST, 0, 0};
    dc_test_rng r;
    dc_layer l;
    dc_cpu_scratch s;
    dc_err e;
    double with[4], without[4];
    memset(&s, 0, sizeof s);
    dc_test_rng_seed(&r, 11);
    dc_test_layer_make(&l, &sp, &r);
    assert_int_equal(dc_cpu_layer_sqnorms(&s, &l, 4, 2.0f, with, &e), 0);
    l.has_bias = false;
    assert_int_equal(dc_cpu_layer_sqnorms(&s, &l, 4, 2.0f, without, &e), 0);
    for (int b = 0; b < 4; b++) {
        double bsq = 0.0;
        for (int j = 0; j < 7; j++) {
            double sum = 0.0;
            for (int t = 0; t < 6; t++) sum += ((float *)l.grad.data)[(b * 6 + t) * 7 + j];
            bsq += 4.0 * sum * sum;
        }
        assert_true(bsq > 0.0);
        assert_true(fabs((with[b] - without[b]) - bsq) <= 1e-4 * with[b]);
    }
    dc_cpu_scratch_free(&s);
    dc_test_layer_free(&l);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_linear),
        cmocka_unit_test(test_linear_entry_point),
        cmocka_unit_test(test_linear_extreme_range),
        cmocka_unit_test(test_linear_bias_term),
        cmocka_unit_test(test_embedding),
        cmocka_unit_test(test_embedding_all_padding),
        cmocka_unit_test(test_norm_layers),
        cmocka_unit_test(test_tied_pair),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
