/* Shared by the GPU tests of the kernels (test_cuda_kernels.c) and of the
 * CUDA backend (test_cuda_backend.c): device copies of reference layers, the
 * backend's switches, and the error bounds stated in those files. Each test
 * binary is one translation unit, so the state below is its own. */
#ifndef DC_CUDA_TEST_H
#define DC_CUDA_TEST_H

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
#include "dc_cuda.h"
#include "dcc.h"
#include "ref.h"

static dc_backend *g_cuda, *g_cpu;
static int g_tf32 = 1; /* f32 inputs on TF32 tensor cores (the backend's default) */

/* The switches g_cuda follows (dcc_options): set with apply_switches after
 * a change; the environment is never read by the tests. */
static dcc_options g_opts;

static inline void apply_switches(void) {
    if (g_cuda) dc_cuda_backend_set_options(g_cuda, &g_opts);
}

/* tf32 for f32 inputs; modern = the grouped norms and book-keeping (for
 * every step, however small: grouped_min 0), the one-pass outputs and the
 * f32 noise, else the per-layer, staged, double-precision paths. The
 * kernels' own choices (tiles, splits, wgmma, TMA) go back to the model's. */
static inline void set_switches(int tf32, int modern) {
    dcc_options_default(&g_opts);
    g_opts.tf32 = tf32 != 0;
    g_opts.grouped = modern != 0;
    g_opts.grouped_min = 0;
    g_opts.one_pass = modern != 0;
    g_opts.noise = modern ? DCC_NOISE_FAST : DCC_NOISE_EXACT;
    /* the clipped sums of kept per-sample gradients (bf16-rounded) have
     * their own test and bounds (test_cuda_sgrad.c) */
    g_opts.sgrad = DCC_SGRAD_OFF;
    g_tf32 = tf32;
    apply_switches();
}

/* f32 inputs on TF32 tensor cores: each operand truncated to 10 mantissa
 * bits loses less than 2^-10 of itself, a product less than 2^-9, a squared
 * norm less than 2^-8 (3.9e-3); clipped sums likewise, relative to the sum
 * of |products| (cuda/norms_tf32.cu). */
#define TF32_RTOL 5e-3

/* Relative norm tolerance for inputs of dtype t under the current switches. */
static inline double norm_rtol(dc_dtype t) {
    return t == DC_F32 && g_tf32 ? TF32_RTOL : dc_test_rtol(t);
}

#define CUDA_OK(x) assert_int_equal((int)(x), (int)cudaSuccess)

static inline size_t tensor_bytes(const dc_tensor *t) {
    size_t n = dc_dtype_size(t->dtype);
    for (int i = 0; i < t->ndim; i++) n *= (size_t)t->shape[i];
    return n;
}

static inline int64_t numel(const dc_tensor *t) {
    int64_t n = 1;
    for (int i = 0; i < t->ndim; i++) n *= t->shape[i];
    return n;
}

/* Host to device, complete on return. A cudaMemcpy from pageable memory
 * may return once the bytes are staged, before the DMA lands, and is
 * ordered only with the legacy default stream: the backend's stream is
 * non-blocking, so a step could read the old contents (seen once: a norm of
 * 0 in a full-suite run on a busy H100). */
static inline void h2d(void *dst, const void *src, size_t n) {
    CUDA_OK(cudaMemcpy(dst, src, n, cudaMemcpyHostToDevice));
    CUDA_OK(cudaDeviceSynchronize());
}

/* A device copy of a host tensor (same dtype, shape and contents). */
static inline dc_tensor dev_copy(const dc_tensor *h) {
    dc_tensor d = *h;
    if (!h->data) return d;
    size_t n = tensor_bytes(h);
    CUDA_OK(cudaMalloc(&d.data, n ? n : 1));
    h2d(d.data, h->data, n);
    return d;
}

static inline void dev_free(dc_tensor *t) {
    if (t->data) CUDA_OK(cudaFree(t->data));
    t->data = NULL;
}

static inline dc_layer dev_layer(const dc_layer *h) {
    dc_layer d = *h;
    d.input = dev_copy(&h->input);
    d.grad = dev_copy(&h->grad);
    d.weight_grad_out = dev_copy(&h->weight_grad_out);
    d.bias_grad_out = dev_copy(&h->bias_grad_out);
    return d;
}

static inline void dev_layer_free(dc_layer *d) {
    dev_free(&d->input);
    dev_free(&d->grad);
    dev_free(&d->weight_grad_out);
    dev_free(&d->bias_grad_out);
}

