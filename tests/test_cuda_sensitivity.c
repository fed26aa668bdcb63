/* Certified sensitivity on the CUDA backend (step.h dc_clip_e, issue 38):
 * for every sample b, c_b ||G_b|| <= C exactly, in double, where G_b is the
 * exact per-sample gradient of the inputs as given (the f64 reference,
 * ref.c) and c_b the coefficient the backend used (PER_LAYER: each layer's
 * against its C_l; a norm group's clip phase: each member's share), on
 * every kernel path: TF32 (mma.sync and wgmma, direct and ghost), exact f32
 * on CUDA cores, bf16 and f16 on the grouped kernel, the per-layer wgmma
 * kernels and mma.sync, the ghost form, kept bf16 gradients, embedding,
 * LayerNorm, RMSNorm, the rank-one T = 1 formula and a tied pair. Also
 * c_b ||G_b|| >= C (1 - 2 e) for clipped samples: the bound costs at most a
 * factor 1 + e on C.
 *
 * The inputs are adversarial: their rounding takes every computed norm
 * below the exact one, deterministically, whatever the order of the sums.
 *   TF32: positive values with their 13 low bits set, which the tensor
 *     cores drop (2^-10 of each operand); also checked against the exact
 *     norms of the truncated values, which the sums multiply.
 *   f32, bf16, f16 accumulations (direct over T, ghost Grams over d, an
 *     embedding's run): positive sums of a large term every 512 rows and
 *     tiny ones under half an ulp of any partial sum that holds one, even
 *     summed 16 at a time (a tensor core's k step): the kernels drop them.
 *   Kept gradients: entries 1 + 2^-8 - 2^-16, which bf16 rounds to 1.
 * Each such case asserts that today's coefficient, min(1, C / (n + 1e-6)),
 * would release clipped samples above C, so the inputs stay adversarial.
 * Without a CUDA device the test prints "SKIP: no CUDA device" and exits
 * DC_TEST_SKIP (77). */
#include "cpu.h"
#include "cuda_test.h"

#define NS 8 /* samples a step */

typedef struct verdict {
    int clipped, unclipped, old_over;
    double worst; /* max c ||G|| / C */
} verdict;

/* Today's coefficient, as the code before the bound computed it. */
static float old_coef(float C, float norm) {
    if (!(norm >= 0.0f && norm <= 3.4e38f)) return 0.0f;
    float c = C / (norm + 1e-6f);
    return c < 1.0f ? c : 1.0f;
}

/* c ||G|| <= C exactly; >= C (1 - 2 e) when c < 1. */
static void check_one(verdict *v, double c, double n_exact, double C, float reported, double e,
                      const char *what, uint32_t b) {
    const double r = c * n_exact;
    if (!(r <= C))
        printf("  %s sample %u: c %.9g * ||G|| %.12g = %.12g > C %.9g\n", what, b, c, n_exact, r,
               C);
    assert_true(r <= C);
    if (c < 1.0) {
        if (!(r >= C * (1.0 - 2.0 * e) - 2e-6))
            printf("  %s sample %u: c ||G|| %.12g below C (1 - 2e) %.12g\n", what, b, r,
                   C * (1.0 - 2.0 * e));
        assert_true(r >= C * (1.0 - 2.0 * e) - 2e-6);
        v->clipped++;
    } else {
        v->unclipped++;
    }
    v->old_over += (double)old_coef((float)C, reported) * n_exact > C;
    if (r / C > v->worst) v->worst = r / C;
}

/* Runs ds on the GPU and checks its coefficients against the exact norms
 * of hs (the host twin), and of ht when given (the values the kernels
 * multiply, where they differ from the inputs: TF32 truncations). how: the
 * paths whose bound the backend applies (for the utility check). */
