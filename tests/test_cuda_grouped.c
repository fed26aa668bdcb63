/* The grouped launches over many LINEAR layers (cuda/kernels/grouped_tma.cu) run
 * all or nothing: a tensor map the driver refuses for a later chunk must
 * not leave earlier chunks launched, since the backend then runs every
 * layer per layer, and the norms, added into n2, would count twice.
 *
 * The refused layer here is a real layer's tensors described with 2^30 rows
 * a sample: a per-sample stride of 2^44 bytes, past the 2^40 a tensor map
 * may have (cuTensorMapEncodeTiled), while everything the launches check
 * themselves (dtype, alignment, widths) qualifies. Its chunk is built but
 * never launched. The valid layer's norms and clipped sum are checked
 * against the double-precision reference (relative 1e-3, bf16 inputs:
 * dc_test_rtol), so that the all-zero result after a refusal means nothing
 * ran rather than nothing works. Without a CUDA device, or on a GPU
 * without the grouped kernels (sm_90a, TMA): skipped (77). */
#include "cuda_test.h"

enum { B = 2 };

static void test_refused_map_runs_nothing(void **state) {
    (void)state;
    dc_test_rng r;
    dc_test_rng_seed(&r, 1818);
    dc_layer h;
    dc_test_layer_spec sp = {DC_LAYER_LINEAR, B, 64, 128, 256, DC_BF16, 0, DC_ALGO_DIRECT, 1, 0};
    dc_test_layer_make(&h, &sp, &r);
    dc_layer d = dev_layer(&h);
    const dcc_linear ok = {d.input.data, d.grad.data, DC_BF16, DC_BF16, B,       64,
                           128,          256,         false,   false,   &g_opts, NULL};
    assert_true(dcc_norms_grouped_ok(&ok, DC_ALGO_DIRECT)); /* main checked the GPU */
    assert_true(dcc_bk_grouped_ok(&ok));
    dcc_linear refused = ok;
    refused.T = 1 << 30;
    refused.d = refused.p = 8192;
    assert_true(dcc_norms_grouped_ok(&refused, DC_ALGO_DIRECT));
    assert_true(dcc_bk_grouped_ok(&refused));

    /* norms */
    double want[B];
    dc_ref_layer_sqnorms(&h, B, 1.0, want);
    float *n2, got[2 * B];
    CUDA_OK(cudaMalloc((void **)&n2, sizeof got));
    const dcc_norm_layer nl[2] = {{ok, n2, NULL, NULL}, {refused, n2 + B, NULL, NULL}};
    CUDA_OK(cudaMemset(n2, 0, sizeof got));
    CUDA_OK(dcc_linear_sqnorms_grouped(nl, 1, 1.0f, 1, 0));
    CUDA_OK(cudaMemcpy(got, n2, sizeof got, cudaMemcpyDeviceToHost));
    for (int b = 0; b < B; b++) assert_true(fabs(got[b] - want[b]) <= 1e-3 * want[b]);
    for (int n = 1; n <= 2; n++) { /* the refused layer alone, then after the valid one */
        CUDA_OK(cudaMemset(n2, 0, sizeof got));
        /* one layer a chunk: the valid layer's chunk comes first */
        assert_int_equal(dcc_linear_sqnorms_grouped(nl + 2 - n, n, 1.0f, 1, 0),
                         cudaErrorNotSupported);
        CUDA_OK(cudaDeviceSynchronize());
        CUDA_OK(cudaMemcpy(got, n2, sizeof got, cudaMemcpyDeviceToHost));
        for (int i = 0; i < 2 * B; i++) assert_true(got[i] == 0.0f);
    }

    /* clipped sums, every coefficient 1 (perm identity, factors 1) */
    const size_t nw = 256 * 128;
    double *wref = calloc(nw, sizeof *wref), coef[B] = {1.0, 1.0};
    float *w, *hw = malloc(nw * sizeof *hw), ones[B] = {1.0f, 1.0f};
    int *perm, order[B] = {0, 1};
    float *fac;
    assert_non_null(wref);
    assert_non_null(hw);
    dc_ref_layer_clipped_sum(&h, B, 1.0, coef, wref, NULL);
    CUDA_OK(cudaMalloc((void **)&w, 2 * nw * sizeof *w));
    CUDA_OK(cudaMalloc((void **)&perm, sizeof order));
    CUDA_OK(cudaMalloc((void **)&fac, sizeof ones));
    h2d(perm, order, sizeof order);
    h2d(fac, ones, sizeof ones);
    const dcc_bk_layer bl[2] = {{ok, perm, fac, w, NULL, NULL, NULL, -1, -1},
                                {refused, perm, fac, w + nw, NULL, NULL, NULL, -1, -1}};
    CUDA_OK(dcc_linear_clipped_grouped(bl, 1, 1, 0));
    CUDA_OK(cudaMemcpy(hw, w, nw * sizeof *hw, cudaMemcpyDeviceToHost));
    double err = 0.0, big = 0.0;
    for (size_t i = 0; i < nw; i++) {
        err = fmax(err, fabs(hw[i] - wref[i]));
        big = fmax(big, fabs(wref[i]));
    }
    assert_true(big > 0.0 && err <= 1e-3 * big);
    for (size_t i = 0; i < nw; i++) hw[i] = 7.0f;
    h2d(w, hw, nw * sizeof *hw);
    assert_int_equal(dcc_linear_clipped_grouped(bl, 2, 1, 0), cudaErrorNotSupported);
    CUDA_OK(cudaDeviceSynchronize());
    CUDA_OK(cudaMemcpy(hw, w, nw * sizeof *hw, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < nw; i++) assert_true(hw[i] == 7.0f);
    printf("a refused tensor map in the second chunk: nothing launched (norms and sums)\n");

    CUDA_OK(cudaFree(n2));
    CUDA_OK(cudaFree(w));
    CUDA_OK(cudaFree(perm));
    CUDA_OK(cudaFree(fac));
    free(wref);
    free(hw);
    dev_layer_free(&d);
    dc_test_layer_free(&h);
}

int main(void) {
    if (cuda_test_skip()) return DC_TEST_SKIP;
    dcc_options o;
    dcc_options_default(&o);
    if (!dcc_wgmma_available(&o)) {
        printf("SKIP: no grouped kernels on this GPU (sm_90a, TMA)\n");
        return DC_TEST_SKIP;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_refused_map_runs_nothing),
    };
    return cmocka_run_group_tests(tests, cuda_test_setup, cuda_test_teardown);
}
