/* noise.c: Philox4x32-10 against the published known-answer vectors, the
 * statistics of the normals, reproducibility, and the noise a whole step adds. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "backend.h"
#include "noise.h"
#include "ref.h"

/* Random123's kat_vectors, "philox4x32 10" lines: counter, key, expected. */
static void test_philox_known_answers(void **state) {
    (void)state;
    static const uint32_t kat[3][10] = {
        {0, 0, 0, 0, 0, 0, 0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8},
        {0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff, 0x408f276d,
         0x41c83b0e, 0xa20bc7c6, 0x6d5451fd},
        {0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344, 0xa4093822, 0x299f31d0, 0xd16cfe09,
         0x94fdcceb, 0x5001e420, 0x24126ea1},
    };
    for (int i = 0; i < 3; i++) {
        uint32_t out[4];
        dc_philox4x32_10(kat[i], kat[i] + 4, out);
        for (int j = 0; j < 4; j++) assert_int_equal(out[j], kat[i][6 + j]);
    }
}

/* One million draws: mean, variance, kurtosis, the one-sigma fraction and
 * the lag-one correlation (Box-Muller pairs) within 5 standard errors. */
static void test_normal_statistics(void **state) {
    (void)state;
    const size_t n = 1000000;
    float *z = malloc(n * sizeof *z);
    assert_non_null(z);
    dc_noise_normal(0x0123456789abcdefull, 42, 3, z, n);
    double m1 = 0, m2 = 0, m4 = 0, lag = 0, within = 0, mx = 0;
    for (size_t i = 0; i < n; i++) {
        double x = z[i];
        m1 += x;
        m2 += x * x;
        m4 += x * x * x * x;
        within += fabs(x) < 1.0;
        mx = fmax(mx, fabs(x));
        if (i + 1 < n) lag += x * (double)z[i + 1];
    }
    m1 /= (double)n;
    m2 /= (double)n;
    m4 /= (double)n;
    lag /= (double)(n - 1);
    within /= (double)n;
    double sn = sqrt((double)n);
    assert_true(fabs(m1) < 5.0 / sn);
    assert_true(fabs(m2 - 1.0) < 5.0 * sqrt(2.0) / sn);  /* Var(z^2) = 2 */
    assert_true(fabs(m4 - 3.0) < 5.0 * sqrt(96.0) / sn); /* Var(z^4) = 105 - 9 */
    assert_true(fabs(lag) < 5.0 / sn);
    double p1 = 0.682689492137086;
    assert_true(fabs(within - p1) < 5.0 * sqrt(p1 * (1 - p1)) / sn);
    assert_true(mx > 3.5 && mx < 8.6); /* tails exist and are bounded by 53-bit uniforms */
    free(z);
}

static void test_reproducible_and_distinct(void **state) {
    (void)state;
    enum { N = 4097 };
    float *a = malloc(N * sizeof *a), *b = malloc(N * sizeof *b), *c = malloc(N * sizeof *c);
    assert_true(a && b && c);
    dc_noise_normal(7, 100, 0, a, N);
    dc_noise_normal(7, 100, 0, b, N);
    assert_memory_equal(a, b, N * sizeof *a);
    /* a prefix is the same whatever n is: values depend on (key, step, stream, i) only */
    dc_noise_normal(7, 100, 0, c, 7);
    assert_memory_equal(a, c, 7 * sizeof *a);
    const struct {
        uint64_t key, step;
        uint32_t stream;
    } other[] = {{7, 101, 0}, {7, 100, 1}, {8, 100, 0}, {7, 100ull | (1ull << 40), 0}};
    for (size_t k = 0; k < sizeof other / sizeof *other; k++) {
        dc_noise_normal(other[k].key, other[k].step, other[k].stream, c, N);
        size_t same = 0;
        for (size_t i = 0; i < N; i++) same += a[i] == c[i];
        assert_true(same < 4); /* independent streams: essentially no equal values */
    }
    /* add_normal adds std times the same values */
    for (size_t i = 0; i < N; i++) c[i] = 1.0f;
    dc_noise_add_normal(7, 100, 0, 0.25f, c, N);
    for (size_t i = 0; i < N; i++) assert_true(c[i] == 1.0f + 0.25f * a[i]);
    dc_noise_add_normal(7, 100, 0, 0.0f, c, N); /* std 0: untouched */
    for (size_t i = 0; i < N; i++) assert_true(c[i] == 1.0f + 0.25f * a[i]);
    free(a);
    free(b);
    free(c);
}

static void test_seed(void **state) {
    (void)state;
    uint64_t k1 = 0, k2 = 0;
    assert_int_equal(dc_noise_seed(&k1), 0);
    assert_int_equal(dc_noise_seed(&k2), 0);
    assert_true(k1 != k2); /* 2^-64 chance of a false failure */
}

