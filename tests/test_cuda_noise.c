/* The noise ahead (cuda/clip.cu dcc_noise_ahead, grouped_tma.cu): the
 * outputs of the grouped clipped sum get their draws on a second stream
 * while the norms run, and the sum is added onto them in the kernel's
 * epilogue. Checked against the CPU backend (the same draws: a missing or
 * doubled noise misses its outputs by far more than the bounds), and bit
 * for bit against the same step with every draw left to the output pass
 * (but for subnormals, which the f32 reduction flushes to zero); every
 * other output (an f32 layer's, outside the grouped launch) still drawn by
 * the pass, to within its sums' atomic order. Failures with the noise ahead write nothing. Error bounds: see
 * test_cuda_kernels.c. Without a CUDA device the test prints "SKIP: no
 * CUDA device" and exits DC_TEST_SKIP (77). */
#include <float.h>
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

enum { NL = 4, NB = 5 };

/* Grouped: bf16 with bias, bf16 without (a bf16 output, ragged tiles), f16
 * with bias; not grouped: f32 (TF32 kernels, noise by the output pass). */
static const dc_test_layer_spec kSpecs[NL] = {
    {DC_LAYER_LINEAR, NB, 96, 64, 40, DC_BF16, 1, DC_ALGO_DIRECT, 1, 0},
    {DC_LAYER_LINEAR, NB, 70, 136, 264, DC_BF16, 0, DC_ALGO_AUTO, 1, 0},
    {DC_LAYER_LINEAR, NB, 64, 72, 48, DC_F16, 1, DC_ALGO_AUTO, 1, 0},
    {DC_LAYER_LINEAR, NB, 80, 32, 24, DC_F32, 1, DC_ALGO_AUTO, 1, 0},
};
enum { AHEAD_OUTPUTS = 5 }; /* layers 0-2: weights and biases */

typedef struct set {
    dc_layer h[NL], d[NL];
} set;

