/* Certified sensitivity on the CPU backend (step.h dc_clip_e, issue 38): for
 * every sample b, c_b ||G_b|| <= C exactly, in double, where G_b is the
 * exact per-sample gradient of the inputs as given (the f64 reference,
 * ref.c) and c_b the coefficient the backend used (PER_LAYER: each layer's
 * against its C_l; a norm group: each member's share of the group's norm).
 *
 * The inputs are adversarial. Exact norms sit at C (1 + delta) for deltas
 * from -1e-3 to 1e-3 (and a few far from C). In the absorption layers every
 * gradient entry is one long sum of positive terms: large ones every 128
 * rows (or features) and tiny ones in between, each under half an ulp of
 * any f32 partial sum that already holds a large one, so an f32
 * accumulation in any order that meets a large term first drops them, and
 * the computed norm lands below the exact one (by 4e-6 to 8e-6 here), just
 * under C for the samples with 0 < delta < that. Today's coefficient,
 * min(1, C / (n + 1e-6)), releases those samples above C: each absorption
 * case asserts that it would, so that the inputs stay adversarial, and that
 * the backend's does not. The other cases (every layer kind, dtype, MEAN,
 * tied weights, per-layer clipping, a norm group) place random data at C
 * (1 + delta) by scaling each sample's output gradients.
 *
 * Utility: a clipped sample's c_b ||G_b|| is at least C (1 - 2 e) - the
 * bound costs at most a factor 1 + e on C. */
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

#define NB 24      /* samples a step */
#define PERIOD 128 /* rows (features) between large terms */

/* delta_b: exact norm / C - 1 */
static const double kDelta[NB] = {-1e-3, -1e-4, -3e-5, -1e-5, -5e-6, -2e-6, -1e-6, -3e-7,
                                  0.0,   3e-7,  1e-6,  2e-6,  3e-6,  4e-6,  5e-6,  6e-6,
                                  8e-6,  1e-5,  2e-5,  5e-5,  1e-4,  1e-3,  1e-2,  -1e-2};

static const dc_dtype kDtypes[3] = {DC_F32, DC_BF16, DC_F16};

/* The large and tiny terms of an absorption sum in dtype dt: tiny is under
 * half an ulp of large (f16 has no normal number that small: its least
 * subnormal, 2^-24, against 2, whose half ulp is 2^-23). */
static double as_dtype(double v, dc_dtype dt) {
    unsigned char raw[4];
    dc_store_f32(raw, dt, 0, (float)v);
    return dc_load_f32(raw, dt, 0);
}

static void absorb_terms(dc_dtype dt, double *big, double *tiny) {
    *big = dt == DC_F16 ? 2.0 : 1.0;
    *tiny = as_dtype(dt == DC_F16 ? 0x1p-24 : 0.99 * 0x1p-24, dt);
}

/* --- the checks -------------------------------------------------------------- */

typedef struct verdict {
    int clipped, unclipped;
    int old_over; /* samples today's rule would release above C */
    double worst; /* max c ||G|| / C */
} verdict;

/* Today's coefficient, as the code before the bound computed it. */
static float old_coef(float C, float norm) {
    if (!(norm >= 0.0f && norm <= 3.4e38f)) return 0.0f;
    float c = C / (norm + 1e-6f);
    return c < 1.0f ? c : 1.0f;
}

/* c ||G|| <= C exactly, and >= C (1 - 2 e) when c < 1. */
static void check_one(verdict *v, double c, double n_exact, double C, float norm_reported, double e,
                      const char *what, uint32_t b) {
    const double r = c * n_exact;
    if (!(r <= C))
        print_message("%s sample %u: c %.9g * ||G|| %.12g = %.12g > C %.9g\n", what, b, c, n_exact,
                      r, C);
    assert_true(r <= C);
    if (c < 1.0) {
        if (!(r >= C * (1.0 - 2.0 * e) - 1e-6))
            print_message("%s sample %u: c ||G|| = %.12g, below C (1 - 2e) = %.12g\n", what, b, r,
                          C * (1.0 - 2.0 * e));
        assert_true(r >= C * (1.0 - 2.0 * e) - 1e-6);
        v->clipped++;
    } else {
        v->unclipped++;
    }
    if ((double)old_coef((float)C, norm_reported) * n_exact > C) v->old_over++;
    if (r / C > v->worst) v->worst = r / C;
}

