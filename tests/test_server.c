/* daemon/service/server.c: the loop's polling windows (dc_server_poll). A window
 * keeps the loop polling (its idle handle active) from its start to its end;
 * one for completions closes early once nothing is in flight; a later one
 * waits on a timer and opens when due, also when it was set while the loop
 * was polling for an earlier one; spin_us = 0 turns them all off. Only the
 * windows' state is asserted, never how fast anything went. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "dc_ewma.h"
#include "server.h"

typedef struct rig {
    uv_loop_t loop;
    dc_server srv;
} rig;

/* The parts of a server the windows use: the loop's idle handle and timer,
 * and the pools' in-flight counts (no pools, no GPUs: nothing in flight
 * unless a test says so). */
static bool g_precise = true; /* the windows' timerfd; false: the uv timer alone */

static void rig_open(rig *r, uint64_t spin_ns) {
    memset(r, 0, sizeof *r);
    assert_int_equal(uv_loop_init(&r->loop), 0);
    r->srv.loop = &r->loop;
    r->srv.spin_ns = spin_ns;
    dc_server_windows_init(&r->srv, &r->loop, g_precise);
    assert_true((r->srv.spin_tfd >= 0) == g_precise);
}

static void rig_close(rig *r) {
    dc_server_windows_close(&r->srv);
    uv_run(&r->loop, UV_RUN_DEFAULT);
    assert_int_equal(uv_loop_close(&r->loop), 0);
}

static int polling(const rig *r) { return uv_is_active((const uv_handle_t *)&r->srv.spin); }

/* Runs the loop without blocking until `until` (uv_hrtime) or until the
 * loop stops polling and has nothing pending, whichever is first; returns
 * whether it was still polling at the end. */
static int run_until(rig *r, uint64_t until) {
    while (uv_hrtime() < until) {
        uv_run(&r->loop, UV_RUN_NOWAIT);
        if (!polling(r) && !dc_server_window_pending(&r->srv)) break;
    }
    return polling(r);
}

static void test_idle_window_runs_to_its_end(void **state) {
    (void)state;
    rig r;
    rig_open(&r, 50000);
    uint64_t now = uv_hrtime();
    dc_server_poll(&r.srv, now, now + 200000000u, true);
    assert_true(polling(&r));
    /* nothing is in flight, yet an idle window stays open */
    assert_true(run_until(&r, now + 5000000u));
    /* and closes after its end */
    while (polling(&r)) uv_run(&r.loop, UV_RUN_NOWAIT);
    assert_true(uv_hrtime() >= now + 200000000u);
    assert_int_equal(r.srv.spin_any_to, 0);
    rig_close(&r);
}

static void test_busy_window_closes_when_idle(void **state) {
    (void)state;
    rig r;
    rig_open(&r, 50000);
    uint64_t now = uv_hrtime();
    r.srv.cpu_pool.busy = 1; /* a job in flight */
    dc_server_poll(&r.srv, now, now + 60000000000ull, false);
    assert_true(run_until(&r, now + 2000000u));
    r.srv.cpu_pool.busy = 0; /* it completed */
    uv_run(&r.loop, UV_RUN_NOWAIT);
    assert_false(polling(&r));
    rig_close(&r);
}

/* A window that starts later waits on the timer; one set while the loop
 * polls for an earlier window opens when due, after that one closed. */
static void test_later_windows_open_when_due(void **state) {
    (void)state;
    rig r;
    rig_open(&r, 50000);
    uint64_t now = uv_hrtime();
    /* far enough ahead that a loaded machine still runs the steps below
     * before it opens */
    const uint64_t from = now + 300000000u, to = now + 310000000u;
    dc_server_poll(&r.srv, from, to, true);
    assert_false(polling(&r));
    assert_true(dc_server_window_pending(&r.srv));
    assert_int_equal(r.srv.pend_from, from);

    /* an earlier, shorter window now: it polls at once, the later one waits */
    dc_server_spin(&r.srv, true);
    assert_true(polling(&r));
    while (polling(&r)) uv_run(&r.loop, UV_RUN_NOWAIT);
    assert_true(uv_hrtime() < from);
    assert_true(dc_server_window_pending(&r.srv));

    /* the later one opens, when due on the timerfd (libuv's timer may fire
     * up to a millisecond early: the margins of dc_ewma_margin cover
     * that), and runs to its end */
    while (!polling(&r)) uv_run(&r.loop, UV_RUN_ONCE);
    assert_true(uv_hrtime() + (g_precise ? 0u : 2000000u) >= from);
    assert_int_equal(r.srv.pend_from, 0);
    while (polling(&r)) uv_run(&r.loop, UV_RUN_NOWAIT);
    assert_true(uv_hrtime() >= to);
    rig_close(&r);
}

static void test_off_and_stopping(void **state) {
    (void)state;
    rig r;
    rig_open(&r, 0); /* daemon.spin_us = 0 */
    uint64_t now = uv_hrtime();
    dc_server_poll(&r.srv, now, now + 10000000u, true);
    dc_server_poll(&r.srv, now + 5000000u, now + 10000000u, true);
    dc_server_spin(&r.srv, true);
    assert_false(polling(&r));
    assert_false(dc_server_window_pending(&r.srv));
    rig_close(&r);

    rig_open(&r, 50000);
    r.srv.stopping = true;
    dc_server_poll(&r.srv, now, uv_hrtime() + 10000000u, true);
    assert_false(polling(&r));
    /* a window already over is ignored */
    r.srv.stopping = false;
    dc_server_poll(&r.srv, now - 2000000u, now - 1000000u, true);
    assert_false(polling(&r));
    rig_close(&r);
}

static void test_margin(void **state) {
    (void)state;
    /* at least 0.3 ms, else 2.5% of the wait */
    assert_int_equal(dc_ewma_margin(1000000u), 300000u);
    assert_int_equal(dc_ewma_margin(100000000u), 2500000u);
    /* the window around what is due in 100 ms: a margin before, two after */
    uint64_t from, to;
    dc_ewma_window(1000000000u, 100000000u, 0, &from, &to);
    assert_true(from == 1097500000u && to == 1105000000u);
    dc_ewma_window(1000000000u, 100000000u, 1000000u, &from, &to); /* widened */
    assert_true(from == 1096500000u && to == 1106000000u);
    /* due sooner than its margin: it opens now, never before */
    dc_ewma_window(1000000000u, 100000u, 0, &from, &to);
    assert_true(from == 1000000000u && to == 1000700000u);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_idle_window_runs_to_its_end),
        cmocka_unit_test(test_busy_window_closes_when_idle),
        cmocka_unit_test(test_later_windows_open_when_due),
        cmocka_unit_test(test_off_and_stopping),
        cmocka_unit_test(test_margin),
    };
    /* with the timerfd (the daemon's way), then the uv timer alone (where
     * no timerfd could be made) */
    int failed = cmocka_run_group_tests(tests, NULL, NULL);
    g_precise = false;
    return failed + cmocka_run_group_tests(tests, NULL, NULL);
}
