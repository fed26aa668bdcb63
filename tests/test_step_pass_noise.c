/* A sharded step's noise, added by the daemon in the owner's sums step
 * (issue 38): a STEP_SUMS step of a pass with noise adds N(0, (sigma C)^2)
 * / E to exactly the part of each output its rank owns (Layer.weight_noise
 * / bias_noise: rows, or the columns of a weight kept transposed), each
 * element the draw a whole step would give it, and nothing elsewhere; the
 * pass is charged or covered once per logical step, its sums not at all;
 * every rule is refused naming its field. Through a real daemon (CPU
 * backend), validate.c on its own, and the CPU backend in process. The
 * same on the GPU against this backend: test_cuda_pass_noise.c. */
#include <fcntl.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cmocka.h>

#include "accountant.h"
#include "backend.h"
#include "harness.h"
#include "validate.h"

#define B 6
#define L 4
#define SIGMA 2.0f
#define Q 0.05

static dc_harness g_h;

static int setup(void **state) {
    (void)state;
    return dc_harness_start(&g_h, "--workers 2 --no-gpu");
}

static int teardown(void **state) {
    (void)state;
    return dc_harness_stop(&g_h) == 0 ? 0 : -1;
}

static dpclip_client *connect_ok(const char *job) {
    return dc_harness_connect(&g_h, "test_step_pass_noise", job);
}

/* The noise range of one output of a sums step: dim, [begin, end). */
typedef struct range {
    uint32_t dim;
    uint64_t begin, end;
} range;

/* Four layers with outputs (a large Linear whose owned rows alone hold
 * 131072 values; a small one whose weight is noised by columns, as a
 * weight kept transposed; an embedding; a LayerNorm whose bias this rank
 * owns none of), C the median norm (or C > 0), a mean loss over E = 7,
 * at sample rate Q (each step names its own sigma); and each output's
 * range. */
static const range kRanges[L][2] = {
    {{0, 256, 768}, {0, 256, 768}},
    {{1, 24, 72}, {0, 10, 30}},
    {{0, 100, 200}, {0, 0, 0}},
    {{0, 12, 36}, {0, 0, 0}},
};

static void make(dc_shm_step *s, dpclip_client *c, uint64_t seed, float C) {
    static const dc_test_layer_spec specs[L] = {
        {DC_LAYER_LINEAR, B, 4, 256, 1024, DC_F32, 1, DC_ALGO_DIRECT, 1, 0},
        {DC_LAYER_LINEAR, B, 3, 96, 40, DC_F32, 1, DC_ALGO_GHOST, 1, 0},
        {DC_LAYER_EMBEDDING, B, 5, 64, 300, DC_F32, 0, DC_ALGO_AUTO, 1, 0},
        {DC_LAYER_LAYERNORM, B, 4, 48, 0, DC_F32, 1, DC_ALGO_AUTO, 1, 0},
    };
    dpclip_clip_config cfg = {.max_grad_norm = 1.0f,
                              .reduction = DPCLIP_MEAN,
                              .expected_batch_size = 7,
                              .noise_multiplier = 0.0f,
                              .sample_rate = Q,
                              .target_delta = 1e-5};
    dc_test_rng r;
    dc_test_rng_seed(&r, seed);
    assert_int_equal(dc_shm_step_init(s, c, 8u << 20, B, &cfg), 0);
    for (int l = 0; l < L; l++) assert_true(dc_shm_step_add(s, &specs[l], &r, 1.0f) >= 0);
    cfg.max_grad_norm = C > 0.0f ? C : (float)dc_shm_step_median_norm(s);
    assert_int_equal(dc_shm_step_set_config(s, &cfg), 0);
}

/* A step of phase ph naming layers[0..n) of s at noise multiplier sigma;
 * a sums step with sigma > 0 names each output's range (kRanges, or
 * whole: the output's own rows). dp_world 0: no data parallelism. */