/* Runs s (FLAT or PER_LAYER) on the CPU backend and checks every sample's
 * (and layer's) coefficient against the exact norms. */
static verdict run_check(const dc_step *s, const char *what) {
    const uint32_t B = s->batch;
    const size_t L = s->n_layers;
    const bool pl = s->mode == DC_CLIP_PER_LAYER;
    dc_backend *be;
    dc_err err;
    dc_step_result res;
    verdict v = {0, 0, 0, 0.0};
    double *norms = calloc(B, sizeof *norms), *lsq = calloc(L * B, sizeof *lsq);
    assert_true(norms && lsq);
    assert_int_equal(dc_cpu_backend_create(1, &be, &err), 0);
    assert_int_equal(dc_step_result_init(&res, B, L, pl), 0);
    int rc = dc_backend_run_step(be, s, &res, &err);
    if (rc) print_message("%s: %s: %s\n", what, err.field, err.msg);
    assert_int_equal(rc, 0);
    dc_ref_step(s, norms, NULL, lsq, NULL, NULL, NULL);
    if (!pl) {
        const double e = dc_clip_e_step(s, 0);
        for (uint32_t b = 0; b < B; b++)
            check_one(&v, res.coefs[b], norms[b], s->max_grad_norm, res.norms[b], e, what, b);
    } else {
        for (size_t l = 0; l < L; l++) {
            const double e = dc_clip_e(s, l, 0);
            for (uint32_t b = 0; b < B; b++)
                check_one(&v, res.layer_coefs[l * B + b], sqrt(lsq[l * B + b]),
                          s->layers[l].max_grad_norm, res.layer_norms[l * B + b], e, what, b);
        }
    }
    print_message("%-44s e %.3g: %d clipped, %d not; worst c||G||/C - 1 = %.3g; today's rule "
                  "releases %d above C\n",
                  what, pl ? dc_clip_e(s, 0, 0) : dc_clip_e_step(s, 0), v.clipped, v.unclipped,
                  v.worst - 1.0, v.old_over);
    dc_step_result_free(&res);
    dc_backend_destroy(be);
    free(norms);
    free(lsq);
    return v;
}

static void step_of(dc_step *s, dc_layer *ls, size_t L, uint32_t B, float C) {
    memset(s, 0, sizeof *s);
    s->batch = B;
    s->n_layers = L;
    s->layers = ls;
    s->mode = DC_CLIP_FLAT;
    s->max_grad_norm = C;
    s->reduction = DC_REDUCTION_SUM;
    s->expected_batch = B;
    s->device = -1;
}

/* --- absorption layers -------------------------------------------------------- */

/* LINEAR [B, T, d] -> p, direct form: a = 1, every column of g_b the same
 * sum over T of `big` every PERIOD rows from row 0, a knob at row 1 and
 * `tiny` elsewhere, so that every entry of G_b is S_b = sum_t g_b[t] and
 * ||G_b|| = sqrt(d p) S_b. The knob puts the exact norm at target[b]. */
static void absorb_direct(dc_layer *l, uint32_t B, int64_t T, int64_t d, int64_t p, dc_dtype dt,
                          const double *target) {
    dc_test_rng r;
    dc_test_rng_seed(&r, 1);
    dc_test_layer_spec sp = {DC_LAYER_LINEAR, B, T, d, p, dt, 0, DC_ALGO_DIRECT, 1, 0};
    dc_test_layer_make(l, &sp, &r);
    double big, tiny;
    absorb_terms(dt, &big, &tiny);
    const double nbig = (double)((T + PERIOD - 1) / PERIOD), ntiny = (double)T - nbig - 1.0;
    for (size_t i = 0; i < (size_t)(B * T * d); i++) dc_store_f32(l->input.data, dt, i, 1.0f);
    for (uint32_t b = 0; b < B; b++) {
        const double knob = target[b] / sqrt((double)(d * p)) - nbig * big - ntiny * tiny;
        assert_true(knob > 0.0);
        for (int64_t t = 0; t < T; t++) {
            const double v = t % PERIOD == 0 ? big : t == 1 ? knob : tiny;
            for (int64_t j = 0; j < p; j++)
                dc_store_f32(l->grad.data, dt, (size_t)(((int64_t)b * T + t) * p + j), (float)v);
        }
    }
}

