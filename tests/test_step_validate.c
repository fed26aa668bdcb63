/* daemon/protocol/step_validate.c: the validation stage of a step, alone. A request's
 * refusal names its field and holds nothing; what the step names of the
 * session (device, events, early notice) is refused naming the field or
 * taken into the job; the plan cache matches exactly the bytes, registry
 * generation and limits a step validated under, and lends its step. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "step_validate.h"

static void test_request_refused(void **state) {
    (void)state;
    Dpclip__ClipStep m = DPCLIP__CLIP_STEP__INIT;
    dc_registry reg;
    dc_limits lim;
    dc_step_job j;
    dc_err e;

    memset(&lim, 0, sizeof lim);
    lim.max_batch = 64;
    lim.max_layers = 8;
    dc_registry_init(&reg);
    memset(&j, 0, sizeof j);
    m.batch_size = 0;
    m.sample_rate = 0.25;
    m.wait_event = 3;
    m.notify_enqueued = true;
    assert_int_equal(dc_step_validate(&j, &m, &reg, &lim, &e), DC_EINVAL);
    assert_string_equal(e.field, "clip_step.batch_size");
    assert_null(j.step.layers);
    /* the request's other terms are the job's, for the later stages */
    assert_true(j.params.sample_rate == 0.25);
    assert_int_equal(j.params.wait_event, 3);
    assert_true(j.params.notify_enqueued);
    m.batch_size = 4; /* no layers */
    assert_int_equal(dc_step_validate(&j, &m, &reg, &lim, &e), DC_EINVAL);
    assert_string_equal(e.field, "clip_step.layers");
    dc_registry_destroy(&reg);
}

static void test_names(void **state) {
    (void)state;
    int ev_a, ev_b; /* stand-ins for cudaEvent_t */
    struct dc_session_event wait = {7, 0, &ev_a}, signal = {8, 0, &ev_b}, other = {9, 1, &ev_b};
    dc_step_job j;
    dc_err e;

    /* a device the daemon has no backend for */
    memset(&j, 0, sizeof j);
    j.step.device = 1;
    assert_int_equal(dc_step_validate_names(&j, 1, NULL, NULL, &e), DC_EPRECOND);
    assert_string_equal(e.field, "clip_step");

    /* events named but not registered */
    memset(&j, 0, sizeof j);
    j.step.device = 0;
    j.params.wait_event = 7;
    assert_int_equal(dc_step_validate_names(&j, 1, NULL, NULL, &e), DC_ENOTFOUND);
    assert_string_equal(e.field, "clip_step.wait_event");
    j.params.wait_event = 0;
    j.params.signal_event = 8;
    assert_int_equal(dc_step_validate_names(&j, 1, NULL, NULL, &e), DC_ENOTFOUND);
    assert_string_equal(e.field, "clip_step.signal_event");

    /* an event of another device */
    assert_int_equal(dc_step_validate_names(&j, 2, NULL, &other, &e), DC_EINVAL);
    assert_string_equal(e.field, "clip_step.signal_event");
    j.step.device = -1; /* a host step names no GPU's event */
    j.params.signal_event = 0;
    j.params.wait_event = 7;
    assert_int_equal(dc_step_validate_names(&j, 1, &wait, NULL, &e), DC_EINVAL);
    assert_string_equal(e.field, "clip_step.wait_event");

    /* an early notice needs a signal event */
    memset(&j, 0, sizeof j);
    j.params.wait_event = 7;
    j.params.notify_enqueued = true;
    assert_int_equal(dc_step_validate_names(&j, 1, &wait, NULL, &e), DC_EINVAL);
    assert_string_equal(e.field, "clip_step.notify_enqueued");

    /* all in order: the job holds the events */
    j.params.signal_event = 8;
    assert_int_equal(dc_step_validate_names(&j, 1, &wait, &signal, &e), 0);
    assert_ptr_equal(j.wait_event, &ev_a);
    assert_ptr_equal(j.signal_event, &ev_b);
    assert_true(j.notify);

    /* a host step with no events */
    memset(&j, 0, sizeof j);
    j.step.device = -1;
    assert_int_equal(dc_step_validate_names(&j, 0, NULL, NULL, &e), 0);
    assert_null(j.wait_event);
    assert_null(j.signal_event);
    assert_false(j.notify);
}

static void test_plan(void **state) {
    (void)state;
    static const uint8_t key[] = {0x6a, 0x03, 0x01, 0x02, 0x03};
    uint8_t other[sizeof key];
    dc_layer layers[2];
    dc_limits lim, lim2;
    dc_step_job j, k;
    dc_step_plan *p;

    memset(layers, 0, sizeof layers);
    snprintf(layers[1].name, sizeof layers[1].name, "second");
    memset(&lim, 0, sizeof lim);
    lim.max_batch = 16;
    memset(&j, 0, sizeof j);
    j.step.batch = 4;
    j.step.n_layers = 2;
    j.step.layers = layers;
    j.params.sample_rate = 0.5;
    p = dc_step_plan_new(&j, key, sizeof key, 11, &lim);
    assert_non_null(p);
    /* a copy: the job's own layers may go */
    assert_ptr_not_equal(p->step.layers, layers);
    assert_string_equal(p->step.layers[1].name, "second");

    assert_true(dc_step_plan_matches(p, key, sizeof key, 11, &lim));
    memcpy(other, key, sizeof key);
    other[4] ^= 1;
    assert_false(dc_step_plan_matches(p, other, sizeof key, 11, &lim));
    assert_false(dc_step_plan_matches(p, key, sizeof key - 1, 11, &lim));
    assert_false(dc_step_plan_matches(p, key, sizeof key, 12, &lim)); /* a buffer came or went */
    lim2 = lim;
    lim2.max_batch = 8; /* a reload */
    assert_false(dc_step_plan_matches(p, key, sizeof key, 11, &lim2));

    memset(&k, 0, sizeof k);
    dc_step_plan_use(p, &k);
    assert_true(k.cached);
    assert_ptr_equal(k.step.layers, p->step.layers);
    assert_int_equal(k.step.batch, 4);
    assert_true(k.params.sample_rate == 0.5);
    dc_step_plan_free(p);
    dc_step_plan_free(NULL);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_request_refused),
        cmocka_unit_test(test_names),
        cmocka_unit_test(test_plan),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
