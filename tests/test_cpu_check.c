/* cpu_check.c: the data checks before any arithmetic. Non-finite values of
 * each float dtype are found at their first position (across scan blocks),
 * finite extremes pass, and a refused layer names its field, sample,
 * position and feature; embedding indices are copied into daemon memory
 * and range-checked there, for both index types. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "cpu.h"
#include "ref.h"

/* Past one scan block (1024 values), so that a block's fast test and the
 * search for the exact position are both exercised. */
#define N_VALUES 3000

static const dc_dtype float_dtypes[] = {DC_F32, DC_BF16, DC_F16};

/* n ones of dtype t. */
static void *ones(dc_dtype t, size_t n) {
    void *p = calloc(n, t == DC_F32 ? 4 : 2);
    assert_non_null(p);
    for (size_t i = 0; i < n; i++) dc_store_f32(p, t, i, 1.0f);
    return p;
}

static void store_bits16(void *p, size_t i, uint16_t bits) { ((uint16_t *)p)[i] = bits; }

static void test_find_each_dtype(void **state) {
    (void)state;
    for (size_t k = 0; k < sizeof float_dtypes / sizeof float_dtypes[0]; k++) {
        dc_dtype t = float_dtypes[k];
        void *p = ones(t, N_VALUES);
        assert_int_equal(dc_cpu_find_nonfinite(p, t, N_VALUES), -1);
        /* infinities of either sign and NaN, at positions in later blocks */
        const float bad[3] = {INFINITY, -INFINITY, NAN};
        const size_t at[3] = {2049, 1023, 1024};
        for (int j = 0; j < 3; j++) {
            dc_store_f32(p, t, at[j], bad[j]);
            assert_int_equal(dc_cpu_find_nonfinite(p, t, N_VALUES), (int64_t)at[j]);
            /* outside the n scanned values it is not seen */
            assert_int_equal(dc_cpu_find_nonfinite(p, t, at[j]), -1);
            dc_store_f32(p, t, at[j], 1.0f);
        }
        /* the first of two, even when the later one is in an earlier scan */
        dc_store_f32(p, t, 2500, NAN);
        dc_store_f32(p, t, 7, INFINITY);
        assert_int_equal(dc_cpu_find_nonfinite(p, t, N_VALUES), 7);
        free(p);
    }
}

/* The largest finite value, subnormals and negative zero of each dtype are
 * finite: only an all-ones exponent is refused. */
static void test_finite_extremes_pass(void **state) {
    float *f = ones(DC_F32, 8);
    uint16_t *h = ones(DC_F16, 8), *bf = ones(DC_BF16, 8);
    (void)state;
    f[0] = 3.4028234663852886e38f;
    f[1] = -3.4028234663852886e38f;
    f[2] = 1e-45f; /* subnormal */
    f[3] = -0.0f;
    assert_int_equal(dc_cpu_find_nonfinite(f, DC_F32, 8), -1);
    store_bits16(h, 0, 0x7bffu); /* 65504 */
    store_bits16(h, 1, 0xfbffu); /* -65504 */
    store_bits16(h, 2, 0x0001u); /* subnormal */
    store_bits16(h, 3, 0x8000u); /* -0 */
    assert_int_equal(dc_cpu_find_nonfinite(h, DC_F16, 8), -1);
    store_bits16(bf, 0, 0x7f7fu); /* bf16's largest */
    store_bits16(bf, 1, 0xff7fu);
    store_bits16(bf, 2, 0x0001u);
    assert_int_equal(dc_cpu_find_nonfinite(bf, DC_BF16, 8), -1);
    /* one step further is infinity: f16 0x7c00, bf16 0x7f80 */
    store_bits16(h, 5, 0x7c00u);
    assert_int_equal(dc_cpu_find_nonfinite(h, DC_F16, 8), 5);
    store_bits16(bf, 6, 0x7f80u);
    assert_int_equal(dc_cpu_find_nonfinite(bf, DC_BF16, 8), 6);
    /* a quiet NaN with payload bits */
    store_bits16(bf, 6, 0x3f80u);
    store_bits16(bf, 4, 0xffc1u);
    assert_int_equal(dc_cpu_find_nonfinite(bf, DC_BF16, 8), 4);
    free(f);
    free(h);
    free(bf);
}

