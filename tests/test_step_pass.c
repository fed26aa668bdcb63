/* Steps in phases (daemon/protocol/step_pass.c) through a real daemon: one norm pass
 * (STEP_NORMS) and the clipped sums it keeps for (STEP_SUMS), layer group by
 * layer group, against the per-sample double-precision reference and the
 * same step whole; and every rule a pass enforces, each refused naming its
 * field while the daemon keeps serving. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "harness.h"
#include "step_pass.h"

#define B 4
#define L 5

static dc_harness g_h;

static int setup(void **state) {
    (void)state;
    return dc_harness_start(&g_h, "--workers 2 --no-gpu");
}

static int teardown(void **state) {
    (void)state;
    return dc_harness_stop(&g_h) == 0 ? 0 : -1;
}

static dpclip_client *connect_ok(const char *job) {
    return dc_harness_connect(&g_h, "test_step_pass", job);
}

/* Every kind of layer, with outputs; C the median norm, sigma 0, a mean
 * loss: half the samples clipped. The first layer's sums are long enough
 * (T = 40) for a rounding bound above the CPU's floor: the sums steps
 * without it clip by the pass's bound all the same. */
static void make(dc_shm_step *s, dpclip_client *c, uint64_t seed) {
    static const dc_test_layer_spec specs[L] = {
        {DC_LAYER_LINEAR, B, 40, 12, 10, DC_F32, 1, DC_ALGO_DIRECT, 1, 0},
        {DC_LAYER_EMBEDDING, B, 6, 8, 20, DC_F32, 0, DC_ALGO_AUTO, 1, 0},
        {DC_LAYER_LAYERNORM, B, 6, 12, 0, DC_F32, 1, DC_ALGO_AUTO, 1, 0},
        {DC_LAYER_LINEAR, B, 6, 12, 7, DC_BF16, 0, DC_ALGO_GHOST, 1, 0},
        {DC_LAYER_RMSNORM, B, 6, 7, 0, DC_F32, 0, DC_ALGO_AUTO, 1, 0},
    };
    dpclip_clip_config cfg = {.max_grad_norm = 1.0f,
                              .reduction = DPCLIP_MEAN,
                              .expected_batch_size = 5,
                              .noise_multiplier = 0.0f};
    dc_test_rng r;
    dc_test_rng_seed(&r, seed);
    assert_int_equal(dc_shm_step_init(s, c, 1u << 20, B, &cfg), 0);
    for (int l = 0; l < L; l++) assert_true(dc_shm_step_add(s, &specs[l], &r, 1.0f) >= 0);
    cfg.max_grad_norm = (float)dc_shm_step_median_norm(s);
    assert_int_equal(dc_shm_step_set_config(s, &cfg), 0);
}

/* A step of phase ph naming layers[0..n) of s. */
static dpclip_step *phase_step(dc_shm_step *s, dpclip_phase ph, const size_t *layers, size_t n,
                               const dpclip_clip_config *cfg) {
    dpclip_step *p = dpclip_step_new(B, cfg ? cfg : &s->cfg);
    assert_non_null(p);
    assert_int_equal(dpclip_step_set_phase(p, ph), 0);
    assert_int_equal(dc_shm_step_wire_layers(s, p, layers, n, ph == DPCLIP_STEP_SUMS), 0);
    return p;
}

/* Runs p and expects it refused with code and field. */
static void refused(dpclip_client *c, dpclip_step *p, int code, const char *field) {
    dpclip_result res;
    memset(&res, 0, sizeof res);
    int rc = dpclip_run(c, p, &res);
    if (rc != code || strcmp(dpclip_errfield(c), field) != 0)
        fprintf(stderr, "expected %d '%s', got %d '%s': %s\n", code, field, rc, dpclip_errfield(c),
                dpclip_errmsg(c));
    assert_int_equal(rc, code);
    assert_string_equal(dpclip_errfield(c), field);
    dpclip_result_free(&res);
}

static void run_ok(dpclip_client *c, dpclip_step *p, dpclip_result *res) {
    int rc = dpclip_run(c, p, res);
    if (rc) fprintf(stderr, "step: %s (%s)\n", dpclip_errmsg(c), dpclip_errfield(c));
    assert_int_equal(rc, 0);
}

/* The norm pass and three sums steps (out of order, layer groups of 2, 2
 * and 1) give the reference's norms, coefficients and clipped sums, and the
 * same sums as the step whole; the sums are part of the pass's step. */
