/* Logical steps (daemon/protocol/step_logical.c, the backends' accumulation):
 * a logical batch sent as micro-batches through a real daemon. With noise
 * off, the committed outputs are the whole batch's clipped sum against the
 * per-sample double-precision reference (micro-batches of 8, and ragged 5 +
 * 27 + 32, every layer kind, SUM and MEAN); nothing is written before the
 * commit; the noise is drawn once per logical step (its std sigma*C/E); the
 * ledger charges the commit once, at the logical batch's rate; every rule
 * and limit refuses naming its field or setting, and an abort releases and
 * charges nothing; a session gone mid-step leaves no accumulator. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>

#include "accountant.h"
#include "harness.h"

#define B 64

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
    return dc_harness_connect(&g_h, "test_step_logical", job);
}

/* Every layer kind; C the median norm (about half the samples clipped). */
static void make(dc_shm_step *s, dpclip_client *c, dpclip_reduction red, uint32_t expected,
                 float sigma, uint64_t seed) {
    static const dc_test_layer_spec specs[5] = {
        {DC_LAYER_LINEAR, B, 3, 12, 10, DC_F32, 1, DC_ALGO_DIRECT, 1, 0},
        {DC_LAYER_EMBEDDING, B, 3, 8, 20, DC_F32, 0, DC_ALGO_AUTO, 1, 0},
        {DC_LAYER_LAYERNORM, B, 3, 12, 0, DC_F32, 1, DC_ALGO_AUTO, 1, 0},
        {DC_LAYER_LINEAR, B, 3, 12, 7, DC_BF16, 0, DC_ALGO_GHOST, 1, 0},
        {DC_LAYER_RMSNORM, B, 3, 7, 0, DC_F32, 0, DC_ALGO_AUTO, 1, 0},
    };
    dpclip_clip_config cfg = {.max_grad_norm = 1.0f,
                              .reduction = red,
                              .expected_batch_size = expected,
                              .noise_multiplier = sigma};
    dc_test_rng r;
    dc_test_rng_seed(&r, seed);
    assert_int_equal(dc_shm_step_init(s, c, 1u << 20, B, &cfg), 0);
    for (int l = 0; l < 5; l++) assert_true(dc_shm_step_add(s, &specs[l], &r, 1.0f) >= 0);
    cfg.max_grad_norm = (float)dc_shm_step_median_norm(s);
    assert_int_equal(dc_shm_step_set_config(s, &cfg), 0);
}

/* Micro-batch k of logical step id: samples [b0, b0 + nb) of s. */
static dpclip_step *micro(dc_shm_step *s, const dpclip_clip_config *cfg, uint64_t id, uint32_t k,
                          uint32_t b0, uint32_t nb, int commit) {
    dpclip_step *p = dpclip_step_new(nb, cfg);
    assert_non_null(p);
    assert_int_equal(dc_shm_step_wire_slice(s, p, b0, nb), 0);
    assert_int_equal(dpclip_step_set_logical(p, id, k, commit), 0);
    return p;
}

static int run(dpclip_client *c, dpclip_step *p, dpclip_result *res) {
    memset(res, 0, sizeof *res);
    int rc = dpclip_run(c, p, res);
    if (rc) print_message("step: %s (%s)\n", dpclip_errmsg(c), dpclip_errfield(c));
    return rc;
}

static void all_nan(dc_shm_step *s) {
    int64_t n = dc_shm_step_outputs(s, NULL);
    float *got = malloc((size_t)n * sizeof *got);
    assert_non_null(got);
    dc_shm_step_outputs(s, got);
    for (int64_t i = 0; i < n; i++) assert_true(isnan(got[i]));
    free(got);
}

/* The micro-batches' sizes must sum to B; MEAN: each micro-batch's output
 * grads carry 1/its size, as a trainer's mean over it would, and the commit
 * divides by the logical batch's expected size. */
