/* The CPU backend as the worker sees it: whole multi-layer steps (every
 * layer kind, mixed dtypes and ranks) against dc_ref_step. */
#include <math.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdatomic.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "backend.h"
#include "cpu.h"
#include "ref.h"

#define NL 8

static void assert_close(const float *got, const double *want, int64_t n, double rtol) {
    double mx = 0.0;
    for (int64_t i = 0; i < n; i++) mx = fmax(mx, fabs(want[i]));
    assert_true(mx > 0.0);
    double e = dc_test_max_relerr_f(got, want, n, rtol, rtol * mx);
    if (e > 1.0) print_message("error %.3g of tolerance\n", e);
    assert_true(e <= 1.0);
}

/* A model-like stack: embedding, norms, linears of both algorithms, 2D and
 * 3D, inputs in f32/bf16/f16. Every layer has outputs. */
static size_t make_model(dc_layer *ls, uint32_t B, int64_t T, dc_test_rng *r, uint64_t seed) {
    dc_dtype dt[3] = {DC_F32, DC_BF16, DC_F16};
    dc_test_layer_spec sp[NL] = {
        {DC_LAYER_EMBEDDING, B, T, 16, 40, dt[seed % 3], 0, DC_ALGO_AUTO, 1, 0},
        {DC_LAYER_LAYERNORM, B, T, 16, 0, dt[(seed + 1) % 3], 1, DC_ALGO_AUTO, 1, 0},
        {DC_LAYER_LINEAR, B, T, 16, 24, dt[seed % 3], 1, DC_ALGO_GHOST, 1, 0},
        {DC_LAYER_LINEAR, B, T, 24, 16, dt[(seed + 2) % 3], 0, DC_ALGO_DIRECT, 1, 0},
        {DC_LAYER_RMSNORM, B, T, 16, 0, dt[seed % 3], 0, DC_ALGO_AUTO, 1, 0},
        {DC_LAYER_LINEAR, B, T, 16, 5, DC_F32, 1, DC_ALGO_AUTO, 1, 0},
        {DC_LAYER_LINEAR, B, 0, 5, 3, dt[(seed + 1) % 3], 1, DC_ALGO_AUTO, 1, 0}, /* 2D head */
        {DC_LAYER_LAYERNORM, B, 0, 5, 0, DC_F32, 0, DC_ALGO_AUTO, 1, 0},
    };
    for (int i = 0; i < NL; i++) {
        dc_test_layer_make(&ls[i], &sp[i], r);
        ls[i].max_grad_norm = (float)(0.05 + dc_test_uniform(r));
    }
    return NL;
}

