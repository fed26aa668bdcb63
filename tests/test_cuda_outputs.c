/* The one-pass output path with the max |.| that the grouped clipped sum's
 * epilogue finds (cuda/kernels/grouped_tma.cu, dcc_out.amax_found): the output
 * check then reads only the other outputs, and its proof that no noised
 * value can leave its dtype rests on those maxima. Checked: whole steps
 * against the CPU backend (grouped layers with and without bias, bf16 and
 * f16 outputs, an f32 layer outside the grouped launch whose output the
 * check still scans); a value past f16 in the last, ragged tile of a
 * grouped output, which the epilogue's max must see (or the step would
 * write it); a non-finite input. A failed step writes nothing. Error
 * bounds: see test_cuda_kernels.c. Without a CUDA device the test prints
 * "SKIP: no CUDA device" and exits DC_TEST_SKIP (77). */
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

#include "cpu.h"
#include "cuda_test.h"

enum { NL = 4, NB = 5 };

/* Grouped: bf16 with bias, bf16 without (ragged tiles: p = 264 rows in two
 * 256-row tiles, d = 136 columns in two 128-column ones), f16 with bias;
 * not grouped: f32 (TF32 kernels). */
static const dc_test_layer_spec kSpecs[NL] = {
    {DC_LAYER_LINEAR, NB, 96, 64, 40, DC_BF16, 1, DC_ALGO_DIRECT, 1, 0},
    {DC_LAYER_LINEAR, NB, 70, 136, 264, DC_BF16, 0, DC_ALGO_AUTO, 1, 0},
    {DC_LAYER_LINEAR, NB, 64, 72, 48, DC_F16, 1, DC_ALGO_AUTO, 1, 0},
    {DC_LAYER_LINEAR, NB, 80, 32, 24, DC_F32, 1, DC_ALGO_AUTO, 1, 0},
};
enum { FOUND = 5 }; /* layers 0-2: weights and biases */

typedef struct set {
    dc_layer h[NL], d[NL];
} set;

/* Layer 1's weight output in dtype w1, layer 2's in f16; the rest f32. */
static void set_make(set *m, dc_test_rng *r, dc_dtype w1) {
    for (int l = 0; l < NL; l++) {
        dc_test_layer_make(&m->h[l], &kSpecs[l], r);
        m->h[l].max_grad_norm = 0.05f;
    }
    const dc_dtype want[2] = {w1, DC_F16};
    for (int k = 0; k < 2; k++) {
        dc_tensor *w = &m->h[1 + k].weight_grad_out;
        dc_tensor t = dc_test_tensor_new(want[k], w->ndim, w->shape[0], w->shape[1], 0);
        dc_test_tensor_free(w);
        *w = t;
    }
    for (int l = 0; l < NL; l++) m->d[l] = dev_layer(&m->h[l]);
}

static void set_free(set *m) {
    for (int l = 0; l < NL; l++) {
        dc_test_layer_free(&m->h[l]);
        dev_layer_free(&m->d[l]);
    }
}

static dc_tensor *out_of(set *m, int l, int k) {
    return k ? &m->d[l].bias_grad_out : &m->d[l].weight_grad_out;
}

/* Against the CPU backend: a sum, a mean, the staged outputs (the maxima
 * unused) and the double-precision draws; then with grouped launches off,
 * where the check finds every maximum itself. */