static void accumulate_matches_whole(const uint32_t *sizes, int m, dpclip_reduction red,
                                     uint64_t seed) {
    dpclip_client *c = connect_ok("accumulate");
    dc_shm_step s;
    dpclip_result res;
    const uint32_t E = 80;
    make(&s, c, red, E, 0.0f, seed);
    int64_t n = dc_shm_step_outputs(&s, NULL);
    double *want = malloc((size_t)n * sizeof *want), norms[B];
    float *got = malloc((size_t)n * sizeof *got);
    assert_non_null(want);
    assert_non_null(got);
    /* the whole logical batch's reference, as one step of B samples */
    dc_shm_step_ref_outputs(&s, want);
    dc_shm_step_ref_norms(&s, norms);
    if (red == DPCLIP_MEAN) {
        /* each sample's output grads rescaled from 1/B to 1/(its micro-batch):
         * the sizes divide B by powers of two, so bf16 grads stay exact */
        uint32_t b0 = 0;
        for (int k = 0; k < m; b0 += sizes[k], k++)
            for (size_t l = 0; l < s.ref.n_layers; l++) {
                dc_tensor *g = &s.ref.layers[l].grad;
                int64_t row = dc_test_tensor_numel(g) / B;
                float f = (float)B / (float)sizes[k];
                for (int64_t i = (int64_t)b0 * row; i < (int64_t)(b0 + sizes[k]) * row; i++) {
                    if (g->dtype == DC_F32) {
                        ((float *)g->data)[i] *= f;
                    } else {
                        uint16_t *h = (uint16_t *)g->data + i;
                        uint32_t bits = (uint32_t)*h << 16;
                        float v;
                        memcpy(&v, &bits, 4);
                        v *= f;
                        memcpy(&bits, &v, 4);
                        *h = (uint16_t)(bits >> 16);
                    }
                }
            }
    }
    dc_shm_step_fill_outputs(&s, NAN);
    uint32_t b0 = 0;
    for (int k = 0; k < m; b0 += sizes[k], k++) {
        dpclip_step *p = micro(&s, &s.cfg, 7, (uint32_t)k, b0, sizes[k], k == m - 1);
        assert_int_equal(run(c, p, &res), 0);
        assert_int_equal(res.logical_id, 7);
        assert_int_equal(res.micro_batches, (uint32_t)k + 1);
        assert_int_equal(res.step_index, 1);
        for (uint32_t b = 0; b < sizes[k]; b++)
            assert_true(fabs(res.norms[b] - norms[b0 + b]) <= 1e-3 * norms[b0 + b] + 1e-6);
        if (k < m - 1) all_nan(&s); /* nothing written before the commit */
        dpclip_result_free(&res);
        dpclip_step_free(p);
    }
    dc_shm_step_outputs(&s, got);
    double e = dc_test_max_relerr_f(got, want, n, dc_test_rtol(DC_BF16), 1e-6);
    if (e > 1.0) print_message("outputs off by %.3g of the tolerance\n", e);
    assert_true(e <= 1.0);
    free(want);
    free(got);
    dc_shm_step_free(&s);
    dpclip_disconnect(c);
}

static void test_micro_batches_of_8_sum(void **state) {
    static const uint32_t sizes[8] = {8, 8, 8, 8, 8, 8, 8, 8};
    (void)state;
    accumulate_matches_whole(sizes, 8, DPCLIP_SUM, 11);
}

static void test_ragged_sum(void **state) {
    static const uint32_t sizes[3] = {5, 27, 32};
    (void)state;
    accumulate_matches_whole(sizes, 3, DPCLIP_SUM, 12);
}

static void test_ragged_mean(void **state) {
    static const uint32_t sizes[3] = {16, 16, 32};
    (void)state;
    accumulate_matches_whole(sizes, 3, DPCLIP_MEAN, 13);
}

/* Noise once per logical step: the committed output of zero data is the
 * noise alone, std sigma*C/E over 1.3e5 values (not sqrt(M) times that);
 * and the ledger charges once, at the logical batch's rate. */
