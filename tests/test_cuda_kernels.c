/* The CUDA kernels and backend against the naive double-precision reference
 * (tests/support/ref.h) and the CPU backend (itself checked against the
 * reference in test_cpu_*.c).
 *
 * Error bounds, stated per input dtype (inputs are already rounded to their
 * dtype, so only accumulation order and f32 rounding differ):
 *   squared norms vs the double reference: relative 1e-4 (f32 on the exact
 *     kernels, DPCLIP_CUDA_TF32=0), 2e-3 (f32 on TF32 tensor cores, the
 *     default: operands rounded to 10-bit mantissas), 1e-3 (bf16, f16)
 *     = dc_test_rtol;
 *   clipped sums vs the CPU backend, as ||got - want|| / ||want|| over the
 *     tensor: 1e-4 in f32 outputs; 2e-3 in bf16/f16 outputs, where a one-ulp
 *     rounding flip of a single element is allowed; LINEAR weights from f32
 *     inputs on TF32 add 2e-3 (one TF32 rounding of each operand, ~4e-4
 *     typical);
 *   noise vs daemon/noise.c: 2e-6 absolute per N(0,1) draw in double
 *     (DPCLIP_CUDA_NOISE=exact, libm ulps); 6e-7 * r + 1e-7 for the default
 *     f32 draws, r = sqrt(-2 ln u1) the pair's radius (f32 transcendentals
 *     of 1 ulp; a host emulation with 1-ulp perturbations reached half of it).
 * Every whole-step test also runs with the backend's switches in their old
 * positions (per-layer book-keeping, staged outputs, double noise, exact
 * f32), the configuration the benchmark compares against.
 * Without a CUDA device the test prints "SKIP: no CUDA device" and passes. */
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

#include "dc_cuda.h"
#include "dcc.h"
#include "noise.h"
#include "ref.h"

static dc_backend *g_cuda, *g_cpu;
static int g_tf32 = 1; /* f32 inputs on TF32 tensor cores (the backend's default) */

/* The backend's switches (backend_cuda.cu), read at every step: tf32 for f32
 * inputs; modern = the grouped norms and book-keeping (for every step, however
 * small: DPCLIP_CUDA_GROUPED_MIN=0), the one-pass outputs and the f32 noise,
 * else the per-layer, staged, double-precision paths. */
static void set_switches(int tf32, int modern) {
    setenv("DPCLIP_CUDA_TF32", tf32 ? "1" : "0", 1);
    setenv("DPCLIP_CUDA_GROUPED", modern ? "1" : "0", 1);
    setenv("DPCLIP_CUDA_GROUPED_MIN", "0", 1);
    setenv("DPCLIP_CUDA_ONE_PASS", modern ? "1" : "0", 1);
    setenv("DPCLIP_CUDA_NOISE", modern ? "fast" : "exact", 1);
    g_tf32 = tf32;
}

/* Relative norm tolerance for inputs of dtype t under the current switches. */
static double norm_rtol(dc_dtype t) {
    return t == DC_F32 && g_tf32 ? 2e-3 : dc_test_rtol(t);
}

#define CUDA_OK(x) assert_int_equal((int)(x), (int)cudaSuccess)

static size_t tensor_bytes(const dc_tensor *t) {
    size_t n = dc_dtype_size(t->dtype);
    for (int i = 0; i < t->ndim; i++) n *= (size_t)t->shape[i];
    return n;
}

static int64_t numel(const dc_tensor *t) {
    int64_t n = 1;
    for (int i = 0; i < t->ndim; i++) n *= t->shape[i];
    return n;
}

/* A device copy of a host tensor (same dtype, shape and contents). */
static dc_tensor dev_copy(const dc_tensor *h) {
    dc_tensor d = *h;
    if (!h->data) return d;
    size_t n = tensor_bytes(h);
    CUDA_OK(cudaMalloc(&d.data, n ? n : 1));
    CUDA_OK(cudaMemcpy(d.data, h->data, n, cudaMemcpyHostToDevice));
    return d;
}

static void dev_free(dc_tensor *t) {
    if (t->data) CUDA_OK(cudaFree(t->data));
    t->data = NULL;
}

static dc_layer dev_layer(const dc_layer *h) {
    dc_layer d = *h;
    d.input = dev_copy(&h->input);
    d.grad = dev_copy(&h->grad);
    d.weight_grad_out = dev_copy(&h->weight_grad_out);
    d.bias_grad_out = dev_copy(&h->bias_grad_out);
    return d;
}

static void dev_layer_free(dc_layer *d) {
    dev_free(&d->input);
    dev_free(&d->grad);
    dev_free(&d->weight_grad_out);
    dev_free(&d->bias_grad_out);
}

/* Device tensor contents as f32 on the host (malloc'd). */
static float *dev_to_f32(const dc_tensor *d) {
    int64_t n = numel(d);
    size_t bytes = tensor_bytes(d);
    void *raw = malloc(bytes ? bytes : 1);
    float *out = malloc((size_t)(n ? n : 1) * sizeof *out);
    assert_non_null(raw);
    assert_non_null(out);
    CUDA_OK(cudaMemcpy(raw, d->data, bytes, cudaMemcpyDeviceToHost));
    for (int64_t i = 0; i < n; i++) out[i] = dc_load_f32(raw, d->dtype, (size_t)i);
    free(raw);
    return out;
}

static float *host_to_f32(const dc_tensor *h) {
    int64_t n = numel(h);
    float *out = malloc((size_t)(n ? n : 1) * sizeof *out);
    assert_non_null(out);
    for (int64_t i = 0; i < n; i++) out[i] = dc_load_f32(h->data, h->dtype, (size_t)i);
    return out;
}