static void test_found_maxima(void **state) {
    (void)state;
    dc_test_rng r;
    dc_test_rng_seed(&r, 4242);
    for (int mode = 0; mode < 6; mode++) {
        set m;
        set_make(&m, &r, DC_BF16);
        dc_step hs, ds;
        step_init(&hs, m.h, NL, NB, -1);
        step_init(&ds, m.d, NL, NB, 0);
        hs.noise_multiplier = ds.noise_multiplier = 2.0f;
        if (mode == 1) {
            hs.reduction = ds.reduction = DC_REDUCTION_MEAN;
            hs.expected_batch = ds.expected_batch = 8;
        }
        static const char *const names[6] = {"sum",
                                             "mean",
                                             "sum, staged",
                                             "sum, exact draws",
                                             "sum, per layer",
                                             "sum, two blocks a pass"};
        printf("%s\n", names[mode]);
        set_switches(1, mode != 4);
        g_opts.one_pass = mode != 2;
        if (mode == 3) g_opts.noise = DCC_NOISE_EXACT;
        if (mode == 5) g_opts.out_blocks = 2; /* many chunks a block, found outputs jumped */
        apply_switches();
        dc_step_result rh, rd;
        dc_err eh, ed;
        assert_int_equal(run(g_cpu, &hs, &rh, &eh), 0);
        int rc = run(g_cuda, &ds, &rd, &ed);
        if (rc) fprintf(stderr, "cuda: %s: %s\n", ed.field, ed.msg);
        assert_int_equal(rc, 0);
        assert_int_equal(dc_cuda_backend_amax_found(g_cuda), mode == 4 ? 0 : FOUND);
        for (int l = 0; l < NL; l++)
            for (int k = 0; k < 2; k++) {
                const dc_tensor *ho = k ? &m.h[l].bias_grad_out : &m.h[l].weight_grad_out;
                if (!ho->data) continue;
                float *got = dev_to_f32(out_of(&m, l, k)), *want = host_to_f32(ho);
                double e = rel_l2(got, want, numel(ho));
                double tol = ho->dtype == DC_F32 ? 1e-4 : 2e-3;
                if (l == NL - 1) tol += TF32_RTOL; /* weight and bias of TF32 values */
                printf("  layer %d %s (%s): rel l2 err %.2e\n", l, k ? "bias" : "weight",
                       dc_dtype_name(ho->dtype), e);
                assert_true(e <= tol);
                free(got);
                free(want);
            }
        dc_step_result_free(&rh);
        dc_step_result_free(&rd);
        set_free(&m);
    }
    set_switches(1, 1);
}

/* Failures with the maxima found in the epilogue: nothing is written.
 * 0: one product past f16's range in the last element of layer 1's weight
 *    (its f16 output), in the last row and column tile, without clipping or
 *    noise: only that tile's maximum says the value cannot be written;
 * 1: a NaN in a grouped layer's grad (an input the norms catch);
 * 2: noise that no f16 output can hold (layer 2's weight).
 * 0 and 1 again with the grouped sums written directly whatever their
 * bound (DCC_DIRECT_ALWAYS): 0's check launch finds the value, 1's launches
 * see the failed status, and neither writes. */