static void run_model(dc_backend *be, uint32_t B, int64_t T, dc_clip_mode mode, dc_reduction red,
                      uint64_t seed) {
    dc_layer ls[NL];
    dc_test_rng r;
    dc_err e;
    dc_step_result res;
    float *norms_out = malloc(B * sizeof(float)), *coefs_out = malloc(B * sizeof(float));
    double *norms = malloc(B * sizeof(double)), *coefs = malloc(B * sizeof(double));
    double *lsq = malloc(NL * B * sizeof(double)), *lc = malloc(NL * B * sizeof(double));
    double *w[NL], *bb[NL];
    bool pl = mode == DC_CLIP_PER_LAYER;

    dc_test_rng_seed(&r, seed);
    size_t L = make_model(ls, B, T, &r, seed);
    dc_step s = {.batch = B,
                 .n_layers = L,
                 .layers = ls,
                 .mode = mode,
                 .max_grad_norm = 0.8f,
                 .reduction = red,
                 .expected_batch = B + 3,
                 .noise_multiplier = 0.0f,
                 .noise_key = 1,
                 .noise_step = seed,
                 .device = -1};
    s.norms_out = (dc_tensor){norms_out, DC_F32, 1, {B, 0, 0}};
    s.coefs_out = (dc_tensor){coefs_out, DC_F32, 1, {B, 0, 0}};
    for (size_t l = 0; l < L; l++) {
        w[l] = calloc((size_t)dc_test_tensor_numel(&ls[l].weight_grad_out), sizeof(double));
        bb[l] = ls[l].bias_grad_out.data
                    ? calloc((size_t)dc_test_tensor_numel(&ls[l].bias_grad_out), sizeof(double))
                    : NULL;
    }
    for (uint32_t b = 0; b < B; b++) norms_out[b] = coefs_out[b] = -1.0f;

    assert_int_equal(dc_step_result_init(&res, B, L, pl), 0);
    int rc = dc_backend_run_step(be, &s, &res, &e);
    if (rc) print_message("run_step %d: %s: %s\n", rc, e.field, e.msg);
    assert_int_equal(rc, 0);
    assert_true(res.compute_ns > 0);
    dc_ref_step(&s, norms, coefs, lsq, pl ? lc : NULL, w, bb);

    const double rt = 1e-3; /* mixed dtypes: the loosest of them */
    int clipped = 0;
    for (uint32_t b = 0; b < B; b++) {
        assert_true(fabs(norms_out[b] - norms[b]) <= rt * norms[b]);
        assert_true(fabs(coefs_out[b] - coefs[b]) <= rt * coefs[b]);
        assert_true(norms_out[b] == res.norms[b]);
        assert_true(coefs_out[b] == res.coefs[b]);
        if (pl) assert_true(res.coefs[b] == 1.0f);
        clipped += coefs[b] < 1.0;
    }
    for (size_t i = 0; i < L * B; i++) {
        assert_true(fabs(res.layer_norms[i] - sqrt(lsq[i])) <= rt * sqrt(lsq[i]));
        if (pl) {
            assert_true(fabs(res.layer_coefs[i] - lc[i]) <= rt * lc[i]);
            clipped += lc[i] < 1.0;
        }
    }
    assert_true(clipped > 0); /* the thresholds do bite */
    for (size_t l = 0; l < L; l++) {
        assert_close(ls[l].weight_grad_out.data, w[l], dc_test_tensor_numel(&ls[l].weight_grad_out),
                     rt);
        if (bb[l])
            assert_close(ls[l].bias_grad_out.data, bb[l],
                         dc_test_tensor_numel(&ls[l].bias_grad_out), rt);
        free(w[l]);
        free(bb[l]);
        dc_test_layer_free(&ls[l]);
    }
    dc_step_result_free(&res);
    free(norms_out);
    free(coefs_out);
    free(norms);
    free(coefs);
    free(lsq);
    free(lc);
}

static void test_flat(void **state) {
    (void)state;
    dc_backend *be;
    dc_err e;
    assert_int_equal(dc_cpu_backend_create(1, &be, &e), 0);
    assert_string_equal(be->ops->name, "cpu");
    for (uint64_t seed = 1; seed <= 3; seed++) {
        run_model(be, 6, 7, DC_CLIP_FLAT, DC_REDUCTION_SUM, seed);
        run_model(be, 6, 7, DC_CLIP_FLAT, DC_REDUCTION_MEAN, seed + 10);
    }
    dc_backend_destroy(be);
}

static void test_per_layer(void **state) {
    (void)state;
    dc_backend *be;
    dc_err e;
    assert_int_equal(dc_cpu_backend_create(0, &be, &e), 0);
    for (uint64_t seed = 1; seed <= 3; seed++) {
        run_model(be, 5, 9, DC_CLIP_PER_LAYER, DC_REDUCTION_SUM, seed);
        run_model(be, 5, 9, DC_CLIP_PER_LAYER, DC_REDUCTION_MEAN, seed + 20);
    }
    dc_backend_destroy(be);
}

/* One instance across steps whose shapes grow and shrink: scratch reuse
 * must not leak state from one step into the next. */