static verdict check_gpu(const dc_step *hs, const dc_step *ds, const dc_step *ht, unsigned how,
                         const char *what) {
    const uint32_t B = hs->batch;
    const size_t L = hs->n_layers;
    const bool pl = hs->mode == DC_CLIP_PER_LAYER;
    verdict v = {0, 0, 0, 0.0}, vt = {0, 0, 0, 0.0};
    dc_step_result res;
    dc_err err;
    double norms[NS], lsq[8 * NS], tn[NS], tsq[8 * NS];
    assert_true(B <= NS && L <= 8);
    int rc = run(g_cuda, ds, &res, &err);
    if (rc) printf("  %s: %s: %s\n", what, err.field, err.msg);
    assert_int_equal(rc, 0);
    dc_ref_step(hs, norms, NULL, lsq, NULL, NULL, NULL);
    if (ht) dc_ref_step(ht, tn, NULL, tsq, NULL, NULL, NULL);
    for (size_t l = 0; l < (pl ? L : 1); l++) {
        const double e = pl ? dc_clip_e(ds, l, how) : dc_clip_e_step(ds, how);
        for (uint32_t b = 0; b < B; b++) {
            const size_t i = l * B + b;
            const double c = pl ? res.layer_coefs[i] : res.coefs[b];
            const double C = pl ? hs->layers[l].max_grad_norm : hs->max_grad_norm;
            const float rep = pl ? res.layer_norms[i] : res.norms[b];
            check_one(&v, c, pl ? sqrt(lsq[i]) : norms[b], C, rep, e, what, b);
            if (ht) check_one(&vt, c, pl ? sqrt(tsq[i]) : tn[b], C, rep, e, what, b);
        }
    }
    printf("%-46s e %.3g: %d clipped, %d not; worst c||G||/C - 1 = %.3g; today's rule "
           "releases %d above C\n",
           what, pl ? dc_clip_e(ds, 0, how) : dc_clip_e_step(ds, how), v.clipped, v.unclipped,
           v.worst - 1.0, v.old_over);
    dc_step_result_free(&res);
    return v;
}

/* --- data ---------------------------------------------------------------- */

static void store(dc_tensor *t, size_t i, double v) {
    dc_store_f32(t->data, t->dtype, i, (float)v);
}

/* Every f32 value of t with its 13 low bits set (the TF32 tensor cores drop
 * them), or cleared (what they keep). */
static void tf32_bits(dc_tensor *t, bool set) {
    uint32_t *w = t->data;
    for (int64_t i = 0; i < numel(t); i++) w[i] = set ? (w[i] | 0x1fffu) : (w[i] & 0xffffe000u);
}

/* Positive values in [0.25, 1.25) */
static void fill_positive(dc_tensor *t, dc_test_rng *r) {
    for (int64_t i = 0; i < numel(t); i++) store(t, (size_t)i, 0.25 + dc_test_uniform(r));
}

/* t[b] (rows of `row` values, `rows` a sample) times 2^(b % 4): samples
 * whose norms differ by powers of two, exactly, so that C between them
 * clips some and not others. */
static void spread_samples(dc_tensor *t, uint32_t B) {
    const size_t per = (size_t)numel(t) / B;
    for (uint32_t b = 0; b < B; b++)
        for (size_t i = 0; i < per; i++) {
            const size_t k = (size_t)b * per + i;
            store(t, k, dc_load_f32(t->data, t->dtype, k) * (double)(1u << (b % 4)));
        }
}

/* The geometric middle of the exact norms: half the samples clipped. */
static float middle_c(dc_step *hs) {
    double n[NS], lo = INFINITY, hi = 0.0;
    dc_ref_step(hs, n, NULL, NULL, NULL, NULL, NULL);
    for (uint32_t b = 0; b < hs->batch; b++) {
        lo = fmin(lo, n[b]);
        hi = fmax(hi, n[b]);
    }
    return (float)sqrt(lo * hi);
}

/* Absorption along rows: a = 1, every column of g the positive sum over T
 * of `big` every `period` rows (from row 0) and `tiny` between. */
