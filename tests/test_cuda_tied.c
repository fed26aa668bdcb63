/* Tied parameters on the CUDA backend (cuda/kernels/tied.cu, backend_tied.cu): an
 * embedding and a linear layer sharing one weight, in both orders, behind
 * other layers, with the backend's switches in both positions, against the
 * reference that sums both uses' per-sample gradients explicitly: every
 * norm (the cross term included), the owner's weight output (the linear
 * use's sum, the embedding's added onto it, noised once) and the later
 * layer's bias. Also a GPT-2-shaped pair (T = 128, bf16, a vocabulary of
 * 2053) and a bad index inside the pair (nothing written). Without a CUDA
 * device the test prints "SKIP: no CUDA device" and exits DC_TEST_SKIP. */
#include "cuda_test.h"

#define NL 4

typedef struct tied {
    dc_layer h[NL], d[NL];
    uint32_t B;
} tied;

static void tied_make(tied *t, uint32_t B, int64_t Te, int64_t Tl, int64_t d, int64_t V,
                      dc_dtype dt, int has_bias, int emb_first, uint64_t seed) {
    dc_test_rng r;
    dc_test_layer_spec pre[2] = {
        {DC_LAYER_LAYERNORM, B, Tl, d, 0, dt, 1, DC_ALGO_AUTO, 1, 0},
        {DC_LAYER_LINEAR, B, Tl, d, d, dt, 1, DC_ALGO_DIRECT, 1, 0},
    };
    dc_test_rng_seed(&r, seed);
    t->B = B;
    dc_test_layer_make(&t->h[0], &pre[0], &r);
    dc_test_layer_make(&t->h[1], &pre[1], &r);
    dc_test_tied_pair(t->h + 2, 2, B, Te, Tl, d, V, dt, has_bias, emb_first, &r);
    for (int l = 0; l < NL; l++) t->d[l] = dev_layer(&t->h[l]);
}

static void tied_free(tied *t) {
    for (int l = 0; l < NL; l++) {
        dc_test_layer_free(&t->h[l]);
        dev_layer_free(&t->d[l]);
    }
}

/* C between the middle reference norms: some samples clipped, some not. */
static float middle_c(dc_step *hs) {
    double n[64];
    hs->max_grad_norm = 1e30f;
    dc_ref_step(hs, n, NULL, NULL, NULL, NULL, NULL);
    for (uint32_t i = 1; i < hs->batch; i++)
        for (uint32_t j = i; j > 0 && n[j] < n[j - 1]; j--) {
            double x = n[j];
            n[j] = n[j - 1];
            n[j - 1] = x;
        }
    return (float)(0.5 * (n[hs->batch / 2 - 1] + n[hs->batch / 2]));
}

static void run_tied(tied *t, dc_reduction red) {
    dc_step hs, ds;
    dc_step_result res;
    dc_err err;
    const uint32_t B = t->B;
    double norms[64], coefs[64], lsq[NL * 64], *w[NL] = {0}, *bb[NL] = {0};
    assert_true(B <= 64);
    step_init(&hs, t->h, NL, B, -1);
    hs.reduction = red;
    hs.expected_batch = B + 2;
    hs.max_grad_norm = middle_c(&hs);
    ds = hs;
    ds.layers = t->d;
    ds.device = 0;
    for (int l = 0; l < NL; l++) {
        if (t->h[l].weight_grad_out.data)
            w[l] = calloc((size_t)numel(&t->h[l].weight_grad_out), sizeof(double));
        if (t->h[l].bias_grad_out.data)
            bb[l] = calloc((size_t)numel(&t->h[l].bias_grad_out), sizeof(double));
    }
    /* the reference's coefficients min(1, C' / (n + 1e-6)) with C' = C /
     * (1 + e) are the backend's, min(1, C / (n (1 + e) + 1e-6)), to 1e-6 e / n
     * (step.h); its norms are C's */
    dc_step hr = hs;
    hr.max_grad_norm = (float)(hs.max_grad_norm / (1.0 + dc_clip_e_step(&ds, dc_clip_e_how(&ds))));
    dc_ref_step(&hr, norms, coefs, lsq, NULL, w, bb);
    int rc = run(g_cuda, &ds, &res, &err);
    if (rc) fprintf(stderr, "cuda: %s: %s\n", err.field, err.msg);
    assert_int_equal(rc, 0);
    dc_dtype dt = t->h[3].grad.dtype;
    double tol = norm_rtol(dt) * 2;
    int clipped = 0;
    for (uint32_t b = 0; b < B; b++) {
        if (!(fabs(res.norms[b] - norms[b]) <= tol * norms[b]))
            fprintf(stderr, "sample %u: norm %.8g, reference %.8g\n", b, res.norms[b], norms[b]);
        assert_true(fabs(res.norms[b] - norms[b]) <= tol * norms[b]);
        clipped += coefs[b] < 1.0;
    }
    assert_true(clipped > 0 && clipped < (int)B);
    for (size_t i = 0; i < NL * B; i++)
        assert_true(fabs((double)res.layer_norms[i] - sqrt(lsq[i])) <= tol * sqrt(lsq[i]) + 1e-30);
    for (int l = 0; l < NL; l++) {
        dc_tensor *o[2] = {&t->d[l].weight_grad_out, &t->d[l].bias_grad_out};
        double *want[2] = {w[l], bb[l]};
        for (int k = 0; k < 2; k++) {
            if (!o[k]->data) continue;
            int64_t n = numel(o[k]);
            float *got = dev_to_f32(o[k]), *wf = malloc((size_t)n * sizeof *wf);
            assert_non_null(wf);
            for (int64_t i = 0; i < n; i++) wf[i] = (float)want[k][i];
            double e = rel_l2(got, wf, n);
            printf("  %s.%s: rel l2 err %.2e\n", t->h[l].name, k ? "bias" : "weight", e);
            assert_true(e <= (dt == DC_F32 && !g_tf32 ? 1e-4 : TF32_RTOL));
            free(got);
            free(wf);
        }
        free(w[l]);
        free(bb[l]);
    }
    dc_step_result_free(&res);
}

