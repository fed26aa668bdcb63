/* The client tests' fixture (test_client.c, test_submit.c): one dpclipd
 * for the test group, connections to it, and a small two-layer step in its
 * own buffer, checked against the double-precision reference. Include
 * after <cmocka.h>. */
#ifndef DC_CLIENT_TEST_H
#define DC_CLIENT_TEST_H

#include "harness.h"

#define MAX_BATCH 64

/* one per test program (a static in each that includes this) */
static dc_harness g_h;

static inline int group_setup(void **state) {
    (void)state;
    /* --no-gpu: the same answers on GPU machines (CUDA refusals included). */
    return dc_harness_start(&g_h, "--workers 2 --max-batch 64 --no-gpu");
}

static inline int group_teardown(void **state) {
    (void)state;
    /* normally stopped (and checked) by test_clean_shutdown; this only
     * cleans up after a failure */
    if (g_h.pid) dc_harness_stop(&g_h);
    return 0;
}

static inline dpclip_client *connect_ok(void) {
    return dc_harness_connect(&g_h, "test_client", "job-1");
}

static const dpclip_clip_config k_cfg = {.max_grad_norm = 1.0f,
                                         .reduction = DPCLIP_SUM,
                                         .expected_batch_size = 0,
                                         .noise_multiplier = 0.0f,
                                         .mode = DPCLIP_FLAT};

/* A small two-layer step (linear with bias + layernorm) in its own buffer,
 * with C set to the median norm so that some samples are clipped. */
static inline void make_step(dc_shm_step *s, dpclip_client *c, uint32_t B, uint64_t seed) {
    dc_test_rng r;
    dc_test_layer_spec lin = {.kind = DC_LAYER_LINEAR,
                              .B = B,
                              .T = 3,
                              .d = 8,
                              .p = 6,
                              .dtype = DC_F32,
                              .has_bias = 1,
                              .with_outputs = 1};
    dc_test_layer_spec ln = {.kind = DC_LAYER_LAYERNORM,
                             .B = B,
                             .T = 3,
                             .d = 8,
                             .dtype = DC_F32,
                             .has_bias = 1,
                             .with_outputs = 1};
    dpclip_clip_config cfg = k_cfg;
    dc_test_rng_seed(&r, seed);
    assert_int_equal(dc_shm_step_init(s, c, 1u << 20, B, &cfg), 0);
    assert_true(dc_shm_step_add(s, &lin, &r, 1.0f) >= 0);
    assert_true(dc_shm_step_add(s, &ln, &r, 1.0f) >= 0);
    cfg.max_grad_norm = (float)dc_shm_step_median_norm(s);
    assert_int_equal(dc_shm_step_set_config(s, &cfg), 0);
}

static inline void check(dc_shm_step *s, const dpclip_result *res) {
    double e = dc_shm_step_check(s, res, dc_test_rtol(DC_F32), 1e-6);
    assert_true(e <= 1.0);
}

/* Callbacks' log (dpclip_submit_cb): the order they ran in, each
 * status and step index; do_ping calls back into the handle. */
typedef struct cb_log {
    dpclip_client *c;
    int n;
    int order[16];
    int status[16];
    uint64_t step_index[16];
    int ping_rc;
} cb_log;

typedef struct cb_arg {
    cb_log *log;
    int id;
    int do_ping;
} cb_arg;

static inline void on_step(void *user, int status, const char *errmsg, const dpclip_result *res) {
    cb_arg *a = user;
    cb_log *lg = a->log;
    lg->order[lg->n] = a->id;
    lg->status[lg->n] = status;
    lg->step_index[lg->n] = status == 0 ? res->step_index : 0;
    if (status) assert_non_null(errmsg);
    /* callbacks run without the handle's lock: calling back in must work */
    if (a->do_ping) lg->ping_rc = dpclip_ping(lg->c);
    lg->n++;
}

/* SIGTERM: the daemon finishes, exits 0 and removes its socket (cmocka
 * does not count a failing group teardown, so this is a test). */
static inline void test_clean_shutdown(void **state) {
    (void)state;
    assert_int_equal(dc_harness_stop(&g_h), 0);
}

#endif