static void test_noise_once_and_one_charge(void **state) {
    dpclip_client *c = connect_ok("noise-once");
    dc_shm_step s;
    dpclip_result res;
    dc_test_layer_spec big = {DC_LAYER_LINEAR, 8, 1, 512, 256, DC_F32, 0, DC_ALGO_AUTO, 1, 0};
    const float C = 2.0f, sigma = 1.5f;
    const uint32_t E = 32;
    dpclip_clip_config cfg = {.max_grad_norm = C,
                              .reduction = DPCLIP_MEAN,
                              .expected_batch_size = E,
                              .noise_multiplier = sigma,
                              .sample_rate = 0.01};
    dc_test_rng r;
    double rdp[DC_RDP_N_ORDERS], want_eps;
    (void)state;
    dc_test_rng_seed(&r, 5);
    assert_int_equal(dc_shm_step_init(&s, c, 4u << 20, 8, &cfg), 0);
    assert_true(dc_shm_step_add(&s, &big, &r, 1.0f) >= 0);
    for (uint64_t id = 1; id <= 2; id++) {
        for (uint32_t k = 0; k < 4; k++) {
            dpclip_step *p = micro(&s, &cfg, id, k, 2 * k, 2, k == 3);
            memset(s.ref.layers[0].input.data, 0,
                   (size_t)dc_test_tensor_numel(&s.ref.layers[0].input) * 4);
            assert_int_equal(run(c, p, &res), 0);
            dc_rdp_steps(0.01, sigma, dc_rdp_default_orders(), DC_RDP_N_ORDERS, rdp);
            for (int o = 0; o < DC_RDP_N_ORDERS; o++) rdp[o] *= (double)(k == 3 ? id : id - 1);
            want_eps = id == 1 && k < 3 ? 0.0
                                        : dc_rdp_epsilon(dc_rdp_default_orders(), rdp,
                                                         DC_RDP_N_ORDERS, 1e-5, NULL);
            /* a micro-batch reports the job's epsilon without it */
            assert_true(fabs(res.epsilon - want_eps) <= 1e-9 * (want_eps + 1e-300));
            dpclip_result_free(&res);
            dpclip_step_free(p);
        }
        {
            int64_t n = dc_shm_step_outputs(&s, NULL);
            float *v = malloc((size_t)n * sizeof *v);
            double sum = 0, sq = 0, want = (double)sigma * C / E;
            assert_non_null(v);
            dc_shm_step_outputs(&s, v);
            for (int64_t i = 0; i < n; i++) {
                sum += v[i];
                sq += (double)v[i] * v[i];
            }
            double mean = sum / (double)n, sd = sqrt(sq / (double)n - mean * mean);
            print_message("logical step %llu: %lld values, std %.6f, want %.6f\n",
                          (unsigned long long)id, (long long)n, sd, want);
            assert_true(n >= 100000);
            assert_true(fabs(sd - want) <= 0.01 * want);
            assert_true(fabs(mean) <= 5.0 * want / sqrt((double)n));
            free(v);
        }
    }
    dc_shm_step_free(&s);
    dpclip_disconnect(c);
}

static void refused(dpclip_client *c, dpclip_step *p, int code, const char *field) {
    dpclip_result res;
    memset(&res, 0, sizeof res);
    int rc = dpclip_run(c, p, &res);
    if (rc != code || strcmp(dpclip_errfield(c), field) != 0)
        print_message("expected %d '%s', got %d '%s': %s\n", code, field, rc, dpclip_errfield(c),
                      dpclip_errmsg(c));
    assert_int_equal(rc, code);
    assert_string_equal(dpclip_errfield(c), field);
    dpclip_result_free(&res);
}

/* The rules: in order, ids up, the same terms, no whole step while open,
 * phases refused; any refusal or failure aborts (nothing written or
 * charged: the job's epsilon stays 0), and a new id opens again. */
