/* cuda/prims/dcc_util.cuh on the host (no GPU needed): the ghost form's tile-pair
 * decode over every index of small triangles and at the top of the range
 * the launchers allow (2^30 pairs), and the SM count, which is the
 * device's own or an error, never a guess. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

extern "C" { /* cmocka.h declares its C functions without extern "C" */
#include <cmocka.h>
}
#include <cuda_runtime_api.h>

#include "dcc_util.cuh"

/* idx decodes to the pair that numbers to it, inside the triangle. */
static void check_pair(int idx) {
    int ti = -1, si = -1;
    dcc_tri_pair(idx, &ti, &si);
    assert_true(ti >= 0 && si >= 0 && si <= ti);
    assert_true((int64_t)ti * (ti + 1) / 2 + si == idx);
}

static void test_tri_pair_small(void **state) {
    (void)state;
    /* row by row: (0,0) (1,0) (1,1) (2,0) ... */
    int idx = 0;
    for (int t = 0; t < 2048; t++)
        for (int s = 0; s <= t; s++, idx++) {
            int ti, si;
            dcc_tri_pair(idx, &ti, &si);
            assert_int_equal(ti, t);
            assert_int_equal(si, s);
        }
}

/* Where the float square root is coarse and (ti + 1) (ti + 2) passes
 * INT_MAX: the last rows below 2^30 pairs, and row starts and ends there. */
static void test_tri_pair_large(void **state) {
    (void)state;
    const int top = (1 << 30) - 1;
    for (int idx = top; idx > top - 200000; idx--) check_pair(idx);
    for (int64_t t = 40000; t * (t + 1) / 2 <= top; t += 7) {
        int64_t first = t * (t + 1) / 2;
        check_pair((int)first);
        if (first + t <= top) check_pair((int)(first + t));
        if (first > 0) check_pair((int)(first - 1));
    }
}

/* The wide items of nt row blocks: row by row, sj <= ti / 2, counted by
 * dcc_wide_count; each item's first pair is dcc_tri_pair's (ti, 2 sj), and
 * over samples they follow one another, pairs * B past the last. */
static void test_wide_pairs(void **state) {
    (void)state;
    for (int64_t nt = 1; nt <= 300; nt++) {
        const int64_t pairs = nt * (nt + 1) / 2, per_b = dcc_wide_count(nt);
        int idx = 0;
        for (int t = 0; t < nt; t++)
            for (int s = 0; 2 * s <= t; s++, idx++) {
                int ti, sj;
                dcc_wide_pair(idx, &ti, &sj);
                assert_int_equal(ti, t);
                assert_int_equal(sj, s);
                for (int64_t b = 0; b < 3; b++)
                    assert_int_equal(dcc_wide_first_pair(b * per_b + idx, per_b, pairs),
                                     b * pairs + (int64_t)t * (t + 1) / 2 + 2 * s);
            }
        assert_int_equal(per_b, idx);
        assert_int_equal(dcc_wide_first_pair(3 * per_b, per_b, pairs), 3 * pairs);
    }
}

static void test_sm_count(void **state) {
    int n = 0, sms = -1, dev = 0, want = 0;
    cudaError_t e;
    (void)state;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
        /* no device: an error, not a made-up count */
        e = dcc_sm_count(&sms);
        assert_int_not_equal(e, cudaSuccess);
        printf("test_cuda_util: no GPU: dcc_sm_count says %s\n", cudaGetErrorString(e));
        return;
    }
    assert_int_equal(dcc_sm_count(&sms), cudaSuccess);
    assert_int_equal(cudaGetDevice(&dev), cudaSuccess);
    assert_int_equal(cudaDeviceGetAttribute(&want, cudaDevAttrMultiProcessorCount, dev),
                     cudaSuccess);
    assert_true(sms > 0);
    assert_int_equal(sms, want);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_tri_pair_small),
        cmocka_unit_test(test_tri_pair_large),
        cmocka_unit_test(test_wide_pairs),
        cmocka_unit_test(test_sm_count),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
