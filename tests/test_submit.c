/* libdpclip's asynchronous calls against a real dpclipd (client/submit.c):
 * submit/wait out of order, submit_cb/poll and their order with run, and
 * callbacks outstanding at disconnect. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "client_test.h"

static void test_submit_wait(void **state) {
    (void)state;
    dpclip_client *c = connect_ok();
    dc_shm_step s[3];
    uint64_t t[3];
    dpclip_result res[3];

    for (int i = 0; i < 3; i++) make_step(&s[i], c, (uint32_t)(8 + 4 * i), 10 + (uint64_t)i);
    for (int i = 0; i < 3; i++) assert_int_equal(dpclip_submit(c, s[i].step, &t[i]), 0);
    assert_true(t[0] != t[1] && t[1] != t[2]);
    /* collect out of order: the last first */
    assert_int_equal(dpclip_wait(c, t[2], -1, &res[2]), 0);
    /* a zero timeout may or may not find t[0] finished; either answer is legal */
    int rc = dpclip_wait(c, t[0], 0, &res[0]);
    assert_true(rc == 0 || rc == DPCLIP_EAGAIN);
    if (rc == DPCLIP_EAGAIN) assert_int_equal(dpclip_wait(c, t[0], -1, &res[0]), 0);
    assert_int_equal(dpclip_wait(c, t[1], 5000, &res[1]), 0);
    for (int i = 0; i < 3; i++) {
        assert_int_equal(res[i].batch, 8 + 4 * i);
        check(&s[i], &res[i]);
    }
    assert_true(res[0].step_index < res[1].step_index);
    assert_true(res[1].step_index < res[2].step_index);
    /* collected tickets and made-up ones are unknown */
    {
        dpclip_result again;
        assert_int_equal(dpclip_wait(c, t[1], 0, &again), DPCLIP_EARG);
        assert_null(again.norms);
        assert_int_equal(dpclip_wait(c, 999999, -1, &again), DPCLIP_EARG);
    }
    for (int i = 0; i < 3; i++) {
        dpclip_result_free(&res[i]);
        dc_shm_step_free(&s[i]);
    }
    assert_int_equal(dpclip_poll(c, 0), 0); /* nothing outstanding */
    dpclip_disconnect(c);
}

static void test_submit_cb_poll(void **state) {
    (void)state;
    dpclip_client *c = connect_ok();
    dc_shm_step s;
    cb_log lg;
    cb_arg args[6];
    uint64_t ticket;
    dpclip_result res, tres;
    int done = 0;

    memset(&lg, 0, sizeof lg);
    lg.c = c;
    lg.ping_rc = -1;
    make_step(&s, c, 12, 20);
    for (int i = 0; i < 6; i++) args[i] = (cb_arg){&lg, i, i == 3};

    /* cb, cb, ticket, cb, cb: completions in submission order */
    assert_int_equal(dpclip_submit_cb(c, s.step, on_step, &args[0]), 0);
    assert_int_equal(dpclip_submit_cb(c, s.step, on_step, &args[1]), 0);
    assert_int_equal(dpclip_submit(c, s.step, &ticket), 0);
    assert_int_equal(dpclip_submit_cb(c, s.step, on_step, &args[2]), 0);
    assert_int_equal(dpclip_submit_cb(c, s.step, on_step, &args[3]), 0);
    while (lg.n < 4) {
        int n = dpclip_poll(c, 5000);
        assert_true(n >= 0);
        done += n;
    }
    assert_int_equal(done, 5); /* four callbacks and the ticket */
    for (int i = 0; i < 4; i++) {
        assert_int_equal(lg.order[i], i);
        assert_int_equal(lg.status[i], 0);
        if (i) assert_true(lg.step_index[i] > lg.step_index[i - 1]);
    }
    assert_int_equal(lg.ping_rc, 0);
    assert_int_equal(dpclip_wait(c, ticket, 0, &tres), 0); /* already completed by poll */
    assert_true(tres.step_index > lg.step_index[1] && tres.step_index < lg.step_index[2]);
    check(&s, &tres);
    dpclip_result_free(&tres);

    /* dpclip_run completes earlier submits first: their callbacks have run
     * by the time it returns */
    assert_int_equal(dpclip_submit_cb(c, s.step, on_step, &args[4]), 0);
    assert_int_equal(dpclip_submit_cb(c, s.step, on_step, &args[5]), 0);
    assert_int_equal(dpclip_run(c, s.step, &res), 0);
    assert_int_equal(lg.n, 6);
    assert_int_equal(lg.order[4], 4);
    assert_int_equal(lg.order[5], 5);
    assert_true(lg.step_index[5] < res.step_index);
    check(&s, &res);
    dpclip_result_free(&res);
    dc_shm_step_free(&s);
    dpclip_disconnect(c);
}

/* Disconnecting with callbacks outstanding runs them with DPCLIP_EIO or
 * their real status; never leaks and never hangs. */
static void test_disconnect_pending(void **state) {
    (void)state;
    dpclip_client *c = connect_ok();
    dc_shm_step s;
    cb_log lg;
    cb_arg args[4];
    uint64_t t;

    memset(&lg, 0, sizeof lg);
    lg.c = c;
    make_step(&s, c, 8, 40);
    for (int i = 0; i < 4; i++) {
        args[i] = (cb_arg){&lg, i, 0};
        assert_int_equal(dpclip_submit_cb(c, s.step, on_step, &args[i]), 0);
    }
    assert_int_equal(dpclip_submit(c, s.step, &t), 0);
    dpclip_step_free(s.step);
    s.step = NULL;
    s.c = NULL; /* the buffer goes with the connection */
    dpclip_disconnect(c);
    assert_int_equal(lg.n, 4);
    for (int i = 0; i < 4; i++) assert_int_equal(lg.order[i], i);
    dc_shm_step_free(&s);
}

int main(void) {
    const struct CMUnitTest daemon[] = {
        cmocka_unit_test(test_submit_wait),
        cmocka_unit_test(test_submit_cb_poll),
        cmocka_unit_test(test_disconnect_pending),
        cmocka_unit_test(test_clean_shutdown),
    };
    return cmocka_run_group_tests_name("client_submit", daemon, group_setup, group_teardown);
}
