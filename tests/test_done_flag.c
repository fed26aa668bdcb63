/* ClipStep.done_flag end to end on the CPU backend: the notice comes with
 * the value, which the daemon stores into the client's shared memory once
 * the step has finished (a success's outputs checked against the
 * reference; a failure's outputs zeroed first, its abandon word left
 * alone: test_step_run has outputs that cannot be zeroed), and every
 * malformed flag is refused naming its field, with nothing stored. */
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
#include "shm_step.h"

static dc_harness g_h;

static int group_setup(void **state) {
    (void)state;
    return dc_harness_start(&g_h, "--workers 2");
}

static int group_teardown(void **state) {
    (void)state;
    if (g_h.pid) dc_harness_stop(&g_h);
    return 0;
}

#define B 6

/* A step of one Linear and one LayerNorm with both [B] outputs, and a flag
 * word after everything else in its buffer (set to 0). */
static void make_step(dc_shm_step *s, dpclip_client *c, dc_test_rng *r, dpclip_tensor *flag,
                      uint32_t **word) {
    dpclip_clip_config cfg = {.max_grad_norm = 1.0f, .reduction = DPCLIP_SUM};
    dc_test_layer_spec lin = {DC_LAYER_LINEAR, B, 3, 8, 5, DC_F32, 1, DC_ALGO_AUTO, 1, 0};
    dc_test_layer_spec ln = {DC_LAYER_LAYERNORM, B, 3, 8, 0, DC_F32, 1, DC_ALGO_AUTO, 1, 0};
    assert_int_equal(dc_shm_step_init(s, c, 1u << 20, B, &cfg), 0);
    assert_int_equal(dc_shm_step_add(s, &lin, r, 1.0f), 0);
    assert_int_equal(dc_shm_step_add(s, &ln, r, 1.0f), 1);
    assert_int_equal(dc_shm_step_add_outputs(s, 1, 1), 0);
    cfg.max_grad_norm = (float)dc_shm_step_median_norm(s);
    assert_int_equal(dc_shm_step_set_config(s, &cfg), 0);
    size_t off = (s->used + 63) & ~(size_t)63;
    assert_true(off + 64 <= s->size);
    s->used = off + 64;
    *word = (uint32_t *)(s->base + off);
    **word = 0;
    *flag = (dpclip_tensor){
        .buffer = s->buf_id, .offset = off, .dtype = DPCLIP_I32, .ndim = 1, .shape = {1}};
    dpclip_step_notify_enqueued(s->step, 1);
    assert_int_equal(dpclip_step_set_done_flag(s->step, flag), 0);
}

static uint32_t load(const uint32_t *w) { return __atomic_load_n(w, __ATOMIC_ACQUIRE); }

static void test_done_flag_success(void **state) {
    (void)state;
    dpclip_client *c = dc_harness_connect(&g_h, "done", "done-flag");
    dc_test_rng r;
    dc_shm_step s;
    dpclip_tensor flag;
    uint32_t *word;
    dc_test_rng_seed(&r, 11);
    make_step(&s, c, &r, &flag, &word);
    for (uint32_t k = 1; k <= 3; k++) {
        uint64_t ticket;
        dpclip_enqueued info;
        dpclip_result res;
        dc_shm_step_refill(&s, &r);
        dc_shm_step_fill_outputs(&s, -777.0f);
        assert_int_equal(dpclip_submit(c, s.step, &ticket), 0);
        assert_int_equal(dpclip_wait_enqueued(c, ticket, -1, &info), 0);
        /* the session's count of flagged steps, from 1 */
        assert_int_equal(info.done_value, k);
        assert_int_equal(dpclip_wait(c, ticket, -1, &res), 0);
        /* stored by the time the reply came, after the outputs */
        assert_int_equal(load(word), k);
        assert_true(dc_shm_step_check(&s, &res, dc_test_rtol(DC_F32), 1e-7) <= 1.0);
        dpclip_result_free(&res);
    }
    dc_shm_step_free(&s);
    dpclip_disconnect(c);
}

static int all_zero(const float *p, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (p[i] != 0.0f) return 0;
    return 1;
}

