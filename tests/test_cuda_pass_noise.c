/* A sums step's noise ranges on the CUDA backend (issue 38: the owner's
 * sums step adds the noise of the rows its rank owns, dc_layer.noise_w /
 * noise_b): on every output path (the staged dcc_finalize, the one-pass
 * check and write, a whole step with kept per-sample gradients, which a
 * ranged layer never keeps, and the clip phase a STEP_SUMS step runs),
 * each element in a range gets the draw the whole step gives it and the
 * others none, as the CPU backend does (test_step_pass_noise.c); with real
 * data, noised minus noiseless is the host's draw inside and nothing
 * outside. Skips without a GPU. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <cuda_runtime_api.h>

#include "cpu.h"
#include "cuda_test.h"
#include "noise.h"

#define NL 5
#define B 4
#define SIGMA 1.5f
#define E 5.0 /* the expected batch: the noise's divisor */

typedef struct range {
    uint32_t dim;
    uint64_t begin, end;
} range;

/* A bf16 direct Linear the grouped book-keeping may keep (and its bias),
 * an f32 one whose rows of 7 put a range's first element at 21 (odd: the
 * second draw of its pair), an f16 ghost one noised by columns (a weight
 * kept transposed), an embedding, and a LayerNorm with none of its weight
 * and all of its bias. */
static const dc_test_layer_spec kSpecs[NL] = {
    {DC_LAYER_LINEAR, B, 64, 136, 264, DC_BF16, 1, DC_ALGO_DIRECT, 1, 0},
    {DC_LAYER_LINEAR, B, 3, 7, 33, DC_F32, 1, DC_ALGO_AUTO, 1, 0},
    {DC_LAYER_LINEAR, B, 5, 64, 48, DC_F16, 1, DC_ALGO_GHOST, 1, 0},
    {DC_LAYER_EMBEDDING, B, 6, 8, 50, DC_F32, 0, DC_ALGO_AUTO, 1, 0},
    {DC_LAYER_LAYERNORM, B, 4, 40, 0, DC_F32, 1, DC_ALGO_AUTO, 1, 0},
};
static const range kRanges[NL][2] = {
    {{0, 100, 200}, {0, 100, 200}}, {{0, 3, 20}, {0, 3, 20}}, {{1, 16, 40}, {0, 8, 24}},
    {{0, 10, 30}, {0, 0, 0}},       {{0, 0, 0}, {0, 0, 40}},
};

/* Host layers h and their device copies d; zero: every float input and
 * output gradient 0, so that every clipped sum is exactly 0 on every path
 * and an output holds its noise alone. */
static void make(dc_layer *h, dc_layer *d, int zero, uint64_t seed) {
    dc_test_rng r;
    dc_test_rng_seed(&r, seed);
    for (int l = 0; l < NL; l++) {
        dc_test_layer_make(&h[l], &kSpecs[l], &r);
        if (zero) {
            if (h[l].kind != DC_LAYER_EMBEDDING) /* indices stay: they must be in range */
                memset(h[l].input.data, 0, tensor_bytes(&h[l].input));
            memset(h[l].grad.data, 0, tensor_bytes(&h[l].grad));
        }
        d[l] = dev_layer(&h[l]);
    }
}

static void release(dc_layer *h, dc_layer *d) {
    for (int l = 0; l < NL; l++) {
        dc_test_layer_free(&h[l]);
        dev_layer_free(&d[l]);
    }
}

static void set_ranges(dc_layer *ls, int on) {
    for (int l = 0; l < NL; l++) {
        const range *w = &kRanges[l][0], *b = &kRanges[l][1];
        ls[l].noise_w = on ? (dc_noise_range){true, w->dim, w->begin, w->end} : (dc_noise_range){0};
        ls[l].noise_b = on ? (dc_noise_range){true, b->dim, b->begin, b->end} : (dc_noise_range){0};
    }
}

static void step_of(dc_step *s, dc_layer *ls, int dev, float sigma) {
    step_init(s, ls, NL, B, dev ? 0 : -1);
    s->max_grad_norm = 0.5f;
    s->noise_multiplier = sigma;
    s->reduction = DC_REDUCTION_MEAN;
    s->expected_batch = (uint32_t)E;
    s->noise_key = 0x5eedf00dcafe1234ull;
    s->noise_step = 4242;
}

