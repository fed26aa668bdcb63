/* Norm groups through a real daemon (daemon/protocol/group.c, session_group.c): a
 * model split over 2-4 sessions is clipped exactly as the whole model, by
 * its per-sample double-precision reference: a tensor-parallel split of a
 * Linear by output features, a pipeline split of a small transformer by
 * layers, replicated LayerNorms; members that never come or disconnect; the
 * ledger charged once per group step; group-wise clipping. Noise is off
 * except where the test is about noise (the daemon's seed is fixed). */
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
#include "dc_clock.h"
#include "harness.h"
#include "group_test.h"
#include "service.h"

#define B DC_GROUP_TEST_B
#define MAXM DC_GROUP_TEST_MAXM

static dc_harness g_h;

static dpclip_client *member(const char *group, uint32_t rank, uint32_t size, uint32_t timeout_ms,
                             int group_wise, const char *job) {
    return dc_group_member(g_h.sock, group, rank, size, timeout_ms, group_wise, job, NULL);
}

static const char *g_args = "--workers 2";

static int group_setup(void **state) {
    (void)state;
    return dc_harness_start(&g_h, g_args);
}

static int group_teardown(void **state) {
    (void)state;
    return dc_harness_stop(&g_h) == 0 ? 0 : -1;
}

/* A copy of columns [p0, p0 + pn) of a Linear's output features: the
 * output grad's slice, the same activations, outputs [pn, d] and [pn]. */
static dc_layer tp_slice(const dc_layer *full, int64_t p0, int64_t pn, const char *name) {
    dc_layer l = *full;
    int64_t rows = B * full->T;
    snprintf(l.name, sizeof l.name, "%s", name);
    l.p = pn;
    l.grad = dc_test_tensor_new(DC_F32, 3, B, full->T, pn);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < pn; j++)
            ((float *)l.grad.data)[r * pn + j] =
                ((const float *)full->grad.data)[r * full->p + p0 + j];
    l.weight_grad_out = dc_test_tensor_new(DC_F32, 2, pn, full->d, 0);
    l.bias_grad_out = full->has_bias ? dc_test_tensor_new(DC_F32, 1, pn, 0, 0) : (dc_tensor){0};
    return l;
}

static void free_slice(dc_layer *l) {
    dc_test_tensor_free(&l->grad);
    dc_test_tensor_free(&l->weight_grad_out);
    dc_test_tensor_free(&l->bias_grad_out);
}

/* Tensor parallelism: one Linear's output features over 2 and 4 members.
 * The members' outputs, stacked, are the unsplit layer's clipped sum. */
static void test_tp_split(void **state) {
    (void)state;
    static const int64_t cuts[2][5] = {{0, 4, 10, 0, 0}, {0, 3, 6, 8, 10}};
    for (int v = 0; v < 2; v++) {
        int n = v ? 4 : 2;
        char name[32];
        dc_test_rng r;
        dc_test_rng_seed(&r, 300 + (uint64_t)v);
        dc_test_layer_spec sp = {DC_LAYER_LINEAR, B, 5, 12, 10, DC_F32, 1, DC_ALGO_AUTO, 1, 0};
        dc_layer full;
        dc_test_layer_make(&full, &sp, &r);
        double sq[B];
        dc_ref_layer_sqnorms(&full, B, 1.0, sq);
        double med = 0;
        for (int b = 0; b < B; b++) med += sqrt(sq[b]) / B;
        dpclip_clip_config cfg = dc_group_config((float)med, 0.0f);
        dc_shm_step st[MAXM];
        dpclip_result res[MAXM];
        int rcs[MAXM];
        snprintf(name, sizeof name, "tp%d", n);
        for (int k = 0; k < n; k++) {
            dc_layer sl = tp_slice(&full, cuts[v][k], cuts[v][k + 1] - cuts[v][k], "fc");
            assert_int_equal(
                dc_shm_step_init(&st[k], member(name, (uint32_t)k, (uint32_t)n, 0, 0, "tp-job"), 0,
                                 B, &cfg),
                0);
            assert_true(dc_shm_step_add_layer(&st[k], &sl) >= 0);
            free_slice(&sl);
        }
        for (int it = 0; it < 2; it++) { /* two group steps */
            dc_group_run(st, n, res, rcs);
            for (int k = 0; k < n; k++) {
                if (rcs[k]) print_message("member %d: %s\n", k, dpclip_errmsg(st[k].c));
                assert_int_equal(rcs[k], 0);
            }
            dc_group_check(st, n, res, cfg.max_grad_norm);
            /* and the unsplit layer's own norms */
            for (int b = 0; b < B; b++)
                assert_true(fabs(res[0].norms[b] - sqrt(sq[b])) <= 1e-4 * sqrt(sq[b]));
            for (int k = 0; k < n; k++) dpclip_result_free(&res[k]);
        }
        for (int k = 0; k < n; k++) {
            dpclip_client *c = st[k].c;
            dc_shm_step_free(&st[k]);
            dpclip_disconnect(c);
        }
        dc_test_layer_free(&full);
    }
}

