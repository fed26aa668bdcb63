/* The plans of the wgmma norm forms (cuda/kernels/direct_plan.cu) forced through
 * dcc_options, each against the double-precision reference of
 * tests/support/ref.h within the bounds test_cuda_kernels.c states: the
 * direct form's tile heights, K splits and split tails; the ghost form's
 * wide items, persistent pairs and split tails. Per-layer launches (a
 * grouped step would run the layers in the persistent kernels, whatever
 * these switches say). Without a CUDA device the test prints "SKIP: no CUDA
 * device" and exits DC_TEST_SKIP (77). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "cuda_test.h"
#include "dcc_path.h"

/* The direct form's tile heights and K splits (clusters of 1-3 CTAs adding
 * partial tiles), and the hybrid (whole waves unsplit, a split tail),
 * forced, on a ragged K range with a bias. */
static void test_direct_splits(void **state) {
    (void)state;
    dc_test_rng r;
    dc_test_layer_spec sp = {DC_LAYER_LINEAR, 2, 2500, 136, 264, DC_BF16, 1, DC_ALGO_DIRECT, 0, 0};
    dc_layer h;
    double ref[2];
    dc_test_rng_seed(&r, 107);
    dc_test_layer_make(&h, &sp, &r);
    dc_ref_layer_sqnorms(&h, 2, 1.0, ref);
    /* what the backend will plan for this layer: the split kernels run on
     * the wgmma path with TMA only (else these cases test nothing new) */
    dc_layer d = dev_layer(&h);
    dcc_linear L = {d.input.data, d.grad.data, DC_BF16, DC_BF16, 2,       (int)h.T,
                    (int)h.d,     (int)h.p,    true,    true,    &g_opts, NULL};
    if (dcc_linear_path(&L) != DCC_PATH_WGMMA) {
        dev_layer_free(&d);
        dc_test_layer_free(&h);
        skip();
    }
    /* per-layer launches: a grouped step would run the layer in the
     * persistent kernel, whatever these switches say */
    g_opts.grouped = false;
    for (int k = 0; k < 6; k++) {
        char split[2] = {(char)('1' + k % 3), 0};
        g_opts.direct_tile = k < 3 ? 128 : 256;
        g_opts.direct_split = 1 + k % 3;
        apply_switches();
        dcc_direct_plan pl;
        dcc_direct_plan_get(&L, &pl); /* the forced tile and split are what runs */
        assert_int_equal(pl.rows, g_opts.direct_tile);
        assert_int_equal(pl.split, g_opts.direct_split);
        double e = layer_err(&h, 2, ref);
        printf("direct tile=%s split=%s: max rel err %.2e\n", k < 3 ? "128" : "256", split, e);
        assert_true(e <= norm_rtol(DC_BF16));
    }
    /* The bias's sums by the tiles of column 0 (no scratch) and spread over
     * every tile (one-wave plans given scratch), called directly, each
     * tile height and split, three times over one scratch (zeroed by each
     * launch) */
    float *n2;
    void *bws;
    CUDA_OK(cudaMalloc((void **)&n2, 2 * sizeof(float)));
    for (int k = 0; k < 12; k++) {
        g_opts.direct_tile = k % 2 ? 256 : 128;
        g_opts.direct_split = 1 + k / 2 % 3;
        L.bias_ws = NULL;
        if (k >= 6) {
            CUDA_OK(cudaMalloc(&bws, dcc_linear_bias_ws_bytes(&L)));
            L.bias_ws = bws;
        }
        for (int rep = 0; rep < (k >= 6 ? 3 : 1); rep++) {
            float got[2];
            CUDA_OK(cudaMemset(n2, 0, 2 * sizeof(float)));
            CUDA_OK(dcc_linear_sqnorms(&L, DC_ALGO_DIRECT, 1.0f, n2, 0));
            CUDA_OK(cudaMemcpy(got, n2, sizeof got, cudaMemcpyDeviceToHost));
            for (int b = 0; b < 2; b++) {
                double e = fabs((double)got[b] - ref[b]) / ref[b];
                printf("direct tile=%d split=%d bias %s, run %d: rel err %.2e\n",
                       g_opts.direct_tile, g_opts.direct_split, L.bias_ws ? "spread" : "column 0",
                       rep, e);
                assert_true(e <= norm_rtol(DC_BF16));
            }
        }
        if (L.bias_ws) CUDA_OK(cudaFree(bws));
    }
    L.bias_ws = NULL;
    CUDA_OK(cudaFree(n2));
    g_opts.direct_tile = 0;
    g_opts.direct_split = 0;
    /* The hybrid: the first N tiles (numbered over samples) unsplit, the
     * rest on clusters of K; N = 0 and N = all included; the tail launch
     * overlapping the unsplit one (PDL) and after it. */
    assert_int_equal(dcc_direct_ks_floor(1), 2); /* DPCLIP_CUDA_DIRECT_TAIL's rounding */
    assert_int_equal(dcc_direct_ks_floor(5), 4);
    assert_int_equal(dcc_direct_ks_floor(8), 6);
    enum { NTAIL = 8 };
    static const int tails[NTAIL][2] = {{2, 5}, {3, 0}, {4, 11}, {4, 12},
                                        {2, 7}, {3, 1}, {6, 3},  {6, 0}};
    for (int k = 0; k < 2 * NTAIL; k++) {
        g_opts.direct_tile = k < NTAIL ? 128 : 256;
        g_opts.tail_k = tails[k % NTAIL][0];
        g_opts.tail_after = tails[k % NTAIL][1];
        g_opts.pdl = k % 3 != 2;
        apply_switches();
        dcc_direct_plan pl;
        dcc_direct_plan_get(&L, &pl);
        assert_int_equal(pl.tail_ks, tails[k % NTAIL][0]);
        assert_true(pl.full <= tails[k % NTAIL][1] && pl.split == 1); /* N: at most all */
        double e = layer_err(&h, 2, ref);
        printf("direct tile=%d tail=%d:%d pdl=%d: max rel err %.2e\n", g_opts.direct_tile,
               tails[k % NTAIL][0], tails[k % NTAIL][1], (int)g_opts.pdl, e);
        assert_true(e <= norm_rtol(DC_BF16));
    }
    set_switches(1, 1); /* the model's tiles and splits again */
    dev_layer_free(&d);
    dc_test_layer_free(&h);
}