/* Every output (layer order, weight then bias) as f32 on the host. */
static float *outputs(const dc_layer *ls, int dev, int64_t *n) {
    int64_t tot = 0, off = 0;
    for (int l = 0; l < NL; l++)
        for (int o = 0; o < 2; o++) {
            const dc_tensor *t = o ? &ls[l].bias_grad_out : &ls[l].weight_grad_out;
            if (t->data) tot += numel(t);
        }
    float *v = malloc((size_t)tot * sizeof *v);
    assert_non_null(v);
    for (int l = 0; l < NL; l++)
        for (int o = 0; o < 2; o++) {
            const dc_tensor *t = o ? &ls[l].bias_grad_out : &ls[l].weight_grad_out;
            if (!t->data) continue;
            float *x = dev ? dev_to_f32(t) : host_to_f32(t);
            memcpy(v + off, x, (size_t)numel(t) * sizeof *v);
            free(x);
            off += numel(t);
        }
    *n = tot;
    return v;
}

/* One step on a backend (dev: the GPU's layers d, else the host's h):
 * whole (run_step), or as a sums step runs it (the norm phase, then the
 * clip phase with its own totals); its outputs. */
static float *run_on(dc_backend *be, dc_layer *ls, int dev, float sigma, int ranged, int phased,
                     int64_t *n) {
    dc_step s;
    dc_step_result res;
    dc_err err;
    set_ranges(ls, ranged);
    step_of(&s, ls, dev, sigma);
    if (!phased) {
        int rc = run(be, &s, &res, &err);
        if (rc) fprintf(stderr, "%s: %s: %s\n", be->ops->name, err.field, err.msg);
        assert_int_equal(rc, 0);
    } else {
        double n2[NL * B], tot[B] = {0};
        assert_int_equal(be->ops->run_norms(be, &s, n2, NULL, &err), 0);
        for (int l = 0; l < NL; l++)
            for (int b = 0; b < B; b++) tot[b] += n2[l * B + b];
        assert_int_equal(dc_step_result_init(&res, B, NL, false), 0);
        int rc = be->ops->run_clip(be, &s, n2, tot, 0.0, NULL, NULL, &res, &err);
        if (rc) fprintf(stderr, "%s: %s: %s\n", be->ops->name, err.field, err.msg);
        assert_int_equal(rc, 0);
    }
    dc_step_result_free(&res);
    return outputs(ls, dev, n);
}

/* Runs the statements given for every output element, with l, o (0
 * weight, 1 bias), i (its index in the output), inside (in its range) and
 * at (its index in outputs()'s array) in scope. */
#define FOR_ELEMENTS(ls, ...)                                                                      \
    do {                                                                                           \
        int64_t at_ = 0;                                                                           \
        for (int l = 0; l < NL; l++)                                                               \
            for (int o = 0; o < 2; o++) {                                                          \
                const dc_tensor *t_ = o ? &(ls)[l].bias_grad_out : &(ls)[l].weight_grad_out;       \
                if (!t_->data) continue;                                                           \
                const range rg_ = kRanges[l][o];                                                   \
                const int64_t inner_ = t_->ndim == 2 ? t_->shape[1] : 1;                           \
                for (int64_t i = 0; i < numel(t_); i++, at_++) {                                   \
                    const int64_t k_ = rg_.dim ? i % inner_ : i / inner_;                          \
                    const int inside = k_ >= (int64_t)rg_.begin && k_ < (int64_t)rg_.end;          \
                    const int64_t at = at_;                                                        \
                    __VA_ARGS__                                                                    \
                }                                                                                  \
            }                                                                                      \
    } while (0)

/* Zero sums, so each output is its noise alone: on each path, an element
 * in a range holds exactly what the same step without ranges writes there
 * (bit for bit; within 1e-6 of the noise's scale against the kept
 * gradients' sum, which adds it in its own kernel), an element outside
 * holds exactly 0; and both match the CPU backend's ranged step, the same
 * draws of the same key (to the GPU draw's stated error: 2e-6 per N(0, 1)
 * draw in double, 6e-6 in f32). A ranged layer keeps no per-sample
 * gradients. */