/* Pipeline parallelism: a small transformer's layers over 2 stages (3 over
 * 4 members in the second round), which arrive in any order. */
static void test_pp_split(void **state) {
    (void)state;
    for (int v = 0; v < 2; v++) {
        int n = v ? 4 : 2;
        char name[32];
        dc_test_rng r;
        dc_shm_step st[MAXM];
        dpclip_result res[MAXM];
        int rcs[MAXM];
        dpclip_clip_config cfg = dc_group_config(1.0f, 0.0f);
        snprintf(name, sizeof name, "pp%d", n);
        dc_test_rng_seed(&r, 400 + (uint64_t)v);
        for (int k = 0; k < n; k++)
            assert_int_equal(
                dc_shm_step_init(&st[k], member(name, (uint32_t)k, (uint32_t)n, 0, 0, "pp-job"), 0,
                                 B, &cfg),
                0);
        for (int l = 0; l < 6; l++)
            assert_true(dc_shm_step_add(&st[dc_group_pp_stage_of[v][l]], &dc_group_pp_model[l], &r,
                                        1.0f) >= 0);
        cfg = dc_group_config(dc_group_median(st, n), 0.0f); /* clips half of the whole model's */
        dc_group_set_c(st, n, cfg.max_grad_norm, 0.0f);
        /* the last stage first: members may come in any order */
        uint64_t t[MAXM];
        for (int k = n - 1; k >= 0; k--)
            assert_int_equal(dpclip_submit(st[k].c, st[k].step, &t[k]), 0);
        for (int k = 0; k < n; k++) rcs[k] = dpclip_wait(st[k].c, t[k], 30000, &res[k]);
        for (int k = 0; k < n; k++) {
            if (rcs[k]) print_message("stage %d: %s\n", k, dpclip_errmsg(st[k].c));
            assert_int_equal(rcs[k], 0);
        }
        dc_group_check(st, n, res, cfg.max_grad_norm);
        for (int k = 0; k < n; k++) {
            dpclip_client *c = st[k].c;
            dpclip_result_free(&res[k]);
            dc_shm_step_free(&st[k]);
            dpclip_disconnect(c);
        }
    }
}

/* Tensor parallelism with a LayerNorm every member holds whole: counted in
 * the norm once, and with noise on, its noised gradient is the same on both
 * members while the split Linear's noise differs. */
static void test_replicated(void **state) {
    (void)state;
    for (int noisy = 0; noisy < 2; noisy++) {
        dc_test_rng r;
        dc_test_rng_seed(&r, 500 + (uint64_t)noisy);
        dc_test_layer_spec lsp = {DC_LAYER_LINEAR, B, 5, 12, 10, DC_F32, 0, DC_ALGO_AUTO, 1, 0};
        dc_test_layer_spec nsp = {DC_LAYER_LAYERNORM, B, 5, 12, 0, DC_F32, 1, DC_ALGO_AUTO, 1, 0};
        dc_layer full, ln;
        dc_test_layer_make(&full, &lsp, &r);
        dc_test_layer_make(&ln, &nsp, &r);
        snprintf(ln.name, sizeof ln.name, "ln");
        ln.replicated = true;
        dc_shm_step st[2];
        dpclip_result res[2];
        int rcs[2];
        dpclip_clip_config cfg = dc_group_config(0.3f, noisy ? 0.5f : 0.0f);
        const char *gname = noisy ? "rep-noisy" : "rep";
        for (int k = 0; k < 2; k++) {
            dc_layer sl = tp_slice(&full, k ? 4 : 0, k ? 6 : 4, "fc");
            assert_int_equal(dc_shm_step_init(&st[k],
                                              member(gname, (uint32_t)k, 2, 0, 0, "rep-job"), 0, B,
                                              &cfg),
                             0);
            assert_true(dc_shm_step_add_layer(&st[k], &ln) >= 0);
            assert_true(dc_shm_step_add_layer(&st[k], &sl) >= 0);
            free_slice(&sl);
        }
        cfg = dc_group_config(dc_group_median(st, 2), cfg.noise_multiplier);
        dc_group_set_c(st, 2, cfg.max_grad_norm, cfg.noise_multiplier);
        for (int k = 0; k < 2; k++)
            assert_int_equal(dpclip_step_set_replicated(st[k].step, 0, 1), 0);
        dc_group_run(st, 2, res, rcs);
        for (int k = 0; k < 2; k++) {
            if (rcs[k]) print_message("member %d: %s\n", k, dpclip_errmsg(st[k].c));
            assert_int_equal(rcs[k], 0);
        }
        if (!noisy) {
            dc_group_check(st, 2, res, cfg.max_grad_norm);
        } else {
            /* LN weight and bias: bitwise equal on both; the fc slices'
             * noise is independent (compare a noised output to its
             * reference: it must differ) */
            const dc_layer *a = &st[0].ref.layers[0], *b = &st[1].ref.layers[0];
            assert_memory_equal(a->weight_grad_out.data, b->weight_grad_out.data,
                                12 * sizeof(float));
            assert_memory_equal(a->bias_grad_out.data, b->bias_grad_out.data, 12 * sizeof(float));
            const float *w0 = st[0].ref.layers[1].weight_grad_out.data,
                        *w1 = st[1].ref.layers[1].weight_grad_out.data;
            assert_true(memcmp(w0, w1, 4 * 12 * sizeof(float)) != 0);
        }
        for (int k = 0; k < 2; k++) {
            dpclip_client *c = st[k].c;
            dpclip_result_free(&res[k]);
            dc_shm_step_free(&st[k]);
            dpclip_disconnect(c);
        }
        free_slice(&full); /* grad and outputs; input below */
        dc_test_tensor_free(&full.input);
        dc_test_layer_free(&ln);
    }
}