static double rel_l2(const float *got, const float *want, int64_t n) {
    double e = 0.0, w = 0.0;
    for (int64_t i = 0; i < n; i++) {
        double d = (double)got[i] - (double)want[i];
        e += d * d;
        w += (double)want[i] * want[i];
    }
    if (isnan(e)) return INFINITY;
    return w > 0.0 ? sqrt(e / w) : sqrt(e);
}

static void step_init(dc_step *s, dc_layer *layers, size_t L, uint32_t B, int device) {
    memset(s, 0, sizeof *s);
    s->batch = B;
    s->n_layers = L;
    s->layers = layers;
    s->mode = DC_CLIP_FLAT;
    s->max_grad_norm = 1.0f;
    s->reduction = DC_REDUCTION_SUM;
    s->expected_batch = B;
    s->noise_key = 0x0123456789abcdefull;
    s->noise_step = 7;
    s->device = device;
}

/* Runs one step on a backend; returns the code, result in *res (caller frees). */
static int run(dc_backend *be, const dc_step *s, dc_step_result *res, dc_err *err) {
    dc_err_clear(err);
    assert_int_equal(dc_step_result_init(res, s->batch, s->n_layers, s->mode == DC_CLIP_PER_LAYER),
                     0);
    return dc_backend_run_step(be, s, res, err);
}

/* --- squared norms vs the reference ---------------------------------------- */

/* GPU squared norms of a one-layer step (no outputs) vs dc_ref_layer_sqnorms. */
static double layer_err(const dc_layer *h, uint32_t B, const double *ref) {
    dc_layer d = dev_layer(h);
    dc_step s;
    dc_step_result res;
    dc_err err;
    double worst = 0.0;
    step_init(&s, &d, 1, B, 0);
    int rc = run(g_cuda, &s, &res, &err);
    if (rc) fprintf(stderr, "run_step failed: %s: %s\n", err.field, err.msg);
    assert_int_equal(rc, 0);
    for (uint32_t b = 0; b < B; b++) {
        double got = (double)res.layer_norms[b] * res.layer_norms[b];
        double e = fabs(got - ref[b]) / (ref[b] > 0.0 ? ref[b] : 1.0);
        if (!(e <= worst)) worst = isnan(e) ? INFINITY : e;
    }
    dc_step_result_free(&res);
    dev_layer_free(&d);
    return worst;
}

static const dc_dtype kDtypes[3] = {DC_BF16, DC_F16, DC_F32};

static void test_linear_norms(void **state) {
    (void)state;
    static const struct {
        uint32_t B;
        int64_t T, d, p;
        int path16; /* expected tensor-core path for bf16/f16 inputs (see dcc.h) */
    } cases[] = {
        {3, 19, 100, 37, 1},    /* odd sizes: element loads, ragged tiles */
        {2, 77, 136, 264, 2},   /* 16-byte rows, not multiples of the tiles */
        {4, 0, 200, 120, 2},    /* 2D input: T = 1 */
        {5, 1, 64, 48, 2},      /* [B,1,d] */
        {1, 16384, 64, 40, 2},  /* long sequence, B = 1 */
        {64, 33, 48, 24, 2},    /* B = 64 */
        {1, 1000, 520, 648, 2}, /* several full tiles both ways */
    };
    static const dc_algo algos[3] = {DC_ALGO_AUTO, DC_ALGO_DIRECT, DC_ALGO_GHOST};
    dc_test_rng r;
    dc_test_rng_seed(&r, 101);
    for (int pass = 0; pass < 2; pass++) { /* TF32 on; then f32 again, exact */
    set_switches(pass == 0, 1);
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        for (int di = pass == 0 ? 0 : 2; di < 3; di++) {
            dc_test_layer_spec sp = {DC_LAYER_LINEAR, cases[c].B, cases[c].T, cases[c].d,
                                     cases[c].p, kDtypes[di], (int)((c + (size_t)di) & 1),
                                     DC_ALGO_AUTO, 0, 0};
            dc_layer h;
            double *ref = calloc(cases[c].B, sizeof *ref);
            assert_non_null(ref);
            dc_test_layer_make(&h, &sp, &r);
            dc_ref_layer_sqnorms(&h, cases[c].B, 1.0, ref);
            dcc_linear x = {h.input.data, h.grad.data, h.input.dtype, h.grad.dtype,
                            (int)cases[c].B, (int)h.T, (int)h.d, (int)h.p, h.has_bias,
                            g_tf32 != 0};
            /* the path is decided on alignment; host pointers from malloc are
             * 16-byte aligned like cudaMalloc's */
            int path = dcc_linear_path(&x);
            /* 2 (mma.sync, 16-byte loads) becomes 3 where wgmma runs */
            assert_int_equal(path == 3 ? 2 : path,
                             kDtypes[di] == DC_F32 ? (g_tf32 ? 4 : 0) : cases[c].path16);
            assert_true(path != 3 || dcc_wgmma_available());
            for (int ai = 0; ai < 3; ai++) {
                h.algo = algos[ai];
                double e = layer_err(&h, cases[c].B, ref);
                printf("linear B=%u T=%lld d=%lld p=%lld %s bias=%d algo=%d(%d) path=%d: "
                       "max rel err %.2e\n",
                       cases[c].B, (long long)cases[c].T, (long long)cases[c].d,
                       (long long)cases[c].p, dc_dtype_name(kDtypes[di]), (int)h.has_bias, ai,
                       (int)dc_cuda_linear_pick(&h), path, e);
                assert_true(e <= norm_rtol(kDtypes[di]));
            }
            free(ref);
            dc_test_layer_free(&h);
        }
    }
    }
    set_switches(1, 1);
}

/* The direct form's tile heights and K splits (clusters of 1-3 CTAs adding
 * partial tiles), forced, on a ragged K range with a bias. */