/* A split tail after two or more whole waves of 256-row tiles: the waves
 * on persistent CTAs (the grouped kernel, dcc_linear_sqnorms_waves), on a
 * layer of 2 waves and a part (9 tiles a sample), T ragged; the tail after
 * the whole waves, after a run that is not a multiple of the SMs (the
 * persistent CTAs' last round partial), after fewer than two waves (one
 * CTA a tile), and with DIRECT_PERSIST off; bf16 and f16. */
static void test_direct_persist(void **state) {
    (void)state;
    int sms;
    CUDA_OK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    const uint32_t B = (uint32_t)(2 * sms) / 9 + 2;
    dc_test_rng r;
    dc_test_rng_seed(&r, 137);
    g_opts.grouped = false; /* per-layer launches, which the plan steers */
    g_opts.direct_tile = 256;
    for (int di = 0; di < 2; di++) {
        dc_test_layer_spec sp = {DC_LAYER_LINEAR, B, 100, 264, 520, kDtypes[di], 1,
                                 DC_ALGO_DIRECT,  0, 0};
        dc_layer h;
        double *ref = (double *)malloc(B * sizeof *ref);
        assert_non_null(ref);
        dc_test_layer_make(&h, &sp, &r);
        dc_ref_layer_sqnorms(&h, B, 1.0, ref);
        dc_layer d = dev_layer(&h);
        dcc_linear L = {d.input.data, d.grad.data, kDtypes[di], kDtypes[di], (int)B,  (int)h.T,
                        (int)h.d,     (int)h.p,    true,        true,        &g_opts, NULL};
        const int wg = dcc_linear_path(&L) == DCC_PATH_WGMMA;
        dev_layer_free(&d);
        if (!wg) {
            dc_test_layer_free(&h);
            free(ref);
            skip();
        }
        const long long after[4] = {-1, 2LL * sms + 7, 2LL * sms - 1, -1};
        for (int k = 0; k < 4; k++) {
            g_opts.tail_k = 2;
            g_opts.tail_after = after[k];
            g_opts.persist = k < 3;
            apply_switches();
            dcc_direct_plan pl;
            dcc_direct_plan_get(&L, &pl);
            assert_int_equal(pl.tail_ks, 2);
            assert_int_equal(pl.persist, k < 2);
            double e = layer_err(&h, B, ref);
            printf("direct %s B=%u tail=2:%lld persist=%d: max rel err %.2e\n",
                   dc_dtype_name(kDtypes[di]), B, pl.full, (int)pl.persist, e);
            assert_true(e <= norm_rtol(kDtypes[di]));
        }
        dc_test_layer_free(&h);
        free(ref);
    }
    set_switches(1, 1); /* the model's plans again */
}

