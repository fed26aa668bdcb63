/* Hostile clients against steps whose norms and clipped sums are computed
 * in different worker tasks (daemon/protocol/step_pass.c, step_run.c, group.c,
 * step_fuse.c): a sums step's norm pass, a grouped member's norm phase
 * before the group's reduction, replicated layers counted once. The client
 * owns the memory and may rewrite it between the two; what the daemon
 * releases must be clipped by norms of the data it sums, or nothing is
 * released (issue 38: each case once released an unclipped sum). */
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

#include "group_test.h"
#include "harness.h"

#define B 4

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
    return dc_harness_connect(&g_h, "hostile-phases", job);
}

static void sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* A Linear and an Embedding (f32), C the median norm, sigma 0, sum loss. */
static void make(dc_shm_step *s, dpclip_client *c, uint64_t seed) {
    static const dc_test_layer_spec specs[2] = {
        {DC_LAYER_LINEAR, B, 5, 8, 6, DC_F32, 1, DC_ALGO_AUTO, 1, 0},
        {DC_LAYER_EMBEDDING, B, 5, 6, 40, DC_F32, 0, DC_ALGO_AUTO, 1, 0},
    };
    dpclip_clip_config cfg = {.max_grad_norm = 1.0f, .reduction = DPCLIP_SUM};
    dc_test_rng r;
    dc_test_rng_seed(&r, seed);
    assert_int_equal(dc_shm_step_init(s, c, 1u << 20, B, &cfg), 0);
    for (int l = 0; l < 2; l++) assert_true(dc_shm_step_add(s, &specs[l], &r, 1.0f) >= 0);
    cfg.max_grad_norm = (float)dc_shm_step_median_norm(s);
    assert_int_equal(dc_shm_step_set_config(s, &cfg), 0);
}

static dpclip_step *phase_step(dc_shm_step *s, dpclip_phase ph) {
    static const size_t all[2] = {0, 1};
    dpclip_step *p = dpclip_step_new(B, &s->cfg);
    assert_non_null(p);
    assert_int_equal(dpclip_step_set_phase(p, ph), 0);
    assert_int_equal(dc_shm_step_wire_layers(s, p, all, 2, ph == DPCLIP_STEP_SUMS), 0);
    return p;
}

/* The step is refused naming `field`, and none of its outputs was written. */
static void refused_unwritten(dc_shm_step *s, dpclip_step *p, const char *field) {
    dpclip_result res;
    int64_t n = dc_shm_step_outputs(s, NULL);
    float *got = malloc((size_t)n * sizeof *got);
    int rc;
    assert_non_null(got);
    memset(&res, 0, sizeof res);
    rc = dpclip_run(s->c, p, &res);
    if (rc == 0 || strstr(dpclip_errfield(s->c), field) == NULL)
        print_message("got %d '%s': %s\n", rc, dpclip_errfield(s->c), dpclip_errmsg(s->c));
    assert_true(rc != 0);
    assert_non_null(strstr(dpclip_errfield(s->c), field));
    dc_shm_step_outputs(s, got);
    for (int64_t i = 0; i < n; i++) assert_true(isnan(got[i]));
    dpclip_result_free(&res);
    free(got);
}

static void run_ok(dpclip_client *c, dpclip_step *p) {
    dpclip_result res;
    int rc = dpclip_run(c, p, &res);
    if (rc) print_message("step: %s (%s)\n", dpclip_errmsg(c), dpclip_errfield(c));
    assert_int_equal(rc, 0);
    dpclip_result_free(&res);
}

/* The activations scaled after the norm pass: the sums step measures again
 * and refuses (once: per-sample norms of 10^4 against C = 1 released). */
static void test_rewrite_between_phases(void **state) {
    dpclip_client *c = connect_ok("rewrite");
    dc_shm_step s;
    dpclip_step *norms, *sums;
    (void)state;
    make(&s, c, 1);
    norms = phase_step(&s, DPCLIP_STEP_NORMS);
    sums = phase_step(&s, DPCLIP_STEP_SUMS);
    dc_shm_step_fill_outputs(&s, NAN);
    run_ok(c, norms);
    {
        dc_tensor *a = &s.ref.layers[0].input;
        float *x = a->data;
        for (int64_t i = 0; i < dc_test_tensor_numel(a); i++) x[i] *= 1e4f;
    }
    refused_unwritten(&s, sums, "clip_step.layers");
    dpclip_step_free(norms);
    dpclip_step_free(sums);
    dc_shm_step_free(&s);
    dpclip_disconnect(c);
}

/* Embedding indices rewritten to collide after the pass: the rows' sums
 * grow (once: a row norm of 64 against B * C = 20), refused. */