/* A layer of `kind` (B = 3, T = 4, d = 5, p = 6). */
static void make_layer(dc_layer *l, dc_layer_kind kind, dc_dtype t, uint64_t seed) {
    dc_test_rng r;
    dc_test_layer_spec sp = {kind, 3, 4, 5, 6, t, 1, DC_ALGO_AUTO, 0, 0};
    dc_test_rng_seed(&r, seed);
    dc_test_layer_make(l, &sp, &r);
}

static void test_linear_refusals(void **state) {
    (void)state;
    for (size_t k = 0; k < sizeof float_dtypes / sizeof float_dtypes[0]; k++) {
        dc_layer l, safe;
        dc_err e;
        make_layer(&l, DC_LAYER_LINEAR, float_dtypes[k], 1 + k);
        snprintf(l.name, sizeof l.name, "fc1");
        assert_int_equal(dc_cpu_check_layer(&l, 3, &safe, NULL, &e), 0);
        /* a clean linear layer is read in place */
        assert_ptr_equal(safe.input.data, l.input.data);
        assert_ptr_equal(safe.grad.data, l.grad.data);

        /* activations [3, 4, 5]: sample 1, position 2, feature 3 */
        dc_store_f32(l.input.data, l.input.dtype, (1 * 4 + 2) * 5 + 3, INFINITY);
        assert_int_equal(dc_cpu_check_layer(&l, 3, &safe, NULL, &e), DC_ENONFINITE);
        assert_int_equal(e.code, DC_ENONFINITE);
        assert_string_equal(e.field, "fc1.activations");
        assert_non_null(strstr(e.msg, "non-finite value inf in activations of sample 1 "
                                      "(position 2, feature 3)"));
        dc_store_f32(l.input.data, l.input.dtype, (1 * 4 + 2) * 5 + 3, 0.5f);

        /* output_grad [3, 4, 6]: the last sample's last value */
        dc_store_f32(l.grad.data, l.grad.dtype, 3 * 4 * 6 - 1, NAN);
        assert_int_equal(dc_cpu_check_layer(&l, 3, &safe, NULL, &e), DC_ENONFINITE);
        assert_string_equal(e.field, "fc1.output_grad");
        assert_non_null(strstr(e.msg, "of sample 2 (position 3, feature 5)"));
        /* a batch that stops before the bad sample does not see it */
        assert_int_equal(dc_cpu_check_layer(&l, 2, &safe, NULL, &e), 0);
        dc_test_layer_free(&l);
    }
}

static void test_norm_layer_refusals(void **state) {
    const dc_layer_kind kinds[2] = {DC_LAYER_LAYERNORM, DC_LAYER_RMSNORM};
    (void)state;
    for (int k = 0; k < 2; k++) {
        dc_layer l, safe;
        dc_err e;
        make_layer(&l, kinds[k], DC_BF16, 10 + (uint64_t)k);
        snprintf(l.name, sizeof l.name, "norm");
        assert_int_equal(dc_cpu_check_layer(&l, 3, &safe, NULL, &e), 0);
        dc_store_f32(l.input.data, l.input.dtype, 0, -INFINITY);
        assert_int_equal(dc_cpu_check_layer(&l, 3, &safe, NULL, &e), DC_ENONFINITE);
        assert_string_equal(e.field, "norm.input");
        assert_non_null(strstr(e.msg, "-inf in input of sample 0 (position 0, feature 0)"));
        dc_store_f32(l.input.data, l.input.dtype, 0, 1.0f);
        dc_store_f32(l.grad.data, l.grad.dtype, 4 * 5 + 1, NAN);
        assert_int_equal(dc_cpu_check_layer(&l, 3, &safe, NULL, &e), DC_ENONFINITE);
        assert_string_equal(e.field, "norm.output_grad");
        assert_non_null(strstr(e.msg, "of sample 1 (position 0, feature 1)"));
        dc_test_layer_free(&l);
    }
}

static void set_index(dc_tensor *t, size_t i, int64_t v) {
    if (t->dtype == DC_I32) ((int32_t *)t->data)[i] = (int32_t)v;
    else ((int64_t *)t->data)[i] = v;
}