static void test_direct_splits(void **state) {
    (void)state;
    dc_test_rng r;
    dc_test_layer_spec sp = {DC_LAYER_LINEAR, 2, 2500, 136, 264, DC_BF16, 1, DC_ALGO_DIRECT, 0, 0};
    dc_layer h;
    double ref[2];
    dc_test_rng_seed(&r, 107);
    dc_test_layer_make(&h, &sp, &r);
    dc_ref_layer_sqnorms(&h, 2, 1.0, ref);
    for (int k = 0; k < 6; k++) {
        char split[2] = {(char)('1' + k % 3), 0};
        setenv("DPCLIP_CUDA_DIRECT_TILE", k < 3 ? "128" : "256", 1);
        setenv("DPCLIP_CUDA_DIRECT_SPLIT", split, 1);
        double e = layer_err(&h, 2, ref);
        printf("direct tile=%s split=%s: max rel err %.2e\n", k < 3 ? "128" : "256", split, e);
        assert_true(e <= norm_rtol(DC_BF16));
    }
    unsetenv("DPCLIP_CUDA_DIRECT_TILE");
    unsetenv("DPCLIP_CUDA_DIRECT_SPLIT");
    dc_test_layer_free(&h);
}

/* Activations in one dtype, grads in another: the CUDA-core path. */
static void test_linear_mixed(void **state) {
    (void)state;
    dc_test_rng r;
    dc_test_rng_seed(&r, 202);
    for (int k = 0; k < 2; k++) {
        dc_test_layer_spec sp = {DC_LAYER_LINEAR, 3, 45, 72, 56, DC_BF16, 1, DC_ALGO_AUTO, 0, 0};
        dc_layer h;
        double ref[3];
        dc_test_layer_make(&h, &sp, &r);
        /* regrade the grads to f32 (same values: bf16 -> f32 is exact) */
        dc_tensor g32 = dc_test_tensor_new(DC_F32, h.grad.ndim, h.grad.shape[0], h.grad.shape[1],
                                           h.grad.shape[2]);
        for (int64_t i = 0; i < numel(&h.grad); i++)
            ((float *)g32.data)[i] = dc_load_f32(h.grad.data, h.grad.dtype, (size_t)i);
        dc_test_tensor_free(&h.grad);
        h.grad = g32;
        dc_ref_layer_sqnorms(&h, 3, 1.0, ref);
        h.algo = k ? DC_ALGO_GHOST : DC_ALGO_DIRECT;
        double e = layer_err(&h, 3, ref);
        printf("linear mixed bf16/f32 algo=%d: max rel err %.2e\n", (int)h.algo, e);
        assert_true(e <= dc_test_rtol(DC_BF16));
        dc_test_layer_free(&h);
    }
}

static void test_other_norms(void **state) {
    (void)state;
    static const struct {
        dc_layer_kind kind;
        uint32_t B;
        int64_t T, d, p;
        int bias, distinct;
    } cases[] = {
        {DC_LAYER_EMBEDDING, 4, 50, 40, 30, 0, 0},   /* many repeats */
        {DC_LAYER_EMBEDDING, 3, 20, 64, 1000, 0, 1}, /* all distinct */
        {DC_LAYER_EMBEDDING, 5, 0, 16, 10, 0, 0},    /* [B] indices */
        {DC_LAYER_EMBEDDING, 2, 700, 24, 5, 0, 0},   /* long runs */
        {DC_LAYER_LAYERNORM, 3, 17, 100, 0, 1, 0},
        {DC_LAYER_LAYERNORM, 2, 0, 64, 0, 0, 0},
        {DC_LAYER_LAYERNORM, 2, 100, 300, 0, 1, 0},
        {DC_LAYER_RMSNORM, 3, 17, 100, 0, 0, 0},
        {DC_LAYER_RMSNORM, 1, 70, 520, 0, 0, 0},
    };
    dc_test_rng r;
    dc_test_rng_seed(&r, 303);
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        for (int di = 0; di < 3; di++) {
            for (int seed = 0; seed < 2; seed++) { /* index dtype / padding vary by draw */
                dc_test_layer_spec sp = {cases[c].kind, cases[c].B, cases[c].T, cases[c].d,
                                         cases[c].p, kDtypes[di], cases[c].bias, DC_ALGO_AUTO,
                                         0, cases[c].distinct};
                dc_layer h;
                double *ref = calloc(cases[c].B, sizeof *ref);
                assert_non_null(ref);
                dc_test_layer_make(&h, &sp, &r);
                dc_ref_layer_sqnorms(&h, cases[c].B, 1.0, ref);
                double e = layer_err(&h, cases[c].B, ref);
                printf("%s B=%u T=%lld d=%lld %s pad=%d: max rel err %.2e\n", h.name, cases[c].B,
                       (long long)cases[c].T, (long long)cases[c].d, dc_dtype_name(kDtypes[di]),
                       (int)h.has_padding_idx, e);
                assert_true(e <= norm_rtol(kDtypes[di]));
                free(ref);
                dc_test_layer_free(&h);
            }
        }
    }
}

/* --- whole steps vs the CPU backend ---------------------------------------- */

typedef struct multi {
    dc_layer h[6], d[6];
    size_t L;
    uint32_t B;
    dc_tensor norms_out, coefs_out; /* device */
} multi;

/* Six layers of every kind with outputs, inputs of dtype dt; one output in
 * bf16 and one in f16. */