static void test_indices_collide_after_pass(void **state) {
    dpclip_client *c = connect_ok("collide");
    dc_shm_step s;
    dpclip_step *norms, *sums;
    (void)state;
    make(&s, c, 2);
    /* every token of a sample the same gradient, so that collisions add up */
    {
        dc_layer *e = &s.ref.layers[1];
        float *g = e->grad.data;
        int64_t T = e->T, d = e->d;
        int64_t *ix = e->input.data;
        for (int64_t b = 0; b < B; b++)
            for (int64_t t = 0; t < T; t++) {
                ix[b * T + t] = 1 + t; /* distinct rows */
                for (int64_t k = 0; k < d; k++) g[(b * T + t) * d + k] = 1.0f;
            }
    }
    {
        dpclip_clip_config cfg = s.cfg;
        cfg.max_grad_norm = (float)dc_shm_step_median_norm(&s);
        assert_int_equal(dc_shm_step_set_config(&s, &cfg), 0);
    }
    norms = phase_step(&s, DPCLIP_STEP_NORMS);
    sums = phase_step(&s, DPCLIP_STEP_SUMS);
    dc_shm_step_fill_outputs(&s, NAN);
    run_ok(c, norms);
    {
        dc_layer *e = &s.ref.layers[1];
        int64_t *ix = e->input.data;
        for (int64_t i = 0; i < B * e->T; i++) ix[i] = 3; /* all one row */
    }
    refused_unwritten(&s, sums, "clip_step.layers");
    dpclip_step_free(norms);
    dpclip_step_free(sums);
    dc_shm_step_free(&s);
    dpclip_disconnect(c);
}

/* The pass's buffer released and another registered (the daemon may map it
 * at the same address) with other data at the same offsets: refused. */
static void test_buffer_swapped_after_pass(void **state) {
    dpclip_client *c = connect_ok("swap");
    dc_shm_step s;
    dpclip_step *norms, *sums;
    uint64_t id;
    void *mem;
    (void)state;
    make(&s, c, 3);
    norms = phase_step(&s, DPCLIP_STEP_NORMS);
    run_ok(c, norms);
    /* the same bytes, activations scaled, in a new buffer of the same size,
     * registered once the old one is gone */
    uint8_t *copy = malloc(s.size);
    assert_non_null(copy);
    memcpy(copy, s.base, s.size);
    assert_int_equal(dpclip_buffer_release(c, s.buf_id), 0);
    s.buf_id = 0;
    assert_int_equal(dpclip_buffer_alloc(c, s.size, &id, &mem), 0);
    memcpy(mem, copy, s.size);
    free(copy);
    {
        const dc_tensor *a = &s.ref.layers[0].input;
        float *x = (float *)((uint8_t *)mem + ((uint8_t *)a->data - s.base));
        for (int64_t i = 0; i < dc_test_tensor_numel(a); i++) x[i] *= 1e4f;
    }
    assert_int_equal(dc_shm_step_wire_buffer(&s, id), 0);
    sums = phase_step(&s, DPCLIP_STEP_SUMS);
    {
        dpclip_result res;
        memset(&res, 0, sizeof res);
        assert_true(dpclip_run(c, sums, &res) != 0);
        assert_non_null(strstr(dpclip_errfield(c), "clip_step.layers"));
        dpclip_result_free(&res);
    }
    dpclip_step_free(norms);
    dpclip_step_free(sums);
    dc_shm_step_free(&s); /* its buffer was released above */
    dpclip_disconnect(c);
}

/* --- norm groups ------------------------------------------------------------- */

/* Two members of a NORM_REDUCE group whose layers are a replicated
 * LayerNorm and a Linear of their own; member 1's copy of the LayerNorm
 * holds other data than member 0's. */
static void group_of_two(const char *sock, const char *name, dc_shm_step st[2], uint64_t seed) {
    dc_test_layer_spec ln = {
        DC_LAYER_LAYERNORM, DC_GROUP_TEST_B, 5, 8, 0, DC_F32, 1, DC_ALGO_AUTO, 1, 0};
    dc_test_layer_spec lin = {
        DC_LAYER_LINEAR, DC_GROUP_TEST_B, 5, 8, 6, DC_F32, 1, DC_ALGO_AUTO, 1, 0};
    dpclip_clip_config cfg = dc_group_config(1.0f, 0.0f);
    dc_test_rng r;
    dc_layer l;
    dc_test_rng_seed(&r, seed);
    dc_test_layer_make(&l, &ln, &r);
    snprintf(l.name, sizeof l.name, "ln");
    l.replicated = true;
    for (int k = 0; k < 2; k++) {
        int at;
        assert_int_equal(dc_shm_step_init(&st[k],
                                          dc_group_member(sock, name, (uint32_t)k, 2, 5000, 0,
                                                          "rep-job", NULL),
                                          0, DC_GROUP_TEST_B, &cfg),
                         0);
        assert_true((at = dc_shm_step_add_layer(&st[k], &l)) >= 0);
        assert_int_equal(dpclip_step_set_replicated(st[k].step, (size_t)at, 1), 0);
        assert_true(dc_shm_step_add(&st[k], &lin, &r, 1.0f) >= 0);
    }
    dc_test_layer_free(&l);
}

static void free_group(dc_shm_step st[2]) {
    for (int k = 0; k < 2; k++) {
        dpclip_client *c = st[k].c;
        dc_shm_step_free(&st[k]);
        dpclip_disconnect(c);
    }
}