/* Device tensor contents as f32 on the host (malloc'd). */
static inline float *dev_to_f32(const dc_tensor *d) {
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

/* Sets element i of a device tensor (and of its host twin) to v. */
static inline void plant(dc_tensor *h, dc_tensor *d, size_t i, float v) {
    unsigned char raw[8];
    size_t sz = dc_dtype_size(h->dtype);
    dc_store_f32(h->data, h->dtype, i, v);
    memcpy(raw, (char *)h->data + i * sz, sz);
    h2d((char *)d->data + i * sz, raw, sz);
}

/* Every weight and bias output of device layers d[0..L) set to v. */
static inline void outputs_fill(dc_layer *d, size_t L, float v) {
    for (size_t l = 0; l < L; l++) {
        dc_tensor *o[2] = {&d[l].weight_grad_out, &d[l].bias_grad_out};
        for (int k = 0; k < 2; k++) {
            if (!o[k]->data) continue;
            int64_t n = numel(o[k]);
            void *raw = malloc(tensor_bytes(o[k]));
            assert_non_null(raw);
            for (int64_t i = 0; i < n; i++) dc_store_f32(raw, o[k]->dtype, (size_t)i, v);
            h2d(o[k]->data, raw, tensor_bytes(o[k]));
            free(raw);
        }
    }
}

/* Every weight and bias output of d[0..L) still holds v. */
static inline void assert_outputs_hold(dc_layer *d, size_t L, float v) {
    for (size_t l = 0; l < L; l++) {
        dc_tensor *o[2] = {&d[l].weight_grad_out, &d[l].bias_grad_out};
        for (int k = 0; k < 2; k++) {
            if (!o[k]->data) continue;
            float *got = dev_to_f32(o[k]);
            for (int64_t i = 0; i < numel(o[k]); i++) assert_true(got[i] == v);
            free(got);
        }
    }
}

static inline float *host_to_f32(const dc_tensor *h) {
    int64_t n = numel(h);
    float *out = malloc((size_t)(n ? n : 1) * sizeof *out);
    assert_non_null(out);
    for (int64_t i = 0; i < n; i++) out[i] = dc_load_f32(h->data, h->dtype, (size_t)i);
    return out;
}

/* a and b (host f32 copies of n-element outputs of dtype dt) agree to the
 * roundings two runs may differ by: their norms, added atomically, can
 * differ in the last bit, which moves a value by 1e-6 of itself, or of the
 * noise's scale near 0, and may then flip its rounding to dt. Returns how
 * many differ by more; *exact counts the bit-equal ones. */
static inline long differ(const float *a, const float *b, int64_t n, dc_dtype dt, double scale,
                          long *exact) {
    const double ulp = dt == DC_BF16 ? 0x1p-8 : dt == DC_F16 ? 0x1p-11 : 0.0;
    long bad = 0;
    for (int64_t i = 0; i < n; i++) {
        const double tol = (1e-6 + ulp) * (fabs(a[i]) + scale) + 1e-30;
        bad += !(fabs((double)a[i] - b[i]) <= tol);
        *exact += memcmp(&a[i], &b[i], sizeof a[i]) == 0;
    }
    return bad;
}

static inline double rel_l2(const float *got, const float *want, int64_t n) {
    double e = 0.0, w = 0.0;
    for (int64_t i = 0; i < n; i++) {
        double d = (double)got[i] - (double)want[i];
        e += d * d;
        w += (double)want[i] * want[i];
    }
    if (isnan(e)) return INFINITY;
    return w > 0.0 ? sqrt(e / w) : sqrt(e);
}

static inline void step_init(dc_step *s, dc_layer *layers, size_t L, uint32_t B, int device) {
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
static inline int run(dc_backend *be, const dc_step *s, dc_step_result *res, dc_err *err) {
    dc_err_clear(err);
    assert_int_equal(dc_step_result_init(res, s->batch, s->n_layers, s->mode == DC_CLIP_PER_LAYER),
                     0);
    return dc_backend_run_step(be, s, res, err);
}

/* --- squared norms vs the reference ---------------------------------------- */

/* GPU squared norms of a one-layer step (no outputs) vs dc_ref_layer_sqnorms. */
static inline double layer_err(const dc_layer *h, uint32_t B, const double *ref) {
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

/* A CUDA test's first check: without a device it prints "SKIP: no CUDA
 * device", and main returns DC_TEST_SKIP (77), which ctest reports as
 * skipped, never passed. */
static inline bool cuda_test_skip(void) {
    if (dc_cuda_device_count() > 0) return false;
    printf("SKIP: no CUDA device\n");
    return true;
}

static inline int cuda_test_setup(void **state) {
    dc_err err;
    (void)state;
    if (dc_cuda_backend_create(0, &g_cuda, &err)) {
        fprintf(stderr, "dc_cuda_backend_create: %s\n", err.msg);
        return -1;
    }
    set_switches(1, 1); /* whatever the environment says */
    if (dc_cpu_backend_create(1, &g_cpu, &err)) return -1;
    return 0;
}

/* The same, the CPU backend the GPU's results are compared with clipping
 * by the GPU's rounding bounds (step.h dc_clip_e): both then compute the
 * same coefficients from the same norms. */
static inline int cuda_test_setup_gpu_bounds(void **state) {
    int rc = cuda_test_setup(state);
    if (rc == 0) dc_cpu_backend_set_clip_how(g_cpu, DC_E_GPU | DC_E_TF32);
    return rc;
}

static inline int cuda_test_teardown(void **state) {
    (void)state;
    dc_backend_destroy(g_cuda);
    dc_backend_destroy(g_cpu);
    return 0;
}

#endif