static void multi_make(multi *m, dc_dtype dt, dc_test_rng *r) {
    static const dc_test_layer_spec specs[6] = {
        {DC_LAYER_LINEAR, 6, 70, 72, 48, DC_F32, 1, DC_ALGO_DIRECT, 1, 0}, /* fused book-keeping */
        {DC_LAYER_LINEAR, 6, 9, 30, 20, DC_F32, 1, DC_ALGO_GHOST, 1, 0}, /* small-T book-keeping */
        {DC_LAYER_LINEAR, 6, 0, 33, 17, DC_F32, 0, DC_ALGO_AUTO, 1, 0},  /* T = 1 */
        {DC_LAYER_EMBEDDING, 6, 12, 16, 25, DC_F32, 0, DC_ALGO_AUTO, 1, 0},
        {DC_LAYER_LAYERNORM, 6, 40, 72, 0, DC_F32, 1, DC_ALGO_AUTO, 1, 0},
        {DC_LAYER_RMSNORM, 6, 40, 48, 0, DC_F32, 0, DC_ALGO_AUTO, 1, 0},
    };
    m->L = 6;
    m->B = 6;
    for (size_t l = 0; l < m->L; l++) {
        dc_test_layer_spec sp = specs[l];
        sp.dtype = dt;
        dc_test_layer_make(&m->h[l], &sp, r);
        m->h[l].max_grad_norm = 0.05f + 0.1f * (float)l;
    }
    /* output dtypes other than f32 */
    dc_tensor *w0 = &m->h[0].weight_grad_out;
    dc_tensor bf = dc_test_tensor_new(DC_BF16, w0->ndim, w0->shape[0], w0->shape[1], 0);
    dc_test_tensor_free(w0);
    *w0 = bf;
    dc_tensor *w4 = &m->h[4].weight_grad_out;
    dc_tensor hf = dc_test_tensor_new(DC_F16, w4->ndim, w4->shape[0], 0, 0);
    dc_test_tensor_free(w4);
    *w4 = hf;
    for (size_t l = 0; l < m->L; l++) m->d[l] = dev_layer(&m->h[l]);
    CUDA_OK(cudaMalloc(&m->norms_out.data, m->B * sizeof(float)));
    CUDA_OK(cudaMalloc(&m->coefs_out.data, m->B * sizeof(float)));
    m->norms_out.dtype = m->coefs_out.dtype = DC_F32;
    m->norms_out.ndim = m->coefs_out.ndim = 1;
    m->norms_out.shape[0] = m->coefs_out.shape[0] = m->B;
}

static void multi_free(multi *m) {
    for (size_t l = 0; l < m->L; l++) {
        dc_test_layer_free(&m->h[l]);
        dev_layer_free(&m->d[l]);
    }
    dev_free(&m->norms_out);
    dev_free(&m->coefs_out);
}