/* LINEAR [B, T, d] -> p, ghost form: every row of a_b the same absorption
 * pattern over its d features (big every PERIOD features from 0, a knob at
 * feature 1, tiny elsewhere; tiny^2 under half an ulp of big^2), g = 1, so
 * that every Gram entry a_t . a_s is the same sum S_b and ||G_b||^2 = T^2 p
 * S_b. */
static void absorb_ghost(dc_layer *l, uint32_t B, int64_t T, int64_t d, int64_t p, dc_dtype dt,
                         const double *target) {
    dc_test_rng r;
    dc_test_rng_seed(&r, 2);
    dc_test_layer_spec sp = {DC_LAYER_LINEAR, B, T, d, p, dt, 0, DC_ALGO_GHOST, 1, 0};
    dc_test_layer_make(l, &sp, &r);
    const double big = dt == DC_F16 ? 2.0 : 1.0;
    const double tiny = as_dtype(dt == DC_F16 ? 0x1p-12 : 0.99 * 0x1p-12, dt);
    const double nbig = (double)((d + PERIOD - 1) / PERIOD), ntiny = (double)d - nbig - 1.0;
    for (size_t i = 0; i < (size_t)(B * T * p); i++) dc_store_f32(l->grad.data, dt, i, 1.0f);
    for (uint32_t b = 0; b < B; b++) {
        const double s = target[b] * target[b] / ((double)(T * T) * (double)p);
        const double knob2 = s - nbig * big * big - ntiny * tiny * tiny;
        assert_true(knob2 > 0.0);
        for (int64_t t = 0; t < T; t++)
            for (int64_t k = 0; k < d; k++) {
                const double v = k % PERIOD == 0 ? big : k == 1 ? sqrt(knob2) : tiny;
                dc_store_f32(l->input.data, dt, (size_t)(((int64_t)b * T + t) * d + k), (float)v);
            }
    }
}

static void targets(double C, double *t) {
    for (int b = 0; b < NB; b++) t[b] = C * (1.0 + kDelta[b]);
}

/* The direct form's f32 sums over T = 16384 and the ghost form's Grams
 * over d = 16384, in every input dtype: today's rule releases samples above
 * C, the bound none. */
static void test_absorption(void **state) {
    (void)state;
    for (int k = 0; k < 2; k++)
        for (int di = 0; di < 3; di++) {
            const dc_dtype dt = kDtypes[di];
            dc_layer l;
            dc_step s;
            double t[NB];
            char what[96];
            /* C where the knob is of the order of one term (the sum is
             * S_b = 128 large terms, the knob and the tiny ones; the ghost
             * form's n^2 = T^2 p S_b = 12 S_b) */
            const double S = (dt == DC_F16 ? 4.0 : 1.0) * (k == 0 ? 130.0 : 131.0);
            const float C = k == 0 ? (float)(4.0 * S) : (float)sqrt(12.0 * S);
            targets(C, t);
            if (k == 0) absorb_direct(&l, NB, 16384, 4, 4, dt, t);
            else absorb_ghost(&l, NB, 2, 16384, 3, dt, t);
            step_of(&s, &l, 1, NB, C);
            snprintf(what, sizeof what, "%s absorption, %s",
                     k ? "ghost (d = 16384)" : "direct (T = 16384)", dc_dtype_name(dt));
            verdict v = run_check(&s, what);
            assert_true(v.clipped > 0 && v.unclipped > 0);
            assert_true(v.old_over > 0); /* the inputs are adversarial */
            dc_test_layer_free(&l);
        }
}

/* Per-layer clipping with an absorption layer beside a random one, and a
 * MEAN step (the norms of B times the gradients). */