/* The ghost form's plan forced, in each dtype the wgmma ghost serves:
 *   wide items (16-bit; a row block against two column blocks in m64n256,
 *   the other operand's blocks in two halves): none, some, all; on layers
 *   where a's Gram blocks are the wide ones (more k-steps; the bias then
 *   sums the narrow blocks) and where g's are, with a row-block count odd
 *   (T = 600: the last item's second column block lies past T) and even;
 *   then the pairs left on persistent CTAs, and the rest on clusters of K
 *   CTAs that split both K ranges and add their partial Gram blocks: N = 0
 *   (every pair split), N = all (none) and K = 1 (never split) included,
 *   with and without the launches overlapping. K ranges so short that some
 *   ranks get no k-steps of a's (d = 72: two steps of bf16) are included. */
static void test_ghost_plans(void **state) {
    (void)state;
    dc_test_rng r;
    dc_test_rng_seed(&r, 113);
    g_opts.grouped = false; /* per-layer launches, which these switches steer */
    enum { NCASE = 14 };
    static const long long cases[NCASE][3] = {/* wide items, K, N */
                                              {-1, 2, 0},   {-1, 3, 20}, {-1, 4, 44}, {-1, 6, 1},
                                              {-1, 2, 200}, {-1, 6, 0},  {-1, 1, 0},  {1000, 1, 0},
                                              {7, 1, 0},    {11, 2, 0},  {13, 3, 5},  {26, 1, 0},
                                              {1, 6, 0},    {5, 4, 3}};
    static const int layers[2][4] = {{3, 1000, 520, 264}, {3, 600, 72, 136}}; /* B, T, d, p */
    for (int di = 0; di < 3; di++) {
        for (int w = 0; w < 2; w++) {
            dc_test_layer_spec sp = {DC_LAYER_LINEAR,
                                     (uint32_t)layers[w][0],
                                     layers[w][1],
                                     layers[w][2],
                                     layers[w][3],
                                     kDtypes[di],
                                     1,
                                     DC_ALGO_GHOST,
                                     0,
                                     0};
            const long long nt = (layers[w][1] + 127) / 128, items = nt * (nt + 1) / 2 * 3;
            dc_layer h;
            double ref[3];
            dc_test_layer_make(&h, &sp, &r);
            dc_ref_layer_sqnorms(&h, 3, 1.0, ref);
            dc_layer d = dev_layer(&h);
            dcc_linear L = {d.input.data, d.grad.data, h.input.dtype, h.grad.dtype, 3,
                            (int)h.T,     (int)h.d,    (int)h.p,      true,         true,
                            &g_opts,      NULL};
            const int wg = dcc_linear_path(&L) == DCC_PATH_WGMMA ||
                           (kDtypes[di] == DC_F32 && dcc_wgmma_available(&g_opts));
            dev_layer_free(&d);
            if (!wg) { /* the plan steers the wgmma kernels only */
                dc_test_layer_free(&h);
                continue;
            }
            for (int k = 0; k < NCASE; k++) {
                g_opts.ghost_wide = cases[k][0];
                g_opts.ghost_tail_k = (int)cases[k][1];
                g_opts.ghost_tail_after = cases[k][2];
                g_opts.pdl = k % 3 != 2;
                apply_switches();
                dcc_ghost_plan pl;
                dcc_ghost_plan_get(&L, &pl);
                assert_int_equal(pl.tail_ks, cases[k][1] > 1 ? cases[k][1] : 0);
                if (kDtypes[di] == DC_F32 || cases[k][0] < 0) assert_int_equal(pl.wide, 0);
                else assert_true(pl.wide > 0 && pl.wide <= cases[k][0]);
                assert_true((pl.first > 0) == (pl.wide > 0));
                assert_true(pl.first <= pl.full && pl.full <= items);
                double e = layer_err(&h, 3, ref);
                printf("ghost %s T=%d d=%d: wide %lld, pairs from %lld, split %d from %lld, "
                       "pdl=%d: max rel err %.2e\n",
                       dc_dtype_name(kDtypes[di]), (int)h.T, (int)h.d, pl.wide, pl.first,
                       pl.tail_ks, pl.full, (int)g_opts.pdl, e);
                assert_true(e <= norm_rtol(kDtypes[di]));
            }
            dc_test_layer_free(&h);
        }
    }
    set_switches(1, 1); /* the model's plans again */
}

int main(void) {
    if (cuda_test_skip()) return DC_TEST_SKIP;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_direct_splits),
        cmocka_unit_test(test_direct_persist),
        cmocka_unit_test(test_ghost_plans),
    };
    return cmocka_run_group_tests(tests, cuda_test_setup, cuda_test_teardown);
}