static dpclip_step *phase_step(dc_shm_step *s, dpclip_phase ph, const size_t *layers, size_t n,
                               float sigma, uint32_t dp_world, uint32_t dp_rank, int whole) {
    dpclip_clip_config cfg = s->cfg;
    cfg.noise_multiplier = sigma;
    dpclip_step *p = dpclip_step_new(B, &cfg);
    assert_non_null(p);
    assert_int_equal(dpclip_step_set_phase(p, ph), 0);
    assert_int_equal(dc_shm_step_wire_layers(s, p, layers, n, ph != DPCLIP_STEP_NORMS), 0);
    if (dp_world)
        assert_int_equal(dpclip_step_set_data_parallel(p, dp_world, dp_rank, SIGMA, 0), 0);
    if (ph == DPCLIP_STEP_SUMS && sigma > 0.0f)
        for (size_t k = 0; k < n; k++) {
            const dc_layer *ly = &s->ref.layers[layers[k]];
            for (int o = 0; o < 2; o++) {
                const dc_tensor *t = o ? &ly->bias_grad_out : &ly->weight_grad_out;
                range r = kRanges[layers[k]][o];
                if (!t->data) continue;
                if (whole) r = (range){0, 0, (uint64_t)t->shape[0]};
                assert_int_equal(dpclip_step_set_noise_range(p, k, o, r.dim, r.begin, r.end), 0);
            }
        }
    return p;
}

static void run_ok(dpclip_client *c, dpclip_step *p, dpclip_result *res) {
    memset(res, 0, sizeof *res);
    int rc = dpclip_run(c, p, res);
    if (rc) fprintf(stderr, "step: %s (%s)\n", dpclip_errmsg(c), dpclip_errfield(c));
    assert_int_equal(rc, 0);
}

static void refused(dpclip_client *c, dpclip_step *p, int code, const char *field) {
    dpclip_result res;
    memset(&res, 0, sizeof res);
    int rc = dpclip_run(c, p, &res);
    if (rc != code || strcmp(dpclip_errfield(c), field) != 0)
        fprintf(stderr, "expected %d '%s', got %d '%s': %s\n", code, field, rc, dpclip_errfield(c),
                dpclip_errmsg(c));
    assert_int_equal(rc, code);
    assert_string_equal(dpclip_errfield(c), field);
    dpclip_result_free(&res);
}

/* A norm pass of every layer, then sums steps of layers {0, 2} and {1, 3};
 * the outputs (dc_shm_step_outputs order) into out. */
static void pass_and_sums(dc_shm_step *s, dpclip_client *c, float sigma, uint32_t world,
                          uint32_t rank, float *out, dpclip_result *pass) {
    static const size_t all[L] = {0, 1, 2, 3}, g0[2] = {0, 2}, g1[2] = {1, 3};
    dpclip_result res;
    dc_shm_step_fill_outputs(s, NAN);
    dpclip_step *p = phase_step(s, DPCLIP_STEP_NORMS, all, L, sigma, world, rank, 0);
    run_ok(c, p, pass);
    dpclip_step_free(p);
    for (int g = 0; g < 2; g++) {
        p = phase_step(s, DPCLIP_STEP_SUMS, g ? g1 : g0, 2, sigma, 0, 0, 0);
        run_ok(c, p, &res);
        assert_int_equal(res.step_index, pass->step_index); /* part of the pass's step */
        assert_true(res.epsilon == pass->epsilon);          /* and not charged again */
        dpclip_result_free(&res);
        dpclip_step_free(p);
    }
    dc_shm_step_outputs(s, out);
}

/* Whether element i of output t is in range r (dc_noise_span's rule). */
static int in_range(const dc_tensor *t, range r, int64_t i) {
    int64_t inner = t->ndim == 2 ? t->shape[1] : 1;
    int64_t k = r.dim ? i % inner : i / inner;
    return k >= (int64_t)r.begin && k < (int64_t)r.end;
}

/* The owner's sums: rank 1 of 4 noises its ranges (rows, a transposed
 * weight's columns, an empty one) and nothing else. Outside them each
 * output is bit for bit the noiseless sums (sigma 0); inside, (noised -
 * noiseless) E / (sigma C) is N(0, 1) over 139948 values. */
