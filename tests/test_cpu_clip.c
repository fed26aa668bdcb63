/* cpu_clip.c and the CPU backend's clipping: book-keeping sums against the
 * naive reference, coefficients, reductions, PER_LAYER, and the data checks
 * that must fail a step without writing anything. */
#include <math.h>
#include <setjmp.h>
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

static const dc_dtype dtypes[] = {DC_F32, DC_BF16, DC_F16};
/* exactly representable in f32, bf16 and f16 */
#define SENTINEL 28672.0f

/* max|got - want| within rtol of the largest |want| (sums of signed terms
 * can cancel to near zero, where a per-element relative test means little). */
static void assert_close(const float *got, const double *want, int64_t n, double rtol,
                         const char *what) {
    double mx = 0.0;
    for (int64_t i = 0; i < n; i++) mx = fmax(mx, fabs(want[i]));
    assert_true(mx > 0.0);
    double e = dc_test_max_relerr_f(got, want, n, rtol, rtol * mx);
    if (e > 1.0) print_message("%s: error %.3g of tolerance\n", what, e);
    assert_true(e <= 1.0);
}

static size_t weight_numel(const dc_layer *l) { return dc_cpu_numel(&l->weight_grad_out); }

static dc_test_layer_spec spec_for(dc_layer_kind k, dc_dtype dt, int bias) {
    dc_test_layer_spec sp = {k, 5, 6, 9, 7, dt, bias, DC_ALGO_AUTO, 1, 0};
    if (k == DC_LAYER_EMBEDDING) sp.p = 11; /* vocab */
    return sp;
}

/* dc_cpu_layer_clipped_sum vs dc_ref_layer_clipped_sum with arbitrary
 * coefficients, for every kind and input dtype. */
static void test_clipped_sum_kinds(void **state) {
    (void)state;
    for (int k = DC_LAYER_LINEAR; k <= DC_LAYER_RMSNORM; k++)
        for (size_t t = 0; t < 3; t++)
            for (int bias = 0; bias < 2; bias++)
                for (int twod = 0; twod < 2; twod++)
                    for (uint64_t seed = 1; seed <= 3; seed++) {
                        dc_test_layer_spec sp = spec_for((dc_layer_kind)k, dtypes[t], bias);
                        dc_test_rng r;
                        dc_layer l;
                        dc_cpu_scratch s;
                        dc_err e;
                        float c[5];
                        double cd[5];
                        if (twod) sp.T = 0;
                        memset(&s, 0, sizeof s);
                        dc_test_rng_seed(&r, seed * 101 + (uint64_t)k * 7 + t);
                        dc_test_layer_make(&l, &sp, &r);
                        for (int b = 0; b < 5; b++) {
                            c[b] = (float)(dc_test_uniform(&r) * 3.0); /* coef * scale */
                            cd[b] = c[b];
                        }
                        size_t nw = weight_numel(&l);
                        size_t nb = l.bias_grad_out.data ? dc_cpu_numel(&l.bias_grad_out) : 0;
                        float *w = calloc(nw, sizeof *w), *bo = calloc(nb + 1, sizeof *bo);
                        double *ww = calloc(nw, sizeof *ww), *bw = calloc(nb + 1, sizeof *bw);
                        assert_true(w && bo && ww && bw);
                        assert_int_equal(
                            dc_cpu_layer_clipped_sum(&s, &l, 5, c, w, nb ? bo : NULL, &e), 0);
                        dc_ref_layer_clipped_sum(&l, 5, 1.0, cd, ww, nb ? bw : NULL);
                        assert_close(w, ww, (int64_t)nw, dc_test_rtol(dtypes[t]), "weight sum");
                        if (nb) assert_close(bo, bw, (int64_t)nb, dc_test_rtol(dtypes[t]), "bias");
                        assert_int_equal(nb != 0,
                                         bias && (k == DC_LAYER_LINEAR || k == DC_LAYER_LAYERNORM));
                        free(w);
                        free(bo);
                        free(ww);
                        free(bw);
                        dc_cpu_scratch_free(&s);
                        dc_test_layer_free(&l);
                    }
}

/* --- whole steps through the backend ------------------------------------ */

