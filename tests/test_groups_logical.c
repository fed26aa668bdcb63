/* Logical steps in a norm group (daemon/protocol/step_logical.c with group.c
 * and step_fuse.c): a small transformer split over 2 pipeline stages, its
 * logical batch sent as micro-batches, each micro-batch a group step whose
 * per-sample norms are summed over the stages before its coefficients; the
 * committed outputs of every stage are the whole logical batch's clipped
 * sums against the whole model's per-sample f64 reference, fused (one
 * daemon, groups.fuse) and in phases. The stages submit each micro-batch in
 * turn without waiting, the last stage first, as a pipeline's backward
 * passes come; members that disagree on the micro-batch fail it on both. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "group_test.h"
#include "harness.h"
#include "step_pass.h"

#define B DC_GROUP_TEST_B

/* The two stages of dc_group_pp_model, joined to `name` on sock. */
static void stages(const char *sock, const char *name, dc_shm_step st[2], uint64_t seed) {
    dpclip_clip_config cfg = dc_group_config(1.0f, 0.0f);
    dc_test_rng r;
    dc_test_rng_seed(&r, seed);
    for (int k = 0; k < 2; k++)
        assert_int_equal(dc_shm_step_init(&st[k],
                                          dc_group_member(sock, name, (uint32_t)k, 2, 20000, 0,
                                                          "logical-job", NULL),
                                          0, B, &cfg),
                         0);
    for (int l = 0; l < 6; l++)
        assert_true(
            dc_shm_step_add(&st[dc_group_pp_stage_of[0][l]], &dc_group_pp_model[l], &r, 1.0f) >= 0);
    dc_group_set_c(st, 2, dc_group_median(st, 2), 0.0f);
}

static void free_stages(dc_shm_step st[2]) {
    for (int k = 0; k < 2; k++) {
        dpclip_client *c = st[k].c;
        dc_shm_step_free(&st[k]);
        dpclip_disconnect(c);
    }
}

/* Every stage's committed outputs against the whole batch's reference. */
static void check_outputs(dc_shm_step st[2], int phased) {
    double tot[B], coef[B];
    const double margin = phased ? 1.0 + DC_PHASE_RECHECK_TOL : 1.0;
    const float C = st[0].cfg.max_grad_norm;
    int clipped = 0;
    dc_group_sq(st, 2, tot);
    for (int b = 0; b < B; b++) {
        coef[b] = fmin(1.0, C / (sqrt(tot[b] * margin) + 1e-6));
        clipped += coef[b] < 1.0;
    }
    assert_true(clipped > 0 && clipped < B);
    for (int k = 0; k < 2; k++) {
        int64_t m = dc_shm_step_outputs(&st[k], NULL), off = 0;
        float *got = malloc((size_t)m * sizeof *got);
        double *want = calloc((size_t)m, sizeof *want);
        assert_non_null(got);
        assert_non_null(want);
        dc_shm_step_outputs(&st[k], got);
        for (size_t l = 0; l < st[k].ref.n_layers; l++) {
            const dc_layer *ly = &st[k].ref.layers[l];
            int64_t nw = dc_test_tensor_numel(&ly->weight_grad_out);
            int64_t nb = ly->bias_grad_out.data ? dc_test_tensor_numel(&ly->bias_grad_out) : 0;
            dc_ref_layer_clipped_sum(ly, B, 1.0, coef, want + off, nb ? want + off + nw : NULL);
            off += nw + nb;
        }
        double e = dc_test_max_relerr_f(got, want, m, dc_test_rtol(DC_BF16), 1e-6);
        if (e > 1.0) print_message("stage %d: outputs off by %.3g of the tolerance\n", k, e);
        assert_true(e <= 1.0);
        free(got);
        free(want);
    }
}

/* Micro-batches of sizes[0..n) (summing to B), submitted stage by stage,
 * the last stage first (first_stage 1), or the first; each stage waits for
 * these replies at the end. */
static void run_logical_from(dc_shm_step st[2], const uint32_t *sizes, int n, uint64_t id,
                             int first_stage);
static void run_logical(dc_shm_step st[2], const uint32_t *sizes, int n, uint64_t id) {
    run_logical_from(st, sizes, n, id, 1);
}

static void run_logical_from(dc_shm_step st[2], const uint32_t *sizes, int n, uint64_t id,
                             int first_stage) {
    dpclip_step *p[2][8];
    uint64_t t[2][8];
    uint32_t b0 = 0;
    for (int m = 0; m < n; b0 += sizes[m], m++)
        for (int i = 0; i < 2; i++) {
            const int k = first_stage ? 1 - i : i;
            p[k][m] = dpclip_step_new(sizes[m], &st[k].cfg);
            assert_non_null(p[k][m]);
            assert_int_equal(dc_shm_step_wire_slice(&st[k], p[k][m], b0, sizes[m]), 0);
            assert_int_equal(dpclip_step_set_logical(p[k][m], id, (uint32_t)m, m == n - 1), 0);
            assert_int_equal(dpclip_submit(st[k].c, p[k][m], &t[k][m]), 0);
        }
    for (int k = 0; k < 2; k++)
        for (int m = 0; m < n; m++) {
            dpclip_result res;
            int rc = dpclip_wait(st[k].c, t[k][m], 30000, &res);
            if (rc) print_message("stage %d micro-batch %d: %s\n", k, m, dpclip_errmsg(st[k].c));
            assert_int_equal(rc, 0);
            assert_int_equal(res.micro_batches, (uint32_t)m + 1);
            dpclip_result_free(&res);
            dpclip_step_free(p[k][m]);
        }
}