static void test_done_flag_failure_zeroes_outputs(void **state) {
    (void)state;
    dpclip_client *c = dc_harness_connect(&g_h, "done-fail", "done-flag-fail");
    dc_test_rng r;
    dc_shm_step s;
    dpclip_tensor flag;
    uint32_t *word;
    dc_test_rng_seed(&r, 12);
    make_step(&s, c, &r, &flag, &word);
    /* with its abandon word, which a backend that zeroed leaves alone */
    flag.shape[0] = 2;
    word[1] = 0;
    assert_int_equal(dpclip_step_set_done_flag(s.step, &flag), 0);
    int64_t n = dc_shm_step_outputs(&s, NULL);
    float *out = malloc((size_t)n * sizeof *out);
    assert_non_null(out);
    ((float *)s.ref.layers[0].input.data)[5] = NAN;
    dc_shm_step_fill_outputs(&s, -5.0f);
    uint64_t ticket;
    dpclip_enqueued info;
    dpclip_result res;
    assert_int_equal(dpclip_submit(c, s.step, &ticket), 0);
    /* accepted (charged) before it ran: the notice comes, then the failure */
    assert_int_equal(dpclip_wait_enqueued(c, ticket, -1, &info), 0);
    assert_int_equal(info.done_value, 1);
    assert_int_equal(dpclip_wait(c, ticket, -1, &res), DPCLIP_ENONFINITE);
    assert_int_equal(load(word), 1);
    assert_int_equal(load(word + 1), 0);
    assert_int_equal(dc_shm_step_outputs(&s, out), n);
    assert_true(all_zero(out, n));
    free(out);
    dc_shm_step_free(&s);
    dpclip_disconnect(c);
}

/* One refusal: the step with `bad` as its flag (or without notify) gets
 * the error naming `field`, and the flag word stays 0. */
static void refused(dpclip_client *c, dc_shm_step *s, const dpclip_tensor *bad, int notify,
                    const uint32_t *word, const char *field) {
    uint64_t ticket;
    dpclip_enqueued info;
    dpclip_result res;
    dpclip_step_notify_enqueued(s->step, notify);
    assert_int_equal(dpclip_step_set_done_flag(s->step, bad), 0);
    assert_int_equal(dpclip_submit(c, s->step, &ticket), 0);
    int rc = dpclip_wait_enqueued(c, ticket, -1, &info);
    if (rc == 0) rc = dpclip_wait(c, ticket, -1, &res);
    assert_int_not_equal(rc, 0);
    if (strcmp(dpclip_errfield(c), field) != 0)
        fail_msg("field %s, wanted %s (%s)", dpclip_errfield(c), field, dpclip_errmsg(c));
    assert_int_equal(load(word), 0);
}

static void test_done_flag_refusals(void **state) {
    (void)state;
    dpclip_client *c = dc_harness_connect(&g_h, "done-bad", "done-flag-bad");
    dc_test_rng r;
    dc_shm_step s;
    dpclip_tensor flag, bad;
    uint32_t *word;
    dc_test_rng_seed(&r, 13);
    make_step(&s, c, &r, &flag, &word);
    refused(c, &s, &flag, 0, word, "clip_step.done_flag");
    bad = flag;
    bad.dtype = DPCLIP_F32;
    refused(c, &s, &bad, 1, word, "clip_step.done_flag.dtype");
    bad = flag;
    bad.shape[0] = 3; /* ([2]: the flag and its abandon word) */
    refused(c, &s, &bad, 1, word, "clip_step.done_flag.shape");
    bad = flag;
    bad.offset += 2;
    refused(c, &s, &bad, 1, word, "clip_step.done_flag.offset");
    bad = flag;
    bad.offset = s.size; /* past the end */
    refused(c, &s, &bad, 1, word, "clip_step.done_flag.offset");
    bad = flag;
    bad.buffer = s.buf_id + 1000;
    refused(c, &s, &bad, 1, word, "clip_step.done_flag.buffer_id");
    dc_shm_step_free(&s);
    dpclip_disconnect(c);
}

static void test_clean_shutdown(void **state) {
    (void)state;
    assert_int_equal(dc_harness_stop(&g_h), 0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_done_flag_success),
        cmocka_unit_test(test_done_flag_failure_zeroes_outputs),
        cmocka_unit_test(test_done_flag_refusals),
        cmocka_unit_test(test_clean_shutdown),
    };
    return cmocka_run_group_tests_name("done_flag", tests, group_setup, group_teardown);
}