typedef struct fixture {
    dc_layer layers[4];
    size_t n;
    dc_step step;
    float norms_out[16], coefs_out[16];
} fixture;

static void fixture_init(fixture *f, uint32_t B, dc_test_rng *r, dc_dtype dt) {
    memset(f, 0, sizeof *f);
    dc_test_layer_spec sp[4] = {
        {DC_LAYER_LINEAR, B, 5, 8, 6, dt, 1, DC_ALGO_AUTO, 1, 0},
        {DC_LAYER_EMBEDDING, B, 5, 6, 13, dt, 0, DC_ALGO_AUTO, 1, 0},
        {DC_LAYER_LAYERNORM, B, 5, 8, 0, dt, 1, DC_ALGO_AUTO, 1, 0},
        {DC_LAYER_RMSNORM, B, 5, 6, 0, dt, 0, DC_ALGO_AUTO, 1, 0},
    };
    for (int i = 0; i < 4; i++) dc_test_layer_make(&f->layers[i], &sp[i], r);
    f->n = 4;
    f->step.batch = B;
    f->step.n_layers = 4;
    f->step.layers = f->layers;
    f->step.mode = DC_CLIP_FLAT;
    f->step.max_grad_norm = 1.0f;
    f->step.reduction = DC_REDUCTION_SUM;
    f->step.expected_batch = B;
    f->step.device = -1;
    f->step.norms_out = (dc_tensor){f->norms_out, DC_F32, 1, {B, 0, 0}};
    f->step.coefs_out = (dc_tensor){f->coefs_out, DC_F32, 1, {B, 0, 0}};
}

static void fixture_free(fixture *f) {
    for (size_t i = 0; i < f->n; i++) dc_test_layer_free(&f->layers[i]);
}

static void fill_outputs(fixture *f, float v) {
    for (size_t i = 0; i < f->n; i++) {
        dc_tensor *o[2] = {&f->layers[i].weight_grad_out, &f->layers[i].bias_grad_out};
        for (int k = 0; k < 2; k++)
            if (o[k]->data)
                for (size_t j = 0; j < dc_cpu_numel(o[k]); j++)
                    dc_store_f32(o[k]->data, o[k]->dtype, j, v);
    }
    for (int b = 0; b < 16; b++) f->norms_out[b] = f->coefs_out[b] = v;
}

static void assert_outputs_are(const fixture *f, float v) {
    for (size_t i = 0; i < f->n; i++) {
        const dc_tensor *o[2] = {&f->layers[i].weight_grad_out, &f->layers[i].bias_grad_out};
        for (int k = 0; k < 2; k++)
            if (o[k]->data)
                for (size_t j = 0; j < dc_cpu_numel(o[k]); j++)
                    assert_true(dc_load_f32(o[k]->data, o[k]->dtype, j) == v);
    }
    for (uint32_t b = 0; b < f->step.batch; b++) {
        assert_true(f->norms_out[b] == v);
        assert_true(f->coefs_out[b] == v);
    }
}

/* The reference's coefficients under the certified rule (step.h): from
 * its exact norms, c = min(1, C / (n (1 + e) + 1e-6)) with the backend's e
 * (FLAT: the step's; PER_LAYER: each layer's), and its clipped sums with
 * them (divided as dc_ref_step divides). */
static void ref_certified(const dc_step *s, const double *norms, const double *lsq, double *coefs,
                          double *lc, double **w, double **bb) {
    uint32_t B = s->batch;
    bool pl = s->mode == DC_CLIP_PER_LAYER;
    double scale = s->reduction == DC_REDUCTION_MEAN ? (double)B : 1.0;
    double div = s->reduction == DC_REDUCTION_MEAN
                     ? (double)(s->expected_batch ? s->expected_batch : B)
                     : 1.0;
    double e = dc_clip_e_step(s, 0);
    for (uint32_t b = 0; b < B; b++)
        coefs[b] = pl ? 1.0 : fmin(1.0, (double)s->max_grad_norm / (norms[b] * (1.0 + e) + 1e-6));
    for (size_t l = 0; l < s->n_layers; l++) {
        const dc_layer *ly = &s->layers[l];
        double el = dc_clip_e(s, l, 0);
        for (uint32_t b = 0; pl && b < B; b++)
            lc[l * B + b] = fmin(1.0, (double)ly->max_grad_norm /
                                          (sqrt(lsq[l * B + b]) * (1.0 + el) + 1e-6));
        size_t nw = dc_cpu_numel(&ly->weight_grad_out);
        size_t nb = bb[l] ? dc_cpu_numel(&ly->bias_grad_out) : 0;
        dc_ref_layer_clipped_sum(ly, B, scale, pl ? lc + l * B : coefs, w[l], bb[l]);
        for (size_t i = 0; i < nw; i++) w[l][i] /= div;
        for (size_t i = 0; i < nb; i++) bb[l][i] /= div;
    }
}