static void test_owned_rows_noised(void **state) {
    (void)state;
    dpclip_client *c = connect_ok("pass-noise-rows");
    dc_shm_step s;
    dpclip_result pass0, pass1;
    make(&s, c, 31, 0.0f);
    const int64_t n = dc_shm_step_outputs(&s, NULL);
    float *quiet = malloc((size_t)n * sizeof *quiet), *noisy = malloc((size_t)n * sizeof *noisy);
    assert_non_null(quiet);
    assert_non_null(noisy);
    pass_and_sums(&s, c, 0.0f, 0, 0, quiet, &pass0);
    pass_and_sums(&s, c, SIGMA, 4, 1, noisy, &pass1);
    for (int b = 0; b < B; b++) assert_true(pass1.coefs[b] == pass0.coefs[b]);

    const double scale = (double)s.cfg.expected_batch_size / (SIGMA * s.cfg.max_grad_norm);
    double sum = 0.0, sum2 = 0.0;
    int64_t inside = 0, off = 0, outside = 0;
    for (int l = 0; l < L; l++)
        for (int o = 0; o < 2; o++) {
            const dc_layer *ly = &s.ref.layers[l];
            const dc_tensor *t = o ? &ly->bias_grad_out : &ly->weight_grad_out;
            if (!t->data) continue;
            const int64_t m = dc_test_tensor_numel(t);
            for (int64_t i = 0; i < m; i++) {
                const float q = quiet[off + i], v = noisy[off + i];
                assert_true(isfinite(q) && isfinite(v));
                if (!in_range(t, kRanges[l][o], i)) {
                    if (memcmp(&q, &v, sizeof q) != 0) {
                        fprintf(stderr,
                                "layer %d output %d element %lld: %.9g noised outside "
                                "the range (%.9g without noise)\n",
                                l, o, (long long)i, v, q);
                        fail();
                    }
                    outside++;
                    continue;
                }
                const double z = ((double)v - (double)q) * scale;
                sum += z;
                sum2 += z * z;
                inside++;
            }
            off += m;
        }
    assert_int_equal(off, n);
    assert_int_equal(inside, 512 * 256 + 512 + 40 * 48 + 20 + 100 * 64 + 24);
    const double mean = sum / (double)inside, sd = sqrt(sum2 / (double)inside - mean * mean);
    printf("noise: %lld values in range, mean %.4f, std %.4f (want 0, 1); %lld outside, "
           "unnoised\n",
           (long long)inside, mean, sd, (long long)outside);
    assert_true(fabs(sd - 1.0) < 6.0 / sqrt(2.0 * (double)inside));
    assert_true(fabs(mean) < 6.0 / sqrt((double)inside));
    dpclip_result_free(&pass0);
    dpclip_result_free(&pass1);
    free(quiet);
    free(noisy);
    dc_shm_step_free(&s);
    dpclip_disconnect(c);
}

/* What a sums step with noise is refused for, each naming its field; the
 * pass serves on after each. */