static void test_tied_pairs(void **state) {
    (void)state;
    for (int modern = 1; modern >= 0; modern--) {
        set_switches(modern, modern);
        for (int k = 0; k < 8; k++) {
            tied t;
            int64_t Te = 5 + k % 3, Tl = k % 4 == 3 ? 1 : Te + 70 * (k % 2);
            tied_make(&t, 6 + (uint32_t)(k % 3), Te, Tl, 16 + 8 * (k % 2), 37, kDtypes[k % 3],
                      k % 2, (k / 2) % 2, 900 + (uint64_t)k);
            printf("modern %d case %d: Te %lld Tl %lld %s\n", modern, k, (long long)Te,
                   (long long)Tl, dc_dtype_name(kDtypes[k % 3]));
            run_tied(&t, k % 3 == 0 ? DC_REDUCTION_MEAN : DC_REDUCTION_SUM);
            tied_free(&t);
        }
    }
    set_switches(1, 1);
}

/* GPT-2's shape, scaled down: one sequence length for both uses, bf16, a
 * vocabulary not a multiple of any tile, the direct-form grouped kernels. */
static void test_gpt2_shaped(void **state) {
    (void)state;
    tied t;
    tied_make(&t, 4, 128, 128, 64, 2053, DC_BF16, 0, 1, 77);
    run_tied(&t, DC_REDUCTION_MEAN);
    tied_free(&t);
}

/* An index past the vocabulary in the tied embedding: the step fails
 * naming it and writes nothing (the cross term's gather skips it). */
static void test_bad_index(void **state) {
    (void)state;
    tied t;
    dc_step ds;
    dc_step_result res;
    dc_err err;
    tied_make(&t, 4, 9, 9, 16, 37, DC_F32, 1, 1, 5);
    int64_t bad = 1000000;
    dc_tensor *idx = &t.h[2].input;
    size_t at = 7 * dc_dtype_size(idx->dtype);
    if (idx->dtype == DC_I32) {
        int32_t v = (int32_t)bad;
        h2d((char *)t.d[2].input.data + at, &v, sizeof v);
    } else {
        h2d((char *)t.d[2].input.data + at, &bad, sizeof bad);
    }
    float sentinel = 7.0f;
    int64_t n = numel(&t.d[2].weight_grad_out);
    float *fill = malloc((size_t)n * sizeof *fill);
    assert_non_null(fill);
    for (int64_t i = 0; i < n; i++) fill[i] = sentinel;
    h2d(t.d[2].weight_grad_out.data, fill, (size_t)n * sizeof *fill);
    step_init(&ds, t.d, NL, 4, 0);
    int rc = run(g_cuda, &ds, &res, &err);
    assert_int_equal(rc, DC_EINVAL);
    assert_non_null(strstr(err.field, "indices"));
    float *got = dev_to_f32(&t.d[2].weight_grad_out);
    for (int64_t i = 0; i < n; i++) assert_true(got[i] == sentinel);
    free(got);
    free(fill);
    dc_step_result_free(&res);
    tied_free(&t);
}

int main(void) {
    if (cuda_test_skip()) return DC_TEST_SKIP;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_tied_pairs),
        cmocka_unit_test(test_gpt2_shaped),
        cmocka_unit_test(test_bad_index),
    };
    return cmocka_run_group_tests(tests, cuda_test_setup, cuda_test_teardown);
}