/* Runs the step and compares everything with dc_ref_step's norms and the
 * certified coefficients and sums (ref_certified). */
static void run_and_compare(fixture *f, dc_dtype dt, int *n_clipped, int *n_unclipped) {
    dc_backend *be;
    dc_err e;
    dc_step_result res;
    const dc_step *s = &f->step;
    uint32_t B = s->batch;
    size_t L = s->n_layers;
    double norms[16], coefs[16], lsq[64], lc[64];
    double *w[4] = {0}, *bb[4] = {0};
    bool pl = s->mode == DC_CLIP_PER_LAYER;

    assert_int_equal(dc_cpu_backend_create(1, &be, &e), 0);
    assert_int_equal(dc_step_result_init(&res, B, L, pl), 0);
    for (size_t l = 0; l < L; l++) {
        w[l] = calloc(weight_numel(&f->layers[l]), sizeof(double));
        if (f->layers[l].bias_grad_out.data)
            bb[l] = calloc(dc_cpu_numel(&f->layers[l].bias_grad_out), sizeof(double));
    }
    fill_outputs(f, SENTINEL);
    int rc = dc_backend_run_step(be, s, &res, &e);
    if (rc) print_message("run_step: %d %s: %s\n", rc, e.field, e.msg);
    assert_int_equal(rc, 0);
    dc_ref_step(s, norms, coefs, lsq, pl ? lc : NULL, NULL, NULL);
    ref_certified(s, norms, lsq, coefs, lc, w, bb);
    double rt = dc_test_rtol(dt);
    for (uint32_t b = 0; b < B; b++) {
        assert_true(fabs(res.norms[b] - norms[b]) <= rt * norms[b]);
        assert_true(fabs(res.coefs[b] - coefs[b]) <= rt * coefs[b]);
        assert_true(f->norms_out[b] == res.norms[b]);
        assert_true(f->coefs_out[b] == res.coefs[b]);
        if (!pl) {
            if (coefs[b] < 1.0) ++*n_clipped;
            else ++*n_unclipped;
        }
    }
    for (size_t i = 0; i < L * B; i++) {
        assert_true(fabs(res.layer_norms[i] - sqrt(lsq[i])) <= rt * sqrt(lsq[i]) + 1e-30);
        if (pl) {
            assert_true(fabs(res.layer_coefs[i] - lc[i]) <= rt * lc[i]);
            if (lc[i] < 1.0) ++*n_clipped;
            else ++*n_unclipped;
        }
    }
    for (size_t l = 0; l < L; l++) {
        assert_close(f->layers[l].weight_grad_out.data, w[l], (int64_t)weight_numel(&f->layers[l]),
                     rt, "weight_grad_out");
        if (bb[l])
            assert_close(f->layers[l].bias_grad_out.data, bb[l],
                         (int64_t)dc_cpu_numel(&f->layers[l].bias_grad_out), rt, "bias_grad_out");
        free(w[l]);
        free(bb[l]);
    }
    dc_step_result_free(&res);
    dc_backend_destroy(be);
}

/* C at the median reference norm: some samples clipped, some not; SUM and
 * MEAN, the latter with an expected batch other than B. */