static void absorb_rows(dc_layer *h, double big, double tiny, int64_t period) {
    for (int64_t i = 0; i < numel(&h->input); i++) store(&h->input, (size_t)i, 1.0);
    const int64_t T = h->T, w = h->kind == DC_LAYER_LINEAR ? h->p : h->d;
    for (int64_t i = 0; i < numel(&h->grad); i++) {
        const int64_t t = (i / w) % T;
        store(&h->grad, (size_t)i, t % period == 0 ? big : tiny);
    }
}

/* --- cases --------------------------------------------------------------- */

/* f32 on TF32: direct and ghost, per layer and (modern off) the older
 * launches, SUM and MEAN, and per-layer clipping of two TF32 layers. */
static void test_tf32(void **state) {
    (void)state;
    static const dc_algo algos[2] = {DC_ALGO_DIRECT, DC_ALGO_GHOST};
    for (int modern = 1; modern >= 0; modern--)
        for (int k = 0; k < 2; k++)
            for (int mean = 0; mean < 2; mean++) {
                set_switches(1, modern);
                dc_test_rng r;
                dc_test_rng_seed(&r, 10 + (uint64_t)(4 * modern + 2 * k + mean));
                dc_test_layer_spec sp = {DC_LAYER_LINEAR, NS, 200,      136, 72,
                                         DC_F32,          1,  algos[k], 1,   0};
                dc_layer h, t, d;
                dc_test_layer_make(&h, &sp, &r);
                dc_test_layer_make(&t, &sp, &r);
                fill_positive(&h.input, &r);
                fill_positive(&h.grad, &r);
                spread_samples(&h.grad, NS);
                tf32_bits(&h.input, true);
                tf32_bits(&h.grad, true);
                memcpy(t.input.data, h.input.data, tensor_bytes(&h.input));
                memcpy(t.grad.data, h.grad.data, tensor_bytes(&h.grad));
                tf32_bits(&t.input, false);
                tf32_bits(&t.grad, false);
                d = dev_layer(&h);
                dc_step hs, ts, ds;
                step_init(&hs, &h, 1, NS, -1);
                if (mean) hs.reduction = DC_REDUCTION_MEAN;
                hs.max_grad_norm = middle_c(&hs);
                ts = hs;
                ts.layers = &t;
                ds = hs;
                ds.layers = &d;
                ds.device = 0;
                char what[96];
                snprintf(what, sizeof what, "tf32 %s%s%s", k ? "ghost" : "direct",
                         mean ? ", mean" : "", modern ? "" : " (per-layer launches)");
                verdict v = check_gpu(&hs, &ds, &ts, DC_E_GPU | DC_E_TF32, what);
                assert_true(v.clipped > 0 && v.unclipped > 0);
                assert_true(v.old_over > 0);
                dev_layer_free(&d);
                dc_test_layer_free(&h);
                dc_test_layer_free(&t);
            }
    /* per layer: a direct and a ghost layer, each with its own C */
    set_switches(1, 1);
    dc_test_rng r;
    dc_test_rng_seed(&r, 20);
    dc_layer h[2], d[2];
    for (int k = 0; k < 2; k++) {
        dc_test_layer_spec sp = {DC_LAYER_LINEAR, NS, 100 + 40 * k, 64, 128,
                                 DC_F32,          k,  algos[k],     1,  0};
        dc_test_layer_make(&h[k], &sp, &r);
        fill_positive(&h[k].input, &r);
        fill_positive(&h[k].grad, &r);
        spread_samples(&h[k].grad, NS);
        tf32_bits(&h[k].input, true);
        tf32_bits(&h[k].grad, true);
        dc_step one;
        step_init(&one, &h[k], 1, NS, -1);
        h[k].max_grad_norm = middle_c(&one);
        d[k] = dev_layer(&h[k]);
    }
    dc_step hs, ds;
    step_init(&hs, h, 2, NS, -1);
    step_init(&ds, d, 2, NS, 0);
    hs.mode = ds.mode = DC_CLIP_PER_LAYER;
    verdict v = check_gpu(&hs, &ds, NULL, DC_E_GPU | DC_E_TF32, "tf32 per layer");
    assert_true(v.clipped > 0 && v.unclipped > 0 && v.old_over > 0);
    for (int k = 0; k < 2; k++) {
        dev_layer_free(&d[k]);
        dc_test_layer_free(&h[k]);
    }
}