static void test_pass_rules(void **state) {
    (void)state;
    dpclip_client *c = connect_ok("pass-noise-rules");
    dc_shm_step s;
    dpclip_result res;
    static const size_t all[L] = {0, 1, 2, 3}, first[1] = {0}, second[1] = {1};
    dpclip_step *p;
    make(&s, c, 32, 0.0f);

    /* a pass outside data parallelism, with noise */
    dpclip_step *norms = phase_step(&s, DPCLIP_STEP_NORMS, all, L, SIGMA, 0, 0, 0);
    run_ok(c, norms, &res);
    assert_true(isfinite(res.epsilon) && res.epsilon > 0.0);
    dpclip_result_free(&res);
    /* sums without the pass's noise, or with less, or more */
    p = phase_step(&s, DPCLIP_STEP_SUMS, first, 1, 0.0f, 0, 0, 0);
    refused(c, p, DPCLIP_EINVAL, "clip_step.noise_multiplier");
    dpclip_step_free(p);
    p = phase_step(&s, DPCLIP_STEP_SUMS, first, 1, SIGMA / 2, 0, 0, 1);
    refused(c, p, DPCLIP_EINVAL, "clip_step.noise_multiplier");
    dpclip_step_free(p);
    p = phase_step(&s, DPCLIP_STEP_SUMS, first, 1, SIGMA * 2, 0, 0, 1);
    refused(c, p, DPCLIP_EINVAL, "clip_step.noise_multiplier");
    dpclip_step_free(p);
    /* outside data parallelism, part of an output: the rest would go
     * unnoised, with no other member to noise it */
    p = phase_step(&s, DPCLIP_STEP_SUMS, first, 1, SIGMA, 0, 0, 0);
    refused(c, p, DPCLIP_EINVAL, "clip_step.layers[0].weight_noise");
    dpclip_step_free(p);
    /* an output without its range */
    {
        dpclip_clip_config cfg = s.cfg;
        cfg.noise_multiplier = SIGMA;
        p = dpclip_step_new(B, &cfg);
        assert_int_equal(dpclip_step_set_phase(p, DPCLIP_STEP_SUMS), 0);
        assert_int_equal(dc_shm_step_wire_layers(&s, p, second, 1, 1), 0);
        assert_int_equal(dpclip_step_set_noise_range(p, 0, 0, 0, 0, 40), 0);
        refused(c, p, DPCLIP_EINVAL, "clip_step.layers[0].bias_noise");
        /* a range outside the output: rows past the end, a column past it */
        assert_int_equal(dpclip_step_set_noise_range(p, 0, 1, 0, 0, 41), 0);
        refused(c, p, DPCLIP_EINVAL, "clip_step.layers[0].bias_noise.end");
        assert_int_equal(dpclip_step_set_noise_range(p, 0, 1, 0, 0, 40), 0);
        assert_int_equal(dpclip_step_set_noise_range(p, 0, 0, 1, 0, 97), 0);
        refused(c, p, DPCLIP_EINVAL, "clip_step.layers[0].weight_noise.end");
        /* columns of a 1-D output */
        assert_int_equal(dpclip_step_set_noise_range(p, 0, 0, 0, 0, 40), 0);
        assert_int_equal(dpclip_step_set_noise_range(p, 0, 1, 1, 0, 1), 0);
        refused(c, p, DPCLIP_EINVAL, "clip_step.layers[0].bias_noise.dim");
        assert_int_equal(dpclip_step_set_noise_range(p, 0, 1, 0, 0, 40), 0);
        /* the client's own checks */
        assert_int_equal(dpclip_step_set_noise_range(p, 0, 0, 2, 0, 1), DPCLIP_EARG);
        assert_int_equal(dpclip_step_set_noise_range(p, 0, 0, 0, 5, 4), DPCLIP_EARG);
        assert_int_equal(dpclip_step_set_noise_range(p, 0, 2, 0, 0, 1), DPCLIP_EARG);
        assert_int_equal(dpclip_step_set_noise_range(p, 1, 0, 0, 0, 1), DPCLIP_EARG);
        /* whole ranges: the sum is released, noised */
        run_ok(c, p, &res);
        dpclip_result_free(&res);
        dpclip_step_free(p);
    }
    p = phase_step(&s, DPCLIP_STEP_SUMS, first, 1, SIGMA, 0, 0, 1);
    run_ok(c, p, &res); /* the refusals took nothing from the pass */
    dpclip_result_free(&res);
    dpclip_step_free(p);
    dpclip_step_free(norms);

    /* a range on a step that is no sums step, or has no noise */
    norms = phase_step(&s, DPCLIP_STEP_NORMS, all, L, 0.0f, 0, 0, 0);
    run_ok(c, norms, &res);
    dpclip_result_free(&res);
    p = phase_step(&s, DPCLIP_STEP_SUMS, first, 1, 0.0f, 0, 0, 0);
    assert_int_equal(dpclip_step_set_noise_range(p, 0, 0, 0, 0, 1024), 0);
    refused(c, p, DPCLIP_EINVAL, "clip_step.layers[0].weight_noise");
    dpclip_step_free(p);
    p = phase_step(&s, DPCLIP_STEP_SUMS, first, 1, SIGMA, 0, 0, 1); /* pass was noiseless */
    refused(c, p, DPCLIP_EINVAL, "clip_step.noise_multiplier");
    dpclip_step_free(p);
    p = phase_step(&s, DPCLIP_STEP_WHOLE, first, 1, SIGMA, 0, 0, 0);
    assert_int_equal(dpclip_step_set_noise_range(p, 0, 0, 0, 0, 1024), 0);
    refused(c, p, DPCLIP_EINVAL, "clip_step.layers[0].weight_noise");
    dpclip_step_free(p);
    dpclip_step_free(norms);
    dc_shm_step_free(&s);
    dpclip_disconnect(c);
    assert_true(dc_harness_alive(&g_h));
}

