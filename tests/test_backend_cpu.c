/* The CPU backend as the worker sees it: whole multi-layer steps (every
 * layer kind, mixed dtypes and ranks) against dc_ref_step. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "backend.h"
#include "ref.h"

#define NL 8

static void assert_close(const float *got, const double *want, int64_t n, double rtol) {
    double mx = 0.0;
    for (int64_t i = 0; i < n; i++) mx = fmax(mx, fabs(want[i]));
    assert_true(mx > 0.0);
    double e = dc_test_max_relerr_f(got, want, n, rtol, rtol * mx);
    if (e > 1.0) print_message("error %.3g of tolerance\n", e);
    assert_true(e <= 1.0);
}

/* A model-like stack: embedding, norms, linears of both algorithms, 2D and
 * 3D, inputs in f32/bf16/f16. Every layer has outputs. */
static size_t make_model(dc_layer *ls, uint32_t B, int64_t T, dc_test_rng *r, uint64_t seed) {
    dc_dtype dt[3] = {DC_F32, DC_BF16, DC_F16};
    dc_test_layer_spec sp[NL] = {
        {DC_LAYER_EMBEDDING, B, T, 16, 40, dt[seed % 3], 0, DC_ALGO_AUTO, 1, 0},
        {DC_LAYER_LAYERNORM, B, T, 16, 0, dt[(seed + 1) % 3], 1, DC_ALGO_AUTO, 1, 0},
        {DC_LAYER_LINEAR, B, T, 16, 24, dt[seed % 3], 1, DC_ALGO_GHOST, 1, 0},
        {DC_LAYER_LINEAR, B, T, 24, 16, dt[(seed + 2) % 3], 0, DC_ALGO_DIRECT, 1, 0},
        {DC_LAYER_RMSNORM, B, T, 16, 0, dt[seed % 3], 0, DC_ALGO_AUTO, 1, 0},
        {DC_LAYER_LINEAR, B, T, 16, 5, DC_F32, 1, DC_ALGO_AUTO, 1, 0},
        {DC_LAYER_LINEAR, B, 0, 5, 3, dt[(seed + 1) % 3], 1, DC_ALGO_AUTO, 1, 0}, /* 2D head */
        {DC_LAYER_LAYERNORM, B, 0, 5, 0, DC_F32, 0, DC_ALGO_AUTO, 1, 0},
    };
    for (int i = 0; i < NL; i++) {
        dc_test_layer_make(&ls[i], &sp[i], r);
        ls[i].max_grad_norm = (float)(0.05 + dc_test_uniform(r));
    }
    return NL;
}

static void run_model(dc_backend *be, uint32_t B, int64_t T, dc_clip_mode mode,
                      dc_reduction red, uint64_t seed) {
    dc_layer ls[NL];
    dc_test_rng r;
    dc_err e;
    dc_step_result res;
    float *norms_out = malloc(B * sizeof(float)), *coefs_out = malloc(B * sizeof(float));
    double *norms = malloc(B * sizeof(double)), *coefs = malloc(B * sizeof(double));
    double *lsq = malloc(NL * B * sizeof(double)), *lc = malloc(NL * B * sizeof(double));
    double *w[NL], *bb[NL];
    bool pl = mode == DC_CLIP_PER_LAYER;

    dc_test_rng_seed(&r, seed);
    size_t L = make_model(ls, B, T, &r, seed);
    dc_step s = {.batch = B, .n_layers = L, .layers = ls, .mode = mode,
                 .max_grad_norm = 0.8f, .reduction = red, .expected_batch = B + 3,
                 .noise_multiplier = 0.0f, .noise_key = 1, .noise_step = seed, .device = -1};
    s.norms_out = (dc_tensor){norms_out, DC_F32, 1, {B, 0, 0}};
    s.coefs_out = (dc_tensor){coefs_out, DC_F32, 1, {B, 0, 0}};
    for (size_t l = 0; l < L; l++) {
        w[l] = calloc((size_t)dc_test_tensor_numel(&ls[l].weight_grad_out), sizeof(double));
        bb[l] = ls[l].bias_grad_out.data
                    ? calloc((size_t)dc_test_tensor_numel(&ls[l].bias_grad_out), sizeof(double))
                    : NULL;
    }
    for (uint32_t b = 0; b < B; b++) norms_out[b] = coefs_out[b] = -1.0f;

    assert_int_equal(dc_step_result_init(&res, B, L, pl), 0);
    int rc = dc_backend_run_step(be, &s, &res, &e);
    if (rc) print_message("run_step %d: %s: %s\n", rc, e.field, e.msg);
    assert_int_equal(rc, 0);
    assert_true(res.compute_ns > 0);
    dc_ref_step(&s, norms, coefs, lsq, pl ? lc : NULL, w, bb);

    const double rt = 1e-3; /* mixed dtypes: the loosest of them */
    int clipped = 0;
    for (uint32_t b = 0; b < B; b++) {
        assert_true(fabs(norms_out[b] - norms[b]) <= rt * norms[b]);
        assert_true(fabs(coefs_out[b] - coefs[b]) <= rt * coefs[b]);
        assert_true(norms_out[b] == res.norms[b]);
        assert_true(coefs_out[b] == res.coefs[b]);
        if (pl) assert_true(res.coefs[b] == 1.0f);
        clipped += coefs[b] < 1.0;
    }
    for (size_t i = 0; i < L * B; i++) {
        assert_true(fabs(res.layer_norms[i] - sqrt(lsq[i])) <= rt * sqrt(lsq[i]));
        if (pl) {
            assert_true(fabs(res.layer_coefs[i] - lc[i]) <= rt * lc[i]);
            clipped += lc[i] < 1.0;
        }
    }
    assert_true(clipped > 0); /* the thresholds do bite */
    for (size_t l = 0; l < L; l++) {
        assert_close(ls[l].weight_grad_out.data, w[l], dc_test_tensor_numel(&ls[l].weight_grad_out),
                     rt);
        if (bb[l])
            assert_close(ls[l].bias_grad_out.data, bb[l],
                         dc_test_tensor_numel(&ls[l].bias_grad_out), rt);
        free(w[l]);
        free(bb[l]);
        dc_test_layer_free(&ls[l]);
    }
    dc_step_result_free(&res);
    free(norms_out);
    free(coefs_out);
    free(norms);
    free(coefs);
    free(lsq);
    free(lc);
}