static void test_absorption_per_layer_mean(void **state) {
    (void)state;
    double t[NB];
    dc_layer ls[2];
    dc_step s;
    dc_test_rng r;
    dc_test_rng_seed(&r, 3);
    targets(4.0 * 129.5, t);
    absorb_direct(&ls[0], NB, 4096, 4, 4, DC_F32, t);
    dc_test_layer_spec sp = {DC_LAYER_LAYERNORM, NB, 7, 12, 0, DC_F32, 1, DC_ALGO_AUTO, 1, 0};
    dc_test_layer_make(&ls[1], &sp, &r);
    step_of(&s, ls, 2, NB, 0.0f);
    s.mode = DC_CLIP_PER_LAYER;
    ls[0].max_grad_norm = (float)(4.0 * 129.5);
    ls[1].max_grad_norm = 0.05f;
    verdict v = run_check(&s, "per layer: absorption + layer norm");
    assert_true(v.old_over > 0 && v.clipped > 0 && v.unclipped > 0);
    /* MEAN: the norms are of B = 24 times the gradients given, here the
     * same divided by 16 (exact: the large and tiny terms keep their
     * places in their binades) */
    for (size_t i = 0; i < (size_t)(NB * 4096 * 4); i++) ((float *)ls[0].grad.data)[i] /= 16.0f;
    s.n_layers = 1;
    s.mode = DC_CLIP_FLAT;
    s.reduction = DC_REDUCTION_MEAN;
    s.max_grad_norm = (float)(4.0 * 129.5 * NB / 16.0);
    v = run_check(&s, "mean: absorption");
    assert_true(v.old_over > 0);
    dc_test_layer_free(&ls[0]);
    dc_test_layer_free(&ls[1]);
}

/* --- random layers placed at C ------------------------------------------------- */

/* Scales sample b's output gradients, every layer's, by f[b] (rounded to
 * the dtype): a norm is homogeneous in them, a tied pair's too. */
static void scale_sample_grads(dc_layer *ls, size_t L, uint32_t B, const double *f) {
    for (size_t l = 0; l < L; l++) {
        dc_tensor *g = &ls[l].grad;
        size_t per = dc_cpu_numel(g) / B;
        for (uint32_t b = 0; b < B; b++)
            for (size_t i = 0; i < per; i++) {
                size_t k = (size_t)b * per + i;
                dc_store_f32(g->data, g->dtype, k,
                             (float)(dc_load_f32(g->data, g->dtype, k) * f[b]));
            }
    }
}

/* Each sample's exact total norm to C (1 + delta_b). */
static void place_at_c(dc_step *s) {
    double n[NB], f[NB];
    assert_true(s->batch <= NB);
    dc_ref_step(s, n, NULL, NULL, NULL, NULL, NULL);
    for (uint32_t b = 0; b < s->batch; b++)
        f[b] = n[b] > 0.0 ? s->max_grad_norm * (1.0 + kDelta[b]) / n[b] : 1.0;
    scale_sample_grads(s->layers, s->n_layers, s->batch, f);
}

/* Every layer kind and dtype, alone and together, SUM and MEAN, near C. */
static void test_kinds_near_c(void **state) {
    (void)state;
    static const dc_test_layer_spec specs[] = {
        {DC_LAYER_LINEAR, NB, 300, 40, 24, DC_F32, 1, DC_ALGO_DIRECT, 1, 0},
        {DC_LAYER_LINEAR, NB, 9, 70, 90, DC_F32, 1, DC_ALGO_GHOST, 1, 0},
        {DC_LAYER_LINEAR, NB, 0, 33, 17, DC_F32, 1, DC_ALGO_AUTO, 1, 0}, /* T = 1 */
        {DC_LAYER_EMBEDDING, NB, 40, 16, 9, DC_F32, 0, DC_ALGO_AUTO, 1, 0},
        {DC_LAYER_LAYERNORM, NB, 20, 24, 0, DC_F32, 1, DC_ALGO_AUTO, 1, 0},
        {DC_LAYER_RMSNORM, NB, 20, 24, 0, DC_F32, 0, DC_ALGO_AUTO, 1, 0},
    };
    const size_t NS = sizeof specs / sizeof specs[0];
    for (int di = 0; di < 3; di++)
        for (size_t k = 0; k <= NS; k++) /* each kind alone, then all together */
            for (int red = 0; red < 2; red++) {
                dc_layer ls[8];
                dc_step s;
                dc_test_rng r;
                char what[96];
                size_t L = 0;
                dc_test_rng_seed(&r, 100 + 10 * (uint64_t)k + (uint64_t)di);
                for (size_t i = 0; i < NS; i++) {
                    if (k < NS && i != k) continue;
                    dc_test_layer_spec sp = specs[i];
                    sp.dtype = kDtypes[di];
                    dc_test_layer_make(&ls[L++], &sp, &r);
                }
                step_of(&s, ls, L, NB, 0.75f);
                if (red) {
                    s.reduction = DC_REDUCTION_MEAN;
                    s.expected_batch = 30;
                }
                place_at_c(&s);
                snprintf(what, sizeof what, "%s, %s, %s", k < NS ? ls[0].name : "every kind",
                         dc_dtype_name(kDtypes[di]), red ? "mean" : "sum");
                verdict v = run_check(&s, what);
                assert_true(v.clipped > 0 && v.unclipped > 0);
                for (size_t i = 0; i < L; i++) dc_test_layer_free(&ls[i]);
            }
}