/* Fills every device output with a sentinel. */
static void poison(multi *m, float v) {
    for (size_t l = 0; l < m->L; l++) {
        dc_tensor *o[2] = {&m->d[l].weight_grad_out, &m->d[l].bias_grad_out};
        for (int k = 0; k < 2; k++) {
            if (!o[k]->data) continue;
            int64_t n = numel(o[k]);
            void *raw = malloc(tensor_bytes(o[k]));
            assert_non_null(raw);
            for (int64_t i = 0; i < n; i++) dc_store_f32(raw, o[k]->dtype, (size_t)i, v);
            CUDA_OK(cudaMemcpy(o[k]->data, raw, tensor_bytes(o[k]), cudaMemcpyHostToDevice));
            free(raw);
        }
    }
    float fill[64];
    for (int i = 0; i < 64; i++) fill[i] = v;
    CUDA_OK(cudaMemcpy(m->norms_out.data, fill, m->B * sizeof(float), cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(m->coefs_out.data, fill, m->B * sizeof(float), cudaMemcpyHostToDevice));
}

/* Every output (and norms_out/coefs_out) still holds the sentinel. */
static void assert_untouched(multi *m, float v) {
    for (size_t l = 0; l < m->L; l++) {
        dc_tensor *o[2] = {&m->d[l].weight_grad_out, &m->d[l].bias_grad_out};
        for (int k = 0; k < 2; k++) {
            if (!o[k]->data) continue;
            float *got = dev_to_f32(o[k]);
            for (int64_t i = 0; i < numel(o[k]); i++) assert_true(got[i] == v);
            free(got);
        }
    }
    float got[64];
    CUDA_OK(cudaMemcpy(got, m->norms_out.data, m->B * sizeof(float), cudaMemcpyDeviceToHost));
    for (uint32_t b = 0; b < m->B; b++) assert_true(got[b] == v);
    CUDA_OK(cudaMemcpy(got, m->coefs_out.data, m->B * sizeof(float), cudaMemcpyDeviceToHost));
    for (uint32_t b = 0; b < m->B; b++) assert_true(got[b] == v);
}

static void compare_steps(multi *m, dc_step *hs, dc_step *ds) {
    dc_step_result rh, rd;
    dc_err eh, ed;
    int rc = run(g_cpu, hs, &rh, &eh);
    if (rc) fprintf(stderr, "cpu: %s: %s\n", eh.field, eh.msg);
    assert_int_equal(rc, 0);
    rc = run(g_cuda, ds, &rd, &ed);
    if (rc) fprintf(stderr, "cuda: %s: %s\n", ed.field, ed.msg);
    assert_int_equal(rc, 0);
    double tol_n = 1e-3; /* norms: relative, the loosest input dtype */
    int clipped = 0;
    for (uint32_t b = 0; b < m->B; b++) {
        assert_true(fabs(rd.norms[b] - rh.norms[b]) <= tol_n * rh.norms[b]);
        assert_true(fabs(rd.coefs[b] - rh.coefs[b]) <= tol_n * rh.coefs[b]);
        clipped += rh.coefs[b] < 1.0f;
    }
    for (size_t i = 0; i < m->L * m->B; i++) {
        assert_true(fabs(rd.layer_norms[i] - rh.layer_norms[i]) <= tol_n * rh.layer_norms[i]);
        if (hs->mode == DC_CLIP_PER_LAYER)
            assert_true(fabs(rd.layer_coefs[i] - rh.layer_coefs[i]) <= tol_n * rh.layer_coefs[i]);
    }
    float *no = dev_to_f32(&m->norms_out), *co = dev_to_f32(&m->coefs_out);
    for (uint32_t b = 0; b < m->B; b++) {
        assert_true(no[b] == rd.norms[b]);
        assert_true(co[b] == rd.coefs[b]);
    }
    free(no);
    free(co);
    for (size_t l = 0; l < m->L; l++) {
        dc_tensor *o[2] = {&m->d[l].weight_grad_out, &m->d[l].bias_grad_out};
        dc_tensor *ho[2] = {&m->h[l].weight_grad_out, &m->h[l].bias_grad_out};
        for (int k = 0; k < 2; k++) {
            if (!o[k]->data) continue;
            float *got = dev_to_f32(o[k]), *want = host_to_f32(ho[k]);
            double e = rel_l2(got, want, numel(o[k]));
            double tol = o[k]->dtype == DC_F32 ? 1e-4 : 2e-3;
            if (k == 0 && m->h[l].kind == DC_LAYER_LINEAR && m->h[l].input.dtype == DC_F32 &&
                g_tf32)
                tol += 2e-3;
            printf("  %s.%s (%s): rel l2 err %.2e\n", m->h[l].name, k ? "bias" : "weight",
                   dc_dtype_name(o[k]->dtype), e);
            assert_true(e <= tol);
            free(got);
            free(want);
        }
    }
    printf("  %d of %u samples clipped\n", clipped, m->B);
    dc_step_result_free(&rh);
    dc_step_result_free(&rd);
}

static void test_whole_steps(void **state) {
    (void)state;
    dc_test_rng r;
    dc_test_rng_seed(&r, 404);
    for (int cfg = 0; cfg < 2; cfg++) { /* the default switches, then the old paths */
    set_switches(cfg == 0, cfg == 0);
    for (int di = 0; di < 3; di++) {
        for (int mode = 0; mode < 3; mode++) { /* FLAT+SUM, FLAT+MEAN, PER_LAYER+SUM */
            multi m;
            dc_step hs, ds;
            multi_make(&m, kDtypes[di], &r);
            step_init(&hs, m.h, m.L, m.B, -1);
            step_init(&ds, m.d, m.L, m.B, 0);
            ds.norms_out = m.norms_out;
            ds.coefs_out = m.coefs_out;
            if (mode == 1) {
                hs.reduction = ds.reduction = DC_REDUCTION_MEAN;
                hs.expected_batch = ds.expected_batch = 8;
            }
            if (mode == 2) hs.mode = ds.mode = DC_CLIP_PER_LAYER;
            /* C at the median norm, so that some samples are clipped */
            dc_step_result r0;
            dc_err e0;
            assert_int_equal(run(g_cpu, &hs, &r0, &e0), 0);
            float sorted[6];
            memcpy(sorted, r0.norms, sizeof sorted);
            for (int i = 0; i < 6; i++)
                for (int j = i + 1; j < 6; j++)
                    if (sorted[j] < sorted[i]) {
                        float t = sorted[i];
                        sorted[i] = sorted[j];
                        sorted[j] = t;
                    }
            hs.max_grad_norm = ds.max_grad_norm = 0.5f * (sorted[2] + sorted[3]);
            dc_step_result_free(&r0);
            hs.noise_multiplier = ds.noise_multiplier = 0.5f;
            printf("whole step: %s inputs, mode %d, %s switches\n", dc_dtype_name(kDtypes[di]),
                   mode, cfg == 0 ? "default" : "old");
            compare_steps(&m, &hs, &ds);
            /* the same shapes again: the workspace does not grow */
            size_t ws = dc_cuda_backend_workspace_bytes(g_cuda);
            dc_step_result rr;
            dc_err ee;
            assert_int_equal(run(g_cuda, &ds, &rr, &ee), 0);
            dc_step_result_free(&rr);
            assert_true(dc_cuda_backend_workspace_bytes(g_cuda) == ws);
            multi_free(&m);
        }
    }
    }
    set_switches(1, 1);
}

/* LINEAR clipped sums on their own: the fused tensor-core kernel with one
 * group of samples (plain stores) and with several (atomics), ragged tiles,
 * and the cuBLAS paths (f32; T < 64), against the CPU backend. */
static void test_linear_clipped(void **state) {
    (void)state;
    static const struct {
        uint32_t B;
        int64_t T, d, p;
        dc_dtype dt;
    } cases[] = {
        {1, 100, 64, 136, DC_BF16}, {3, 64, 200, 264, DC_F16}, {2, 300, 136, 72, DC_BF16},
        {4, 65, 256, 128, DC_F32},  {5, 20, 64, 72, DC_BF16},
    };
    dc_test_rng r;
    dc_test_rng_seed(&r, 707);
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
    for (int exact = 0; exact < (cases[c].dt == DC_F32 ? 2 : 1); exact++) {
        set_switches(!exact, 1);
        dc_test_layer_spec sp = {DC_LAYER_LINEAR, cases[c].B, cases[c].T, cases[c].d, cases[c].p,
                                 cases[c].dt, 1, DC_ALGO_AUTO, 1, 0};
        dc_layer h, d;
        dc_step hs, ds;
        dc_step_result rh, rd;
        dc_err eh, ed;
        dc_test_layer_make(&h, &sp, &r);
        d = dev_layer(&h);
        step_init(&hs, &h, 1, cases[c].B, -1);
        step_init(&ds, &d, 1, cases[c].B, 0);
        hs.max_grad_norm = ds.max_grad_norm = 0.5f;
        assert_int_equal(run(g_cpu, &hs, &rh, &eh), 0);
        assert_int_equal(run(g_cuda, &ds, &rd, &ed), 0);
        float *gw = dev_to_f32(&d.weight_grad_out), *ww = host_to_f32(&h.weight_grad_out);
        float *gb = dev_to_f32(&d.bias_grad_out), *wb = host_to_f32(&h.bias_grad_out);
        double ew = rel_l2(gw, ww, numel(&d.weight_grad_out));
        double eb = rel_l2(gb, wb, numel(&d.bias_grad_out));
        printf("clipped sum B=%u T=%lld d=%lld p=%lld %s%s: weight %.2e bias %.2e\n",
               cases[c].B, (long long)cases[c].T, (long long)cases[c].d, (long long)cases[c].p,
               dc_dtype_name(cases[c].dt), cases[c].dt == DC_F32 && g_tf32 ? " (tf32)" : "",
               ew, eb);
        assert_true(ew <= (cases[c].dt == DC_F32 && g_tf32 ? 2e-3 : 1e-4));
        assert_true(eb <= 1e-4);
        free(gw);
        free(ww);
        free(gb);
        free(wb);
        dc_step_result_free(&rh);
        dc_step_result_free(&rd);
        dev_layer_free(&d);
        dc_test_layer_free(&h);
    }
    }
    set_switches(1, 1);
}