/* A member that never sends its step: the others get an error naming it
 * within the timeout, the group is dissolved, joining again forms a new one,
 * and the daemon serves everyone meanwhile. */
static void test_member_timeout(void **state) {
    (void)state;
    dc_test_rng r;
    dc_test_rng_seed(&r, 600);
    dc_test_layer_spec sp = {DC_LAYER_LINEAR, B, 3, 8, 6, DC_F32, 0, DC_ALGO_AUTO, 1, 0};
    dpclip_clip_config cfg = dc_group_config(1.0f, 0.0f);
    dc_shm_step st[2];
    dpclip_result res;
    for (int k = 0; k < 2; k++) {
        assert_int_equal(dc_shm_step_init(&st[k],
                                          member("late", (uint32_t)k, 2, 300, 0, "late-job"), 0, B,
                                          &cfg),
                         0);
        assert_true(dc_shm_step_add(&st[k], &sp, &r, 1.0f) >= 0);
    }
    uint64_t t0 = dc_clock_ms();
    int rc = dpclip_run(st[0].c, st[0].step, &res);
    uint64_t took = dc_clock_ms() - t0;
    print_message("timeout: %d after %llu ms: %s\n", rc, (unsigned long long)took,
                  dpclip_errmsg(st[0].c));
    assert_int_equal(rc, DPCLIP_EUNAVAIL);
    assert_non_null(strstr(dpclip_errmsg(st[0].c), "rank 1 did not arrive"));
    assert_true(took >= 250 && took < 10000);
    assert_int_equal(dpclip_ping(st[1].c), 0); /* served throughout */
    /* the late member's step: the group is gone */
    assert_int_equal(dpclip_run(st[1].c, st[1].step, &res), DPCLIP_EUNAVAIL);
    assert_non_null(strstr(dpclip_errmsg(st[1].c), "join again"));
    /* both join again: a new group, and steps run */
    for (int k = 0; k < 2; k++) {
        dpclip_group_opts g = {"late", (uint32_t)k, 2, 5000, 0};
        assert_int_equal(dpclip_join_group(st[k].c, &g, NULL), 0);
    }
    dpclip_result rr[2];
    int rcs[2];
    dc_group_run(st, 2, rr, rcs);
    assert_int_equal(rcs[0], 0);
    assert_int_equal(rcs[1], 0);
    for (int k = 0; k < 2; k++) {
        dpclip_client *c = st[k].c;
        dpclip_result_free(&rr[k]);
        dc_shm_step_free(&st[k]);
        dpclip_disconnect(c);
    }
}

/* A member that disconnects while another's step waits: the waiting member
 * gets an error naming it at once, not at the timeout. */
static void test_member_disconnect(void **state) {
    (void)state;
    dc_test_rng r;
    dc_test_rng_seed(&r, 700);
    dc_test_layer_spec sp = {DC_LAYER_LINEAR, B, 3, 8, 6, DC_F32, 0, DC_ALGO_AUTO, 1, 0};
    dpclip_clip_config cfg = dc_group_config(1.0f, 0.0f);
    dc_shm_step st;
    dpclip_client *gone = member("gone", 1, 2, 60000, 0, "gone-job");
    dpclip_result res;
    uint64_t ticket;
    assert_int_equal(dc_shm_step_init(&st, member("gone", 0, 2, 60000, 0, "gone-job"), 0, B, &cfg),
                     0);
    assert_true(dc_shm_step_add(&st, &sp, &r, 1.0f) >= 0);
    uint64_t t0 = dc_clock_ms();
    assert_int_equal(dpclip_submit(st.c, st.step, &ticket), 0);
    struct timespec ts = {0, 100 * 1000000L};
    nanosleep(&ts, NULL); /* the step is waiting in the group */
    dpclip_disconnect(gone);
    int rc = dpclip_wait(st.c, ticket, 30000, &res);
    uint64_t took = dc_clock_ms() - t0;
    print_message("disconnect: %d after %llu ms: %s\n", rc, (unsigned long long)took,
                  dpclip_errmsg(st.c));
    assert_int_equal(rc, DPCLIP_EUNAVAIL);
    assert_non_null(strstr(dpclip_errmsg(st.c), "rank 1 left (disconnected)"));
    assert_true(took < 20000);
    dpclip_client *c = st.c;
    dc_shm_step_free(&st);
    dpclip_disconnect(c);
}