static void test_failures_write_nothing(void **state) {
    (void)state;
    dc_test_rng r;
    dc_test_rng_seed(&r, 777);
    for (int which = 0; which < 8; which++) {
        /* 3-5: the same on two blocks a pass (many chunks each) */
        const bool force = which >= 6;
        set_switches(1, 1);
        g_opts.out_blocks = which < 3 || force ? 0 : 2;
        if (force) g_opts.bk_direct = DCC_DIRECT_ALWAYS;
        apply_switches();
        const int w = force ? which - 6 : which % 3;
        set m;
        set_make(&m, &r, w == 0 ? DC_F16 : DC_BF16);
        dc_step ds;
        step_init(&ds, m.d, NL, NB, 0);
        const char *field = "weight_grad_out";
        int bad_layer = 1;
        /* sample 3, row 41, the last feature of layer 1; sample 3, row 0,
         * feature 17 of layer 0 */
        const int64_t T = kSpecs[1].T, d = kSpecs[1].d, p = kSpecs[1].p;
        const size_t gi = (size_t)((3 * T + 41) * p + p - 1);
        const size_t ai = (size_t)((3 * T + 41) * d + d - 1);
        const size_t ni = (size_t)(3 * kSpecs[0].T * kSpecs[0].p + 17);
        if (w == 0) {
            ds.max_grad_norm = 1e30f; /* no clipping: 400 * 400 lands whole */
            plant(&m.h[1].grad, &m.d[1].grad, gi, 400.0f);
            plant(&m.h[1].input, &m.d[1].input, ai, 400.0f);
        } else if (w == 1) {
            plant(&m.h[0].grad, &m.d[0].grad, ni, NAN);
            field = "output_grad";
            bad_layer = 0;
        } else {
            ds.noise_multiplier = 1e7f; /* std 1e7 */
            bad_layer = 2;
        }
        outputs_fill(m.d, NL, 3.0f);
        dc_step_result res;
        dc_err err;
        int rc = run(g_cuda, &ds, &res, &err);
        printf("failure %d%s: %s: %s\n", w,
               force       ? " (direct)"
               : which < 3 ? ""
                           : " (two blocks a pass)",
               err.field, err.msg);
        assert_int_equal(rc, DC_ENONFINITE);
        if (force) assert_int_equal(dc_cuda_backend_direct_layers(g_cuda), 3);
        assert_non_null(strstr(err.field, field));
        assert_non_null(strstr(err.field, m.h[bad_layer].name));
        assert_outputs_hold(m.d, NL, 3.0f);
        dc_step_result_free(&res);
        /* the backend serves the next step */
        ds.max_grad_norm = 1.0f;
        ds.noise_multiplier = 0.5f;
        if (w == 0) plant(&m.h[1].grad, &m.d[1].grad, gi, 0.0f);
        if (w == 1) plant(&m.h[0].grad, &m.d[0].grad, ni, 0.0f);
        rc = run(g_cuda, &ds, &res, &err);
        if (rc) fprintf(stderr, "cuda: %s: %s\n", err.field, err.msg);
        assert_int_equal(rc, 0);
        dc_step_result_free(&res);
        set_free(&m);
    }
}

/* dcc_out_commit where the output check chose mode 1 (the outputs written
 * as they were made) and the step then failed, as a direct sum that read a
 * client's buffers rewritten since the check fails it: with zero_on_fail
 * every output is zeros, whichever pass wrote it, as in mode 0; without, and
 * in a mode-1 step that succeeded, the commit writes nothing. Two outputs
 * (f32 over several chunks, bf16 in part of one), on 1 and 3 blocks. */
static void test_commit_of_failed_direct_writes(void **state) {
    (void)state;
    const uint64_t n[2] = {2 * DCC_OUT_CHUNK + 77, 300};
    const dc_dtype dt[2] = {DC_F32, DC_BF16};
    dcc_out h[2];
    void *dst[2];
    memset(h, 0, sizeof h);
    for (int o = 0; o < 2; o++) {
        assert_int_equal(cudaMalloc(&dst[o], n[o] * dc_dtype_size(dt[o])), cudaSuccess);
        h[o].dst = dst[o];
        h[o].n = n[o];
        h[o].dtype = dt[o];
        h[o].chunk0 = o == 0 ? 0 : dcc_out_chunks(n[0]);
        h[o].noised = (uint32_t)o; /* the kept sum's output: the same */
        h[o].unstaged = (uint32_t)o;
        h[o].nz_hi = UINT64_MAX;
    }
    const uint64_t chunks = dcc_out_chunks(n[0]) + dcc_out_chunks(n[1]);
    dcc_out *douts;
    uint32_t *words; /* mode, status */
    float *staging;
    assert_int_equal(cudaMalloc((void **)&douts, sizeof h), cudaSuccess);
    assert_int_equal(cudaMemcpy(douts, h, sizeof h, cudaMemcpyHostToDevice), cudaSuccess);
    assert_int_equal(cudaMalloc((void **)&words, 2 * sizeof *words), cudaSuccess);
    assert_int_equal(cudaMalloc((void **)&staging, (n[0] + n[1]) * sizeof *staging), cudaSuccess);
    for (int blocks = 1; blocks <= 3; blocks += 2)
        for (int c = 0; c < 3; c++) {
            /* c 0: failed, zero_on_fail; 1: failed without; 2: succeeded */
            const uint32_t w[2] = {1u, c == 2 ? 0u : DCC_STATUS_OUTPUT};
            const bool zeroed = c == 0;
            for (int o = 0; o < 2; o++) /* 0x40 bytes: f32 3.0, bf16 2.0 */
                assert_int_equal(cudaMemset(dst[o], 0x40, n[o] * dc_dtype_size(dt[o])),
                                 cudaSuccess);
            assert_int_equal(cudaMemcpy(words, w, sizeof w, cudaMemcpyHostToDevice), cudaSuccess);
            unsigned grid;
            assert_int_equal(dcc_out_grid(chunks, blocks, &grid), cudaSuccess);
            assert_int_equal(dcc_out_commit(douts, 2, grid, staging, &words[0], &words[1], c == 0,
                                            0),
                             cudaSuccess);
            assert_int_equal(cudaDeviceSynchronize(), cudaSuccess);
            for (int o = 0; o < 2; o++) {
                const size_t bytes = n[o] * dc_dtype_size(dt[o]);
                unsigned char *got = malloc(bytes);
                assert_non_null(got);
                assert_int_equal(cudaMemcpy(got, dst[o], bytes, cudaMemcpyDeviceToHost),
                                 cudaSuccess);
                size_t wrong = 0;
                for (size_t i = 0; i < bytes; i++) wrong += got[i] != (zeroed ? 0 : 0x40);
                if (wrong)
                    fprintf(stderr, "case %d, %d blocks, output %d: %zu bytes wrong\n", c, blocks,
                            o, wrong);
                assert_int_equal(wrong, 0);
                free(got);
            }
        }
    for (int o = 0; o < 2; o++) cudaFree(dst[o]);
    cudaFree(douts);
    cudaFree(words);
    cudaFree(staging);
}