/* Many LINEAR layers in one step: the grouped norm and book-keeping
 * launches take the qualifying ones (a launch per 10 layers, and splits
 * where the dtype changes), the others (T < 64 for the book-keeping, widths
 * not multiples of 8, the ghost form for the norms, bias-only outputs) go
 * per layer. Layer norms and every output against the CPU backend, with the
 * grouped launches and without. */
static void test_grouped_many(void **state) {
    (void)state;
    enum { NL = 40 };
    const uint32_t B = 3;
    dc_layer h[NL], d[NL];
    dc_test_rng r;
    dc_test_rng_seed(&r, 808);
    for (int l = 0; l < NL; l++) {
        int64_t T = l % 7 == 3 ? 40 : 64 + 37 * (l % 5);
        int64_t din = 64 + 8 * (l % 9), p = l % 11 == 5 ? 44 : 40 + 16 * (l % 6);
        dc_dtype dt = l >= 20 && l < 27 ? DC_F16 : DC_BF16;
        dc_algo algo = l % 13 == 7 ? DC_ALGO_GHOST : DC_ALGO_AUTO;
        dc_test_layer_spec sp = {DC_LAYER_LINEAR, B, T, din, p, dt, l % 3 != 0, algo, 1, 0};
        dc_test_layer_make(&h[l], &sp, &r);
        if (l % 4 == 1 && h[l].has_bias) /* the bias sum alone */
            dc_test_tensor_free(&h[l].weight_grad_out);
        d[l] = dev_layer(&h[l]);
    }
    for (int grouped = 1; grouped >= 0; grouped--) {
        dc_step hs, ds;
        dc_step_result rh, rd;
        dc_err eh, ed;
        set_switches(1, 1);
        setenv("DPCLIP_CUDA_GROUPED", grouped ? "1" : "0", 1);
        step_init(&hs, h, NL, B, -1);
        step_init(&ds, d, NL, B, 0);
        hs.max_grad_norm = ds.max_grad_norm = 4.0f;
        assert_int_equal(run(g_cpu, &hs, &rh, &eh), 0);
        int rc = run(g_cuda, &ds, &rd, &ed);
        if (rc) fprintf(stderr, "cuda: %s: %s\n", ed.field, ed.msg);
        assert_int_equal(rc, 0);
        int clipped = 0;
        for (uint32_t b = 0; b < B; b++) {
            assert_true(fabs(rd.norms[b] - rh.norms[b]) <= 1e-3 * rh.norms[b]);
            clipped += rh.coefs[b] < 1.0f;
        }
        for (size_t i = 0; i < (size_t)NL * B; i++)
            assert_true(fabs(rd.layer_norms[i] - rh.layer_norms[i]) <= 1e-3 * rh.layer_norms[i]);
        double worst = 0.0;
        for (int l = 0; l < NL; l++) {
            dc_tensor *o[2] = {&d[l].weight_grad_out, &d[l].bias_grad_out};
            dc_tensor *ho[2] = {&h[l].weight_grad_out, &h[l].bias_grad_out};
            for (int k = 0; k < 2; k++) {
                if (!o[k]->data) continue;
                float *got = dev_to_f32(o[k]), *want = host_to_f32(ho[k]);
                double e = rel_l2(got, want, numel(o[k]));
                if (!(e <= 1e-4))
                    printf("  layer %d %s T=%lld d=%lld p=%lld: rel l2 err %.2e\n", l,
                           k ? "bias" : "weight", (long long)h[l].T, (long long)h[l].d,
                           (long long)h[l].p, e);
                if (!(e <= worst)) worst = isnan(e) ? INFINITY : e;
                free(got);
                free(want);
            }
        }
        printf("grouped=%d: %d layers, %d of %u samples clipped, worst rel l2 err %.2e\n",
               grouped, NL, clipped, B, worst);
        assert_true(worst <= 1e-4);
        dc_step_result_free(&rh);
        dc_step_result_free(&rd);
    }
    set_switches(1, 1);
    for (int l = 0; l < NL; l++) {
        dev_layer_free(&d[l]);
        dc_test_layer_free(&h[l]);
    }
}

/* Outputs the one-pass path cannot prove finite in advance (an f16 weight
 * output with noise std 1e4: 8.6 std > 65504) that are finite: the step
 * takes the staged path and commits; against the CPU backend. */