/* The ledger charges rank 0's job once per group step; the other members
 * of that job are not charged again, and a member of another job is charged
 * to its own (coverage is per job). */
static void test_ledger_once(void **state) {
    (void)state;
    dc_test_rng r;
    dc_test_rng_seed(&r, 800);
    dc_test_layer_spec sp = {DC_LAYER_LINEAR, B, 3, 8, 6, DC_F32, 0, DC_ALGO_AUTO, 1, 0};
    dpclip_clip_config cfg = dc_group_config(1.0f, 1.0f);
    cfg.sample_rate = 0.1;
    dc_shm_step st[3];
    dpclip_result res[3];
    int rcs[3];
    const char *jobs[3] = {"once", "once", "once-other"};
    for (int k = 0; k < 3; k++) {
        assert_int_equal(
            dc_shm_step_init(&st[k], member("once", (uint32_t)k, 3, 0, 0, jobs[k]), 0, B, &cfg), 0);
        assert_true(dc_shm_step_add(&st[k], &sp, &r, 1.0f) >= 0);
    }
    double rdp[DC_RDP_N_ORDERS], want[4] = {0.0};
    for (int it = 1; it <= 3; it++) {
        dc_rdp_steps(0.1, 1.0, dc_rdp_default_orders(), DC_RDP_N_ORDERS, rdp);
        for (int k = 0; k < DC_RDP_N_ORDERS; k++) rdp[k] *= it;
        want[it] = dc_rdp_epsilon(dc_rdp_default_orders(), rdp, DC_RDP_N_ORDERS, 1e-5, NULL);
    }
    for (int it = 1; it <= 3; it++) {
        dc_group_run(st, 3, res, rcs);
        for (int k = 0; k < 3; k++) assert_int_equal(rcs[k], 0);
        assert_true(fabs(res[0].epsilon - want[it]) <= 1e-9 * want[it]);
        /* rank 1 (rank 0's job) reports the job's epsilon as of its own
         * accounting, before or after rank 0's charge of this group step */
        assert_true(fabs(res[1].epsilon - want[it]) <= 1e-9 * want[it] ||
                    fabs(res[1].epsilon - want[it - 1]) <= 1e-9 * want[it]);
        /* rank 2's job is charged once per group step too: its own */
        assert_true(fabs(res[2].epsilon - want[it]) <= 1e-9 * want[it]);
        for (int k = 0; k < 3; k++) dpclip_result_free(&res[k]);
    }
    for (int k = 0; k < 3; k++) {
        dpclip_client *c = st[k].c;
        dc_shm_step_free(&st[k]);
        dpclip_disconnect(c);
    }
}

/* Group-wise steps never wait for each other, so a member's step is
 * charged unless the leader's (rank 0's) step of that group step was
 * charged first: a member stepping alone, or ahead of rank 0, cannot take
 * steps for free. */
static void test_group_wise_charges(void **state) {
    (void)state;
    dc_test_rng r;
    dc_test_rng_seed(&r, 880);
    dc_test_layer_spec sp = {DC_LAYER_LINEAR, B, 3, 8, 6, DC_F32, 0, DC_ALGO_AUTO, 1, 0};
    dpclip_clip_config cfg = dc_group_config(1.0f, 1.0f);
    cfg.sample_rate = 0.1;
    dc_shm_step st[2];
    dpclip_result res;
    const char *jobs[2] = {"gwc", "gwc"};
    for (int k = 0; k < 2; k++) {
        assert_int_equal(
            dc_shm_step_init(&st[k], member("gwc", (uint32_t)k, 2, 0, 1, jobs[k]), 0, B, &cfg), 0);
        assert_true(dc_shm_step_add(&st[k], &sp, &r, 1.0f) >= 0);
    }
    /* rank 1 ahead of rank 0 (group step 1): charged to its own job */
    assert_int_equal(dpclip_run(st[1].c, st[1].step, &res), 0);
    double eps1 = res.epsilon;
    assert_true(eps1 > 0.0 && isfinite(eps1));
    dpclip_result_free(&res);
    /* rank 0 steps 1 and 2 (the job's second and third charges); rank 1's
     * step 2 then is covered: the job's epsilon does not move */
    double eps3 = 0.0;
    for (int it = 0; it < 2; it++) {
        assert_int_equal(dpclip_run(st[0].c, st[0].step, &res), 0);
        assert_true(res.epsilon > eps3);
        eps3 = res.epsilon;
        dpclip_result_free(&res);
    }
    assert_true(eps3 > eps1);
    assert_int_equal(dpclip_run(st[1].c, st[1].step, &res), 0);
    assert_true(res.epsilon == eps3);
    dpclip_result_free(&res);
    /* and its step 3, ahead of rank 0 again, is charged */
    assert_int_equal(dpclip_run(st[1].c, st[1].step, &res), 0);
    assert_true(res.epsilon > eps3);
    dpclip_result_free(&res);
    for (int k = 0; k < 2; k++) {
        dpclip_client *c = st[k].c;
        dc_shm_step_free(&st[k]);
        dpclip_disconnect(c);
    }
}