/* The grouped book-keeping sums written straight into the outputs, noised
 * in the kernel's epilogue (dcc_linear_clipped_direct), against the same
 * step staged (DCC_DIRECT_OFF): the same sums, draws and roundings, so the
 * values agree to what two runs of one path may differ by (differ: the
 * norms are added atomically, and so are the TF32 layer's sums), most of
 * them bit for bit: a sum, means by
 * a power of two and by 6, exact draws; then forced direct where layer 1's
 * f16 output has no bound that fits (no clipping: the output check's mode
 * 0, so the check launch and then the commit launch make the sums), which
 * writes what the staged step writes. The outputs are refilled between the
 * runs, so that every value compared was written by the run. */
static void test_direct_matches_staged(void **state) {
    (void)state;
    dc_test_rng r;
    dc_test_rng_seed(&r, 9090);
    static const char *const names[5] = {"sum", "mean by 8", "mean by 6", "exact draws",
                                         "forced, mode 0"};
    for (int mode = 0; mode < 5; mode++) {
        set m;
        set_make(&m, &r, mode == 4 ? DC_F16 : DC_BF16);
        dc_step ds;
        step_init(&ds, m.d, NL, NB, 0);
        ds.noise_multiplier = mode == 4 ? 0.0f : 2.0f;
        if (mode == 1 || mode == 2) {
            ds.reduction = DC_REDUCTION_MEAN;
            ds.expected_batch = mode == 1 ? 8 : 6;
        }
        if (mode == 4) ds.max_grad_norm = 1e30f; /* 2 B C: past f16 */
        float *want[NL][2] = {{NULL}}, norms[NB];
        long exact = 0, total = 0, bad = 0;
        for (int direct = 0; direct < 2; direct++) {
            set_switches(1, 1);
            if (mode == 3) g_opts.noise = DCC_NOISE_EXACT;
            g_opts.bk_direct = !direct     ? DCC_DIRECT_OFF
                               : mode == 4 ? DCC_DIRECT_ALWAYS
                                           : DCC_DIRECT_AUTO;
            apply_switches();
            outputs_fill(m.d, NL, direct ? -7.0f : 5.0f);
            dc_step_result res;
            dc_err err;
            int rc = run(g_cuda, &ds, &res, &err);
            if (rc) fprintf(stderr, "cuda: %s: %s\n", err.field, err.msg);
            assert_int_equal(rc, 0);
            assert_int_equal(dc_cuda_backend_direct_layers(g_cuda), direct ? 3 : 0);
            for (int b = 0; b < NB; b++) {
                if (!direct) norms[b] = res.norms[b];
                assert_true(fabsf(res.norms[b] - norms[b]) <= 1e-6f * norms[b]);
            }
            /* the noise's scale, which the tolerance is relative to near 0 */
            const double scale = ds.noise_multiplier * ds.max_grad_norm /
                                 (ds.reduction == DC_REDUCTION_MEAN ? ds.expected_batch : 1);
            for (int l = 0; l < NL; l++)
                for (int k = 0; k < 2; k++) {
                    const dc_tensor *t = out_of(&m, l, k);
                    if (!t->data) continue;
                    float *v = dev_to_f32(t);
                    if (!direct) {
                        want[l][k] = v;
                        continue;
                    }
                    /* no noise (mode 4): near 0, relative to the output's
                     * largest value (the TF32 layer's sums are atomic) */
                    double big = 0.0;
                    for (int64_t i = 0; mode == 4 && i < numel(t); i++)
                        big = fmax(big, fabs(want[l][k][i]));
                    bad += differ(want[l][k], v, numel(t), t->dtype, mode == 4 ? big : scale,
                                  &exact);
                    total += numel(t);
                    free(v);
                    free(want[l][k]);
                }
            dc_step_result_free(&res);
        }
        printf("%s: %ld values, %ld bit-equal to the staged step's, %ld beyond its roundings\n",
               names[mode], total, exact, bad);
        assert_true(total > 0);
        assert_int_equal(bad, 0);
        set_free(&m);
    }
    set_switches(1, 1);
}