static void test_phases_match_whole(void **state) {
    (void)state;
    dpclip_client *c = connect_ok("pass-job");
    dc_shm_step s;
    dpclip_result whole, pass, sums;
    static const size_t all[L] = {0, 1, 2, 3, 4};
    static const size_t groups[3][2] = {{3, 0}, {4, 1}, {2, 0}};
    static const size_t sizes[3] = {2, 2, 1};
    make(&s, c, 11);

    memset(&whole, 0, sizeof whole);
    run_ok(c, s.step, &whole);
    assert_true(dc_shm_step_check(&s, &whole, dc_test_rtol(DC_BF16), 1e-6) <= 1.0);
    int64_t n = dc_shm_step_outputs(&s, NULL);
    float *want = malloc((size_t)n * sizeof *want), *got = malloc((size_t)n * sizeof *got);
    assert_non_null(want);
    assert_non_null(got);
    dc_shm_step_outputs(&s, want);
    dc_shm_step_fill_outputs(&s, NAN);

    dpclip_step *norms = phase_step(&s, DPCLIP_STEP_NORMS, all, L, NULL);
    memset(&pass, 0, sizeof pass);
    run_ok(c, norms, &pass);
    assert_int_equal(pass.step_index, whole.step_index + 1);
    for (int b = 0; b < B; b++) {
        /* the pass's coefficients are what its sums apply: with the margin
         * of the sums' re-measurement (step_pass.h) */
        double coef = fmin(1.0, (double)s.cfg.max_grad_norm /
                                    (whole.norms[b] * sqrt(1.0 + DC_PHASE_RECHECK_TOL) + 1e-6));
        assert_float_equal(pass.norms[b], whole.norms[b], 1e-5 * whole.norms[b]);
        assert_float_equal(pass.coefs[b], coef, 2e-6);
        assert_true(pass.coefs[b] > 0.0f && pass.coefs[b] <= 1.0f);
    }
    /* the pass wrote nothing */
    dc_shm_step_outputs(&s, got);
    for (int64_t i = 0; i < n; i++) assert_true(isnan(got[i]));

    for (int g = 0; g < 3; g++) {
        dpclip_step *p = phase_step(&s, DPCLIP_STEP_SUMS, groups[g], sizes[g], NULL);
        memset(&sums, 0, sizeof sums);
        run_ok(c, p, &sums);
        assert_int_equal(sums.step_index, pass.step_index);
        for (int b = 0; b < B; b++) assert_float_equal(sums.coefs[b], pass.coefs[b], 0.0);
        dpclip_result_free(&sums);
        dpclip_step_free(p);
    }
    assert_true(dc_shm_step_check(&s, &pass, dc_test_rtol(DC_BF16), 1e-6) <= 1.0);
    /* exactly the clipped sums at the coefficients the pass reported (the
     * whole step's, `want`, but for the margin): the f64 reference at those */
    dc_shm_step_outputs(&s, got);
    {
        double coef[B], *ref = calloc((size_t)n, sizeof *ref);
        const double scale = dc_step_grad_scale(&s.ref), div = s.ref.expected_batch;
        int64_t off = 0;
        assert_non_null(ref);
        for (int b = 0; b < B; b++) coef[b] = pass.coefs[b];
        for (size_t l = 0; l < s.ref.n_layers; l++) {
            const dc_layer *ly = &s.ref.layers[l];
            int64_t nw = dc_test_tensor_numel(&ly->weight_grad_out);
            int64_t nb = ly->bias_grad_out.data ? dc_test_tensor_numel(&ly->bias_grad_out) : 0;
            dc_ref_layer_clipped_sum(ly, B, scale, coef, ref + off, nb ? ref + off + nw : NULL);
            off += nw + nb;
        }
        assert_int_equal(off, n);
        for (int64_t i = 0; i < n; i++) ref[i] /= div;
        assert_true(dc_test_max_relerr_f(got, ref, n, dc_test_rtol(DC_BF16), 1e-6) <= 1.0);
        free(ref);
    }

    /* every layer summed: the pass is gone */
    dpclip_step *again = phase_step(&s, DPCLIP_STEP_SUMS, all, 1, NULL);
    refused(c, again, DPCLIP_EPRECOND, "clip_step.phase");
    dpclip_step_free(again);
    dpclip_step_free(norms);
    dpclip_result_free(&whole);
    dpclip_result_free(&pass);
    free(want);
    free(got);
    dc_shm_step_free(&s);
    dpclip_disconnect(c);
}