/* Group-wise clipping: each member clips to C / sqrt(2) alone and does not
 * wait for the other. */
static void test_group_wise(void **state) {
    (void)state;
    dc_test_rng r;
    dc_test_rng_seed(&r, 900);
    dc_test_layer_spec sp = {DC_LAYER_LINEAR, B, 4, 10, 8, DC_F32, 1, DC_ALGO_AUTO, 1, 0};
    dc_shm_step st;
    dpclip_clip_config cfg = dc_group_config(1.0f, 0.0f);
    dpclip_client *other = member("gw", 1, 2, 100, 1, "gw-job"); /* never steps */
    assert_int_equal(dc_shm_step_init(&st, member("gw", 0, 2, 100, 1, "gw-job"), 0, B, &cfg), 0);
    assert_true(dc_shm_step_add(&st, &sp, &r, 1.0f) >= 0);
    double med = dc_shm_step_median_norm(&st);
    cfg.max_grad_norm = (float)(med * sqrt(2.0)); /* C_k = C / sqrt(2) = the median */
    assert_int_equal(dc_shm_step_set_config(&st, &cfg), 0);
    dpclip_result res;
    assert_int_equal(dpclip_run(st.c, st.step, &res), 0); /* no wait for rank 1 */
    dpclip_result_free(&res);
    dpclip_disconnect(other); /* a member leaving takes nothing from the others */
    other = NULL;
    assert_int_equal(dpclip_run(st.c, st.step, &res), 0);
    st.ref.max_grad_norm = (float)med; /* the reference at C_k */
    double e = dc_shm_step_check(&st, &res, 1e-4, 1e-6);
    assert_true(e <= 1.0);
    dpclip_result_free(&res);
    dpclip_client *c = st.c;
    dc_shm_step_free(&st);
    dpclip_disconnect(c);
    dpclip_disconnect(other);
}

/* Members whose steps disagree (batch size) fail the step on both, naming
 * the field. */
static void test_members_disagree(void **state) {
    (void)state;
    dc_test_rng r;
    dc_test_rng_seed(&r, 1000);
    dpclip_clip_config cfg = dc_group_config(1.0f, 0.0f);
    dc_shm_step st[2];
    dpclip_result res[2];
    int rcs[2];
    for (int k = 0; k < 2; k++) {
        uint32_t b = k ? B - 1 : B;
        dc_test_layer_spec sp = {DC_LAYER_LINEAR, b, 3, 8, 6, DC_F32, 0, DC_ALGO_AUTO, 1, 0};
        assert_int_equal(dc_shm_step_init(&st[k], member("disagree", (uint32_t)k, 2, 0, 0, "dis"),
                                          0, b, &cfg),
                         0);
        assert_true(dc_shm_step_add(&st[k], &sp, &r, 1.0f) >= 0);
    }
    dc_group_run(st, 2, res, rcs);
    for (int k = 0; k < 2; k++) {
        assert_int_equal(rcs[k], DPCLIP_EINVAL);
        assert_string_equal(dpclip_errfield(st[k].c), "clip_step.batch_size");
    }
    for (int k = 0; k < 2; k++) {
        dpclip_client *c = st[k].c;
        dc_shm_step_free(&st[k]);
        dpclip_disconnect(c);
    }
}

/* /status lists each norm group (members, state, reductions) and /metrics
 * counts the reductions. */
static void test_status_shows_groups(void **state) {
    (void)state;
#ifndef DPCLIP_HAVE_MHD
    skip();
#endif
    dc_test_rng r;
    dc_test_rng_seed(&r, 1100);
    dc_test_layer_spec sp = {DC_LAYER_LINEAR, B, 3, 8, 6, DC_F32, 0, DC_ALGO_AUTO, 1, 0};
    dpclip_clip_config cfg = dc_group_config(1.0f, 0.0f);
    dc_shm_step st[2];
    dpclip_result res[2];
    int rcs[2];
    char sock[400], *body = NULL;
    for (int k = 0; k < 2; k++) {
        assert_int_equal(dc_shm_step_init(&st[k], member("shown", (uint32_t)k, 2, 0, 0, "shown"), 0,
                                          B, &cfg),
                         0);
        assert_true(dc_shm_step_add(&st[k], &sp, &r, 1.0f) >= 0);
    }
    dc_group_run(st, 2, res, rcs);
    assert_int_equal(rcs[0], 0);
    assert_int_equal(rcs[1], 0);
    dc_harness_status_path(&g_h, sock, sizeof sock);
    assert_int_equal(dc_http(sock, "GET", "/status", 10000, NULL, &body, NULL), 200);
    const char *g = strstr(body, "\"norm_groups\":[");
    assert_non_null(g);
    g = strstr(g, "\"name\":\"shown\"");
    assert_non_null(g);
    assert_non_null(strstr(g, "\"size\":2,\"joined\":2,\"waiting\":0,\"clipping\":\"NORM_REDUCE\","
                              "\"state\":\"ready\",\"step\":0,\"reductions\":1"));
    /* one daemon: no link, nothing exchanged or polled */
    assert_non_null(strstr(g, "\"link\":\"none\",\"exchanges\":0,\"exchanges_polled\":0,"));
    free(body);
    body = NULL;
    assert_int_equal(dc_http(sock, "GET", "/metrics", 10000, NULL, &body, NULL), 200);
    assert_non_null(strstr(body, "dpclip_norm_group_reductions_total "));
    free(body);
    for (int k = 0; k < 2; k++) {
        dpclip_client *c = st[k].c;
        dpclip_result_free(&res[k]);
        dc_shm_step_free(&st[k]);
        dpclip_disconnect(c);
    }
}