/* An embedding of vocab 6 with indices of type it: index (b*4 + t) % 6. */
static void make_embedding(dc_layer *l, dc_dtype it) {
    make_layer(l, DC_LAYER_EMBEDDING, DC_F32, 20);
    snprintf(l->name, sizeof l->name, "tok");
    dc_test_tensor_free(&l->input);
    l->input = dc_test_tensor_new(it, 2, 3, 4, 0);
    l->has_padding_idx = false;
    for (size_t i = 0; i < 12; i++) set_index(&l->input, i, (int64_t)(i % 6));
}

static void test_embedding_indices(void **state) {
    const dc_dtype its[2] = {DC_I32, DC_I64};
    (void)state;
    for (int k = 0; k < 2; k++) {
        dc_layer l, safe;
        dc_err e;
        int64_t idx[12];
        make_embedding(&l, its[k]);
        assert_int_equal(l.vocab, 6);

        /* the checked copy is what the later phases read, as i64 */
        memset(idx, 0xff, sizeof idx);
        assert_int_equal(dc_cpu_check_layer(&l, 3, &safe, idx, &e), 0);
        assert_ptr_equal(safe.input.data, idx);
        assert_int_equal(safe.input.dtype, DC_I64);
        assert_ptr_equal(safe.grad.data, l.grad.data);
        for (int64_t i = 0; i < 12; i++) assert_int_equal(idx[i], i % 6);

        /* one past the vocabulary: sample 2, position 1 */
        set_index(&l.input, 2 * 4 + 1, 6);
        assert_int_equal(dc_cpu_check_layer(&l, 3, &safe, idx, &e), DC_EINVAL);
        assert_string_equal(e.field, "tok.indices");
        assert_non_null(strstr(e.msg, "index 6 of sample 2 (position 1) is outside [0, 6)"));
        /* negative */
        set_index(&l.input, 2 * 4 + 1, 0);
        set_index(&l.input, 3, -1);
        assert_int_equal(dc_cpu_check_layer(&l, 3, &safe, idx, &e), DC_EINVAL);
        assert_non_null(strstr(e.msg, "index -1 of sample 0 (position 3)"));
        set_index(&l.input, 3, 5);

        /* the indices are checked before the output grads */
        dc_store_f32(l.grad.data, l.grad.dtype, 5, NAN);
        assert_int_equal(dc_cpu_check_layer(&l, 3, &safe, idx, &e), DC_ENONFINITE);
        assert_string_equal(e.field, "tok.output_grad");
        set_index(&l.input, 0, 99);
        assert_int_equal(dc_cpu_check_layer(&l, 3, &safe, idx, &e), DC_EINVAL);
        assert_string_equal(e.field, "tok.indices");
        dc_test_layer_free(&l);
    }
}

/* An index of i64 that an i32 copy would wrap into range is still refused. */
static void test_wide_index_not_truncated(void **state) {
    dc_layer l, safe;
    dc_err e;
    int64_t idx[12];
    (void)state;
    make_embedding(&l, DC_I64);
    set_index(&l.input, 4, ((int64_t)1 << 32) + 1);
    assert_int_equal(dc_cpu_check_layer(&l, 3, &safe, idx, &e), DC_EINVAL);
    assert_non_null(strstr(e.msg, "index 4294967297 of sample 1 (position 0)"));
    dc_test_layer_free(&l);
}

static void test_unknown_kind(void **state) {
    dc_layer l, safe;
    dc_err e;
    (void)state;
    make_layer(&l, DC_LAYER_LINEAR, DC_F32, 30);
    snprintf(l.name, sizeof l.name, "odd");
    l.kind = (dc_layer_kind)9;
    assert_int_equal(dc_cpu_check_layer(&l, 3, &safe, NULL, &e), DC_EINVAL);
    assert_string_equal(e.field, "odd");
    assert_non_null(strstr(e.msg, "unknown layer kind 9"));
    l.kind = DC_LAYER_LINEAR;
    dc_test_layer_free(&l);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_find_each_dtype),   cmocka_unit_test(test_finite_extremes_pass),
        cmocka_unit_test(test_linear_refusals),   cmocka_unit_test(test_norm_layer_refusals),
        cmocka_unit_test(test_embedding_indices), cmocka_unit_test(test_wide_index_not_truncated),
        cmocka_unit_test(test_unknown_kind),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