static void test_flat(void **state) {
    (void)state;
    dc_backend *be;
    dc_err e;
    assert_int_equal(dc_cpu_backend_create(1, &be, &e), 0);
    assert_string_equal(be->ops->name, "cpu");
    for (uint64_t seed = 1; seed <= 3; seed++) {
        run_model(be, 6, 7, DC_CLIP_FLAT, DC_REDUCTION_SUM, seed);
        run_model(be, 6, 7, DC_CLIP_FLAT, DC_REDUCTION_MEAN, seed + 10);
    }
    dc_backend_destroy(be);
}

static void test_per_layer(void **state) {
    (void)state;
    dc_backend *be;
    dc_err e;
    assert_int_equal(dc_cpu_backend_create(0, &be, &e), 0);
    for (uint64_t seed = 1; seed <= 3; seed++) {
        run_model(be, 5, 9, DC_CLIP_PER_LAYER, DC_REDUCTION_SUM, seed);
        run_model(be, 5, 9, DC_CLIP_PER_LAYER, DC_REDUCTION_MEAN, seed + 20);
    }
    dc_backend_destroy(be);
}

/* One instance across steps whose shapes grow and shrink: scratch reuse
 * must not leak state from one step into the next. */
static void test_scratch_reuse(void **state) {
    (void)state;
    dc_backend *be;
    dc_err e;
    static const struct {
        uint32_t B;
        int64_t T;
    } seq[] = {{2, 3}, {9, 17}, {3, 2}, {9, 17}, {1, 1}, {12, 33}, {4, 5}};
    assert_int_equal(dc_cpu_backend_create(1, &be, &e), 0);
    for (size_t i = 0; i < sizeof seq / sizeof *seq; i++)
        run_model(be, seq[i].B, seq[i].T, i % 2 ? DC_CLIP_PER_LAYER : DC_CLIP_FLAT,
                  DC_REDUCTION_SUM, 100 + i);
    dc_backend_destroy(be);
}

/* Outputs are computed into scratch before anything is written, so an
 * output may alias an input: here a LayerNorm's weight_grad_out is the
 * first d values of its own input. */
static void test_output_aliases_input(void **state) {
    (void)state;
    dc_test_layer_spec sp = {DC_LAYER_LAYERNORM, 3, 4, 8, 0, DC_F32, 0, DC_ALGO_AUTO, 1, 0};
    dc_test_rng r;
    dc_layer l;
    dc_backend *be;
    dc_err e;
    dc_step_result res;
    double want[8];
    double *wp[1] = {want};
    dc_test_rng_seed(&r, 5);
    dc_test_layer_make(&l, &sp, &r);
    dc_step s = {.batch = 3, .n_layers = 1, .layers = &l, .mode = DC_CLIP_FLAT,
                 .max_grad_norm = 0.1f, .reduction = DC_REDUCTION_SUM, .expected_batch = 3,
                 .device = -1};
    dc_ref_step(&s, NULL, NULL, NULL, NULL, wp, NULL);
    dc_test_tensor_free(&l.weight_grad_out);
    l.weight_grad_out = (dc_tensor){l.input.data, DC_F32, 1, {8, 0, 0}};
    assert_int_equal(dc_cpu_backend_create(1, &be, &e), 0);
    assert_int_equal(dc_step_result_init(&res, 3, 1, false), 0);
    assert_int_equal(dc_backend_run_step(be, &s, &res, &e), 0);
    assert_close(l.input.data, want, 8, 1e-4);
    l.weight_grad_out.data = NULL; /* not separately owned */
    dc_step_result_free(&res);
    dc_backend_destroy(be);
    dc_test_layer_free(&l);
}

static void test_refuses_gpu_steps(void **state) {
    (void)state;
    dc_test_layer_spec sp = {DC_LAYER_RMSNORM, 2, 3, 4, 0, DC_F32, 0, DC_ALGO_AUTO, 0, 0};
    dc_test_rng r;
    dc_layer l;
    dc_backend *be;
    dc_err e;
    dc_step_result res;
    dc_test_rng_seed(&r, 1);
    dc_test_layer_make(&l, &sp, &r);
    dc_step s = {.batch = 2, .n_layers = 1, .layers = &l, .max_grad_norm = 1.0f,
                 .reduction = DC_REDUCTION_SUM, .expected_batch = 2, .device = 0};
    assert_int_equal(dc_cpu_backend_create(1, &be, &e), 0);
    assert_int_equal(dc_step_result_init(&res, 2, 1, false), 0);
    assert_int_equal(dc_backend_run_step(be, &s, &res, &e), DC_EPRECOND);
    s.device = -1;
    assert_int_equal(dc_backend_run_step(be, &s, &res, &e), 0);
    assert_true(res.norms[0] > 0.0f);
    dc_step_result_free(&res);
    dc_backend_destroy(be);
    dc_test_layer_free(&l);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_flat),
        cmocka_unit_test(test_per_layer),
        cmocka_unit_test(test_scratch_reuse),
        cmocka_unit_test(test_output_aliases_input),
        cmocka_unit_test(test_refuses_gpu_steps),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