static int try_join(dpclip_client *c, const char *group, uint32_t rank, uint32_t size,
                    dpclip_group_link *link) {
    dpclip_group_opts g = {group, rank, size, 0, 0};
    uint64_t id = 0;
    return dpclip_join_group_linked(c, &g, link, &id);
}

/* A group across daemons: a layout that cannot be is refused naming the
 * field; a daemon without NCCL or a GPU refuses such a group saying it
 * serves only one-daemon groups; one with both makes the NCCL id at rank
 * 0's join and holds every local member to the layout rank 0 gave. (The
 * link itself is tested between two daemons: test_groups_nccl.c.) */
static void test_cross_daemon_join(void **state) {
    (void)state;
    dpclip_client *c = NULL;
    dpclip_connect_opts o = {.client_name = "group-test"};
    dpclip_group_link bad_rank = {.daemons = 2, .daemon_rank = 2, .local_size = 1};
    dpclip_group_link bad_local = {.daemons = 2, .daemon_rank = 0, .local_size = 0};
    dpclip_group_link no_id = {.daemons = 2, .daemon_rank = 1, .local_size = 1};
    dpclip_group_link root = {.daemons = 2, .daemon_rank = 0, .local_size = 2};
    assert_int_equal(dpclip_connect(g_h.sock, &o, &c), 0);
    assert_int_equal(try_join(c, "x", 0, 3, &bad_rank), DPCLIP_EINVAL);
    assert_string_equal(dpclip_errfield(c), "join_group.daemon_rank");
    assert_int_equal(try_join(c, "x", 0, 3, &bad_local), DPCLIP_EINVAL);
    assert_string_equal(dpclip_errfield(c), "join_group.local_size");
    int rc = try_join(c, "x", 1, 3, &no_id);
    if (rc == DPCLIP_EUNIMPL) { /* no NCCL or no GPU: one-daemon groups only */
        assert_string_equal(dpclip_errfield(c), "join_group.daemons");
        assert_non_null(strstr(dpclip_errmsg(c), "only groups whose members all use"));
        assert_int_equal(try_join(c, "x", 0, 3, &root), DPCLIP_EUNIMPL);
    } else {
        assert_int_equal(rc, DPCLIP_EINVAL);
        assert_string_equal(dpclip_errfield(c), "join_group.nccl_id");
        assert_int_equal(try_join(c, "x", 0, 3, &root), 0);
        assert_true(root.nccl_version > 0);
        int nonzero = 0;
        for (int i = 0; i < DPCLIP_NCCL_ID_BYTES; i++) nonzero |= root.nccl_id[i];
        assert_true(nonzero);
        /* a second member on this daemon claiming another daemon's place */
        dpclip_client *c2 = NULL;
        dpclip_group_link other = root;
        other.daemon_rank = 1;
        assert_int_equal(dpclip_connect(g_h.sock, &o, &c2), 0);
        assert_int_equal(try_join(c2, "x", 1, 3, &other), DPCLIP_EINVAL);
        assert_string_equal(dpclip_errfield(c2), "join_group.daemon_rank");
        other.daemon_rank = 0;
        other.nccl_id[0] ^= 1;
        assert_int_equal(try_join(c2, "x", 1, 3, &other), DPCLIP_EINVAL);
        assert_string_equal(dpclip_errfield(c2), "join_group.nccl_id");
        dpclip_disconnect(c2);
        /* limits.max_group_links (16 by default, this one included) */
        dpclip_client *more[16];
        for (int k = 0; k < 16; k++) {
            char name[16];
            dpclip_group_link l = {.daemons = 2, .daemon_rank = 0, .local_size = 2};
            snprintf(name, sizeof name, "x%d", k);
            assert_int_equal(dpclip_connect(g_h.sock, &o, &more[k]), 0);
            rc = try_join(more[k], name, 0, 3, &l);
            assert_int_equal(rc, k < 15 ? 0 : DPCLIP_ENOSPACE);
        }
        assert_string_equal(dpclip_errfield(more[15]), "join_group.daemons");
        assert_non_null(strstr(dpclip_errmsg(more[15]), "limits.max_group_links"));
        for (int k = 0; k < 16; k++) dpclip_disconnect(more[k]);
    }
    dpclip_disconnect(c);
}