static void test_rules_and_aborts(void **state) {
    dpclip_client *c = connect_ok("rules");
    dc_shm_step s;
    dpclip_result res;
    dpclip_clip_config other;
    (void)state;
    make(&s, c, DPCLIP_SUM, 0, 1.0f, 21);
    s.cfg.sample_rate = 0.05;
    dc_shm_step_fill_outputs(&s, NAN);
    dpclip_step *m0 = micro(&s, &s.cfg, 5, 0, 0, 8, 0), *m2 = micro(&s, &s.cfg, 5, 2, 16, 8, 0);
    assert_int_equal(run(c, m0, &res), 0);
    dpclip_result_free(&res);
    refused(c, m2, DPCLIP_EINVAL, "clip_step.logical.micro_batch"); /* 1 is next; aborts */
    dpclip_step *m1 = micro(&s, &s.cfg, 5, 1, 8, 8, 1);
    refused(c, m1, DPCLIP_EPRECOND, "clip_step.logical"); /* aborted */
    all_nan(&s);
    /* ids go up: 5 again is refused, 4 too */
    refused(c, m0, DPCLIP_EINVAL, "clip_step.logical.id");
    dpclip_step_free(m0);
    dpclip_step_free(m1);
    dpclip_step_free(m2);
    /* another C at micro-batch 1: refused naming it */
    m0 = micro(&s, &s.cfg, 6, 0, 0, 8, 0);
    assert_int_equal(run(c, m0, &res), 0);
    dpclip_result_free(&res);
    other = s.cfg;
    other.max_grad_norm *= 2.0f;
    m1 = micro(&s, &other, 6, 1, 8, 8, 1);
    refused(c, m1, DPCLIP_EINVAL, "clip_step.clip.max_grad_norm");
    dpclip_step_free(m0);
    dpclip_step_free(m1);
    /* another sample rate */
    m0 = micro(&s, &s.cfg, 7, 0, 0, 8, 0);
    assert_int_equal(run(c, m0, &res), 0);
    dpclip_result_free(&res);
    other = s.cfg;
    other.sample_rate = 0.5;
    m1 = micro(&s, &other, 7, 1, 8, 8, 1);
    refused(c, m1, DPCLIP_EINVAL, "clip_step.sample_rate");
    dpclip_step_free(m0);
    dpclip_step_free(m1);
    /* a whole step while one is open: refused */
    m1 = micro(&s, &s.cfg, 8, 0, 0, 8, 0);
    assert_int_equal(run(c, m1, &res), 0);
    dpclip_result_free(&res);
    refused(c, s.step, DPCLIP_EPRECOND, "clip_step.logical");
    dpclip_step_free(m1);
    /* a failing micro-batch (a non-finite activation) aborts its step */
    m1 = micro(&s, &s.cfg, 9, 0, 0, 8, 0);
    assert_int_equal(run(c, m1, &res), 0);
    dpclip_result_free(&res);
    dpclip_step_free(m1);
    ((float *)s.ref.layers[0].input.data)[8 * 3 * 12] = NAN; /* sample 8's first value */
    m1 = micro(&s, &s.cfg, 9, 1, 8, 8, 0);
    assert_int_not_equal(run(c, m1, &res), 0);
    dpclip_step_free(m1);
    m1 = micro(&s, &s.cfg, 9, 2, 16, 8, 1);
    refused(c, m1, DPCLIP_EPRECOND, "clip_step.logical");
    dpclip_step_free(m1);
    all_nan(&s);
    ((float *)s.ref.layers[0].input.data)[8 * 3 * 12] = 0.5f;
    /* nothing was charged: a whole logical step now is the job's first */
    m0 = micro(&s, &s.cfg, 10, 0, 0, 32, 0);
    m1 = micro(&s, &s.cfg, 10, 1, 32, 32, 1);
    assert_int_equal(run(c, m0, &res), 0);
    assert_true(res.epsilon == 0.0);
    dpclip_result_free(&res);
    assert_int_equal(run(c, m1, &res), 0);
    {
        double rdp[DC_RDP_N_ORDERS];
        dc_rdp_steps(0.05, 1.0, dc_rdp_default_orders(), DC_RDP_N_ORDERS, rdp);
        double want = dc_rdp_epsilon(dc_rdp_default_orders(), rdp, DC_RDP_N_ORDERS, 1e-5, NULL);
        assert_true(fabs(res.epsilon - want) <= 1e-9 * want);
    }
    assert_int_equal(res.step_index, 1); /* the session's first step done */
    dpclip_result_free(&res);
    dpclip_step_free(m0);
    dpclip_step_free(m1);
    dc_shm_step_free(&s);
    dpclip_disconnect(c);
}