static void test_staged_fallback(void **state) {
    (void)state;
    dc_test_rng r;
    dc_test_rng_seed(&r, 909);
    dc_test_layer_spec sp = {DC_LAYER_LINEAR, 4, 80, 64, 48, DC_BF16, 1, DC_ALGO_AUTO, 1, 0};
    dc_layer h, d;
    dc_step hs, ds;
    dc_step_result rh, rd;
    dc_err eh, ed;
    dc_test_layer_make(&h, &sp, &r);
    dc_tensor *w = &h.weight_grad_out;
    dc_tensor hf = dc_test_tensor_new(DC_F16, w->ndim, w->shape[0], w->shape[1], 0);
    dc_test_tensor_free(w);
    *w = hf;
    d = dev_layer(&h);
    step_init(&hs, &h, 1, 4, -1);
    step_init(&ds, &d, 1, 4, 0);
    /* 3120 draws of |z| <~ 4.5: |v| < 5e4, finite in f16 */
    hs.noise_multiplier = ds.noise_multiplier = 1e4f;
    assert_int_equal(run(g_cpu, &hs, &rh, &eh), 0);
    int rc = run(g_cuda, &ds, &rd, &ed);
    if (rc) fprintf(stderr, "cuda: %s: %s\n", ed.field, ed.msg);
    assert_int_equal(rc, 0);
    float *gw = dev_to_f32(&d.weight_grad_out), *ww = host_to_f32(&h.weight_grad_out);
    float *gb = dev_to_f32(&d.bias_grad_out), *wb = host_to_f32(&h.bias_grad_out);
    double ew = rel_l2(gw, ww, numel(&d.weight_grad_out));
    double eb = rel_l2(gb, wb, numel(&d.bias_grad_out));
    printf("staged fallback: f16 weight %.2e, f32 bias %.2e\n", ew, eb);
    assert_true(ew <= 2e-3);
    assert_true(eb <= 1e-4);
    free(gw);
    free(ww);
    free(gb);
    free(wb);
    dc_step_result_free(&rh);
    dc_step_result_free(&rd);
    dev_layer_free(&d);
    dc_test_layer_free(&h);
}

/* --- failures -------------------------------------------------------------- */

/* Sets element i of a device tensor (and of its host twin) to v. */
static void plant(dc_tensor *h, dc_tensor *d, size_t i, float v) {
    unsigned char raw[8];
    size_t sz = dc_dtype_size(h->dtype);
    dc_store_f32(h->data, h->dtype, i, v);
    memcpy(raw, (char *)h->data + i * sz, sz);
    CUDA_OK(cudaMemcpy((char *)d->data + i * sz, raw, sz, cudaMemcpyHostToDevice));
}

/* Runs a failing step on both backends: same code, field (and message when
 * exact), nothing written by the GPU; then a good step still runs. */
static void expect_failure(multi *m, dc_step *hs, dc_step *ds, int code, const char *field,
                           int exact_msg) {
    dc_step_result rh, rd;
    dc_err eh, ed;
    poison(m, 1536.0f);
    int rch = run(g_cpu, hs, &rh, &eh), rcd = run(g_cuda, ds, &rd, &ed);
    printf("  cpu: %d %s: %s\n  gpu: %d %s: %s\n", rch, eh.field, eh.msg, rcd, ed.field, ed.msg);
    assert_int_equal(rch, code);
    assert_int_equal(rcd, code);
    assert_string_equal(ed.field, field);
    assert_string_equal(ed.field, eh.field);
    if (exact_msg) assert_string_equal(ed.msg, eh.msg);
    else assert_true(strncmp(ed.msg, eh.msg, 20) == 0);
    assert_untouched(m, 1536.0f);
    dc_step_result_free(&rh);
    dc_step_result_free(&rd);
}

static void test_failures(void **state) {
    (void)state;
    dc_test_rng r;
    dc_test_rng_seed(&r, 505);
    char field[128];
    for (int which = 0; which < 6; which++) {
        multi m;
        dc_step hs, ds;
        multi_make(&m, which == 1 ? DC_F16 : DC_BF16, &r);
        step_init(&hs, m.h, m.L, m.B, -1);
        step_init(&ds, m.d, m.L, m.B, 0);
        ds.norms_out = m.norms_out;
        ds.coefs_out = m.coefs_out;
        switch (which) {
        case 0: /* NaN in a linear grad, sample 2 */
            plant(&m.h[0].grad, &m.d[0].grad, (size_t)(2 * 70 * 48 + 5 * 48 + 7), NAN);
            snprintf(field, sizeof field, "%s.output_grad", m.h[0].name);
            expect_failure(&m, &hs, &ds, DC_ENONFINITE, field, 1);
            break;
        case 1: /* Inf in the activations of a T = 1 layer, and a later NaN */
            plant(&m.h[2].input, &m.d[2].input, (size_t)(4 * 33 + 3), INFINITY);
            plant(&m.h[5].grad, &m.d[5].grad, 11, NAN);
            snprintf(field, sizeof field, "%s.activations", m.h[2].name);
            expect_failure(&m, &hs, &ds, DC_ENONFINITE, field, 1);
            break;
        case 2: { /* NaN in an embedding grad row that is padding */
            dc_layer *e = &m.h[3];
            e->has_padding_idx = m.d[3].has_padding_idx = true;
            e->padding_idx = m.d[3].padding_idx = 3;
            int64_t i = 5; /* make position 5 of sample 1 padding */
            if (e->input.dtype == DC_I32) ((int32_t *)e->input.data)[12 + i] = 3;
            else ((int64_t *)e->input.data)[12 + i] = 3;
            dev_free(&m.d[3].input);
            m.d[3].input = dev_copy(&e->input);
            plant(&e->grad, &m.d[3].grad, (size_t)((12 + i) * 16 + 2), NAN);
            snprintf(field, sizeof field, "%s.output_grad", e->name);
            expect_failure(&m, &hs, &ds, DC_ENONFINITE, field, 1);
            break;
        }
        case 3: { /* embedding index out of range */
            dc_layer *e = &m.h[3];
            if (e->input.dtype == DC_I32) ((int32_t *)e->input.data)[4 * 12 + 9] = 25;
            else ((int64_t *)e->input.data)[4 * 12 + 9] = -1;
            dev_free(&m.d[3].input);
            m.d[3].input = dev_copy(&e->input);
            snprintf(field, sizeof field, "%s.indices", e->name);
            expect_failure(&m, &hs, &ds, DC_EINVAL, field, 1);
            break;
        }
        case 4: /* LayerNorm input */
            plant(&m.h[4].input, &m.d[4].input, 100, -INFINITY);
            snprintf(field, sizeof field, "%s.input", m.h[4].name);
            expect_failure(&m, &hs, &ds, DC_ENONFINITE, field, 1);
            break;
        case 5: /* a clipped sum that overflows f16 (layer 4's weight output) */
            hs.max_grad_norm = ds.max_grad_norm = 1e30f;
            hs.noise_multiplier = ds.noise_multiplier = 1e-20f; /* noise std 1e10 */
            /* layer 0's bf16 output holds 1e10 fine; layer 4's f16 does not */
            snprintf(field, sizeof field, "%s.weight_grad_out", m.h[4].name);
            expect_failure(&m, &hs, &ds, DC_ENONFINITE, field, 0);
            break;
        }
        /* the backend is still usable: a clean step of the same shapes */
        multi clean;
        dc_step cs;
        dc_step_result rr;
        dc_err ee;
        multi_make(&clean, DC_BF16, &r);
        step_init(&cs, clean.d, clean.L, clean.B, 0);
        assert_int_equal(run(g_cuda, &cs, &rr, &ee), 0);
        dc_step_result_free(&rr);
        multi_free(&clean);
        multi_free(&m);
    }
}

