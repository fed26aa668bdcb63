/* The CUDA backend's settings that the daemon applies when it creates a GPU's
 * backend (cuda/backend/dc_cuda.h), and the phase timing behind the daemon's
 * dpclip_step_phase_seconds:
 * - gpu.workspace: dc_cuda_backend_set_workspace preallocates it; steps that
 *   fit never grow it; a larger step grows it once; it never shrinks; a
 *   preallocation the device cannot hold is DC_ENOSPACE naming the setting.
 * - gpu.workspace_max: a step needing more is refused with DC_ENOSPACE, a
 *   message naming the setting and the bytes needed, and nothing written;
 *   the backend goes on serving (the same step passes under a cap that fits).
 * - phase timing: on by default; norms, reduction, clipping and noise are
 *   measured and fit in the step's host time; the stream's wait on a client's
 *   event is measured when the step follows dc_cuda_backend_wait_event;
 *   DPCLIP_CUDA_PROFILE=0 at creation turns it off.
 * Norms are checked against the double-precision reference (tests/support).
 * The daemon-level check (RESOURCE_EXHAUSTED through a session) is in
 * test_cuda_ipc.c. Without a CUDA device: prints "SKIP: no CUDA device". */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <cuda_runtime_api.h>

#include "cuda_test.h"

#define B_ 4

/* One LINEAR layer with outputs, on the host (h) and the device (d). */
typedef struct one_layer {
    dc_layer h, d;
    dc_step s;
    double ref[B_]; /* reference squared norms */
} one_layer;

static void one_make(one_layer *o, uint64_t seed) {
    dc_test_layer_spec sp = {DC_LAYER_LINEAR, B_, 16, 32, 24, DC_F32, 1, DC_ALGO_AUTO, 1, 0};
    dc_test_rng r;
    dc_test_rng_seed(&r, seed);
    dc_test_layer_make(&o->h, &sp, &r);
    o->d = dev_layer(&o->h);
    step_init(&o->s, &o->d, 1, B_, 0);
    o->s.noise_multiplier = 0.5f;
    dc_ref_layer_sqnorms(&o->h, B_, 1.0, o->ref);
}

static void one_free(one_layer *o) {
    dc_test_layer_free(&o->h);
    dev_layer_free(&o->d);
}

/* Runs the step on `be`; on success checks its norms against the reference. */
static int one_run(dc_backend *be, one_layer *o, dc_step_result *res, dc_err *err) {
    int rc = run(be, &o->s, res, err);
    if (rc) return rc;
    for (int b = 0; b < B_; b++) {
        double got = (double)res->norms[b] * res->norms[b];
        assert_true(fabs(got - o->ref[b]) <= norm_rtol(DC_F32) * o->ref[b]);
    }
    return 0;
}

static dc_backend *new_backend(void) {
    dc_backend *be = NULL;
    dc_err err;
    if (dc_cuda_backend_create(0, &be, &err)) fail_msg("dc_cuda_backend_create: %s", err.msg);
    return be;
}

static void test_preallocated(void **state) {
    (void)state;
    dc_backend *be = new_backend();
    one_layer o;
    dc_step_result res;
    dc_err err;
    const size_t pre = (size_t)8 << 20;
    one_make(&o, 11);
    assert_int_equal(dc_cuda_backend_set_workspace(be, pre, 0, &err), 0);
    assert_true(dc_cuda_backend_workspace_bytes(be) == pre);
    /* steps that fit leave it as it is: no allocation in the step */
    for (int i = 0; i < 3; i++) {
        assert_int_equal(one_run(be, &o, &res, &err), 0);
        dc_step_result_free(&res);
        assert_true(dc_cuda_backend_workspace_bytes(be) == pre);
    }
    /* a smaller setting does not shrink what is held */
    assert_int_equal(dc_cuda_backend_set_workspace(be, (size_t)1 << 20, 0, &err), 0);
    assert_true(dc_cuda_backend_workspace_bytes(be) == pre);
    /* more than the device has: refused, naming the setting; steps go on */
    assert_int_equal(dc_cuda_backend_set_workspace(be, (size_t)1 << 50, 0, &err), DC_ENOSPACE);
    assert_non_null(strstr(err.msg, "gpu.workspace"));
    assert_int_equal(one_run(be, &o, &res, &err), 0);
    dc_step_result_free(&res);
    one_free(&o);
    dc_backend_destroy(be);
}

static void test_grows_once(void **state) {
    (void)state;
    dc_backend *be = new_backend();
    one_layer o;
    dc_step_result res;
    dc_err err;
    one_make(&o, 12);
    assert_int_equal(dc_cuda_backend_set_workspace(be, 0, 0, &err), 0);
    size_t before = dc_cuda_backend_workspace_bytes(be);
    assert_int_equal(one_run(be, &o, &res, &err), 0);
    dc_step_result_free(&res);
    size_t grown = dc_cuda_backend_workspace_bytes(be);
    assert_true(grown > before);
    assert_int_equal(one_run(be, &o, &res, &err), 0);
    dc_step_result_free(&res);
    assert_true(dc_cuda_backend_workspace_bytes(be) == grown);
    one_free(&o);
    dc_backend_destroy(be);
}