/* limits.max_micro_batches and limits.logical_step_timeout refuse naming
 * themselves; limits.max_accumulator_memory_per_uid holds while a session's
 * accumulators live, and a session gone mid-step leaves none. */
static void test_limits(void **state) {
    dc_harness h;
    dc_shm_step s;
    dpclip_result res;
    (void)state;
    /* one logical step of make()'s layers holds 1544 bytes of accumulators */
    assert_int_equal(dc_harness_start(&h, "--workers 2 --no-gpu --set limits.max_micro_batches=2 "
                                          "--set limits.logical_step_timeout=1 "
                                          "--set limits.max_accumulator_memory_per_uid=2000"),
                     0);
    dpclip_client *c = dc_harness_connect(&h, "test_step_logical", "limits");
    make(&s, c, DPCLIP_SUM, 0, 0.0f, 31);
    for (uint32_t k = 0; k < 3; k++) {
        dpclip_step *p = micro(&s, &s.cfg, 1, k, 8 * k, 8, 0);
        if (k < 2) {
            assert_int_equal(run(c, p, &res), 0);
            dpclip_result_free(&res);
        } else {
            refused(c, p, DPCLIP_ENOSPACE, "limits.max_micro_batches");
        }
        dpclip_step_free(p);
    }
    {
        dpclip_step *p0 = micro(&s, &s.cfg, 2, 0, 0, 8, 0), *p1 = micro(&s, &s.cfg, 2, 1, 8, 8, 1);
        struct timespec ts = {1, 600000000};
        assert_int_equal(run(c, p0, &res), 0);
        dpclip_result_free(&res);
        nanosleep(&ts, NULL);
        refused(c, p1, DPCLIP_EUNAVAIL, "limits.logical_step_timeout");
        dpclip_step_free(p0);
        dpclip_step_free(p1);
    }
    /* this session holds its accumulators: another of the same uid cannot
     * open a logical step past the uid's limit */
    {
        dpclip_client *c2 = dc_harness_connect(&h, "test_step_logical", "limits-2");
        dc_shm_step s2;
        make(&s2, c2, DPCLIP_SUM, 0, 0.0f, 32);
        dpclip_step *q = micro(&s2, &s2.cfg, 1, 0, 0, 8, 0);
        refused(c2, q, DPCLIP_ENOSPACE, "limits.max_accumulator_memory_per_uid");
        /* the first session goes (mid-step: a logical step open): its
         * accumulators with it */
        dpclip_step *p0 = micro(&s, &s.cfg, 3, 0, 0, 8, 0);
        assert_int_equal(run(c, p0, &res), 0);
        dpclip_result_free(&res);
        dpclip_step_free(p0);
        dc_shm_step_free(&s);
        dpclip_disconnect(c);
        struct timespec ts = {0, 300000000};
        nanosleep(&ts, NULL);
        dpclip_step_free(q);
        q = micro(&s2, &s2.cfg, 2, 0, 0, 8, 0);
        assert_int_equal(run(c2, q, &res), 0);
        dpclip_result_free(&res);
        dpclip_step_free(q);
        dc_shm_step_free(&s2);
        dpclip_disconnect(c2);
    }
    assert_int_equal(dc_harness_stop(&h), 0);
}