static void test_scratch_reuse(void **state) {
    (void)state;
    dc_backend *be;
    dc_err e;
    static const struct {
        uint32_t B;
        int64_t T;
    } seq[] = {{2, 3}, {9, 17}, {3, 2}, {9, 17}, {1, 1}, {12, 33}, {4, 5}};
    assert_int_equal(dc_cpu_backend_create(1, &be, &e), 0);
    for (size_t i = 0; i < sizeof seq / sizeof *seq; i++)
        run_model(be, seq[i].B, seq[i].T, i % 2 ? DC_CLIP_PER_LAYER : DC_CLIP_FLAT,
                  DC_REDUCTION_SUM, 100 + i);
    dc_backend_destroy(be);
}

/* Outputs are computed into scratch before anything is written, so an
 * output may alias an input: here a LayerNorm's weight_grad_out is the
 * first d values of its own input. */
static void test_output_aliases_input(void **state) {
    (void)state;
    dc_test_layer_spec sp = {DC_LAYER_LAYERNORM, 3, 4, 8, 0, DC_F32, 0, DC_ALGO_AUTO, 1, 0};
    dc_test_rng r;
    dc_layer l;
    dc_backend *be;
    dc_err e;
    dc_step_result res;
    double want[8];
    double *wp[1] = {want};
    dc_test_rng_seed(&r, 5);
    dc_test_layer_make(&l, &sp, &r);
    dc_step s = {.batch = 3,
                 .n_layers = 1,
                 .layers = &l,
                 .mode = DC_CLIP_FLAT,
                 .max_grad_norm = 0.1f,
                 .reduction = DC_REDUCTION_SUM,
                 .expected_batch = 3,
                 .device = -1};
    dc_ref_step(&s, NULL, NULL, NULL, NULL, wp, NULL);
    dc_test_tensor_free(&l.weight_grad_out);
    l.weight_grad_out = (dc_tensor){l.input.data, DC_F32, 1, {8, 0, 0}};
    assert_int_equal(dc_cpu_backend_create(1, &be, &e), 0);
    assert_int_equal(dc_step_result_init(&res, 3, 1, false), 0);
    assert_int_equal(dc_backend_run_step(be, &s, &res, &e), 0);
    assert_close(l.input.data, want, 8, 1e-4);
    l.weight_grad_out.data = NULL; /* not separately owned */
    dc_step_result_free(&res);
    dc_backend_destroy(be);
    dc_test_layer_free(&l);
}

static void test_refuses_gpu_steps(void **state) {
    (void)state;
    dc_test_layer_spec sp = {DC_LAYER_RMSNORM, 2, 3, 4, 0, DC_F32, 0, DC_ALGO_AUTO, 0, 0};
    dc_test_rng r;
    dc_layer l;
    dc_backend *be;
    dc_err e;
    dc_step_result res;
    dc_test_rng_seed(&r, 1);
    dc_test_layer_make(&l, &sp, &r);
    dc_step s = {.batch = 2,
                 .n_layers = 1,
                 .layers = &l,
                 .max_grad_norm = 1.0f,
                 .reduction = DC_REDUCTION_SUM,
                 .expected_batch = 2,
                 .device = 0};
    assert_int_equal(dc_cpu_backend_create(1, &be, &e), 0);
    assert_int_equal(dc_step_result_init(&res, 2, 1, false), 0);
    assert_int_equal(dc_backend_run_step(be, &s, &res, &e), DC_EPRECOND);
    s.device = -1;
    assert_int_equal(dc_backend_run_step(be, &s, &res, &e), 0);
    assert_true(res.norms[0] > 0.0f);
    dc_step_result_free(&res);
    dc_backend_destroy(be);
    dc_test_layer_free(&l);
}

/* --- a client rewriting its shared memory during a step -------------------
 * A flipper thread toggles one value of an input while steps run, as a
 * client can with its shared memory at any moment. Whatever it catches, a
 * step either fails with the documented error or releases exactly the
 * result of one consistent input (the reference for the good value): never
 * a write outside the output (ASan), never an unclipped sample. */

typedef struct flipper {
    void *p;            /* the value to flip */
    size_t size;        /* 4 or 8 bytes */
    uint64_t good, bad; /* the two bit patterns written in turn */
    atomic_bool stop;
} flipper;