static void test_flat_mixed_clipping(void **state) {
    (void)state;
    int clipped = 0, unclipped = 0;
    for (size_t t = 0; t < 3; t++)
        for (int red = 0; red < 3; red++)
            for (uint64_t seed = 1; seed <= 3; seed++) {
                fixture f;
                dc_test_rng r;
                double norms[8];
                dc_test_rng_seed(&r, seed + 10 * t);
                fixture_init(&f, 8, &r, dtypes[t]);
                f.step.reduction = red ? DC_REDUCTION_MEAN : DC_REDUCTION_SUM;
                if (red == 2) f.step.expected_batch = 13;
                f.step.max_grad_norm = 1e30f;
                dc_ref_step(&f.step, norms, NULL, NULL, NULL, NULL, NULL);
                double sorted[8];
                memcpy(sorted, norms, sizeof sorted);
                for (int i = 0; i < 8; i++) /* insertion sort */
                    for (int j = i; j > 0 && sorted[j] < sorted[j - 1]; j--) {
                        double x = sorted[j];
                        sorted[j] = sorted[j - 1];
                        sorted[j - 1] = x;
                    }
                f.step.max_grad_norm = (float)(0.5 * (sorted[3] + sorted[4]));
                run_and_compare(&f, dtypes[t], &clipped, &unclipped);
                fixture_free(&f);
            }
    assert_true(clipped > 0);
    assert_true(unclipped > 0);
}

/* MEAN divides the sum by expected_batch and scales the grads by B: the
 * same per-sample data given as SUM grads, or as MEAN grads (g / B), yields
 * outputs that differ by exactly the divisor. */
static void test_mean_vs_sum(void **state) {
    (void)state;
    fixture f;
    dc_test_rng r;
    dc_backend *be;
    dc_err e;
    dc_step_result res;
    uint32_t B = 4;
    dc_test_rng_seed(&r, 99);
    fixture_init(&f, B, &r, DC_F32);
    f.step.max_grad_norm = 0.3f;
    assert_int_equal(dc_cpu_backend_create(1, &be, &e), 0);
    assert_int_equal(dc_step_result_init(&res, B, f.n, false), 0);
    assert_int_equal(dc_backend_run_step(be, &f.step, &res, &e), 0);
    size_t n = weight_numel(&f.layers[0]);
    float *sum_out = malloc(n * sizeof *sum_out), norm_sum[4];
    memcpy(sum_out, f.layers[0].weight_grad_out.data, n * sizeof *sum_out);
    memcpy(norm_sum, res.norms, sizeof norm_sum);
    for (size_t l = 0; l < f.n; l++) { /* g -> g / B; B is a power of two: exact */
        dc_tensor *g = &f.layers[l].grad;
        for (size_t i = 0; i < dc_cpu_numel(g); i++) ((float *)g->data)[i] /= (float)B;
    }
    f.step.reduction = DC_REDUCTION_MEAN;
    f.step.expected_batch = 10;
    assert_int_equal(dc_backend_run_step(be, &f.step, &res, &e), 0);
    for (uint32_t b = 0; b < B; b++)
        assert_true(fabsf(res.norms[b] - norm_sum[b]) <= 1e-5f * norm_sum[b]);
    float mx = 0;
    for (size_t i = 0; i < n; i++) mx = fmaxf(mx, fabsf(sum_out[i]));
    assert_true(mx > 0);
    for (size_t i = 0; i < n; i++)
        assert_true(fabsf(((float *)f.layers[0].weight_grad_out.data)[i] * 10.0f - sum_out[i]) <=
                    1e-5f * mx);
    free(sum_out);
    dc_step_result_free(&res);
    dc_backend_destroy(be);
    fixture_free(&f);
}

static void test_per_layer(void **state) {
    (void)state;
    int clipped = 0, unclipped = 0;
    for (size_t t = 0; t < 3; t++)
        for (int red = 0; red < 2; red++)
            for (uint64_t seed = 1; seed <= 3; seed++) {
                fixture f;
                dc_test_rng r;
                double lsq[4 * 8];
                dc_test_rng_seed(&r, seed * 3 + t);
                fixture_init(&f, 8, &r, dtypes[t]);
                f.step.mode = DC_CLIP_PER_LAYER;
                f.step.reduction = red ? DC_REDUCTION_MEAN : DC_REDUCTION_SUM;
                f.step.max_grad_norm = 0.0f; /* unused in PER_LAYER */
                for (size_t l = 0; l < 4; l++) f.layers[l].max_grad_norm = 1e30f;
                dc_ref_step(&f.step, NULL, NULL, lsq, NULL, NULL, NULL);
                /* each layer's threshold between its samples' norms */
                for (size_t l = 0; l < 4; l++)
                    f.layers[l].max_grad_norm = (float)(0.5 *
                                                        (sqrt(lsq[l * 8]) + sqrt(lsq[l * 8 + 1])));
                run_and_compare(&f, dtypes[t], &clipped, &unclipped);
                fixture_free(&f);
            }
    assert_true(clipped > 0);
    assert_true(unclipped > 0);
}