static void set_make(set *m, dc_test_rng *r, dc_dtype out1, dc_dtype out2) {
    for (int l = 0; l < NL; l++) {
        dc_test_layer_make(&m->h[l], &kSpecs[l], r);
        m->h[l].max_grad_norm = 0.05f;
    }
    const dc_dtype want[2] = {out1, out2};
    for (int k = 0; k < 2; k++) { /* other output dtypes than f32 */
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

/* Every device output as f32, [l][k] (NULL where there is none). */
static void snapshot(set *m, float *got[NL][2]) {
    for (int l = 0; l < NL; l++)
        for (int k = 0; k < 2; k++)
            got[l][k] = out_of(m, l, k)->data ? dev_to_f32(out_of(m, l, k)) : NULL;
}

static void poison(set *m, float v) {
    for (int l = 0; l < NL; l++)
        for (int k = 0; k < 2; k++) {
            dc_tensor *o = out_of(m, l, k);
            if (!o->data) continue;
            void *raw = malloc(tensor_bytes(o));
            assert_non_null(raw);
            for (int64_t i = 0; i < numel(o); i++) dc_store_f32(raw, o->dtype, (size_t)i, v);
            h2d(o->data, raw, tensor_bytes(o));
            free(raw);
        }
}

static void run_ok(dc_backend *be, const dc_step *s) {
    dc_step_result res;
    dc_err err;
    int rc = run(be, s, &res, &err);
    if (rc) fprintf(stderr, "%s: %s: %s\n", be == g_cpu ? "cpu" : "cuda", err.field, err.msg);
    assert_int_equal(rc, 0);
    dc_step_result_free(&res);
}

/* Against the CPU backend, then bit for bit against the output pass's draws:
 * a sum, a mean (the division after the noise), the staged outputs
 * (dcc_finalize), and the double-precision draws. */
static void test_noise_ahead_matches(void **state) {
    (void)state;
    dc_test_rng r;
    dc_test_rng_seed(&r, 4242);
    for (int mode = 0; mode < 5; mode++) {
        set m;
        set_make(&m, &r, DC_BF16, DC_F16);
        dc_step hs, ds;
        step_init(&hs, m.h, NL, NB, -1);
        step_init(&ds, m.d, NL, NB, 0);
        hs.noise_multiplier = ds.noise_multiplier = 2.0f;
        if (mode == 1) {
            hs.reduction = ds.reduction = DC_REDUCTION_MEAN;
            hs.expected_batch = ds.expected_batch = 8;
        }
        static const char *const names[5] = {"sum", "mean", "sum, staged", "sum, exact draws",
                                             "sum, beside the clipped sum"};
        printf("noise ahead: %s\n", names[mode]);
        set_switches(1, 1);
        g_opts.one_pass = mode != 2;
        g_opts.noise = mode == 3 ? DCC_NOISE_EXACT : DCC_NOISE_FAST;
        g_opts.ahead_at = mode == 4;
        apply_switches();
        run_ok(g_cpu, &hs);
        run_ok(g_cuda, &ds);
        assert_int_equal(dc_cuda_backend_noised_ahead(g_cuda), AHEAD_OUTPUTS);
        float *ahead[NL][2];
        snapshot(&m, ahead);
        for (int l = 0; l < NL; l++)
            for (int k = 0; k < 2; k++) {
                if (!ahead[l][k]) continue;
                const dc_tensor *ho = k ? &m.h[l].bias_grad_out : &m.h[l].weight_grad_out;
                float *want = host_to_f32(ho);
                double e = rel_l2(ahead[l][k], want, numel(ho));
                double tol = ho->dtype == DC_F32 ? 1e-4 : 2e-3;
                if (l == 3 && k == 0) tol += 2e-3; /* TF32 */
                printf("  layer %d %s (%s): rel l2 err %.2e\n", l, k ? "bias" : "weight",
                       dc_dtype_name(ho->dtype), e);
                assert_true(e <= tol);
                free(want);
            }
        g_opts.noise_ahead = false;
        apply_switches();
        poison(&m, 1536.0f);
        run_ok(g_cuda, &ds);
        assert_int_equal(dc_cuda_backend_noised_ahead(g_cuda), 0);
        float *pass[NL][2];
        snapshot(&m, pass);
        uint64_t same = 0, flushed = 0;
        for (int l = 0; l < NL; l++)
            for (int k = 0; k < 2; k++) {
                if (!ahead[l][k]) continue;
                if (l == NL - 1) { /* the pass's own; its sums add atomically */
                    assert_true(rel_l2(ahead[l][k], pass[l][k], numel(out_of(&m, l, k))) <= 1e-6);
                    free(ahead[l][k]);
                    free(pass[l][k]);
                    continue;
                }
                for (int64_t i = 0; i < numel(out_of(&m, l, k)); i++) {
                    float a = ahead[l][k][i], p = pass[l][k][i];
                    if (memcmp(&a, &p, sizeof a) == 0) {
                        same++;
                    } else { /* only a subnormal flushed to zero */
                        assert_true(fabsf(p) < FLT_MIN && fabsf(a) < FLT_MIN);
                        flushed++;
                    }
                }
                free(ahead[l][k]);
                free(pass[l][k]);
            }
        printf("  %llu values bit-identical to the output pass's, %llu subnormals apart\n",
               (unsigned long long)same, (unsigned long long)flushed);
        assert_true(same > 0);
        set_switches(1, 1);
        set_free(&m);
    }
}

/* With the noise ahead a failed step still writes nothing: a NaN in a grouped
 * layer's grad (an input the norms catch), and an ahead f16 output that
 * cannot hold the noise (the output check falls back to staging and finds it). */
static void test_noise_ahead_failures(void **state) {
    (void)state;
    dc_test_rng r;
    dc_test_rng_seed(&r, 777);
    for (int which = 0; which < 2; which++) {
        set m;
        set_make(&m, &r, DC_BF16, DC_F16);
        dc_step ds;
        step_init(&ds, m.d, NL, NB, 0);
        ds.noise_multiplier = which ? 1e7f : 2.0f; /* std 5e5: past f16's 65504 */
        const char *want;
        if (which == 0) {
            size_t i = (size_t)(3 * 96 * 40 + 17); /* sample 3 */
            uint16_t bits = 0x7fc0;                 /* a bf16 NaN */
            h2d((uint16_t *)m.d[0].grad.data + i, &bits, sizeof bits);
            want = "output_grad";
        } else {
            want = "weight_grad_out";
        }
        poison(&m, 3.0f);
        dc_step_result res;
        dc_err err;
        int rc = run(g_cuda, &ds, &res, &err);
        printf("noise ahead, failure %d: %s: %s\n", which, err.field, err.msg);
        assert_int_equal(rc, DC_ENONFINITE);
        assert_non_null(strstr(err.field, want));
        assert_non_null(strstr(err.field, which ? m.h[2].name : m.h[0].name));
        float *got[NL][2];
        snapshot(&m, got);
        for (int l = 0; l < NL; l++)
            for (int k = 0; k < 2; k++) {
                if (!got[l][k]) continue;
                for (int64_t i = 0; i < numel(out_of(&m, l, k)); i++)
                    assert_true(got[l][k][i] == 3.0f);
                free(got[l][k]);
            }
        dc_step_result_free(&res);
        set_free(&m);
    }
}

int main(void) {
    if (dc_cuda_device_count() == 0) {
        printf("SKIP: no CUDA device\n");
        return DC_TEST_SKIP;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_noise_ahead_matches),
        cmocka_unit_test(test_noise_ahead_failures),
    };
    return cmocka_run_group_tests(tests, cuda_test_setup, cuda_test_teardown);
}