static void test_workspace_max(void **state) {
    (void)state;
    dc_backend *probe = new_backend(), *be = new_backend();
    one_layer o;
    dc_step_result res;
    dc_err err;
    one_make(&o, 13);
    /* what this step makes an uncapped backend hold: at least its need */
    assert_int_equal(dc_cuda_backend_set_workspace(probe, 0, 0, &err), 0);
    assert_int_equal(one_run(probe, &o, &res, &err), 0);
    dc_step_result_free(&res);
    size_t fits = dc_cuda_backend_workspace_bytes(probe);
    dc_backend_destroy(probe);

    /* a cap below any step's need: refused before any work */
    const float sentinel = 12345.0f;
    size_t n_w = tensor_bytes(&o.d.weight_grad_out) / sizeof(float);
    float *w = malloc(n_w * sizeof *w);
    assert_non_null(w);
    for (size_t i = 0; i < n_w; i++) w[i] = sentinel;
    h2d(o.d.weight_grad_out.data, w, n_w * sizeof *w);
    assert_int_equal(dc_cuda_backend_set_workspace(be, 0, 64, &err), 0);
    int rc = one_run(be, &o, &res, &err);
    dc_step_result_free(&res);
    assert_int_equal(rc, DC_ENOSPACE);
    printf("refused: %s\n", err.msg);
    assert_non_null(strstr(err.msg, "gpu.workspace_max"));
    assert_non_null(strstr(err.msg, "needs "));
    assert_non_null(strstr(err.msg, "of 64 bytes"));
    memset(w, 0, n_w * sizeof *w);
    CUDA_OK(cudaMemcpy(w, o.d.weight_grad_out.data, n_w * sizeof *w, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < n_w; i++) assert_true(w[i] == sentinel); /* nothing written */
    assert_true(dc_cuda_backend_workspace_bytes(be) <= 64);
    /* the backend goes on: under a cap that fits, the same step runs, and
     * the workspace stays within the cap */
    assert_int_equal(dc_cuda_backend_set_workspace(be, 0, fits, &err), 0);
    assert_int_equal(one_run(be, &o, &res, &err), 0);
    dc_step_result_free(&res);
    assert_true(dc_cuda_backend_workspace_bytes(be) <= fits);
    assert_true(dc_cuda_backend_workspace_bytes(be) > 0);
    free(w);
    one_free(&o);
    dc_backend_destroy(be);
}

static void test_phase_timing(void **state) {
    (void)state;
    one_layer o;
    dc_step_result res;
    dc_err err;
    float ms[DC_CUDA_PHASES];
    uint64_t sum = 0;
    one_make(&o, 14);
    /* on by default (setup created g_cuda without DPCLIP_CUDA_PROFILE) */
    assert_int_equal(one_run(g_cuda, &o, &res, &err), 0);
    for (int k = DC_RUN_NORMS; k < DC_RUN_N; k++) {
        assert_true(res.phase_ns[k] > 0);
        sum += res.phase_ns[k];
    }
    assert_true(sum <= res.compute_ns);                /* GPU time inside the step's host time */
    assert_true(res.phase_ns[DC_RUN_WAIT_INPUT] == 0); /* no client event */
    dc_step_result_free(&res);
    assert_int_equal(dc_cuda_backend_phase_ms(g_cuda, ms), 0);
    for (int i = 1; i < DC_CUDA_PHASES - 1; i++) assert_true(ms[i] >= 0.0f);

    /* after a wait on a client's event: the wait is measured on the GPU */
    {
        cudaEvent_t ev;
        cudaStream_t st;
        CUDA_OK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
        CUDA_OK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
        CUDA_OK(cudaEventRecord(ev, st));
        assert_int_equal(dc_cuda_backend_wait_event(g_cuda, ev), 0);
        assert_int_equal(one_run(g_cuda, &o, &res, &err), 0);
        assert_true(res.phase_ns[DC_RUN_WAIT_INPUT] > 0);
        dc_step_result_free(&res);
        /* the next step did not wait */
        assert_int_equal(one_run(g_cuda, &o, &res, &err), 0);
        assert_true(res.phase_ns[DC_RUN_WAIT_INPUT] == 0);
        dc_step_result_free(&res);
        CUDA_OK(cudaEventDestroy(ev));
        CUDA_OK(cudaStreamDestroy(st));
    }

    /* DPCLIP_CUDA_PROFILE=0 at creation: nothing measured, same results */
    setenv("DPCLIP_CUDA_PROFILE", "0", 1);
    dc_backend *quiet = new_backend();
    unsetenv("DPCLIP_CUDA_PROFILE");
    assert_int_equal(one_run(quiet, &o, &res, &err), 0);
    for (int k = 0; k < DC_RUN_N; k++) assert_true(res.phase_ns[k] == 0);
    dc_step_result_free(&res);
    assert_int_equal(dc_cuda_backend_phase_ms(quiet, ms), DC_EPRECOND);
    dc_backend_destroy(quiet);
    one_free(&o);
}

static int setup(void **state) {
    unsetenv("DPCLIP_CUDA_PROFILE"); /* the default: phases timed */
    return cuda_test_setup(state);
}

int main(void) {
    if (cuda_test_skip()) return DC_TEST_SKIP;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_preallocated),
        cmocka_unit_test(test_grows_once),
        cmocka_unit_test(test_workspace_max),
        cmocka_unit_test(test_phase_timing),
    };
    return cmocka_run_group_tests(tests, setup, cuda_test_teardown);
}