static double acct_eps(double q, double sigma, double steps) {
    double rdp[DC_RDP_N_ORDERS];
    dc_rdp_steps(q, sigma, dc_rdp_default_orders(), DC_RDP_N_ORDERS, rdp);
    for (int k = 0; k < DC_RDP_N_ORDERS; k++) rdp[k] *= steps;
    return dc_rdp_epsilon(dc_rdp_default_orders(), rdp, DC_RDP_N_ORDERS, 1e-5, NULL);
}

/* Two data-parallel ranks, each noising its own rows in its sums: each
 * logical step is charged once, at the job's sigma, whichever rank's pass
 * comes first; the other's is covered; the sums are charged nothing. */
static void test_charged_once(void **state) {
    (void)state;
    dpclip_client *c[2] = {connect_ok("pass-noise-ledger"), connect_ok("pass-noise-ledger")};
    dc_shm_step s[2];
    float *out[2];
    for (int r = 0; r < 2; r++) { /* both ranks clip to rank 0's median: the members' C */
        make(&s[r], c[r], 40 + (uint64_t)r, r ? s[0].cfg.max_grad_norm : 0.0f);
        out[r] = malloc((size_t)dc_shm_step_outputs(&s[r], NULL) * sizeof(float));
        assert_non_null(out[r]);
    }
    for (int step = 1; step <= 3; step++)
        for (int k = 0; k < 2; k++) {
            const int r = step == 2 ? 1 - k : k; /* rank 1 first in step 2 */
            dpclip_result pass;
            pass_and_sums(&s[r], c[r], SIGMA, 2, (uint32_t)r, out[r], &pass);
            const double want = acct_eps(Q, SIGMA, step);
            if (!(fabs(pass.epsilon - want) <= 1e-9 * want)) {
                fprintf(stderr, "logical step %d, rank %d: epsilon %.17g, want %.17g\n", step, r,
                        pass.epsilon, want);
                fail();
            }
            dpclip_result_free(&pass);
        }
    for (int r = 0; r < 2; r++) {
        free(out[r]);
        dc_shm_step_free(&s[r]);
        dpclip_disconnect(c[r]);
    }
}

/* --- validate.c alone --------------------------------------------------- */

#define BUFSZ (1u << 20)

/* One Linear (B 4, T 3, d 5, p 6, bias, f32 outputs) as a STEP_SUMS step
 * with sigma 1 and whole ranges; each case breaks one thing. */
typedef struct vfx {
    dc_registry reg;
    dc_limits lim;
    Dpclip__TensorRef act, grad, wout, bout;
    int64_t act_shape[3], grad_shape[3], wout_shape[2], bout_shape[1];
    Dpclip__LinearLayer lin;
    Dpclip__NoiseRange wn, bn;
    Dpclip__Layer layer;
    Dpclip__Layer *layers[1];
    Dpclip__ClipConfig clip;
    Dpclip__ClipStep step;
} vfx;

static void ref_init(Dpclip__TensorRef *r, int64_t *shape, uint64_t off, int nd, int64_t a,
                     int64_t b, int64_t c) {
    dpclip__tensor_ref__init(r);
    r->buffer_id = 42;
    r->offset = off;
    r->dtype = DPCLIP__DTYPE__F32;
    r->n_shape = (size_t)nd;
    r->shape = shape;
    shape[0] = a;
    if (nd > 1) shape[1] = b;
    if (nd > 2) shape[2] = c;
}