/* A tied embedding and linear layer (the shared weight's norm has the
 * cross term of its two uses), near C, both orders. */
static void test_tied_near_c(void **state) {
    (void)state;
    for (int order = 0; order < 2; order++)
        for (int di = 0; di < 3; di++) {
            dc_layer ls[2];
            dc_step s;
            dc_test_rng r;
            dc_test_rng_seed(&r, 200 + (uint64_t)(3 * order + di));
            dc_test_tied_pair(ls, 0, NB, 12, 10, 16, 23, kDtypes[di], 1, order, &r);
            step_of(&s, ls, 2, NB, 0.5f);
            place_at_c(&s);
            verdict v = run_check(&s, order ? "tied pair, embedding first" : "tied pair");
            assert_true(v.clipped > 0 && v.unclipped > 0);
            dc_test_layer_free(&ls[0]);
            dc_test_layer_free(&ls[1]);
        }
}

/* A norm group of two members (the backends' norm and clip phases, as
 * group.c runs them): member 0 holds the absorption layer, member 1 a
 * random one, whose rounding bounds differ; each clips by the group's
 * totals with the larger bound (group.h), so that both clip a sample by one
 * coefficient and sum_k c_k^2 ||G_k||^2 <= C^2 for every sample
 * (docs/design.md). */
static void test_group_members(void **state) {
    (void)state;
    double t[NB], n2a[NB], n2b[NB], tot[NB], sq0[NB], sq1[NB];
    dc_layer la, lb;
    dc_step s0, s1;
    dc_test_rng r;
    dc_backend *be;
    dc_err err;
    dc_step_result r0, r1;
    int old_over = 0;
    dc_test_rng_seed(&r, 4);
    const double C = 4.0 * 129.5 * 1.0000001;
    /* member 0's part of each norm at 0.999 of the total */
    for (int b = 0; b < NB; b++) t[b] = C * (1.0 + kDelta[b]) * sqrt(0.999);
    absorb_direct(&la, NB, 16384, 4, 4, DC_F32, t);
    dc_test_layer_spec sp = {DC_LAYER_LINEAR, NB, 5, 6, 7, DC_F32, 1, DC_ALGO_AUTO, 1, 0};
    dc_test_layer_make(&lb, &sp, &r);
    step_of(&s0, &la, 1, NB, (float)C);
    step_of(&s1, &lb, 1, NB, (float)C);
    dc_ref_step(&s0, NULL, NULL, sq0, NULL, NULL, NULL);
    dc_ref_step(&s1, NULL, NULL, sq1, NULL, NULL, NULL);
    double f[NB];
    for (int b = 0; b < NB; b++) f[b] = C * (1.0 + kDelta[b]) * sqrt(0.001) / sqrt(sq1[b]);
    scale_sample_grads(&lb, 1, NB, f);
    dc_ref_step(&s1, NULL, NULL, sq1, NULL, NULL, NULL);
    assert_int_equal(dc_cpu_backend_create(1, &be, &err), 0);
    assert_int_equal(be->ops->run_norms(be, &s0, n2a, NULL, &err), 0);
    assert_int_equal(be->ops->run_norms(be, &s1, n2b, NULL, &err), 0);
    for (int b = 0; b < NB; b++) tot[b] = n2a[b] + n2b[b];
    assert_int_equal(dc_step_result_init(&r0, NB, 1, false), 0);
    assert_int_equal(dc_step_result_init(&r1, NB, 1, false), 0);
    const double e0 = dc_clip_e_phase(&s0, 0u, NULL), e1 = dc_clip_e_phase(&s1, 0u, NULL);
    const double eg = e0 > e1 ? e0 : e1;
    assert_true(e0 != e1);
    assert_int_equal(be->ops->run_clip(be, &s0, n2a, tot, eg, NULL, NULL, &r0, &err), 0);
    assert_int_equal(be->ops->run_clip(be, &s1, n2b, tot, eg, NULL, NULL, &r1, &err), 0);
    for (int b = 0; b < NB; b++) {
        assert_true(r0.coefs[b] == r1.coefs[b]);
        assert_true(r0.coefs[b] == dc_clip_coef((float)C, sqrt(tot[b]), eg));
        const double rel = (double)r0.coefs[b] * r0.coefs[b] * sq0[b] +
                           (double)r1.coefs[b] * r1.coefs[b] * sq1[b];
        assert_true(rel <= C * C);
        const double co = old_coef((float)C, (float)sqrt(tot[b]));
        old_over += co * co * (sq0[b] + sq1[b]) > C * C;
    }
    print_message("norm group of two: today's rule releases %d above C\n", old_over);
    assert_true(old_over > 0);
    dc_step_result_free(&r0);
    dc_step_result_free(&r1);
    dc_backend_destroy(be);
    dc_test_layer_free(&la);
    dc_test_layer_free(&lb);
}