/* Exact f32 on CUDA cores (DPCLIP_CUDA_TF32=0): the direct form's serial
 * FMA chain over T = 16384 drops the tiny terms (2^-24 of 1, every 128th
 * row large). */
static void test_f32_absorption(void **state) {
    (void)state;
    set_switches(0, 1);
    dc_test_rng r;
    dc_test_rng_seed(&r, 30);
    dc_test_layer_spec sp = {DC_LAYER_LINEAR, NS, 16384, 16, 16, DC_F32, 0, DC_ALGO_DIRECT, 1, 0};
    dc_layer h, d;
    dc_test_layer_make(&h, &sp, &r);
    absorb_rows(&h, 1.0, 0.99 * 0x1p-24, 128);
    spread_samples(&h.grad, NS);
    d = dev_layer(&h);
    dc_step hs, ds;
    step_init(&hs, &h, 1, NS, -1);
    hs.max_grad_norm = middle_c(&hs);
    ds = hs;
    ds.layers = &d;
    ds.device = 0;
    verdict v = check_gpu(&hs, &ds, NULL, DC_E_GPU | DC_E_TF32, "f32 cuda cores, absorption");
    assert_true(v.clipped > 0 && v.unclipped > 0 && v.old_over > 0);
    dev_layer_free(&d);
    dc_test_layer_free(&h);
    set_switches(1, 1);
}

/* bf16 and f16 direct form over T = 16384 (64 every 512th row, 2^-23
 * between: dropped by the tensor cores' f32 sums, 16 at a time or one by
 * one), on the grouped kernel, the per-layer wgmma kernels and mma.sync;
 * and the ghost form's Gram over d = 16384 (8 every 2048th feature, 2^-12
 * between: squares 64 and 2^-24). */
static void test_16bit_absorption(void **state) {
    (void)state;
    static const dc_dtype dts[2] = {DC_BF16, DC_F16};
    for (int di = 0; di < 2; di++)
        for (int cfg = 0; cfg < 4; cfg++) {
            set_switches(1, cfg == 0);
            if (cfg == 2) g_opts.wgmma = false;
            apply_switches();
            dc_test_rng r;
            dc_test_rng_seed(&r, 40 + (uint64_t)(4 * di + cfg));
            dc_layer h, d;
            char what[96];
            if (cfg < 3) {
                dc_test_layer_spec sp = {DC_LAYER_LINEAR, NS, 16384,          128, 16,
                                         dts[di],         0,  DC_ALGO_DIRECT, 1,   0};
                dc_test_layer_make(&h, &sp, &r);
                absorb_rows(&h, 64.0, 0x1p-23, 512);
                snprintf(what, sizeof what, "%s direct, %s, absorption", dc_dtype_name(dts[di]),
                         cfg == 0   ? "grouped"
                         : cfg == 1 ? "per layer"
                                    : "mma.sync");
            } else {
                dc_test_layer_spec sp = {DC_LAYER_LINEAR, NS, 16, 16384, 16, dts[di], 0,
                                         DC_ALGO_GHOST,   1,  0};
                dc_test_layer_make(&h, &sp, &r);
                for (int64_t i = 0; i < numel(&h.grad); i++) store(&h.grad, (size_t)i, 1.0);
                for (int64_t i = 0; i < numel(&h.input); i++)
                    store(&h.input, (size_t)i, (i % h.d) % 2048 == 0 ? 8.0 : 0x1p-12);
                snprintf(what, sizeof what, "%s ghost, absorption", dc_dtype_name(dts[di]));
            }
            spread_samples(cfg < 3 ? &h.grad : &h.input, NS);
            d = dev_layer(&h);
            dc_step hs, ds;
            step_init(&hs, &h, 1, NS, -1);
            hs.max_grad_norm = middle_c(&hs);
            ds = hs;
            ds.layers = &d;
            ds.device = 0;
            verdict v = check_gpu(&hs, &ds, NULL, DC_E_GPU | DC_E_TF32, what);
            assert_true(v.clipped > 0 && v.unclipped > 0 && v.old_over > 0);
            dev_layer_free(&d);
            dc_test_layer_free(&h);
        }
    set_switches(1, 1);
}