/* A counter of the daemon's /metrics, or -1 without the status socket. */
static long long metric(dc_harness *h, const char *name) {
#ifndef DPCLIP_HAVE_MHD
    (void)h;
    (void)name;
    return -1;
#else
    char sock[400], line[160], *body = NULL;
    long long v = -1;
    dc_harness_status_path(h, sock, sizeof sock);
    assert_int_equal(dc_http(sock, "GET", "/metrics", 10000, NULL, &body, NULL), 200);
    snprintf(line, sizeof line, "\n%s ", name);
    const char *at = strstr(body, line);
    assert_non_null(at);
    v = atoll(at + strlen(line));
    free(body);
    return v;
#endif
}

/* One group step of a TP split (a replicated LayerNorm, a Linear's output
 * features 5 and 5) with noise, then the same without, on the daemon at
 * sock: each member's noise (noisy - clean outputs) into noise[k]. */
static int64_t split_noise(const char *sock, const dc_layer *full, const dc_layer *ln, float sigma,
                           float *noise[2]) {
    dc_shm_step st[2];
    dpclip_result res[2];
    int rcs[2];
    int64_t m = 0;
    float *clean[2];
    dpclip_clip_config cfg = dc_group_config(1.0f, sigma);
    for (int k = 0; k < 2; k++) {
        dc_layer sl = tp_slice(full, 5 * k, 5, "fc");
        dpclip_client *c = dc_group_member(sock, "fx", (uint32_t)k, 2, 0, 0, "fx-job", NULL);
        assert_int_equal(dc_shm_step_init(&st[k], c, 0, B, &cfg), 0);
        assert_true(dc_shm_step_add_layer(&st[k], ln) >= 0);
        assert_true(dc_shm_step_add_layer(&st[k], &sl) >= 0);
        free_slice(&sl);
    }
    float C = dc_group_median(st, 2);
    for (int pass = 0; pass < 2; pass++) {             /* noisy, then clean */
        dc_group_set_c(st, 2, C, pass ? 0.0f : sigma); /* a new wire step: marked again */
        for (int k = 0; k < 2; k++)
            assert_int_equal(dpclip_step_set_replicated(st[k].step, 0, 1), 0);
        dc_group_run(st, 2, res, rcs);
        for (int k = 0; k < 2; k++) {
            assert_int_equal(rcs[k], 0);
            dpclip_result_free(&res[k]);
            m = dc_shm_step_outputs(&st[k], NULL);
            float *out = malloc((size_t)m * sizeof *out);
            assert_non_null(out);
            dc_shm_step_outputs(&st[k], out);
            if (pass == 0) {
                noise[k] = out;
            } else {
                clean[k] = out;
                for (int64_t i = 0; i < m; i++) noise[k][i] -= clean[k][i];
                free(clean[k]);
            }
        }
    }
    for (int k = 0; k < 2; k++) {
        dpclip_client *c = st[k].c;
        dc_shm_step_free(&st[k]);
        dpclip_disconnect(c);
    }
    return m;
}

/* A fused group step (groups.fuse, the default) draws each member's noise
 * from the stream its own step would have used, as the phased path does:
 * the same fresh daemon run fused and phased gives the same noise. The
 * members' steps may be numbered in either order on each daemon (they
 * arrive concurrently), so member noise is matched as a set; the members'
 * own noise differs, and the replicated LayerNorm's is the same on both. */