static void vfx_make(vfx *f) {
    dc_err e;
    int fd = memfd_create("v", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    memset(f, 0, sizeof *f);
    assert_true(fd >= 0);
    assert_int_equal(ftruncate(fd, BUFSZ), 0);
    assert_int_equal(fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK), 0);
    dc_registry_init(&f->reg);
    assert_int_equal(dc_registry_add_shm(&f->reg, 42, fd, 0, NULL, &e), 0);
    close(fd);
    f->lim.max_batch = 64;
    f->lim.max_layers = 8;
    f->lim.max_frame = 1 << 20;
    ref_init(&f->act, f->act_shape, 0, 3, 4, 3, 5);
    ref_init(&f->grad, f->grad_shape, 4096, 3, 4, 3, 6);
    ref_init(&f->wout, f->wout_shape, 8192, 2, 6, 5, 0);
    ref_init(&f->bout, f->bout_shape, 16384, 1, 6, 0, 0);
    dpclip__linear_layer__init(&f->lin);
    f->lin.activations = &f->act;
    f->lin.output_grad = &f->grad;
    f->lin.has_bias = 1;
    f->lin.weight_grad_out = &f->wout;
    f->lin.bias_grad_out = &f->bout;
    dpclip__noise_range__init(&f->wn);
    dpclip__noise_range__init(&f->bn);
    f->wn.end = 6;
    f->bn.end = 6;
    dpclip__layer__init(&f->layer);
    f->layer.kind_case = DPCLIP__LAYER__KIND_LINEAR;
    f->layer.linear = &f->lin;
    f->layer.weight_noise = &f->wn;
    f->layer.bias_noise = &f->bn;
    f->layers[0] = &f->layer;
    dpclip__clip_config__init(&f->clip);
    f->clip.max_grad_norm = 1.0f;
    f->clip.loss_reduction = DPCLIP__LOSS_REDUCTION__SUM;
    dpclip__clip_step__init(&f->step);
    f->step.batch_size = 4;
    f->step.n_layers = 1;
    f->step.layers = f->layers;
    f->step.clip = &f->clip;
    f->step.noise_multiplier = 1.0f;
    f->step.phase = DPCLIP__STEP_PHASE__STEP_SUMS;
}

static void vcheck(vfx *f, const char *field) {
    dc_step st;
    dc_err e;
    dc_err_clear(&e);
    int rc = dc_validate_step(&f->step, &f->reg, &f->lim, &st, &e);
    if (!field) {
        if (rc) fprintf(stderr, "refused: %s: %s\n", e.field, e.msg);
        assert_int_equal(rc, 0);
        dc_validate_step_free(&st);
        return;
    }
    if (rc != DC_EINVAL || strcmp(e.field, field) != 0)
        fprintf(stderr, "expected '%s', got %d '%s': %s\n", field, rc, e.field, e.msg);
    assert_int_equal(rc, DC_EINVAL);
    assert_string_equal(e.field, field);
}