static void test_ranges_on_every_path(void **state) {
    (void)state;
    dc_layer h[NL], d[NL];
    const double unit = SIGMA * 0.5 / E; /* the noise's std on an output */
    make(h, d, 1, 303);
    int64_t nc, n;
    float *cpu = run_on(g_cpu, h, 0, SIGMA, 1, 0, &nc);
    /* 0: staged (dcc_finalize, double draws); 1: one pass (check, direct
     * write, f32 draws); 2: one pass with kept gradients; 3: the clip
     * phase (a STEP_SUMS step's), staged; 4: the same, one pass */
    for (int path = 0; path < 5; path++) {
        const int modern = path != 0 && path != 3, phased = path >= 3;
        set_switches(1, modern);
        if (path == 2) {
            g_opts.sgrad = DCC_SGRAD_ALL;
            apply_switches();
        }
        float *whole = run_on(g_cuda, d, 1, SIGMA, 0, phased, &n);
        if (path == 2) assert_true(dc_cuda_backend_kept_layers(g_cuda) >= 1);
        float *ranged = run_on(g_cuda, d, 1, SIGMA, 1, phased, &n);
        if (path == 2) assert_int_equal(dc_cuda_backend_kept_layers(g_cuda), 0);
        assert_int_equal(n, nc);
        const double draw_tol = modern ? 6e-6 : 2e-6; /* per N(0, 1) draw */
        long noised = 0;
        FOR_ELEMENTS(d, {
            if (!inside) {
                if (ranged[at] != 0.0f || cpu[at] != 0.0f) {
                    fprintf(stderr,
                            "path %d, layer %d output %d element %lld outside its range: "
                            "%g (CPU %g)\n",
                            path, l, o, (long long)i, ranged[at], cpu[at]);
                    fail();
                }
                continue;
            }
            if (path == 2) assert_true(fabs((double)ranged[at] - whole[at]) <= 1e-6 * unit);
            else assert_memory_equal(&ranged[at], &whole[at], sizeof(float));
            if (!(fabs((double)ranged[at] - cpu[at]) <= (draw_tol + 1e-6) * unit)) {
                fprintf(stderr, "path %d, layer %d output %d element %lld: GPU %.9g, CPU %.9g\n",
                        path, l, o, (long long)i, ranged[at], cpu[at]);
                fail();
            }
            noised += ranged[at] != 0.0f;
        });
        printf("path %d: %ld elements noised in their ranges, none outside\n", path, noised);
        assert_int_equal(noised, 100 * 136 + 100 + 17 * 7 + 17 + 48 * 24 + 16 + 20 * 8 + 40);
        free(whole);
        free(ranged);
    }
    free(cpu);
    release(h, d);
    set_switches(1, 1);
}

/* Real data through the clip phase a sums step runs: noised minus
 * noiseless is the host's draw for that element (dc_noise_normal of the
 * output's stream) times sigma C / E inside the ranges, and nothing
 * outside, to the roundings of two runs' sums (their norms are added
 * atomically); and the noised outputs match the CPU backend's. */
static void test_real_data_clip_phase(void **state) {
    (void)state;
    dc_layer h[NL], d[NL];
    const double unit = SIGMA * 0.5 / E;
    make(h, d, 0, 304);
    for (int modern = 0; modern < 2; modern++) {
        int64_t n, n0, nc;
        set_switches(1, modern);
        float *quiet = run_on(g_cuda, d, 1, 0.0f, 0, 1, &n0);
        float *noisy = run_on(g_cuda, d, 1, SIGMA, 1, 1, &n);
        float *cpu = run_on(g_cpu, h, 0, SIGMA, 1, 1, &nc);
        assert_true(n == n0 && n == nc);
        dc_step s;
        step_of(&s, d, 1, SIGMA);
        double worst_in = 0.0, worst_out = 0.0;
        float *z = NULL;
        int zl = -1, zo = -1;
        FOR_ELEMENTS(d, {
            if (l != zl || o != zo) { /* this output's draws, as a whole step makes them */
                const dc_noise_src src = dc_step_noise_src(&s, &d[l], (size_t)l, o);
                free(z);
                z = malloc((size_t)numel(t_) * sizeof *z);
                assert_non_null(z);
                dc_noise_normal(src.key, src.step, src.stream, z, (size_t)numel(t_));
                zl = l;
                zo = o;
            }
            const double diff = (double)noisy[at] - quiet[at];
            const double tol = 1e-5 * (fabs(noisy[at]) + fabs(quiet[at]) + unit);
            const double e = fabs(diff - (inside ? SIGMA * 0.5 * z[i] / E : 0.0)) / tol;
            if (inside && e > worst_in) worst_in = e;
            if (!inside && e > worst_out) worst_out = e;
        });
        free(z);
        printf("%s: worst noise error %.2f of its bound in the ranges, %.2f outside\n",
               modern ? "one pass" : "staged", worst_in, worst_out);
        assert_true(worst_in <= 1.0 && worst_out <= 1.0);
        for (int l = 0, at = 0; l < NL; l++)
            for (int o = 0; o < 2; o++) {
                const dc_tensor *t = o ? &d[l].bias_grad_out : &d[l].weight_grad_out;
                if (!t->data) continue;
                const double e = rel_l2(noisy + at, cpu + at, numel(t));
                printf("  layer %d %s: GPU against CPU, rel l2 %.2e\n", l, o ? "bias" : "weight",
                       e);
                assert_true(e <= 2e-3);
                at += (int)numel(t);
            }
        free(quiet);
        free(noisy);
        free(cpu);
    }
    release(h, d);
    set_switches(1, 1);
}

int main(void) {
    if (cuda_test_skip()) return DC_TEST_SKIP;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_ranges_on_every_path),
        cmocka_unit_test(test_real_data_clip_phase),
    };
    return cmocka_run_group_tests(tests, cuda_test_setup_gpu_bounds, cuda_test_teardown);
}