static void pipeline(const char *args, int phased) {
    static const uint32_t sizes[3] = {1, 2, 3};
    dc_harness h;
    dc_shm_step st[2];
    assert_int_equal(dc_harness_start(&h, args), 0);
    stages(h.sock, "pp-logical", st, 71);
    for (int k = 0; k < 2; k++) dc_shm_step_fill_outputs(&st[k], NAN);
    run_logical(st, sizes, 3, 1);
    check_outputs(st, phased);
    run_logical(st, sizes, 3, 2); /* a second logical step on the same accumulators */
    check_outputs(st, phased);
    free_stages(st);
    assert_int_equal(dc_harness_stop(&h), 0);
}

static void test_pipeline_fused(void **state) {
    (void)state;
    pipeline("--workers 2 --no-gpu", 0);
}

static void test_pipeline_phased(void **state) {
    (void)state;
    pipeline("--workers 2 --no-gpu --set groups.fuse=false", 1);
}

/* A stage a micro-batch ahead of the other: the group step fails on both,
 * naming clip_step.logical, and both logical steps are aborted. */
static void test_members_disagree(void **state) {
    dc_harness h;
    dc_shm_step st[2];
    dpclip_step *p[2];
    uint64_t t[2];
    (void)state;
    assert_int_equal(dc_harness_start(&h, "--workers 2 --no-gpu"), 0);
    stages(h.sock, "pp-disagree", st, 72);
    for (int k = 0; k < 2; k++) {
        p[k] = dpclip_step_new(B, &st[k].cfg);
        assert_non_null(p[k]);
        assert_int_equal(dc_shm_step_wire_slice(&st[k], p[k], 0, B), 0);
        /* stage 1 says its micro-batch commits, stage 0 that it does not */
        assert_int_equal(dpclip_step_set_logical(p[k], 1, 0, k == 1), 0);
        assert_int_equal(dpclip_submit(st[k].c, p[k], &t[k]), 0);
    }
    for (int k = 0; k < 2; k++) {
        dpclip_result res;
        assert_true(dpclip_wait(st[k].c, t[k], 30000, &res) != 0);
        assert_string_equal(dpclip_errfield(st[k].c), "clip_step.logical");
        dpclip_step_free(p[k]);
    }
    free_stages(st);
    assert_int_equal(dc_harness_stop(&h), 0);
}

/* A stage that gave up a logical step part-way (sent micro-batch 0 of 2,
 * the other stage both): the next logical step's micro-batches still pair
 * (a logical step's micro-batch k is the same group step on every member),
 * the step the first stage waits in is given up, and the next logical step
 * is exact. */
static void test_stage_drops_a_logical_step(void **state) {
    static const uint32_t sizes[3] = {1, 2, 3};
    dc_harness h;
    dc_shm_step st[2];
    dpclip_step *p[2][2];
    uint64_t t[2][2];
    dpclip_result res;
    (void)state;
    assert_int_equal(dc_harness_start(&h, "--workers 2 --no-gpu"), 0);
    stages(h.sock, "pp-drop", st, 73);
    for (int k = 0; k < 2; k++)
        for (int m = 0; m < 2; m++) {
            p[k][m] = dpclip_step_new(3, &st[k].cfg);
            assert_non_null(p[k][m]);
            assert_int_equal(dc_shm_step_wire_slice(&st[k], p[k][m], 3 * (uint32_t)m, 3), 0);
            assert_int_equal(dpclip_step_set_logical(p[k][m], 1, (uint32_t)m, m == 1), 0);
        }
    /* both send micro-batch 0; stage 0 also micro-batch 1; stage 1 gives up */
    for (int k = 0; k < 2; k++) assert_int_equal(dpclip_submit(st[k].c, p[k][0], &t[k][0]), 0);
    assert_int_equal(dpclip_submit(st[0].c, p[0][1], &t[0][1]), 0);
    for (int k = 0; k < 2; k++) {
        assert_int_equal(dpclip_wait(st[k].c, t[k][0], 30000, &res), 0);
        dpclip_result_free(&res);
    }
    /* the next logical step, on both: stage 0's micro-batch 1 is given up */
    for (int k = 0; k < 2; k++) dc_shm_step_fill_outputs(&st[k], NAN);
    run_logical_from(st, sizes, 3, 2, 1);
    assert_true(dpclip_wait(st[0].c, t[0][1], 30000, &res) != 0);
    assert_non_null(strstr(dpclip_errmsg(st[0].c), "given up"));
    check_outputs(st, 0);
    for (int k = 0; k < 2; k++)
        for (int m = 0; m < 2; m++) dpclip_step_free(p[k][m]);
    free_stages(st);
    assert_int_equal(dc_harness_stop(&h), 0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_pipeline_fused),
        cmocka_unit_test(test_pipeline_phased),
        cmocka_unit_test(test_members_disagree),
        cmocka_unit_test(test_stage_drops_a_logical_step),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