static void test_validate_ranges(void **state) {
    vfx f;
    dc_step st;
    dc_err e;
    (void)state;
    vfx_make(&f);
    vcheck(&f, NULL);
    /* what validation makes of them: the elements each backend noises */
    f.wn.dim = 1;
    f.wn.begin = 1;
    f.wn.end = 4;
    f.bn.begin = 2;
    f.bn.end = 2;
    assert_int_equal(dc_validate_step(&f.step, &f.reg, &f.lim, &st, &e), 0);
    {
        const dc_noise_span w = dc_noise_span_of(&st.layers[0], 0);
        const dc_noise_span b = dc_noise_span_of(&st.layers[0], 1);
        assert_true(st.layers[0].noise_w.set && st.layers[0].noise_b.set);
        assert_true(w.mod == 5 && w.lo == 1 && w.hi == 4);
        assert_true(b.mod == 0 && b.lo == 2 && b.hi == 2);
    }
    dc_validate_step_free(&st);
    f.wn.dim = 0;
    f.wn.begin = 2;
    f.wn.end = 5;
    assert_int_equal(dc_validate_step(&f.step, &f.reg, &f.lim, &st, &e), 0);
    {
        const dc_noise_span w = dc_noise_span_of(&st.layers[0], 0);
        assert_true(w.mod == 0 && w.lo == 10 && w.hi == 25);
    }
    dc_validate_step_free(&st);
    /* outside the output */
    f.wn.begin = 4;
    f.wn.end = 3;
    vcheck(&f, "clip_step.layers[0].weight_noise.begin");
    f.wn.begin = 0;
    f.wn.end = 7;
    vcheck(&f, "clip_step.layers[0].weight_noise.end");
    f.wn.dim = 1;
    f.wn.end = 6;
    vcheck(&f, "clip_step.layers[0].weight_noise.end");
    f.wn.end = 5;
    vcheck(&f, NULL);
    f.wn.dim = 2;
    vcheck(&f, "clip_step.layers[0].weight_noise.dim");
    f.wn.dim = 0;
    f.bn.dim = 1;
    vcheck(&f, "clip_step.layers[0].bias_noise.dim");
    f.bn.dim = 0;
    f.bn.begin = UINT64_MAX;
    f.bn.end = UINT64_MAX;
    vcheck(&f, "clip_step.layers[0].bias_noise.end");
    f.bn.begin = 0;
    f.bn.end = 6;
    /* an output the layer does not name */
    f.lin.bias_grad_out = NULL;
    vcheck(&f, "clip_step.layers[0].bias_noise");
    f.layer.bias_noise = NULL;
    vcheck(&f, NULL);
    /* noise without ranges */
    f.layer.weight_noise = NULL;
    vcheck(&f, "clip_step.layers[0].weight_noise");
    f.layer.weight_noise = &f.wn;
    /* a range on a step that is no sums step, or without noise */
    f.step.phase = DPCLIP__STEP_PHASE__STEP_WHOLE;
    vcheck(&f, "clip_step.layers[0].weight_noise");
    f.step.phase = DPCLIP__STEP_PHASE__STEP_NORMS;
    vcheck(&f, "clip_step.layers[0].weight_noise");
    f.step.phase = DPCLIP__STEP_PHASE__STEP_SUMS;
    f.step.noise_multiplier = 0.0f;
    vcheck(&f, "clip_step.layers[0].weight_noise");
    f.layer.weight_noise = NULL;
    vcheck(&f, NULL); /* noiseless sums name no ranges */
    dc_registry_destroy(&f.reg);
}

/* --- the CPU backend in process ------------------------------------------ */

#define NL 3

static void host_step(dc_step *s, dc_layer *ls, float sigma) {
    memset(s, 0, sizeof *s);
    s->batch = 4;
    s->n_layers = NL;
    s->layers = ls;
    s->mode = DC_CLIP_FLAT;
    s->max_grad_norm = 0.5f;
    s->reduction = DC_REDUCTION_MEAN;
    s->expected_batch = 5;
    s->noise_multiplier = sigma;
    s->noise_key = 0x9e3779b97f4a7c15ull;
    s->noise_step = 12345;
    s->device = -1;
}

/* Every output of ls[0..NL) as f32, layer order, weight then bias. */
static float *host_outputs(const dc_layer *ls, int64_t *n) {
    int64_t tot = 0, off = 0;
    for (int l = 0; l < NL; l++)
        for (int o = 0; o < 2; o++) {
            const dc_tensor *t = o ? &ls[l].bias_grad_out : &ls[l].weight_grad_out;
            if (t->data) tot += dc_test_tensor_numel(t);
        }
    float *v = malloc((size_t)tot * sizeof *v);
    assert_non_null(v);
    for (int l = 0; l < NL; l++)
        for (int o = 0; o < 2; o++) {
            const dc_tensor *t = o ? &ls[l].bias_grad_out : &ls[l].weight_grad_out;
            if (!t->data) continue;
            memcpy(v + off, t->data, (size_t)dc_test_tensor_numel(t) * sizeof *v);
            off += dc_test_tensor_numel(t);
        }
    *n = tot;
    return v;
}