/* Kept per-sample gradients (sgrad.cu): every entry of G_b is 1 + 2^-8 -
 * 2^-16 times 2^(b % 4), which the kept bf16 value rounds down to a power
 * of two; the norm is the kept values'. */
static void test_kept(void **state) {
    (void)state;
    set_switches(1, 1);
    g_opts.sgrad = DCC_SGRAD_ALL;
    apply_switches();
    dc_cuda_backend_set_sample_grads(g_cuda, DC_SAMPLE_GRADS_AUTO);
    dc_test_rng r;
    dc_test_rng_seed(&r, 50);
    dc_test_layer_spec sp = {DC_LAYER_LINEAR, NS, 64, 128, 256, DC_BF16, 0, DC_ALGO_DIRECT, 1, 0};
    dc_layer h, d;
    dc_test_layer_make(&h, &sp, &r);
    for (int64_t i = 0; i < numel(&h.input); i++)
        store(&h.input, (size_t)i, (i / h.d) % h.T < 2 ? 1.0 : 0.0);
    for (int64_t i = 0; i < numel(&h.grad); i++) {
        const int64_t t = (i / h.p) % h.T;
        store(&h.grad, (size_t)i, t == 0 ? 1.0 : t == 1 ? 0x1p-8 - 0x1p-16 : 0.0);
    }
    spread_samples(&h.grad, NS);
    d = dev_layer(&h);
    dc_step hs, ds;
    step_init(&hs, &h, 1, NS, -1);
    hs.max_grad_norm = middle_c(&hs);
    ds = hs;
    ds.layers = &d;
    ds.device = 0;
    verdict v = check_gpu(&hs, &ds, NULL, DC_E_GPU | DC_E_TF32 | DC_E_KEPT, "bf16 kept gradients");
    assert_int_equal(dc_cuda_backend_kept_layers(g_cuda), 1);
    assert_true(v.clipped > 0 && v.unclipped > 0 && v.old_over > 0);
    dev_layer_free(&d);
    dc_test_layer_free(&h);
    set_switches(1, 1);
}

/* An embedding whose every position holds one token: its run of T = 4096
 * rows summed in f32 drops the tiny ones (64 every 512th row, 2^-23
 * between). */
static void test_embedding_absorption(void **state) {
    (void)state;
    set_switches(1, 1);
    dc_test_rng r;
    dc_test_rng_seed(&r, 60);
    dc_test_layer_spec sp = {DC_LAYER_EMBEDDING, NS, 4096, 32, 11, DC_F32, 0, DC_ALGO_AUTO, 1, 0};
    dc_layer h, d;
    dc_test_layer_make(&h, &sp, &r);
    h.has_padding_idx = false;
    for (int64_t i = 0; i < numel(&h.input); i++) {
        if (h.input.dtype == DC_I32) ((int32_t *)h.input.data)[i] = 3;
        else ((int64_t *)h.input.data)[i] = 3;
    }
    for (int64_t i = 0; i < numel(&h.grad); i++)
        store(&h.grad, (size_t)i, ((i / h.d) % h.T) % 512 == 0 ? 64.0 : 0x1p-23);
    spread_samples(&h.grad, NS);
    d = dev_layer(&h);
    dc_step hs, ds;
    step_init(&hs, &h, 1, NS, -1);
    hs.max_grad_norm = middle_c(&hs);
    ds = hs;
    ds.layers = &d;
    ds.device = 0;
    verdict v = check_gpu(&hs, &ds, NULL, DC_E_GPU | DC_E_TF32, "embedding, absorption");
    assert_true(v.clipped > 0 && v.unclipped > 0 && v.old_over > 0);
    dev_layer_free(&d);
    dc_test_layer_free(&h);
}