/* --- noise, host steps, events ---------------------------------------------- */

static void test_noise_matches_cpu(void **state) {
    (void)state;
    const uint64_t n = 100001;
    float *want = malloc(n * sizeof *want), *got = malloc(n * sizeof *got), *d;
    assert_non_null(want);
    assert_non_null(got);
    CUDA_OK(cudaMalloc((void **)&d, n * sizeof *d));
    for (int mode = 0; mode < 2; mode++) /* DCC_NOISE_FAST, DCC_NOISE_EXACT */
    for (uint32_t stream = 0; stream < 3; stream++) {
        uint64_t key = 0xfeedfacecafebeefull ^ stream, step = 1000 + stream;
        dc_noise_normal(key, step, stream, want, n);
        CUDA_OK(dcc_noise_normal(key, step, stream, d, n, mode, 0));
        CUDA_OK(cudaMemcpy(got, d, n * sizeof *d, cudaMemcpyDeviceToHost));
        double worst = 0.0, worst_ratio = 0.0;
        uint64_t exact = 0;
        for (uint64_t i = 0; i < n; i++) {
            double e = fabs((double)got[i] - want[i]);
            /* the pair's radius; the unpaired last draw gets the largest */
            uint64_t j = i & ~(uint64_t)1;
            double rr = j + 1 < n ? hypot(want[j], want[j + 1]) : 8.58;
            double bound = mode == DCC_NOISE_EXACT ? 2e-6 : 6e-7 * rr + 1e-7;
            if (!(e <= worst)) worst = isnan(e) ? INFINITY : e;
            if (!(e / bound <= worst_ratio)) worst_ratio = isnan(e) ? INFINITY : e / bound;
            exact += got[i] == want[i];
        }
        printf("noise %s stream %u: max abs diff %.2e (%.2f of its bound), %llu of %llu "
               "bit-identical\n",
               mode == DCC_NOISE_EXACT ? "exact" : "fast", stream, worst, worst_ratio,
               (unsigned long long)exact, (unsigned long long)n);
        assert_true(worst_ratio <= 1.0);
    }
    CUDA_OK(cudaFree(d));
    free(want);
    free(got);
}

static void test_host_step_delegates(void **state) {
    (void)state;
    dc_test_rng r;
    dc_test_rng_seed(&r, 606);
    dc_test_layer_spec sp = {DC_LAYER_LINEAR, 4, 10, 12, 8, DC_F32, 1, DC_ALGO_AUTO, 0, 0};
    dc_layer h;
    dc_step s;
    dc_step_result a, b;
    dc_err e;
    dc_test_layer_make(&h, &sp, &r);
    step_init(&s, &h, 1, 4, -1);
    assert_int_equal(run(g_cpu, &s, &a, &e), 0);
    assert_int_equal(run(g_cuda, &s, &b, &e), 0);
    for (int i = 0; i < 4; i++) assert_true(a.norms[i] == b.norms[i]);
    dc_step_result_free(&a);
    dc_step_result_free(&b);
    dc_test_layer_free(&h);
}

static void test_events(void **state) {
    (void)state;
    cudaEvent_t ev;
    CUDA_OK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    assert_int_equal(dc_cuda_backend_record_event(g_cuda, ev), 0);
    assert_int_equal(dc_cuda_backend_wait_event(g_cuda, ev), 0);
    CUDA_OK(cudaEventSynchronize(ev));
    CUDA_OK(cudaEventDestroy(ev));
}

static int setup(void **state) {
    dc_err err;
    (void)state;
    set_switches(1, 1); /* whatever the environment says */
    if (dc_cuda_backend_create(0, &g_cuda, &err)) {
        fprintf(stderr, "dc_cuda_backend_create: %s\n", err.msg);
        return -1;
    }
    if (dc_cpu_backend_create(1, &g_cpu, &err)) return -1;
    return 0;
}

static int teardown(void **state) {
    (void)state;
    dc_backend_destroy(g_cuda);
    dc_backend_destroy(g_cpu);
    return 0;
}

int main(void) {
    if (dc_cuda_device_count() == 0) {
        printf("SKIP: no CUDA device\n");
        return 0;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_noise_matches_cpu),
        cmocka_unit_test(test_events),
        cmocka_unit_test(test_host_step_delegates),
        cmocka_unit_test(test_linear_norms),
        cmocka_unit_test(test_direct_splits),
        cmocka_unit_test(test_linear_mixed),
        cmocka_unit_test(test_other_norms),
        cmocka_unit_test(test_linear_clipped),
        cmocka_unit_test(test_grouped_many),
        cmocka_unit_test(test_staged_fallback),
        cmocka_unit_test(test_whole_steps),
        cmocka_unit_test(test_failures),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