/* The bounds themselves: at least the floor, growing with the sums'
 * lengths, infinite (and refused) past any bound. */
static void test_bounds(void **state) {
    (void)state;
    dc_layer l;
    dc_step s;
    dc_test_rng r;
    dc_test_rng_seed(&r, 5);
    dc_test_layer_spec sp = {DC_LAYER_LINEAR, 2, 4, 8, 8, DC_F32, 1, DC_ALGO_DIRECT, 0, 0};
    dc_test_layer_make(&l, &sp, &r);
    step_of(&s, &l, 1, 2, 1.0f);
    assert_true(dc_clip_e(&s, 0, 0) == DC_E_FLOOR_CPU);
    assert_true(dc_clip_e(&s, 0, DC_E_GPU) == DC_E_FLOOR_GPU);
    /* TF32 truncation: a bit over 2^-9 */
    double tf = dc_clip_e(&s, 0, DC_E_GPU | DC_E_TF32);
    assert_true(tf > 0x1p-9 && tf < 0x1p-9 + 1e-4);
    /* kept bf16 gradients: a bit over 2^-8 */
    double kept = dc_clip_e(&s, 0, DC_E_GPU | DC_E_KEPT);
    assert_true(kept > 0x1p-8 && kept < 0x1p-8 + 1e-4);
    /* the direct form's bound grows with T; past K u = 1/2 none exists */
    l.T = 1 << 16; /* gamma = 2^-8 / (1 - 2^-8): an inner product of K terms, K u */
    double e16 = dc_clip_e(&s, 0, 0);
    assert_true(e16 > 0x1p-8 && e16 < 0x1p-8 * 1.01);
    l.T = (int64_t)1 << 23;
    assert_true(isinf(dc_clip_e(&s, 0, 0)));
    dc_err err;
    assert_int_equal(dc_clip_e_check(&s, 0, &err), DC_EINVAL);
    assert_string_equal(err.field, l.name);
    /* a layer another member counts is not in the step's e */
    l.norm_excluded = true;
    assert_true(dc_clip_e_step(&s, 0) == 0.0);
    assert_int_equal(dc_clip_e_check(&s, 0, &err), 0);
    dc_test_layer_free(&l);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bounds),
        cmocka_unit_test(test_absorption),
        cmocka_unit_test(test_absorption_per_layer_mean),
        cmocka_unit_test(test_kinds_near_c),
        cmocka_unit_test(test_tied_near_c),
        cmocka_unit_test(test_group_members),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