/* The other kinds and dtypes with random data (LayerNorm, RMSNorm, the
 * rank-one T = 1 form, a tied pair, every kind together): the bound holds,
 * at its cost. */
static void test_kinds(void **state) {
    (void)state;
    set_switches(1, 1);
    static const dc_test_layer_spec specs[] = {
        {DC_LAYER_LAYERNORM, NS, 40, 72, 0, DC_F32, 1, DC_ALGO_AUTO, 1, 0},
        {DC_LAYER_RMSNORM, NS, 40, 48, 0, DC_F32, 0, DC_ALGO_AUTO, 1, 0},
        {DC_LAYER_LINEAR, NS, 0, 33, 17, DC_F32, 1, DC_ALGO_AUTO, 1, 0}, /* T = 1 */
        {DC_LAYER_LINEAR, NS, 70, 72, 48, DC_F32, 1, DC_ALGO_DIRECT, 1, 0},
        {DC_LAYER_EMBEDDING, NS, 12, 16, 25, DC_F32, 0, DC_ALGO_AUTO, 1, 0},
    };
    const size_t N = sizeof specs / sizeof specs[0];
    for (int di = 0; di < 3; di++)
        for (size_t k = 0; k <= N + 1; k++) { /* each alone, all together, a tied pair */
            dc_test_rng r;
            dc_layer h[8], d[8];
            size_t L = 0;
            dc_test_rng_seed(&r, 70 + 10 * (uint64_t)k + (uint64_t)di);
            if (k == N + 1) {
                dc_test_tied_pair(h, 0, NS, 12, 10, 16, 23, kDtypes[di], 1, di % 2, &r);
                L = 2;
            } else {
                for (size_t i = 0; i < N; i++) {
                    if (k < N && i != k) continue;
                    dc_test_layer_spec sp = specs[i];
                    sp.dtype = kDtypes[di];
                    dc_test_layer_make(&h[L++], &sp, &r);
                }
            }
            for (size_t l = 0; l < L; l++) {
                spread_samples(&h[l].grad, NS);
                d[l] = dev_layer(&h[l]);
            }
            dc_step hs, ds;
            step_init(&hs, h, L, NS, -1);
            hs.max_grad_norm = middle_c(&hs);
            ds = hs;
            ds.layers = d;
            ds.device = 0;
            char what[96];
            snprintf(what, sizeof what, "%s, %s",
                     k == N + 1 ? "tied pair"
                     : k == N   ? "every kind"
                                : h[0].name,
                     dc_dtype_name(kDtypes[di]));
            verdict v = check_gpu(&hs, &ds, NULL, DC_E_GPU | DC_E_TF32, what);
            assert_true(v.clipped > 0 && v.unclipped > 0);
            for (size_t l = 0; l < L; l++) {
                dev_layer_free(&d[l]);
                dc_test_layer_free(&h[l]);
            }
        }
}

/* A norm group's clip phase (run_norms, then run_clip with the group's
 * totals): member 0 a TF32 layer, member 1 a bf16 one, whose bounds
 * differ; both clip by the larger (group.h), so one sample's coefficient is
 * the same on both, and sum_k c_k^2 ||G_k||^2 <= C^2. */