/* Whole-word stores: a value is either good or bad, never half of each. */
static void flip_store(flipper *f, uint64_t v) {
    if (f->size == 8) *(volatile uint64_t *)f->p = v;
    else *(volatile uint32_t *)f->p = (uint32_t)v;
}

static void *flip_main(void *arg) {
    flipper *f = arg;
    while (!atomic_load(&f->stop)) {
        flip_store(f, f->bad);
        flip_store(f, f->good);
    }
    return NULL;
}

/* Runs `steps` steps of s while f flips; each must fail with want_fail or
 * match want (weights) and have coefficients that clip. Returns how many
 * steps succeeded. */
static int run_flipping(dc_step *s, flipper *f, int steps, int want_fail, const double *want,
                        int64_t n) {
    dc_backend *be;
    dc_err e;
    dc_step_result res;
    pthread_t th;
    int ok = 0;
    float *w = s->layers[0].weight_grad_out.data;
    assert_int_equal(dc_cpu_backend_create(1, &be, &e), 0);
    assert_int_equal(dc_step_result_init(&res, s->batch, s->n_layers, false), 0);
    atomic_init(&f->stop, false);
    assert_int_equal(pthread_create(&th, NULL, flip_main, f), 0);
    for (int i = 0; i < steps; i++) {
        int rc = dc_backend_run_step(be, s, &res, &e);
        if (rc) {
            assert_int_equal(rc, want_fail);
            continue;
        }
        ok++;
        for (uint32_t b = 0; b < s->batch; b++)
            assert_true(res.coefs[b] * res.norms[b] <= s->max_grad_norm * 1.0001f);
        double err = dc_test_max_relerr_f(w, want, n, 1e-4, 1e-6);
        if (err > 1.0) {
            print_message("step %d: error %.3g of tolerance\n", i, err);
            atomic_store(&f->stop, true); /* a failed assert leaves this frame */
            pthread_join(th, NULL);
        }
        assert_true(err <= 1.0);
    }
    atomic_store(&f->stop, true);
    pthread_join(th, NULL);
    dc_step_result_free(&res);
    dc_backend_destroy(be);
    return ok;
}

/* Embedding indices decide where the clipped sum writes: they are read from
 * client memory once. (Before, an index valid at the check and huge at the
 * scatter wrote outside the output: a heap overflow under ASan.) */
static void test_index_flip(void **state) {
    (void)state;
    for (int k = 0; k < 2; k++) {
        dc_dtype it = k ? DC_I64 : DC_I32;
        dc_test_layer_spec sp = {DC_LAYER_EMBEDDING, 4, 512, 8, 16, DC_F32, 0, DC_ALGO_AUTO, 1, 0};
        dc_test_rng r;
        dc_layer l;
        dc_test_rng_seed(&r, 40 + (uint64_t)k);
        dc_test_layer_make(&l, &sp, &r);
        if (l.input.dtype != it) { /* the maker picks a dtype: use both */
            dc_tensor t = dc_test_tensor_new(it, 2, 4, 512, 0);
            for (size_t i = 0; i < 4 * 512; i++) {
                int64_t v = l.input.dtype == DC_I32 ? ((int32_t *)l.input.data)[i]
                                                    : ((int64_t *)l.input.data)[i];
                if (it == DC_I32) ((int32_t *)t.data)[i] = (int32_t)v;
                else ((int64_t *)t.data)[i] = v;
            }
            dc_test_tensor_free(&l.input);
            l.input = t;
        }
        size_t last = 4 * 512 - 1;
        if (it == DC_I32) ((int32_t *)l.input.data)[last] = 3;
        else ((int64_t *)l.input.data)[last] = 3;
        dc_step s = {.batch = 4,
                     .n_layers = 1,
                     .layers = &l,
                     .mode = DC_CLIP_FLAT,
                     .max_grad_norm = 1e6f,
                     .reduction = DC_REDUCTION_SUM,
                     .expected_batch = 4,
                     .device = -1};
        int64_t n = dc_test_tensor_numel(&l.weight_grad_out);
        double *want = calloc((size_t)n, sizeof *want);
        double *wp[1] = {want};
        dc_ref_step(&s, NULL, NULL, NULL, NULL, wp, NULL);
        flipper f = {.p = (char *)l.input.data + last * dc_dtype_size(it),
                     .size = dc_dtype_size(it),
                     .good = 3,
                     .bad = it == DC_I32 ? (uint64_t)(uint32_t)INT32_MAX : (uint64_t)1 << 40};
        int ok = run_flipping(&s, &f, 400, DC_EINVAL, want, n);
        print_message("index flip (%s): %d of 400 steps succeeded\n", dc_dtype_name(it), ok);
        free(want);
        dc_test_layer_free(&l);
    }
}