/* Output tensors in bf16 / f16 receive the rounded f32 results. */
static void test_output_dtypes(void **state) {
    (void)state;
    for (int od = 1; od < 3; od++) {
        dc_test_layer_spec sp = {DC_LAYER_LINEAR, 3, 4, 5, 6, DC_F32, 1, DC_ALGO_AUTO, 0, 0};
        dc_test_rng r;
        dc_layer l;
        dc_backend *be;
        dc_err e;
        dc_step_result res;
        double w[30], bb[6];
        double *wp[1] = {w}, *bp[1] = {bb};
        dc_test_rng_seed(&r, 3);
        dc_test_layer_make(&l, &sp, &r);
        l.weight_grad_out = dc_test_tensor_new(dtypes[od], 2, 6, 5, 0);
        l.bias_grad_out = dc_test_tensor_new(dtypes[od], 1, 6, 0, 0);
        dc_step s = {.batch = 3,
                     .n_layers = 1,
                     .layers = &l,
                     .mode = DC_CLIP_FLAT,
                     .max_grad_norm = 0.5f,
                     .reduction = DC_REDUCTION_SUM,
                     .expected_batch = 3,
                     .device = -1};
        assert_int_equal(dc_cpu_backend_create(1, &be, &e), 0);
        assert_int_equal(dc_step_result_init(&res, 3, 1, false), 0);
        assert_int_equal(dc_backend_run_step(be, &s, &res, &e), 0);
        dc_ref_step(&s, NULL, NULL, NULL, NULL, wp, bp);
        float got[30];
        for (int i = 0; i < 30; i++)
            got[i] = dc_load_f32(l.weight_grad_out.data, dtypes[od], (size_t)i);
        assert_close(got, w, 30, dtypes[od] == DC_BF16 ? 8e-3 : 1e-3, "weight (rounded)");
        for (int i = 0; i < 6; i++)
            got[i] = dc_load_f32(l.bias_grad_out.data, dtypes[od], (size_t)i);
        assert_close(got, bb, 6, dtypes[od] == DC_BF16 ? 8e-3 : 1e-3, "bias (rounded)");
        dc_step_result_free(&res);
        dc_backend_destroy(be);
        dc_test_layer_free(&l);
    }
}

/* --- failures write nothing --------------------------------------------- */

static void expect_failure(fixture *f, int code, const char *field, const char *msg_part) {
    dc_backend *be;
    dc_err e;
    dc_step_result res;
    dc_err_clear(&e);
    assert_int_equal(dc_cpu_backend_create(1, &be, &e), 0);
    assert_int_equal(dc_step_result_init(&res, f->step.batch, f->step.n_layers, false), 0);
    fill_outputs(f, SENTINEL);
    int rc = dc_backend_run_step(be, &f->step, &res, &e);
    if (rc != code || strcmp(e.field, field) != 0 || !strstr(e.msg, msg_part))
        print_message("got %d field '%s' msg '%s'; want %d '%s' '%s'\n", rc, e.field, e.msg, code,
                      field, msg_part);
    assert_int_equal(rc, code);
    assert_int_equal(e.code, code);
    assert_string_equal(e.field, field);
    assert_non_null(strstr(e.msg, msg_part));
    assert_outputs_are(f, SENTINEL);
    dc_step_result_free(&res);
    dc_backend_destroy(be);
}

/* Puts v at (sample b, position t, feature j) of a float tensor [B,T,w]. */
static void poke(dc_tensor *x, int64_t T, int64_t w, uint32_t b, int64_t t, int64_t j, float v) {
    dc_store_f32(x->data, x->dtype, (size_t)(((int64_t)b * T + t) * w + j), v);
}