static void test_group(void **state) {
    (void)state;
    set_switches(1, 1);
    dc_test_rng r;
    dc_test_rng_seed(&r, 80);
    dc_test_layer_spec sp[2] = {
        {DC_LAYER_LINEAR, NS, 200, 136, 72, DC_F32, 1, DC_ALGO_DIRECT, 1, 0},
        {DC_LAYER_LINEAR, NS, 64, 64, 64, DC_BF16, 1, DC_ALGO_DIRECT, 1, 0},
    };
    dc_layer h[2], d[2];
    dc_step hs[2], ds[2];
    double n2[2][NS], sq[2][NS], tot[NS];
    dc_step_result res[2];
    dc_err err;
    for (int k = 0; k < 2; k++) {
        dc_test_layer_make(&h[k], &sp[k], &r);
        fill_positive(&h[k].input, &r);
        fill_positive(&h[k].grad, &r);
        spread_samples(&h[k].grad, NS);
        if (k == 0) {
            tf32_bits(&h[k].input, true);
            tf32_bits(&h[k].grad, true);
        }
        d[k] = dev_layer(&h[k]);
        step_init(&hs[k], &h[k], 1, NS, -1);
        dc_ref_step(&hs[k], NULL, NULL, sq[k], NULL, NULL, NULL);
    }
    double lo = INFINITY, hi = 0.0;
    for (uint32_t b = 0; b < NS; b++) {
        lo = fmin(lo, sqrt(sq[0][b] + sq[1][b]));
        hi = fmax(hi, sqrt(sq[0][b] + sq[1][b]));
    }
    const float C = (float)sqrt(lo * hi);
    for (int k = 0; k < 2; k++) {
        ds[k] = hs[k];
        ds[k].layers = &d[k];
        ds[k].device = 0;
        ds[k].max_grad_norm = C;
        assert_int_equal(g_cuda->ops->run_norms(g_cuda, &ds[k], n2[k], NULL, &err), 0);
    }
    for (uint32_t b = 0; b < NS; b++) tot[b] = n2[0][b] + n2[1][b];
    const unsigned how = dc_clip_e_how(&ds[0]);
    const double e0 = dc_clip_e_phase(&ds[0], how, NULL), e1 = dc_clip_e_phase(&ds[1], how, NULL);
    const double eg = e0 > e1 ? e0 : e1;
    assert_true(e0 != e1);
    for (int k = 0; k < 2; k++) {
        assert_int_equal(dc_step_result_init(&res[k], NS, 1, false), 0);
        assert_int_equal(
            g_cuda->ops->run_clip(g_cuda, &ds[k], n2[k], tot, eg, NULL, NULL, &res[k], &err), 0);
    }
    for (uint32_t b = 0; b < NS; b++) assert_true(res[0].coefs[b] == res[1].coefs[b]);
    int clipped = 0, old_over = 0;
    for (uint32_t b = 0; b < NS; b++) {
        const double rel = (double)res[0].coefs[b] * res[0].coefs[b] * sq[0][b] +
                           (double)res[1].coefs[b] * res[1].coefs[b] * sq[1][b];
        assert_true(rel <= (double)C * C);
        clipped += res[0].coefs[b] < 1.0f;
        const double co = old_coef(C, (float)sqrt(tot[b]));
        old_over += co * co * (sq[0][b] + sq[1][b]) > (double)C * C;
    }
    printf("norm group of two (tf32 + bf16): %d clipped; today's rule releases %d above C\n",
           clipped, old_over);
    assert_true(clipped > 0 && clipped < NS && old_over > 0);
    for (int k = 0; k < 2; k++) {
        dc_step_result_free(&res[k]);
        dev_layer_free(&d[k]);
        dc_test_layer_free(&h[k]);
    }
}

int main(void) {
    if (cuda_test_skip()) return DC_TEST_SKIP;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_tf32),
        cmocka_unit_test(test_f32_absorption),
        cmocka_unit_test(test_16bit_absorption),
        cmocka_unit_test(test_kept),
        cmocka_unit_test(test_embedding_absorption),
        cmocka_unit_test(test_kinds),
        cmocka_unit_test(test_group),
    };
    return cmocka_run_group_tests(tests, cuda_test_setup, cuda_test_teardown);
}