static float *run_host(dc_backend *be, dc_layer *ls, float sigma, int ranged, int64_t *n) {
    static const range rs[NL][2] = {
        {{0, 3, 20}, {0, 3, 20}}, /* rows of 7: from element 21, odd */
        {{1, 3, 8}, {0, 0, 12}},  /* columns; a whole bias */
        {{0, 0, 0}, {0, 0, 0}},   /* none of the embedding */
    };
    dc_step s;
    dc_step_result res;
    dc_err err;
    host_step(&s, ls, sigma);
    for (int l = 0; l < NL; l++) {
        ls[l].noise_w = ranged ? (dc_noise_range){true, rs[l][0].dim, rs[l][0].begin, rs[l][0].end}
                               : (dc_noise_range){0};
        ls[l].noise_b = ranged ? (dc_noise_range){true, rs[l][1].dim, rs[l][1].begin, rs[l][1].end}
                               : (dc_noise_range){0};
    }
    assert_int_equal(dc_step_result_init(&res, s.batch, NL, false), 0);
    int rc = dc_backend_run_step(be, &s, &res, &err);
    if (rc) fprintf(stderr, "%s: %s\n", err.field, err.msg);
    assert_int_equal(rc, 0);
    dc_step_result_free(&res);
    return host_outputs(ls, n);
}

/* With ranges, each element in one gets exactly the value a whole step
 * (no ranges, the same key and step) gives it, noise included, bit for
 * bit; each element outside, exactly the noiseless value. */
static void test_backend_draws_as_whole_step(void **state) {
    (void)state;
    static const dc_test_layer_spec specs[NL] = {
        {DC_LAYER_LINEAR, 4, 3, 7, 33, DC_F32, 1, DC_ALGO_AUTO, 1, 0},
        {DC_LAYER_LINEAR, 4, 2, 10, 12, DC_F32, 1, DC_ALGO_AUTO, 1, 0},
        {DC_LAYER_EMBEDDING, 4, 3, 5, 50, DC_F32, 0, DC_ALGO_AUTO, 1, 0},
    };
    dc_layer ls[NL];
    dc_backend *be;
    dc_err err;
    dc_test_rng r;
    int64_t n, n2, n3, in = 0;
    dc_test_rng_seed(&r, 77);
    for (int l = 0; l < NL; l++) dc_test_layer_make(&ls[l], &specs[l], &r);
    assert_int_equal(dc_cpu_backend_create(1, &be, &err), 0);
    float *whole = run_host(be, ls, 1.5f, 0, &n);
    float *quiet = run_host(be, ls, 0.0f, 0, &n2);
    float *ranged = run_host(be, ls, 1.5f, 1, &n3);
    assert_true(n == n2 && n == n3);
    int64_t off = 0;
    for (int l = 0; l < NL; l++)
        for (int o = 0; o < 2; o++) {
            const dc_tensor *t = o ? &ls[l].bias_grad_out : &ls[l].weight_grad_out;
            const dc_noise_span sp = dc_noise_span_of(&ls[l], o);
            if (!t->data) continue;
            for (int64_t i = 0; i < dc_test_tensor_numel(t); i++) {
                const uint64_t k = sp.mod ? (uint64_t)i % sp.mod : (uint64_t)i;
                const int inside = k >= sp.lo && k < sp.hi;
                const float want = inside ? whole[off + i] : quiet[off + i];
                assert_memory_equal(&ranged[off + i], &want, sizeof want);
                in += inside && whole[off + i] != quiet[off + i];
            }
            off += dc_test_tensor_numel(t);
        }
    assert_true(in == 17 * 7 + 17 + 12 * 5 + 12); /* the noise is there, on those alone */
    free(whole);
    free(quiet);
    free(ranged);
    dc_backend_destroy(be);
    for (int l = 0; l < NL; l++) dc_test_layer_free(&ls[l]);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_validate_ranges),
        cmocka_unit_test(test_backend_draws_as_whole_step),
        cmocka_unit_test(test_owned_rows_noised),
        cmocka_unit_test(test_pass_rules),
        cmocka_unit_test(test_charged_once),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
