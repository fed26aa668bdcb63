/* daemon/protocol/step_validate.c: the validation stage of a step, alone. A request's
 * refusal names its field and holds nothing; what the step names of the
 * session (device, events, early notice) is refused naming the field or
 * taken into the step call; the plan cache matches exactly the bytes, registry
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
    dc_step_call sc;
    dc_err e;

    memset(&lim, 0, sizeof lim);
    lim.max_batch = 64;
    lim.max_layers = 8;
    dc_registry_init(&reg);
    memset(&sc, 0, sizeof sc);
    m.batch_size = 0;
    m.sample_rate = 0.25;
    m.wait_event = 3;
    m.notify_enqueued = true;
    assert_int_equal(dc_step_validate(&sc, &m, &reg, &lim, &e), DC_EINVAL);
    assert_string_equal(e.field, "clip_step.batch_size");
    assert_null(sc.step.layers);
    /* the request's other terms are the call's, for the later stages */
    assert_true(sc.params.sample_rate == 0.25);
    assert_int_equal(sc.params.wait_event, 3);
    assert_true(sc.params.notify_enqueued);
    m.batch_size = 4; /* no layers */
    assert_int_equal(dc_step_validate(&sc, &m, &reg, &lim, &e), DC_EINVAL);
    assert_string_equal(e.field, "clip_step.layers");
    dc_registry_destroy(&reg);
}

static void test_names(void **state) {
    (void)state;
    int ev_a, ev_b; /* stand-ins for cudaEvent_t */
    struct dc_session_event wait = {7, 0, &ev_a}, signal = {8, 0, &ev_b}, other = {9, 1, &ev_b};
    dc_step_call sc;
    dc_err e;

    /* a device the daemon has no backend for */
    memset(&sc, 0, sizeof sc);
    sc.step.device = 1;
    assert_int_equal(dc_step_validate_names(&sc, 1, NULL, NULL, &e), DC_EPRECOND);
    assert_string_equal(e.field, "clip_step");

    /* events named but not registered */
    memset(&sc, 0, sizeof sc);
    sc.step.device = 0;
    sc.params.wait_event = 7;
    assert_int_equal(dc_step_validate_names(&sc, 1, NULL, NULL, &e), DC_ENOTFOUND);
    assert_string_equal(e.field, "clip_step.wait_event");
    sc.params.wait_event = 0;
    sc.params.signal_event = 8;
    assert_int_equal(dc_step_validate_names(&sc, 1, NULL, NULL, &e), DC_ENOTFOUND);
    assert_string_equal(e.field, "clip_step.signal_event");

    /* an event of another device */
    assert_int_equal(dc_step_validate_names(&sc, 2, NULL, &other, &e), DC_EINVAL);
    assert_string_equal(e.field, "clip_step.signal_event");
    sc.step.device = -1; /* a host step names no GPU's event */
    sc.params.signal_event = 0;
    sc.params.wait_event = 7;
    assert_int_equal(dc_step_validate_names(&sc, 1, &wait, NULL, &e), DC_EINVAL);
    assert_string_equal(e.field, "clip_step.wait_event");

    /* an early notice needs a signal event */
    memset(&sc, 0, sizeof sc);
    sc.params.wait_event = 7;
    sc.params.notify_enqueued = true;
    assert_int_equal(dc_step_validate_names(&sc, 1, &wait, NULL, &e), DC_EINVAL);
    assert_string_equal(e.field, "clip_step.notify_enqueued");

    /* all in order: the call holds the events */
    sc.params.signal_event = 8;
    assert_int_equal(dc_step_validate_names(&sc, 1, &wait, &signal, &e), 0);
    assert_ptr_equal(sc.wait_event, &ev_a);
    assert_ptr_equal(sc.signal_event, &ev_b);
    assert_true(sc.notify);

    /* a host step with no events */
    memset(&sc, 0, sizeof sc);
    sc.step.device = -1;
    assert_int_equal(dc_step_validate_names(&sc, 0, NULL, NULL, &e), 0);
    assert_null(sc.wait_event);
    assert_null(sc.signal_event);
    assert_false(sc.notify);
}

static void test_plan(void **state) {
    (void)state;
    static const uint8_t key[] = {0x6a, 0x03, 0x01, 0x02, 0x03};
    uint8_t other[sizeof key];
    dc_layer layers[2];
    dc_limits lim, lim2;
    dc_step_call sc, k;
    dc_step_plan *p;

    memset(layers, 0, sizeof layers);
    snprintf(layers[1].name, sizeof layers[1].name, "second");
    memset(&lim, 0, sizeof lim);
    lim.max_batch = 16;
    memset(&sc, 0, sizeof sc);
    sc.step.batch = 4;
    sc.step.n_layers = 2;
    sc.step.layers = layers;
    sc.params.sample_rate = 0.5;
    p = dc_step_plan_new(&sc, key, sizeof key, 11, &lim);
    assert_non_null(p);
    /* a copy: the call's own layers may go */
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