/* What a pass refuses, each naming its field; the session (and the daemon)
 * serve on. */
static void test_pass_rules(void **state) {
    (void)state;
    dpclip_client *c = connect_ok("rules-job");
    dc_shm_step s;
    dpclip_result res;
    static const size_t all[L] = {0, 1, 2, 3, 4};
    static const size_t first[1] = {0}, second[1] = {1};
    make(&s, c, 12);
    dpclip_clip_config noisy = s.cfg, per_layer = s.cfg, other_c = s.cfg;
    noisy.noise_multiplier = 1.0f;
    per_layer.mode = DPCLIP_PER_LAYER;
    other_c.max_grad_norm *= 2.0f;

    /* sums before any pass */
    dpclip_step *p = phase_step(&s, DPCLIP_STEP_SUMS, first, 1, NULL);
    refused(c, p, DPCLIP_EPRECOND, "clip_step.phase");
    dpclip_step_free(p);
    /* a pass with noise is accounted at its sigma, and its sums add that
     * noise themselves (test_step_pass_noise.c): a sums step without it is
     * refused */
    p = phase_step(&s, DPCLIP_STEP_NORMS, all, L, &noisy);
    memset(&res, 0, sizeof res);
    run_ok(c, p, &res);
    assert_true(isfinite(res.epsilon) && res.epsilon > 0.0);
    dpclip_result_free(&res);
    dpclip_step_free(p);
    p = phase_step(&s, DPCLIP_STEP_SUMS, first, 1, NULL);
    refused(c, p, DPCLIP_EINVAL, "clip_step.noise_multiplier");
    dpclip_step_free(p);
    /* per-layer clipping, outputs */
    p = phase_step(&s, DPCLIP_STEP_NORMS, all, L, &per_layer);
    refused(c, p, DPCLIP_EINVAL, "clip_step.clip.mode");
    dpclip_step_free(p);
    p = dpclip_step_new(B, &s.cfg);
    assert_int_equal(dpclip_step_set_phase(p, DPCLIP_STEP_NORMS), 0);
    assert_int_equal(dc_shm_step_wire_layers(&s, p, all, L, 1), 0);
    refused(c, p, DPCLIP_EINVAL, "clip_step.layers.weight_grad_out");
    dpclip_step_free(p);
    assert_int_equal(dpclip_step_set_phase(s.step, (dpclip_phase)7), DPCLIP_EARG);

    /* a pass, then: a layer twice, another C, a layer it did not measure */
    dpclip_step *norms = phase_step(&s, DPCLIP_STEP_NORMS, first, 1, NULL);
    memset(&res, 0, sizeof res);
    run_ok(c, norms, &res);
    dpclip_result_free(&res);
    p = phase_step(&s, DPCLIP_STEP_SUMS, second, 1, NULL);
    refused(c, p, DPCLIP_EINVAL, "clip_step.layers");
    dpclip_step_free(p);
    p = phase_step(&s, DPCLIP_STEP_SUMS, first, 1, &other_c);
    refused(c, p, DPCLIP_EINVAL, "clip_step.clip");
    dpclip_step_free(p);
    p = phase_step(&s, DPCLIP_STEP_SUMS, first, 1, NULL);
    memset(&res, 0, sizeof res);
    run_ok(c, p, &res); /* the refusals took nothing from the pass */
    dpclip_result_free(&res);
    /* every layer summed: the pass is gone */
    refused(c, p, DPCLIP_EPRECOND, "clip_step.phase");
    dpclip_step_free(p);

    /* another step ends a pass */
    memset(&res, 0, sizeof res);
    run_ok(c, norms, &res);
    dpclip_result_free(&res);
    memset(&res, 0, sizeof res);
    run_ok(c, s.step, &res);
    assert_true(dc_shm_step_check(&s, &res, dc_test_rtol(DC_BF16), 1e-6) <= 1.0);
    dpclip_result_free(&res);
    p = phase_step(&s, DPCLIP_STEP_SUMS, first, 1, NULL);
    refused(c, p, DPCLIP_EPRECOND, "clip_step.phase");
    dpclip_step_free(p);
    dpclip_step_free(norms);
    dc_shm_step_free(&s);
    dpclip_disconnect(c);
    assert_true(dc_harness_alive(&g_h));
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_phases_match_whole),
        cmocka_unit_test(test_pass_rules),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