/* A gradient value flipped to NaN after the finite check: the norm pass may
 * see NaN where the clipped sum sees the good value. A NaN norm used to get
 * coefficient 1 (NaN < 1 is false), releasing that sample unclipped; now the
 * step fails before any coefficient is used. Threshold C is small so that
 * every sample is clipped and an unclipped one shows in the output. */
static void test_value_flip(void **state) {
    (void)state;
    dc_algo algos[2] = {DC_ALGO_DIRECT, DC_ALGO_GHOST};
    for (int k = 0; k < 2; k++) {
        dc_test_layer_spec sp = {DC_LAYER_LINEAR, 3, 64, 32, 32, DC_F32, 0, algos[k], 1, 0};
        dc_test_rng r;
        dc_layer l;
        dc_test_rng_seed(&r, 50 + (uint64_t)k);
        dc_test_layer_make(&l, &sp, &r);
        float *gv = (float *)l.grad.data + 5;
        *gv = 1.0f;
        dc_step s = {.batch = 3,
                     .n_layers = 1,
                     .layers = &l,
                     .mode = DC_CLIP_FLAT,
                     .max_grad_norm = 0.01f,
                     .reduction = DC_REDUCTION_SUM,
                     .expected_batch = 3,
                     .device = -1};
        int64_t n = dc_test_tensor_numel(&l.weight_grad_out);
        double *want = calloc((size_t)n, sizeof *want), *coefs = calloc(3, sizeof *coefs);
        double *wp[1] = {want};
        dc_ref_step(&s, NULL, coefs, NULL, NULL, wp, NULL);
        for (int b = 0; b < 3; b++) assert_true(coefs[b] < 0.5); /* every sample clipped */
        uint32_t good, bad;
        float one = 1.0f, nan = NAN;
        memcpy(&good, &one, 4);
        memcpy(&bad, &nan, 4);
        flipper f = {.p = gv, .size = 4, .good = good, .bad = bad};
        int ok = run_flipping(&s, &f, 400, DC_ENONFINITE, want, n);
        print_message("value flip (%s): %d of 400 steps succeeded\n", k ? "ghost" : "direct", ok);
        free(want);
        free(coefs);
        dc_test_layer_free(&l);
    }
}

/* dc_clip_coef never turns an unknown norm (or bound) into "no clipping",
 * and rounds its coefficient down: c (n (1 + e) + 1e-6) <= C exactly. */