/* A logical step in phases (a sharded model's): each micro-batch a norm
 * pass over every layer and two sums steps of some layers each; the
 * commit's sums write the whole batch's clipped sums (with the phased
 * margin) against the f64 reference; the pass of a micro-batch is summed
 * whole before the next micro-batch; one charge, at the commit's pass. */
static void test_in_phases(void **state) {
    static const size_t all[5] = {0, 1, 2, 3, 4}, g0[2] = {0, 2}, g1[3] = {1, 3, 4};
    static const uint32_t sizes[3] = {16, 16, 32};
    dpclip_client *c = connect_ok("phases");
    dc_shm_step s;
    dpclip_result res;
    (void)state;
    make(&s, c, DPCLIP_SUM, 0, 0.0f, 41);
    s.cfg.sample_rate = 0.02;
    int64_t n = dc_shm_step_outputs(&s, NULL);
    double *want = malloc((size_t)n * sizeof *want), norms[B], coef[B];
    float *got = malloc((size_t)n * sizeof *got);
    assert_non_null(want);
    assert_non_null(got);
    /* the whole batch's sums at the coefficients of the phased margin */
    dc_shm_step_ref_norms(&s, norms);
    for (int b = 0; b < B; b++)
        coef[b] = fmin(1.0, s.cfg.max_grad_norm / (norms[b] * sqrt(1.0 + 1.0 / 1024.0) + 1e-6));
    {
        int64_t off = 0;
        for (size_t l = 0; l < s.ref.n_layers; l++) {
            const dc_layer *ly = &s.ref.layers[l];
            int64_t nw = dc_test_tensor_numel(&ly->weight_grad_out);
            int64_t nb = ly->bias_grad_out.data ? dc_test_tensor_numel(&ly->bias_grad_out) : 0;
            dc_ref_layer_clipped_sum(ly, B, 1.0, coef, want + off, nb ? want + off + nw : NULL);
            off += nw + nb;
        }
    }
    dc_shm_step_fill_outputs(&s, NAN);
    uint32_t b0 = 0;
    for (int k = 0; k < 3; b0 += sizes[k], k++) {
        const int commit = k == 2;
        dpclip_step *pn = dpclip_step_new(sizes[k], &s.cfg);
        dpclip_step *ps[2] = {dpclip_step_new(sizes[k], &s.cfg), dpclip_step_new(sizes[k], &s.cfg)};
        assert_int_equal(dpclip_step_set_phase(pn, DPCLIP_STEP_NORMS), 0);
        assert_int_equal(dc_shm_step_wire_layers_cut(&s, pn, all, 5, 0, b0, sizes[k]), 0);
        assert_int_equal(dpclip_step_set_logical(pn, 3, (uint32_t)k, commit), 0);
        for (int g = 0; g < 2; g++) {
            assert_int_equal(dpclip_step_set_phase(ps[g], DPCLIP_STEP_SUMS), 0);
            assert_int_equal(
                dc_shm_step_wire_layers_cut(&s, ps[g], g ? g1 : g0, g ? 3 : 2, 1, b0, sizes[k]), 0);
            assert_int_equal(dpclip_step_set_logical(ps[g], 3, (uint32_t)k, commit), 0);
        }
        assert_int_equal(run(c, pn, &res), 0);
        assert_int_equal(res.micro_batches, (uint32_t)k + 1);
        assert_true(commit ? res.epsilon > 0.0 : res.epsilon == 0.0);
        dpclip_result_free(&res);
        assert_int_equal(run(c, ps[0], &res), 0);
        dpclip_result_free(&res);
        assert_int_equal(run(c, ps[1], &res), 0);
        dpclip_result_free(&res);
        if (!commit) all_nan(&s);
        dpclip_step_free(pn);
        dpclip_step_free(ps[0]);
        dpclip_step_free(ps[1]);
    }
    dc_shm_step_outputs(&s, got);
    double e = dc_test_max_relerr_f(got, want, n, dc_test_rtol(DC_BF16), 1e-6);
    if (e > 1.0) print_message("outputs off by %.3g of the tolerance\n", e);
    assert_true(e <= 1.0);
    /* the next micro-batch before a pass is summed whole is refused (and
     * aborts its logical step: its sums are refused after it) */
    {
        dpclip_step *pn = dpclip_step_new(16, &s.cfg), *early = dpclip_step_new(16, &s.cfg);
        dpclip_step *ps = dpclip_step_new(16, &s.cfg);
        assert_int_equal(dpclip_step_set_phase(pn, DPCLIP_STEP_NORMS), 0);
        assert_int_equal(dc_shm_step_wire_layers_cut(&s, pn, all, 5, 0, 0, 16), 0);
        assert_int_equal(dpclip_step_set_logical(pn, 4, 0, 0), 0);
        assert_int_equal(dpclip_step_set_phase(early, DPCLIP_STEP_NORMS), 0);
        assert_int_equal(dc_shm_step_wire_layers_cut(&s, early, all, 5, 0, 16, 16), 0);
        assert_int_equal(dpclip_step_set_logical(early, 4, 1, 0), 0);
        assert_int_equal(dpclip_step_set_phase(ps, DPCLIP_STEP_SUMS), 0);
        assert_int_equal(dc_shm_step_wire_layers_cut(&s, ps, g0, 2, 1, 0, 16), 0);
        assert_int_equal(dpclip_step_set_logical(ps, 4, 0, 0), 0);
        assert_int_equal(run(c, pn, &res), 0);
        dpclip_result_free(&res);
        refused(c, early, DPCLIP_EPRECOND, "clip_step.phase");
        refused(c, ps, DPCLIP_EPRECOND, "clip_step.logical");
        /* the aborted logical step's pass holds nothing back: the next
         * logical step (here of one micro-batch, a whole step) runs */
        dpclip_step *nn = dpclip_step_new(16, &s.cfg), *ns[2];
        assert_int_equal(dpclip_step_set_phase(nn, DPCLIP_STEP_NORMS), 0);
        assert_int_equal(dc_shm_step_wire_layers_cut(&s, nn, all, 5, 0, 0, 16), 0);
        assert_int_equal(dpclip_step_set_logical(nn, 5, 0, 1), 0);
        assert_int_equal(run(c, nn, &res), 0);
        assert_int_equal(res.micro_batches, 1);
        assert_true(res.epsilon > 0.0);
        dpclip_result_free(&res);
        for (int g = 0; g < 2; g++) {
            ns[g] = dpclip_step_new(16, &s.cfg);
            assert_int_equal(dpclip_step_set_phase(ns[g], DPCLIP_STEP_SUMS), 0);
            assert_int_equal(
                dc_shm_step_wire_layers_cut(&s, ns[g], g ? g1 : g0, g ? 3 : 2, 1, 0, 16), 0);
            assert_int_equal(dpclip_step_set_logical(ns[g], 5, 0, 1), 0);
            assert_int_equal(run(c, ns[g], &res), 0);
            dpclip_result_free(&res);
            dpclip_step_free(ns[g]);
        }
        dpclip_step_free(nn);
        dpclip_step_free(pn);
        dpclip_step_free(early);
        dpclip_step_free(ps);
    }
    free(want);
    free(got);
    dc_shm_step_free(&s);
    dpclip_disconnect(c);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_micro_batches_of_8_sum),
        cmocka_unit_test(test_ragged_sum),
        cmocka_unit_test(test_ragged_mean),
        cmocka_unit_test(test_noise_once_and_one_charge),
        cmocka_unit_test(test_rules_and_aborts),
        cmocka_unit_test(test_limits),
        cmocka_unit_test(test_in_phases),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