/* Member 1's replicated copy scaled, or negated (the same norms: the
 * copies' identical noise would cancel between the members' outputs, whose
 * difference is then the noiseless sum): the step fails on both members,
 * fused or in phases (once: only rank 0's copy counted, member 1's was
 * clipped by norms that never saw it; a negated copy passed a check of
 * norms). */
static void replicated_copy_differs(const char *args, float factor) {
    dc_harness h;
    dc_shm_step st[2];
    dpclip_result res[2];
    int rcs[2];
    assert_int_equal(dc_harness_start(&h, args), 0);
    group_of_two(h.sock, "rep", st, 7);
    dc_group_run(st, 2, res, rcs); /* agreeing copies: runs */
    for (int k = 0; k < 2; k++) {
        assert_int_equal(rcs[k], 0);
        dpclip_result_free(&res[k]);
    }
    {
        /* its output grad (the normalised input ignores an affine change) */
        dc_tensor *g = &st[1].ref.layers[0].grad;
        float *v = g->data;
        for (int64_t i = 0; i < dc_test_tensor_numel(g); i++) v[i] *= factor;
    }
    for (int k = 0; k < 2; k++) dc_shm_step_fill_outputs(&st[k], NAN);
    dc_group_run(st, 2, res, rcs);
    for (int k = 0; k < 2; k++) {
        int64_t n = dc_shm_step_outputs(&st[k], NULL);
        float *got = malloc((size_t)n * sizeof *got);
        assert_non_null(got);
        if (rcs[k] == 0 || !strstr(dpclip_errfield(st[k].c), "replicated"))
            print_message("member %d: %d %s: %s\n", k, rcs[k], dpclip_errfield(st[k].c),
                          dpclip_errmsg(st[k].c));
        assert_true(rcs[k] != 0);
        assert_non_null(strstr(dpclip_errfield(st[k].c), "replicated"));
        dc_shm_step_outputs(&st[k], got);
        for (int64_t i = 0; i < n; i++) assert_true(isnan(got[i]));
        free(got);
    }
    free_group(st);
    assert_int_equal(dc_harness_stop(&h), 0);
}

static void test_replicated_copy_differs_fused(void **state) {
    (void)state;
    replicated_copy_differs("--workers 2 --no-gpu", 3.0f);
    replicated_copy_differs("--workers 2 --no-gpu", -1.0f);
}

static void test_replicated_copy_differs_phased(void **state) {
    (void)state;
    replicated_copy_differs("--workers 2 --no-gpu --set groups.fuse=false", 3.0f);
    replicated_copy_differs("--workers 2 --no-gpu --set groups.fuse=false", -1.0f);
}

/* In phases, a member rewrites its data after its norms reached the group
 * and before the group's totals come back: its clip phase measures again
 * and the step fails (once: clipped by the old norms). `layer` 1: its own
 * Linear's activations scaled; 0: its replicated copy negated (the same
 * norms, other data). */
static void member_rewrites_after_norms(int layer) {
    dc_harness h;
    dc_shm_step st[2];
    dpclip_result res[2];
    uint64_t t0;
    assert_int_equal(dc_harness_start(&h, "--workers 2 --no-gpu --set groups.fuse=false"), 0);
    group_of_two(h.sock, "late", st, 9);
    for (int k = 0; k < 2; k++) dc_shm_step_fill_outputs(&st[k], NAN);
    assert_int_equal(dpclip_submit(st[0].c, st[0].step, &t0), 0);
    sleep_ms(300); /* member 0's norms are in the group, waiting for member 1 */
    {
        dc_tensor *a = layer ? &st[0].ref.layers[1].input : &st[0].ref.layers[0].grad;
        float *x = a->data;
        for (int64_t i = 0; i < dc_test_tensor_numel(a); i++) x[i] *= layer ? 1e4f : -1.0f;
    }
    assert_int_equal(dpclip_run(st[1].c, st[1].step, &res[1]), 0); /* its data is as measured */
    dpclip_result_free(&res[1]);
    assert_true(dpclip_wait(st[0].c, t0, 20000, &res[0]) != 0);
    assert_non_null(strstr(dpclip_errfield(st[0].c), "clip_step.layers"));
    {
        int64_t n = dc_shm_step_outputs(&st[0], NULL);
        float *got = malloc((size_t)n * sizeof *got);
        assert_non_null(got);
        dc_shm_step_outputs(&st[0], got);
        for (int64_t i = 0; i < n; i++) assert_true(isnan(got[i]));
        free(got);
    }
    free_group(st);
    assert_int_equal(dc_harness_stop(&h), 0);
}

static void test_group_member_rewrites_after_norms(void **state) {
    (void)state;
    member_rewrites_after_norms(1);
    member_rewrites_after_norms(0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_rewrite_between_phases, setup, teardown),
        cmocka_unit_test_setup_teardown(test_indices_collide_after_pass, setup, teardown),
        cmocka_unit_test_setup_teardown(test_buffer_swapped_after_pass, setup, teardown),
        cmocka_unit_test(test_replicated_copy_differs_fused),
        cmocka_unit_test(test_replicated_copy_differs_phased),
        cmocka_unit_test(test_group_member_rewrites_after_norms),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