static void test_clip_coef_nonfinite(void **state) {
    (void)state;
    assert_true(dc_clip_coef(1.0f, NAN, 0.0) == 0.0f);
    assert_true(dc_clip_coef(1.0f, -NAN, 0.0) == 0.0f);
    assert_true(dc_clip_coef(1.0f, INFINITY, 0.0) == 0.0f);
    assert_true(dc_clip_coef(1.0f, -1.0, 0.0) == 0.0f);
    assert_true(dc_clip_coef(1.0f, 4.0, NAN) == 0.0f);
    assert_true(dc_clip_coef(1.0f, 4.0, INFINITY) == 0.0f);
    assert_true(dc_clip_coef(1.0f, 4.0, -1e-3) == 0.0f);
    assert_true(dc_clip_coef(NAN, 4.0, 0.0) == 0.0f);
    assert_true(dc_clip_coef(1.0f, 0.0, 0.0) == 1.0f);
    assert_true(dc_clip_coef(1.0f, 0.0, 1e-3) == 1.0f);
    assert_true(fabsf(dc_clip_coef(1.0f, 4.0, 0.0) - 0.25f) < 1e-6f);
    assert_true(fabsf(dc_clip_coef(1.0f, 4.0, 1e-3) - 0.25f / 1.001f) < 1e-6f);
    dc_test_rng r;
    dc_test_rng_seed(&r, 5);
    for (int i = 0; i < 100000; i++) {
        const float C = (float)(0.01 + 10.0 * dc_test_uniform(&r));
        const double n = C * (0.5 + dc_test_uniform(&r)), e = 1e-3 * dc_test_uniform(&r);
        const float c = dc_clip_coef(C, n, e);
        const double want = fmin(1.0, C / (n * (1.0 + e) + 1e-6));
        assert_true((double)c <= want);                   /* rounded down */
        assert_true((double)c >= want * (1.0 - 0x1p-23)); /* by at most an ulp */
        const float s = (float)(1.0 + 63.0 * dc_test_uniform(&r)), cs = dc_clip_scaled(c, s);
        assert_true((double)cs <= (double)c * s && (double)cs >= (double)c * s * (1.0 - 0x1p-23));
    }
}

/* An outlier step's scratch is given back after it; steady steps keep
 * theirs (test_scratch_reuse checks the results stay right). */
static void test_scratch_trim(void **state) {
    (void)state;
    dc_backend *be;
    dc_err e;
    assert_int_equal(dc_cpu_backend_create(1, &be, &e), 0);
    run_model(be, 4, 5, DC_CLIP_FLAT, DC_REDUCTION_SUM, 7);
    size_t small = dc_cpu_backend_scratch_bytes(be);
    /* one big step: T = 2500 makes the ghost layer's two T x T Grams 25 MB
     * each */
    run_model(be, 2, 2500, DC_CLIP_FLAT, DC_REDUCTION_SUM, 8);
    size_t after_big = dc_cpu_backend_scratch_bytes(be);
    run_model(be, 4, 5, DC_CLIP_FLAT, DC_REDUCTION_SUM, 9);
    size_t after = dc_cpu_backend_scratch_bytes(be);
    print_message("scratch: %zu, after the outlier %zu, after a small step %zu bytes\n", small,
                  after_big, after);
    assert_true(after_big > ((size_t)50 << 20));
    assert_true(after < after_big / 2);
    dc_backend_destroy(be);
}

/* The halves of a step for norm groups: run_norms gives the squared layer
 * norms of run_step; run_clip with their own sums as the totals writes what
 * run_step writes (bitwise: the same arithmetic and noise), and with 4x the
 * totals clips by twice the norm. */
