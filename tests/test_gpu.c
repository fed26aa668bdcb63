/* daemon/infra/gpu.c without a device to serve: a daemon told to use no
 * GPU (or built without CUDA, or on a node without one) finds none, refuses
 * every GPU request with a clear error, and its step hooks refuse a backend
 * without a device queue (the CPU backend) naming the request's field. On a
 * GPU machine the same daemon, told to use its GPUs, finds and names them. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "cpu.h"
#include "gpu.h"

static void test_disabled(void **state) {
    (void)state;
    uv_loop_t loop;
    dc_gpu g;
    dc_err err;
    dc_gpu_open_task ot;
    dc_gpu_event_task et;
    assert_int_equal(uv_loop_init(&loop), 0);
    memset(&g, 0xab, sizeof g); /* init must not read what it is given */
    assert_int_equal(dc_gpu_init(&g, &loop, false, 0, 0, 0, &err), 0);
    assert_int_equal(g.n, 0);
    assert_null(g.pools);
    assert_false(g.mps_active);
    assert_int_equal(dc_gpu_busy(&g), 0);
    /* every request for a device it does not serve */
    memset(&ot, 0, sizeof ot);
    memset(&et, 0, sizeof et);
    assert_int_not_equal(dc_gpu_open_buffer(&g, &ot), 0);
    assert_int_not_equal(dc_gpu_open_event(&g, &et), 0);
    ot.device = et.device = -1;
    assert_int_not_equal(dc_gpu_open_buffer(&g, &ot), 0);
    assert_int_not_equal(dc_gpu_open_event(&g, &et), 0);
    dc_gpu_close(&g);
    dc_gpu_close(&g); /* twice: nothing left to close */
    assert_int_equal(uv_run(&loop, UV_RUN_DEFAULT), 0);
    assert_int_equal(uv_loop_close(&loop), 0);
}

/* The step hooks through the backend interface: a backend without a device
 * queue refuses to wait or signal, naming the field and the backend. */
static void test_hooks_refuse_host_backend(void **state) {
    (void)state;
    dc_backend *be;
    dc_err err;
    int dummy;
    assert_int_equal(dc_cpu_backend_create(1, &be, &err), 0);
    assert_int_equal(dc_gpu_wait_event(be, &dummy, &err), DC_EUNAVAIL);
    assert_string_equal(err.field, "clip_step.wait_event");
    assert_non_null(strstr(err.msg, "cpu"));
    assert_int_equal(dc_gpu_record_event(be, &dummy, &err), DC_EUNAVAIL);
    assert_string_equal(err.field, "clip_step.signal_event");
    assert_non_null(strstr(err.msg, "cpu"));
    assert_int_equal(dc_backend_workspace_bytes(be), 0);
    dc_backend_destroy(be);
}

/* Told to use its GPUs: none where there are none (a CPU-only build, or no
 * device), else each one named and served by a worker of its own. */
static void test_enabled(void **state) {
    (void)state;
    uv_loop_t loop;
    dc_gpu g;
    dc_err err;
    assert_int_equal(uv_loop_init(&loop), 0);
    assert_int_equal(dc_gpu_init(&g, &loop, true, 0, 0, 0, &err), 0);
    assert_true(g.n >= 0 && g.n <= DC_MAX_GPUS);
    printf("%d GPU(s)\n", g.n);
    for (int i = 0; i < g.n; i++) {
        assert_true(g.names[i][0] != '\0');
        assert_non_null(g.pools);
    }
    if (g.n == 0) assert_null(g.pools);
    assert_int_equal(dc_gpu_busy(&g), 0);
    dc_gpu_close(&g);
    assert_int_equal(uv_run(&loop, UV_RUN_DEFAULT), 0);
    assert_int_equal(uv_loop_close(&loop), 0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_disabled),
        cmocka_unit_test(test_hooks_refuse_host_backend),
        cmocka_unit_test(test_enabled),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