static void test_fused_matches_phased(void **state) {
    (void)state;
    dc_harness a, p;
    dc_test_rng r;
    dc_layer full, ln;
    float *na[2], *np[2];
    dc_test_rng_seed(&r, 900);
    dc_test_layer_spec lsp = {DC_LAYER_LINEAR, B, 5, 12, 10, DC_F32, 1, DC_ALGO_AUTO, 1, 0};
    dc_test_layer_spec nsp = {DC_LAYER_LAYERNORM, B, 5, 12, 0, DC_F32, 1, DC_ALGO_AUTO, 1, 0};
    dc_test_layer_make(&full, &lsp, &r);
    dc_test_layer_make(&ln, &nsp, &r);
    snprintf(ln.name, sizeof ln.name, "ln");
    ln.replicated = true;
    assert_int_equal(dc_harness_start(&a, "--workers 2"), 0);
    assert_int_equal(dc_harness_start(&p, "--workers 2 --set groups.fuse=false"), 0);
    int64_t m = split_noise(a.sock, &full, &ln, 0.5f, na);
    assert_int_equal(split_noise(p.sock, &full, &ln, 0.5f, np), m);
    const int64_t nln = 2 * 12; /* the LayerNorm's weight and bias come first */
    double tol = 1e-4;
    for (int k = 0; k < 2; k++) {
        /* member k of the fused daemon has the noise of one phased member */
        double e[2] = {0, 0};
        for (int q = 0; q < 2; q++)
            for (int64_t i = nln; i < m; i++) e[q] = fmax(e[q], fabs(na[k][i] - np[q][i]));
        if (fmin(e[0], e[1]) > tol) print_message("member %d: off by %g\n", k, fmin(e[0], e[1]));
        assert_true(fmin(e[0], e[1]) <= tol);
        assert_true(fmax(e[0], e[1]) > 100 * tol); /* and not the other's */
        for (int64_t i = 0; i < nln; i++) assert_true(fabs(na[k][i] - np[0][i]) <= tol);
    }
    for (int k = 0; k < 2; k++) {
        free(na[k]);
        free(np[k]);
    }
    /* two group steps each: fused on one daemon, phased on the other */
    long long fa = metric(&a, "dpclip_norm_group_fused_total");
    if (fa >= 0) {
        assert_int_equal(fa, 2);
        assert_int_equal(metric(&p, "dpclip_norm_group_fused_total"), 0);
        assert_int_equal(metric(&a, "dpclip_norm_group_reductions_total"), 2);
        assert_int_equal(metric(&p, "dpclip_norm_group_reductions_total"), 2);
    }
    assert_int_equal(dc_harness_stop(&a), 0);
    assert_int_equal(dc_harness_stop(&p), 0);
    free_slice(&full);
    dc_test_tensor_free(&full.input);
    dc_test_layer_free(&ln);
}

/* Each member's step within limits.max_step_samples, their sum over it:
 * the group step runs in phases instead of fused, still exact. */
static void test_fused_over_limits(void **state) {
    (void)state;
    dc_harness h;
    dc_test_rng r;
    dc_shm_step st[2];
    dpclip_result res[2];
    int rcs[2];
    dpclip_clip_config cfg = dc_group_config(1.0f, 0.0f);
    /* 3 layers x 6 samples a member: 18 fits, 36 does not */
    assert_int_equal(dc_harness_start(&h, "--workers 2 --set limits.max_step_samples=20"), 0);
    dc_test_rng_seed(&r, 990);
    for (int k = 0; k < 2; k++)
        assert_int_equal(dc_shm_step_init(&st[k],
                                          dc_group_member(h.sock, "big", (uint32_t)k, 2, 0, 0,
                                                          "big-job", NULL),
                                          0, B, &cfg),
                         0);
    for (int l = 0; l < 6; l++)
        assert_true(
            dc_shm_step_add(&st[dc_group_pp_stage_of[0][l]], &dc_group_pp_model[l], &r, 1.0f) >= 0);
    dc_group_set_c(st, 2, dc_group_median(st, 2), 0.0f);
    /* every member within the limits, the sum not: the phases, with their
     * margin */
    int was = dc_group_phased;
    dc_group_phased = 1;
    for (int it = 0; it < 2; it++) {
        dc_group_run(st, 2, res, rcs);
        for (int k = 0; k < 2; k++) {
            if (rcs[k]) print_message("member %d: %s\n", k, dpclip_errmsg(st[k].c));
            assert_int_equal(rcs[k], 0);
        }
        dc_group_check(st, 2, res, dc_group_median(st, 2));
        for (int k = 0; k < 2; k++) dpclip_result_free(&res[k]);
    }
    /* not fused (the sum is over the limit): phased, each counted once */
    long long fused = metric(&h, "dpclip_norm_group_fused_total");
    if (fused >= 0) {
        assert_int_equal(fused, 0);
        assert_int_equal(metric(&h, "dpclip_norm_group_reductions_total"), 2);
    }
    for (int k = 0; k < 2; k++) {
        dpclip_client *c = st[k].c;
        dc_shm_step_free(&st[k]);
        dpclip_disconnect(c);
    }
    dc_group_phased = was;
    assert_int_equal(dc_harness_stop(&h), 0);
}

int main(int argc, char **argv) {
    /* --phased: the whole suite again with each member's phases apart */
    if (argc > 1 && strcmp(argv[1], "--phased") == 0) {
        g_args = "--workers 2 --set groups.fuse=false";
        dc_group_phased = 1;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fused_matches_phased),
        cmocka_unit_test(test_fused_over_limits),
        cmocka_unit_test(test_cross_daemon_join),
        cmocka_unit_test(test_group_wise_charges),
        cmocka_unit_test(test_tp_split),
        cmocka_unit_test(test_pp_split),
        cmocka_unit_test(test_replicated),
        cmocka_unit_test(test_member_timeout),
        cmocka_unit_test(test_member_disconnect),
        cmocka_unit_test(test_ledger_once),
        cmocka_unit_test(test_group_wise),
        cmocka_unit_test(test_members_disagree),
        cmocka_unit_test(test_status_shows_groups),
    };
    return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
