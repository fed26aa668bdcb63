#include "group_test.h"
#include "step_pass.h"

#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#define B DC_GROUP_TEST_B
#define MAXM DC_GROUP_TEST_MAXM

dpclip_client *dc_group_member(const char *sock, const char *group, uint32_t rank, uint32_t size,
                               uint32_t timeout_ms, int group_wise, const char *job,
                               dpclip_group_link *link) {
    dpclip_client *c = NULL;
    dpclip_connect_opts o = {.client_name = "group-test", .job_id = job};
    dpclip_group_opts g = {group, rank, size, timeout_ms, group_wise};
    uint64_t id = 0;
    int rc = dpclip_connect(sock, &o, &c);
    if (rc) fprintf(stderr, "connect: %s\n", dpclip_errmsg(c));
    assert_int_equal(rc, 0);
    rc = link ? dpclip_join_group_linked(c, &g, link, &id) : dpclip_join_group(c, &g, &id);
    if (rc) fprintf(stderr, "join: %s: %s\n", dpclip_errfield(c), dpclip_errmsg(c));
    assert_int_equal(rc, 0);
    assert_true(id > 0);
    return c;
}

dpclip_clip_config dc_group_config(float C, float sigma) {
    dpclip_clip_config cfg = {.max_grad_norm = C,
                              .reduction = DPCLIP_SUM,
                              .expected_batch_size = B,
                              .noise_multiplier = sigma};
    return cfg;
}

/* Submits every member's step, then waits for each (a member's step waits
 * for the others inside the daemon). rcs[k] gets each code. */
void dc_group_run(dc_shm_step *st, int n, dpclip_result *res, int *rcs) {
    uint64_t t[MAXM];
    for (int k = 0; k < n; k++) assert_int_equal(dpclip_submit(st[k].c, st[k].step, &t[k]), 0);
    for (int k = 0; k < n; k++) rcs[k] = dpclip_wait(st[k].c, t[k], 30000, &res[k]);
}

/* The reference per-sample squared norms of the whole model: every member's
 * layers, replicated ones once (from member 0). */
void dc_group_sq(dc_shm_step *st, int n, double *tot) {
    double sq[B];
    memset(tot, 0, B * sizeof *tot);
    for (int k = 0; k < n; k++)
        for (size_t l = 0; l < st[k].ref.n_layers; l++) {
            const dc_layer *ly = &st[k].ref.layers[l];
            if (ly->replicated && k > 0) continue;
            dc_ref_layer_sqnorms(ly, B, 1.0, sq);
            for (int b = 0; b < B; b++) tot[b] += sq[b];
        }
}

/* A threshold between the middle two of the model's norms: it clips half. */
float dc_group_median(dc_shm_step *st, int n) {
    double tot[B], v[B];
    dc_group_sq(st, n, tot);
    for (int b = 0; b < B; b++) v[b] = sqrt(tot[b]);
    for (int i = 0; i < B; i++)
        for (int j = i + 1; j < B; j++)
            if (v[j] < v[i]) {
                double t = v[i];
                v[i] = v[j];
                v[j] = t;
            }
    return (float)(0.5 * (v[B / 2 - 1] + v[B / 2]));
}

/* Sets every member's threshold to C. */
void dc_group_set_c(dc_shm_step *st, int n, float C, float sigma) {
    dpclip_clip_config cfg = dc_group_config(C, sigma);
    for (int k = 0; k < n; k++) assert_int_equal(dc_shm_step_set_config(&st[k], &cfg), 0);
}

/* The group's reference: per-sample squared norm over every member's layers
 * (replicated ones once, from member 0), coefficients, and each member's
 * clipped sums compared with what the daemon wrote. */
int dc_group_phased;
unsigned dc_group_e_how;

void dc_group_check(dc_shm_step *st, int n, const dpclip_result *res, float C) {
    dc_group_check_tol(st, n, res, C, 1e-4, 1e-4, 1e-6);
}

void dc_group_check_tol(dc_shm_step *st, int n, const dpclip_result *res, float C, double norm_rtol,
                        double out_rtol, double out_atol) {
    double tot[B], coef[B];
    dc_group_sq(st, n, tot);
    int clipped = 0;
    const double margin = dc_group_phased ? 1.0 + DC_PHASE_RECHECK_TOL : 1.0;
    for (int b = 0; b < B; b++) clipped += C / (sqrt(tot[b] * margin) + 1e-6) < 1.0;
    assert_true(clipped > 0 && clipped < B); /* the threshold bites, not everywhere */
    for (int k = 0; k < n; k++) {
        const double e = dc_clip_e_step(&st[k].ref, dc_group_e_how);
        for (int b = 0; b < B; b++)
            coef[b] = fmin(1.0, C / (sqrt(tot[b] * margin) * (1.0 + e) + 1e-6));
        for (int b = 0; b < B; b++) {
            assert_true(fabs(res[k].norms[b] - sqrt(tot[b])) <= norm_rtol * sqrt(tot[b]));
            assert_true(fabs(res[k].coefs[b] - coef[b]) <= norm_rtol * coef[b]);
        }
        int64_t m = dc_shm_step_outputs(&st[k], NULL);
        float *got = malloc((size_t)m * sizeof *got);
        double *want = calloc((size_t)m, sizeof *want);
        int64_t off = 0;
        dc_shm_step_outputs(&st[k], got);
        for (size_t l = 0; l < st[k].ref.n_layers; l++) {
            const dc_layer *ly = &st[k].ref.layers[l];
            int64_t nw = dc_test_tensor_numel(&ly->weight_grad_out);
            int64_t nb = ly->bias_grad_out.data ? dc_test_tensor_numel(&ly->bias_grad_out) : 0;
            dc_ref_layer_clipped_sum(ly, B, 1.0, coef, want + off, nb ? want + off + nw : NULL);
            off += nw + nb;
        }
        assert_int_equal(off, m);
        double off_by = dc_test_max_relerr_f(got, want, m, out_rtol, out_atol);
        if (off_by > 1.0) print_message("member %d: outputs off by %.3g of tolerance\n", k, off_by);
        assert_true(off_by <= 1.0);
        free(got);
        free(want);
    }
}

const dc_test_layer_spec dc_group_pp_model[6] = {
    {DC_LAYER_EMBEDDING, B, 7, 8, 30, DC_F32, 0, DC_ALGO_AUTO, 1, 0},
    {DC_LAYER_LAYERNORM, B, 7, 8, 0, DC_BF16, 1, DC_ALGO_AUTO, 1, 0},
    {DC_LAYER_LINEAR, B, 7, 8, 16, DC_F32, 1, DC_ALGO_GHOST, 1, 0},
    {DC_LAYER_LINEAR, B, 7, 16, 8, DC_F16, 1, DC_ALGO_DIRECT, 1, 0},
    {DC_LAYER_RMSNORM, B, 7, 8, 0, DC_F32, 0, DC_ALGO_AUTO, 1, 0},
    {DC_LAYER_LINEAR, B, 7, 8, 30, DC_F32, 0, DC_ALGO_AUTO, 1, 0},
};
const int dc_group_pp_stage_of[2][6] = {{0, 0, 0, 1, 1, 1}, {0, 1, 1, 2, 3, 3}};