static void test_nonfinite_inputs(void **state) {
    (void)state;
    const float bad[3] = {NAN, INFINITY, -INFINITY};
    for (size_t t = 0; t < 3; t++)
        for (size_t layer = 0; layer < 4; layer++)
            for (int which = 0; which < 2; which++) {
                fixture f;
                dc_test_rng r;
                char field[128], msg[32];
                uint32_t b = (uint32_t)(layer + 2 * (size_t)which + t) % 6;
                dc_test_rng_seed(&r, 1 + layer);
                fixture_init(&f, 6, &r, dtypes[t]);
                dc_layer *l = &f.layers[layer];
                if (l->kind == DC_LAYER_EMBEDDING && which == 0) { /* no float input */
                    fixture_free(&f);
                    continue;
                }
                dc_tensor *x = which ? &l->grad : &l->input;
                int64_t w = which && l->kind == DC_LAYER_LINEAR ? l->p : l->d;
                poke(x, l->T, w, b, l->T - 1, w - 1, bad[(layer + t) % 3]);
                snprintf(field, sizeof field, "%s.%s", l->name,
                         which ? "output_grad"
                               : (l->kind == DC_LAYER_LINEAR ? "activations" : "input"));
                snprintf(msg, sizeof msg, "sample %u", b);
                expect_failure(&f, DC_ENONFINITE, field, msg);
                fixture_free(&f);
            }
}

static void test_embedding_index_out_of_range(void **state) {
    (void)state;
    const int64_t bad[2] = {-1, 13}; /* vocab is 13 */
    for (int k = 0; k < 2; k++) {
        fixture f;
        dc_test_rng r;
        char field[128];
        dc_test_rng_seed(&r, 42);
        fixture_init(&f, 6, &r, DC_F32);
        dc_layer *l = &f.layers[1];
        size_t pos = 3 * (size_t)l->T + 2; /* sample 3 */
        if (l->input.dtype == DC_I32) ((int32_t *)l->input.data)[pos] = (int32_t)bad[k];
        else ((int64_t *)l->input.data)[pos] = bad[k];
        snprintf(field, sizeof field, "%s.indices", l->name);
        expect_failure(&f, DC_EINVAL, field, "sample 3");
        fixture_free(&f);
    }
}

/* A clipped sum that overflows its f16 output fails the step, and the
 * other layers' outputs (fine on their own) are not written either. */
static void test_output_overflow_writes_nothing(void **state) {
    (void)state;
    fixture f;
    dc_test_rng r;
    char field[128];
    dc_test_rng_seed(&r, 8);
    fixture_init(&f, 4, &r, DC_F32);
    dc_layer *l = &f.layers[3];
    dc_test_tensor_free(&l->weight_grad_out);
    l->weight_grad_out = dc_test_tensor_new(DC_F16, 1, l->d, 0, 0);
    for (size_t i = 0; i < dc_cpu_numel(&l->grad); i++) ((float *)l->grad.data)[i] *= 1e6f;
    f.step.max_grad_norm = 1e30f; /* nothing clipped */
    snprintf(field, sizeof field, "%s.weight_grad_out", l->name);
    expect_failure(&f, DC_ENONFINITE, field, "not finite as f16");
    /* the same step with an f32 output succeeds: the data itself is fine */
    dc_test_tensor_free(&l->weight_grad_out);
    l->weight_grad_out = dc_test_tensor_new(DC_F32, 1, l->d, 0, 0);
    int clipped = 0, unclipped = 0;
    run_and_compare(&f, DC_F32, &clipped, &unclipped);
    fixture_free(&f);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_clipped_sum_kinds),
        cmocka_unit_test(test_flat_mixed_clipping),
        cmocka_unit_test(test_mean_vs_sum),
        cmocka_unit_test(test_per_layer),
        cmocka_unit_test(test_output_dtypes),
        cmocka_unit_test(test_nonfinite_inputs),
        cmocka_unit_test(test_embedding_index_out_of_range),
        cmocka_unit_test(test_output_overflow_writes_nothing),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