static void test_phases(void **state) {
    (void)state;
    dc_backend *be;
    dc_err e;
    dc_layer ls[NL];
    dc_test_rng r;
    dc_step_result whole, part;
    dc_test_rng_seed(&r, 77);
    size_t L = make_model(ls, 5, 6, &r, 77);
    dc_step s = {.batch = 5,
                 .n_layers = L,
                 .layers = ls,
                 .mode = DC_CLIP_FLAT,
                 .max_grad_norm = 0.8f,
                 .reduction = DC_REDUCTION_SUM,
                 .expected_batch = 5,
                 .noise_multiplier = 0.5f,
                 .noise_key = 3,
                 .noise_step = 4,
                 .device = -1};
    double n2[NL * 5], tot[5];
    float *w1 = malloc((size_t)dc_test_tensor_numel(&ls[2].weight_grad_out) * sizeof *w1);
    assert_int_equal(dc_cpu_backend_create(1, &be, &e), 0);
    assert_int_equal(dc_step_result_init(&whole, 5, L, false), 0);
    assert_int_equal(dc_backend_run_step(be, &s, &whole, &e), 0);
    memcpy(w1, ls[2].weight_grad_out.data,
           (size_t)dc_test_tensor_numel(&ls[2].weight_grad_out) * sizeof *w1);
    assert_int_equal(be->ops->run_norms(be, &s, n2, NULL, &e), 0);
    for (size_t i = 0; i < L * 5; i++)
        assert_true(fabs(sqrt(n2[i]) - whole.layer_norms[i]) <= 1e-6 * whole.layer_norms[i]);
    for (int b = 0; b < 5; b++) {
        tot[b] = 0.0;
        for (size_t l = 0; l < L; l++) tot[b] += n2[l * 5 + b];
    }
    assert_int_equal(dc_step_result_init(&part, 5, L, false), 0);
    assert_int_equal(be->ops->run_clip(be, &s, n2, tot, 0.0, NULL, NULL, &part, &e), 0);
    assert_memory_equal(ls[2].weight_grad_out.data, w1,
                        (size_t)dc_test_tensor_numel(&ls[2].weight_grad_out) * sizeof *w1);
    assert_memory_equal(part.coefs, whole.coefs, 5 * sizeof(float));
    for (int b = 0; b < 5; b++) tot[b] *= 4.0;
    assert_int_equal(be->ops->run_clip(be, &s, n2, tot, 0.0, NULL, NULL, &part, &e), 0);
    for (int b = 0; b < 5; b++) /* the bound's e is the step's (its own layers) */
        assert_true(part.coefs[b] == dc_clip_coef(0.8f, sqrt(tot[b]), dc_clip_e_step(&s, 0)));
    const double es = dc_clip_e_step(&s, 0);
    assert_true(es >= DC_E_FLOOR_CPU && es < 1e-4);
    for (int b = 0; b < 5; b++) {
        double want = fmin(1.0, 0.8 / (2.0 * whole.norms[b] * (1.0 + es) + 1e-6));
        assert_true(fabs(part.coefs[b] - want) <= 1e-6 * want);
    }
    dc_step_result_free(&part);
    dc_step_result_free(&whole);
    free(w1);
    for (size_t l = 0; l < L; l++) dc_test_layer_free(&ls[l]);
    dc_backend_destroy(be);
}

/* Tied parameters: an embedding and a linear layer sharing one weight, in
 * both orders, behind other layers, against the reference that sums both
 * uses' per-sample gradients explicitly: every norm (the cross term of the
 * two uses included), the owner's weight output (both uses' clipped sums)
 * and the later layer's bias. */