/* A Linear layer whose output grads are all zero: its clipped sum is 0, so
 * the output is pure noise with std sigma * C / expected_batch. */
typedef struct noise_run {
    float *w;
    size_t n;
} noise_run;

static noise_run run_zero_grad(dc_clip_mode mode, float sigma, uint64_t key, uint64_t nstep,
                               uint32_t expected) {
    dc_test_layer_spec sp = {DC_LAYER_LINEAR, 4, 3, 256, 256, DC_F32, 1, DC_ALGO_AUTO, 1, 0};
    dc_test_rng r;
    dc_layer l[2];
    dc_backend *be;
    dc_err e;
    dc_step_result res;
    dc_test_rng_seed(&r, 1);
    dc_test_layer_make(&l[0], &sp, &r);
    sp.d = sp.p = 8;
    dc_test_layer_make(&l[1], &sp, &r); /* second layer: its C_l counts in PER_LAYER */
    memset(l[0].grad.data, 0, (size_t)dc_test_tensor_numel(&l[0].grad) * sizeof(float));
    l[0].max_grad_norm = 3.0f;
    l[1].max_grad_norm = 4.0f;
    dc_step s = {.batch = 4,
                 .n_layers = 2,
                 .layers = l,
                 .mode = mode,
                 .max_grad_norm = 2.0f,
                 .reduction = expected ? DC_REDUCTION_MEAN : DC_REDUCTION_SUM,
                 .expected_batch = expected ? expected : 4,
                 .noise_multiplier = sigma,
                 .noise_key = key,
                 .noise_step = nstep,
                 .device = -1};
    assert_int_equal(dc_cpu_backend_create(1, &be, &e), 0);
    assert_int_equal(dc_step_result_init(&res, 4, 2, mode == DC_CLIP_PER_LAYER), 0);
    assert_int_equal(dc_backend_run_step(be, &s, &res, &e), 0);
    noise_run out;
    out.n = 256 * 256 + 256;
    out.w = malloc(out.n * sizeof *out.w);
    assert_non_null(out.w);
    memcpy(out.w, l[0].weight_grad_out.data, 256 * 256 * sizeof(float));
    memcpy(out.w + 256 * 256, l[0].bias_grad_out.data, 256 * sizeof(float));
    dc_step_result_free(&res);
    dc_backend_destroy(be);
    dc_test_layer_free(&l[0]);
    dc_test_layer_free(&l[1]);
    return out;
}

static void check_std(const noise_run *r, double want) {
    double m1 = 0, m2 = 0;
    for (size_t i = 0; i < r->n; i++) {
        m1 += r->w[i];
        m2 += (double)r->w[i] * r->w[i];
    }
    m1 /= (double)r->n;
    m2 /= (double)r->n;
    double sn = sqrt((double)r->n);
    assert_true(fabs(m1) < 5.0 * want / sn);
    assert_true(fabs(m2 / (want * want) - 1.0) < 5.0 * sqrt(2.0) / sn);
}

static void test_step_noise(void **state) {
    (void)state;
    /* FLAT, SUM: std = sigma * C */
    noise_run a = run_zero_grad(DC_CLIP_FLAT, 0.7f, 99, 1, 0);
    check_std(&a, 0.7 * 2.0);
    /* FLAT, MEAN with expected_batch 16: std = sigma * C / 16 */
    noise_run b = run_zero_grad(DC_CLIP_FLAT, 0.7f, 99, 1, 16);
    check_std(&b, 0.7 * 2.0 / 16.0);
    /* same key and step: the same draw, scaled */
    for (size_t i = 0; i < a.n; i++) assert_true(b.w[i] * 16.0f == a.w[i]); /* /16 is exact */
    /* PER_LAYER: C = sqrt(3^2 + 4^2) = 5 */
    noise_run c = run_zero_grad(DC_CLIP_PER_LAYER, 0.7f, 99, 1, 0);
    check_std(&c, 0.7 * 5.0);
    /* next step: different noise; sigma 0: exactly zero */
    noise_run d = run_zero_grad(DC_CLIP_FLAT, 0.7f, 99, 2, 0);
    size_t same = 0;
    for (size_t i = 0; i < a.n; i++) same += a.w[i] == d.w[i];
    assert_true(same < 4);
    noise_run z = run_zero_grad(DC_CLIP_FLAT, 0.0f, 99, 3, 0);
    for (size_t i = 0; i < z.n; i++) assert_true(z.w[i] == 0.0f);
    /* weight and bias use different streams */
    for (size_t i = 0; i < 256; i++) assert_true(a.w[i] != a.w[256 * 256 + i]);
    free(a.w);
    free(b.w);
    free(c.w);
    free(d.w);
    free(z.w);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_philox_known_answers),
        cmocka_unit_test(test_normal_statistics),
        cmocka_unit_test(test_reproducible_and_distinct),
        cmocka_unit_test(test_seed),
        cmocka_unit_test(test_step_noise),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