/* What the direct sums save: a fresh instance's workspace after one step of
 * a 1024 x 1024 grouped layer (4 MiB of f32 staging for its weight), with
 * and without them. */
static void test_direct_needs_no_staging(void **state) {
    (void)state;
    dc_test_rng r;
    dc_test_rng_seed(&r, 31);
    const dc_test_layer_spec sp = {DC_LAYER_LINEAR, 2, 64,           1024, 1024,
                                   DC_BF16,         1, DC_ALGO_AUTO, 1,    0};
    dc_layer h, d;
    dc_test_layer_make(&h, &sp, &r);
    d = dev_layer(&h);
    size_t held[2];
    for (int direct = 0; direct < 2; direct++) {
        dc_backend *be = NULL;
        dc_err err;
        assert_int_equal(dc_cuda_backend_create(0, &be, &err), 0);
        assert_int_equal(dc_cuda_backend_set_workspace(be, 0, 0, &err), 0);
        dcc_options o = g_opts;
        o.bk_direct = direct ? DCC_DIRECT_AUTO : DCC_DIRECT_OFF;
        dc_cuda_backend_set_options(be, &o);
        dc_step s;
        step_init(&s, &d, 1, 2, 0);
        s.noise_multiplier = 1.0f;
        dc_step_result res;
        assert_int_equal(run(be, &s, &res, &err), 0);
        assert_int_equal(dc_cuda_backend_direct_layers(be), direct);
        dc_step_result_free(&res);
        held[direct] = dc_cuda_backend_workspace_bytes(be);
        dc_backend_destroy(be);
    }
    printf("workspace: %zu bytes staged, %zu direct\n", held[0], held[1]);
    /* 4 MiB less, but for the quarter of margin and the 2 MiB rounding of
     * what reserve() holds */
    assert_true(held[1] + ((size_t)3 << 20) <= held[0]);
    dev_layer_free(&d);
    dc_test_layer_free(&h);
}

int main(void) {
    if (cuda_test_skip()) return DC_TEST_SKIP;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_found_maxima),
        cmocka_unit_test(test_failures_write_nothing),
        cmocka_unit_test(test_commit_of_failed_direct_writes),
        cmocka_unit_test(test_direct_matches_staged),
        cmocka_unit_test(test_direct_needs_no_staging),
    };
    return cmocka_run_group_tests(tests, cuda_test_setup_gpu_bounds, cuda_test_teardown);
}