static void run_tied(uint32_t B, int64_t Te, int64_t Tl, dc_dtype dt, int has_bias,
                     int embedding_first, dc_reduction red, uint64_t seed) {
    dc_layer ls[4];
    dc_test_rng r;
    dc_test_layer_spec pre[2] = {
        {DC_LAYER_LAYERNORM, B, Tl, 12, 0, dt, 1, DC_ALGO_AUTO, 1, 0},
        {DC_LAYER_LINEAR, B, Tl, 12, 12, dt, 1, DC_ALGO_GHOST, 1, 0},
    };
    dc_backend *be;
    dc_err e;
    dc_step_result res;
    const size_t L = 4;
    double norms[64], coefs[64], lsq[4 * 64], *w[4] = {0}, *bb[4] = {0};

    assert_true(B <= 64);
    dc_test_rng_seed(&r, seed);
    dc_test_layer_make(&ls[0], &pre[0], &r);
    dc_test_layer_make(&ls[1], &pre[1], &r);
    dc_test_tied_pair(ls + 2, 2, B, Te, Tl, 12, 23, dt, has_bias, embedding_first, &r);
    dc_step s = {.batch = B,
                 .n_layers = L,
                 .layers = ls,
                 .mode = DC_CLIP_FLAT,
                 .reduction = red,
                 .expected_batch = B + 1,
                 .noise_key = 1,
                 .noise_step = seed,
                 .device = -1};
    /* C between the middle per-sample norms: some samples clipped, some not */
    s.max_grad_norm = 1e30f;
    dc_ref_step(&s, norms, NULL, NULL, NULL, NULL, NULL);
    double sorted[64];
    memcpy(sorted, norms, B * sizeof *sorted);
    for (uint32_t i = 1; i < B; i++)
        for (uint32_t j = i; j > 0 && sorted[j] < sorted[j - 1]; j--) {
            double x = sorted[j];
            sorted[j] = sorted[j - 1];
            sorted[j - 1] = x;
        }
    s.max_grad_norm = (float)(0.5 * (sorted[B / 2 - 1] + sorted[B / 2]));
    for (size_t l = 0; l < L; l++) {
        if (ls[l].weight_grad_out.data)
            w[l] = calloc((size_t)dc_test_tensor_numel(&ls[l].weight_grad_out), sizeof(double));
        if (ls[l].bias_grad_out.data)
            bb[l] = calloc((size_t)dc_test_tensor_numel(&ls[l].bias_grad_out), sizeof(double));
    }
    dc_ref_step(&s, norms, coefs, lsq, NULL, w, bb);
    int clipped = 0;
    for (uint32_t b = 0; b < B; b++) clipped += coefs[b] < 1.0;
    assert_true(clipped > 0 && clipped < (int)B);

    assert_int_equal(dc_cpu_backend_create(1, &be, &e), 0);
    assert_int_equal(dc_step_result_init(&res, B, L, false), 0);
    int rc = dc_backend_run_step(be, &s, &res, &e);
    if (rc) print_message("run_step %d: %s: %s\n", rc, e.field, e.msg);
    assert_int_equal(rc, 0);
    const double rt = dc_test_rtol(dt);
    for (uint32_t b = 0; b < B; b++) {
        assert_true(fabs(res.norms[b] - norms[b]) <= rt * norms[b]);
        assert_true(fabs(res.coefs[b] - coefs[b]) <= rt * coefs[b]);
    }
    for (size_t i = 0; i < L * B; i++)
        assert_true(fabs(res.layer_norms[i] - sqrt(lsq[i])) <= rt * sqrt(lsq[i]) + 1e-30);
    for (size_t l = 0; l < L; l++) {
        if (w[l])
            assert_close(ls[l].weight_grad_out.data, w[l],
                         dc_test_tensor_numel(&ls[l].weight_grad_out), rt);
        if (bb[l])
            assert_close(ls[l].bias_grad_out.data, bb[l],
                         dc_test_tensor_numel(&ls[l].bias_grad_out), rt);
        free(w[l]);
        free(bb[l]);
        dc_test_layer_free(&ls[l]);
    }
    dc_step_result_free(&res);
    dc_backend_destroy(be);
}

static void test_tied(void **state) {
    (void)state;
    static const dc_dtype dts[] = {DC_F32, DC_BF16, DC_F16};
    for (int k = 0; k < 12; k++) {
        int64_t Te = 5 + k % 3, Tl = k % 4 == 3 ? 1 : Te + k % 2; /* Tl = 1: the rank-1 form */
        run_tied(6 + (uint32_t)(k % 3), Te, Tl, dts[k % 3], k % 2, (k / 2) % 2,
                 k % 5 == 0 ? DC_REDUCTION_MEAN : DC_REDUCTION_SUM, 500 + (uint64_t)k);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_flat),
        cmocka_unit_test(test_per_layer),
        cmocka_unit_test(test_scratch_reuse),
        cmocka_unit_test(test_output_aliases_input),
        cmocka_unit_test(test_refuses_gpu_steps),
        cmocka_unit_test(test_index_flip),
        cmocka_unit_test(test_value_flip),
        cmocka_unit_test(test_clip_coef_nonfinite),
        cmocka_unit_test(test_scratch_trim),
        cmocka_unit_test(test_phases),
        cmocka_unit_test(test_tied),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
