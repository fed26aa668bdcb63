/* The CUDA backend (cuda/backend/backend_cuda.cu) as the daemon uses it: whole
 * steps of every layer kind against the CPU backend and the reference, the
 * staged fallback, failures (non-finite inputs and outputs, bad indices:
 * nothing written, the same errors as the CPU backend), host-memory steps
 * and events (the noise kernel: test_cuda_kernels.c). Error bounds: see
 * test_cuda_kernels.c. Every whole-step test also runs with the backend's
 * switches in their old positions (per-layer book-keeping, staged outputs,
 * double noise, exact f32), the configuration the benchmark compares against.
 * Without a CUDA device the test prints "SKIP: no CUDA device" and exits
 * DC_TEST_SKIP (77), which ctest reports as skipped. */
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
#include <cuda_runtime_api.h>

#include "noise.h"
#include "cpu.h"
#include "cuda_test.h"
#include "dcc.h"

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
    outputs_fill(m->d, m->L, v);
    float fill[64];
    for (int i = 0; i < 64; i++) fill[i] = v;
    h2d(m->norms_out.data, fill, m->B * sizeof(float));
    h2d(m->coefs_out.data, fill, m->B * sizeof(float));
}

/* Every output (and norms_out/coefs_out) still holds the sentinel. */
static void assert_untouched(multi *m, float v) {
    assert_outputs_hold(m->d, m->L, v);
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
            if (m->h[l].kind == DC_LAYER_LINEAR && m->h[l].input.dtype == DC_F32 && g_tf32)
                tol += TF32_RTOL; /* the weight's and the bias's sums of TF32 values */
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

/* 16-bit Linear layers whose widths are not multiples of 8 (a vocabulary of
 * 50257): their norms and clipped sums run on padded copies (cuda/kernels/pad.cu), a
 * few samples at a time, and match the CPU backend; an unaligned p, then an
 * unaligned d, with noise, flat and per-layer. */
static void test_padded_layers(void **state) {
    (void)state;
    static const dc_test_layer_spec specs[2] = {
        {DC_LAYER_LINEAR, 6, 128, 96, 3001, DC_BF16, 1, DC_ALGO_AUTO, 1, 0},
        {DC_LAYER_LINEAR, 6, 300, 100, 520, DC_F16, 1, DC_ALGO_DIRECT, 1, 0},
    };
    dc_test_rng r;
    dc_test_rng_seed(&r, 515);
    for (int mode = 0; mode < 2; mode++) {
        multi m;
        memset(&m, 0, sizeof m);
        m.L = 2;
        m.B = 6;
        for (size_t l = 0; l < m.L; l++) {
            dc_test_layer_make(&m.h[l], &specs[l], &r);
            m.h[l].max_grad_norm = 0.05f;
            m.d[l] = dev_layer(&m.h[l]);
            dcc_linear x = {m.d[l].input.data,
                            m.d[l].grad.data,
                            m.d[l].input.dtype,
                            m.d[l].grad.dtype,
                            (int)m.B,
                            (int)m.h[l].T,
                            (int)m.h[l].d,
                            (int)m.h[l].p,
                            true,
                            false,
                            NULL,
                            NULL};
            assert_true(dcc_pad_wanted(&x));
            /* the norms from padded chunks of 4 samples (then 2) are the
             * unpadded kernels' (element loads) */
            const int per = dcc_pad_samples(&x, dcc_pad_sample_bytes(&x) * 4);
            assert_int_equal(per, 4);
            float *n2;
            void *ws;
            CUDA_OK(cudaMalloc((void **)&n2, 2 * m.B * sizeof(float)));
            CUDA_OK(cudaMalloc(&ws, (size_t)per * dcc_pad_sample_bytes(&x)));
            CUDA_OK(cudaMemset(n2, 0, 2 * m.B * sizeof(float)));
            CUDA_OK(dcc_linear_sqnorms(&x, DC_ALGO_DIRECT, 1.0f, n2, 0));
            for (int b0 = 0; b0 < (int)m.B; b0 += per) {
                dcc_linear c;
                int n = (int)m.B - b0 < per ? (int)m.B - b0 : per;
                CUDA_OK(dcc_pad_chunk(&x, b0, n, ws, &c, 0));
                assert_true(c.d % 8 == 0 && c.p % 8 == 0 && c.B == n);
                CUDA_OK(dcc_linear_sqnorms(&c, DC_ALGO_DIRECT, 1.0f, n2 + m.B + b0, 0));
            }
            float got[12];
            CUDA_OK(cudaMemcpy(got, n2, sizeof got, cudaMemcpyDeviceToHost));
            for (uint32_t b = 0; b < m.B; b++)
                assert_true(fabsf(got[m.B + b] - got[b]) <= 1e-3f * got[b] && got[b] > 0.0f);
            CUDA_OK(cudaFree(n2));
            CUDA_OK(cudaFree(ws));
        }
        CUDA_OK(cudaMalloc(&m.norms_out.data, m.B * sizeof(float)));
        CUDA_OK(cudaMalloc(&m.coefs_out.data, m.B * sizeof(float)));
        m.norms_out.dtype = m.coefs_out.dtype = DC_F32;
        m.norms_out.ndim = m.coefs_out.ndim = 1;
        m.norms_out.shape[0] = m.coefs_out.shape[0] = m.B;
        dc_step hs, ds;
        step_init(&hs, m.h, m.L, m.B, -1);
        step_init(&ds, m.d, m.L, m.B, 0);
        ds.norms_out = m.norms_out;
        ds.coefs_out = m.coefs_out;
        if (mode == 1) hs.mode = ds.mode = DC_CLIP_PER_LAYER;
        hs.noise_multiplier = ds.noise_multiplier = 0.5f;
        printf("padded layers: mode %d\n", mode);
        compare_steps(&m, &hs, &ds);
        multi_free(&m);
    }
}

/* LINEAR clipped sums on their own: the fused tensor-core kernel with one
 * group of samples (plain stores) and with several (atomics), ragged tiles,
 * and the cuBLAS paths (f32; T < 64), against the CPU backend. */
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

/* Host-memory steps are the CPU workers': the CUDA backend refuses them,
 * naming the step, and serves the next device step as before. */
static void test_host_step_refused(void **state) {
    (void)state;
    dc_test_rng r;
    dc_test_rng_seed(&r, 606);
    dc_test_layer_spec sp = {DC_LAYER_LINEAR, 4, 10, 12, 8, DC_F32, 1, DC_ALGO_AUTO, 0, 0};
    dc_layer h, d;
    dc_step s;
    dc_step_result a, b;
    dc_err e;
    dc_test_layer_make(&h, &sp, &r);
    step_init(&s, &h, 1, 4, -1);
    assert_int_equal(run(g_cuda, &s, &b, &e), DC_EINVAL);
    assert_string_equal(e.field, "clip_step");
    dc_step_result_free(&b);
    d = dev_layer(&h);
    dc_step ds;
    step_init(&ds, &d, 1, 4, 0);
    assert_int_equal(run(g_cpu, &s, &a, &e), 0);
    assert_int_equal(run(g_cuda, &ds, &b, &e), 0);
    for (int i = 0; i < 4; i++) assert_true(fabs(a.norms[i] - b.norms[i]) <= 1e-3 * a.norms[i]);
    dc_step_result_free(&a);
    dc_step_result_free(&b);
    dev_layer_free(&d);
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

/* --- a client rewriting its memory during a step ----------------------------
 * A second stream keeps rewriting one embedding index (0, -1, 0,
 * ...) while steps run, as a client may with its IPC memory. The backend
 * copies the indices once per step and every kernel reads the copy, so a
 * step either fails naming the indices or releases exactly the result of the
 * valid value; never a write outside its output. */
typedef struct gpu_flipper {
    char *target;
    size_t size;
    cudaStream_t st;
    atomic_int stop;
} gpu_flipper;

/* Keeps the flips coming while the steps run, on its own stream. */
static void *gpu_flip_main(void *arg) {
    gpu_flipper *f = arg;
    (void)cudaSetDevice(0);
    while (!atomic_load(&f->stop)) {
        (void)cudaMemsetAsync(f->target, 0xff, f->size, f->st);
        (void)cudaMemsetAsync(f->target, 0, f->size, f->st);
        (void)cudaStreamSynchronize(f->st); /* a short queue: flips stay current */
    }
    return NULL;
}

static void test_index_flip(void **state) {
    (void)state;
    for (int k = 0; k < 2; k++) {
        dc_dtype it = k ? DC_I64 : DC_I32;
        dc_test_rng r;
        dc_test_rng_seed(&r, 707 + (uint64_t)k);
        dc_test_layer_spec sp = {DC_LAYER_EMBEDDING, 4, 512, 8, 16, DC_F32, 0, DC_ALGO_AUTO, 1, 0};
        dc_layer h;
        dc_test_layer_make(&h, &sp, &r);
        if (h.input.dtype != it) { /* both index dtypes */
            dc_tensor t = dc_test_tensor_new(it, 2, 4, 512, 0);
            for (size_t i = 0; i < 4 * 512; i++) {
                int64_t v = h.input.dtype == DC_I32 ? ((int32_t *)h.input.data)[i]
                                                    : ((int64_t *)h.input.data)[i];
                if (it == DC_I32) ((int32_t *)t.data)[i] = (int32_t)v;
                else ((int64_t *)t.data)[i] = v;
            }
            dc_test_tensor_free(&h.input);
            h.input = t;
        }
        size_t last = 4 * 512 - 1, isz = dc_dtype_size(it);
        /* index 0 (valid) or -1 (all bytes 0xff): set by cudaMemsetAsync,
         * which runs on the SMs and so alongside the backend's index copy
         * (copies on the copy engine queued behind each other, never
         * overlapping it) */
        if (it == DC_I32) ((int32_t *)h.input.data)[last] = 0;
        else ((int64_t *)h.input.data)[last] = 0;
        dc_layer d = dev_layer(&h);
        dc_step hs, ds;
        step_init(&hs, &h, 1, 4, -1);
        step_init(&ds, &d, 1, 4, 0);
        hs.max_grad_norm = ds.max_grad_norm = 0.05f; /* clipping bites */
        dc_step_result rh, rd;
        dc_err e;
        assert_int_equal(run(g_cpu, &hs, &rh, &e), 0);
        float *want = host_to_f32(&h.weight_grad_out);
        cudaStream_t fs;
        CUDA_OK(cudaStreamCreateWithFlags(&fs, cudaStreamNonBlocking));
        gpu_flipper f = {(char *)d.input.data + last * isz, isz, fs, 0};
        pthread_t th;
        assert_int_equal(pthread_create(&th, NULL, gpu_flip_main, &f), 0);
        int ok = 0, refused = 0;
        for (int step = 0; step < 30; step++) {
            int rc = run(g_cuda, &ds, &rd, &e);
            if (rc) {
                if (rc != DC_EINVAL) printf("  step %d: %d %s: %s\n", step, rc, e.field, e.msg);
                assert_int_equal(rc, DC_EINVAL);
                assert_true(strstr(e.field, ".indices") != NULL);
                refused++;
            } else {
                float *got = dev_to_f32(&d.weight_grad_out);
                assert_true(rel_l2(got, want, numel(&h.weight_grad_out)) < 1e-5);
                for (uint32_t b = 0; b < 4; b++)
                    assert_true(fabsf(rd.norms[b] - rh.norms[b]) <= 1e-4f * rh.norms[b]);
                free(got);
                ok++;
            }
            dc_step_result_free(&rd);
        }
        atomic_store(&f.stop, 1);
        pthread_join(th, NULL);
        CUDA_OK(cudaStreamSynchronize(fs));
        printf("  index flip (%s): %d steps released, %d refused\n", dc_dtype_name(it), ok,
               refused);
        CUDA_OK(cudaStreamDestroy(fs));
        free(want);
        dc_step_result_free(&rh);
        dev_layer_free(&d);
        dc_test_layer_free(&h);
    }
}

/* Activations ~1e19 with output grads ~1e-19: finite, ordinary per-sample
 * gradients whose ghost-form Gram a a^T leaves f32 (the GPU kernels
 * accumulate in f32). The backend sees the overflow, computes those layers'
 * norms again on the host, range-scaled as the CPU backend does, and reruns
 * the step: it matches the CPU backend and the reference, every sample
 * clipped. With an early notice (zero_on_fail) a rerun is too late (the
 * client may use the zeros already written): the step fails NON_FINITE
 * naming the layer, and no sample is released unclipped. */
static void test_extreme_range(void **state) {
    (void)state;
    dc_algo algos[2] = {DC_ALGO_GHOST, DC_ALGO_DIRECT};
    for (int k = 0; k < 4; k++) {
        bool early = k >= 2;
        dc_test_rng r;
        dc_test_rng_seed(&r, 808 + (uint64_t)k);
        dc_test_layer_spec sp = {DC_LAYER_LINEAR, 3, 32, 64, 48, DC_F32, 0, algos[k % 2], 1, 0};
        dc_layer h;
        dc_test_layer_make(&h, &sp, &r);
        float *a = h.input.data, *g = h.grad.data;
        for (int64_t i = 0; i < numel(&h.input); i++) a[i] *= 1e19f;
        for (int64_t i = 0; i < numel(&h.grad); i++) g[i] *= 1e-19f;
        dc_layer d = dev_layer(&h);
        dc_step hs, ds;
        step_init(&hs, &h, 1, 3, -1);
        step_init(&ds, &d, 1, 3, 0);
        hs.max_grad_norm = ds.max_grad_norm = 1e-3f;
        ds.zero_on_fail = early;
        dc_step_result rh, rd;
        dc_err eh, ed;
        float sentinel = 1536.0f;
        float *fill = malloc((size_t)numel(&h.weight_grad_out) * sizeof *fill);
        for (int64_t i = 0; i < numel(&h.weight_grad_out); i++) fill[i] = sentinel;
        h2d(d.weight_grad_out.data, fill, tensor_bytes(&d.weight_grad_out));
        assert_int_equal(run(g_cpu, &hs, &rh, &eh), 0);
        for (uint32_t b = 0; b < 3; b++) assert_true(rh.coefs[b] < 0.5f); /* all clipped */
        int rc = run(g_cuda, &ds, &rd, &ed);
        printf("  %s at 1e19%s: gpu %d %s: %s\n", k % 2 ? "direct" : "ghost",
               early ? " (early notice)" : "", rc, ed.field, ed.msg);
        float *got = dev_to_f32(&d.weight_grad_out);
        if (rc) {
            /* only where the f32 kernels overflow and no rerun is possible */
            assert_true(early);
            assert_int_equal(rc, DC_ENONFINITE);
            assert_string_equal(ed.field, h.name);
            for (int64_t i = 0; i < numel(&h.weight_grad_out); i++)
                assert_true(got[i] == sentinel || got[i] == 0.0f);
        } else {
            float *want = host_to_f32(&h.weight_grad_out);
            assert_true(rel_l2(got, want, numel(&h.weight_grad_out)) < 1e-2);
            for (uint32_t b = 0; b < 3; b++) {
                assert_true(fabsf(rd.coefs[b] - rh.coefs[b]) <= 1e-2f * rh.coefs[b]);
                assert_true(fabsf(rd.norms[b] - rh.norms[b]) <= 1e-2f * rh.norms[b]);
            }
            free(want);
        }
        if (!early) assert_int_equal(rc, 0); /* the rerun makes the ghost form exact */
        free(got);
        free(fill);
        dc_step_result_free(&rh);
        dc_step_result_free(&rd);
        dev_layer_free(&d);
        dc_test_layer_free(&h);
    }
}
/* The two halves of a step for norm groups (run_norms, run_clip): the norm
 * phase gives the step's squared layer norms; the clip phase with their own
 * sum as the totals writes what the whole step writes (same noise), and with
 * 4x the totals clips by twice the norm. A replicated layer's noise comes
 * from the group's key and step: two members (their own noise keys) draw
 * the same noise for it, and different noise for their other layers. */
static void test_phases(void **state) {
    (void)state;
    dc_test_rng r;
    dc_test_rng_seed(&r, 909);
    for (int di = 0; di < 3; di++) {
        multi m;
        dc_step ds;
        dc_step_result whole, part;
        dc_err e;
        multi_make(&m, kDtypes[di], &r);
        step_init(&ds, m.d, m.L, m.B, 0);
        ds.noise_multiplier = 0.5f;
        assert_int_equal(run(g_cuda, &ds, &whole, &e), 0);
        float *out1[6], *out2[6];
        for (size_t l = 0; l < m.L; l++) out1[l] = dev_to_f32(&m.d[l].weight_grad_out);
        double n2[6 * 6], tot[6];
        assert_int_equal(g_cuda->ops->run_norms(g_cuda, &ds, n2, NULL, &e), 0);
        for (size_t i = 0; i < m.L * m.B; i++) {
            double want = (double)whole.layer_norms[i] * whole.layer_norms[i];
            assert_true(fabs(n2[i] - want) <= 1e-5 * want + 1e-12);
        }
        for (uint32_t b = 0; b < m.B; b++) {
            tot[b] = 0.0;
            for (size_t l = 0; l < m.L; l++) tot[b] += n2[l * m.B + b];
        }
        assert_int_equal(dc_step_result_init(&part, m.B, m.L, false), 0);
        assert_int_equal(g_cuda->ops->run_clip(g_cuda, &ds, n2, tot, 0.0, NULL, NULL, &part, &e),
                         0);
        for (size_t l = 0; l < m.L; l++) {
            out2[l] = dev_to_f32(&m.d[l].weight_grad_out);
            assert_true(rel_l2(out2[l], out1[l], numel(&m.d[l].weight_grad_out)) < 1e-5);
            free(out2[l]);
        }
        for (uint32_t b = 0; b < m.B; b++) {
            assert_true(fabsf(part.coefs[b] - whole.coefs[b]) <= 1e-5f * whole.coefs[b]);
            tot[b] *= 4.0;
        }
        dc_step_result_free(&part);
        assert_int_equal(dc_step_result_init(&part, m.B, m.L, false), 0);
        assert_int_equal(g_cuda->ops->run_clip(g_cuda, &ds, n2, tot, 0.0, NULL, NULL, &part, &e),
                         0);
        const double es = dc_clip_e_step(&ds, dc_clip_e_how(&ds)); /* the clip phase's */
        for (uint32_t b = 0; b < m.B; b++) {
            double want = fmin(1.0, ds.max_grad_norm / (2.0 * whole.norms[b] * (1.0 + es) + 1e-6));
            assert_true(fabs(part.norms[b] - 2.0 * whole.norms[b]) <= 1e-4 * whole.norms[b]);
            assert_true(fabs(part.coefs[b] - want) <= 1e-4 * want);
        }
        dc_step_result_free(&part);
        m.d[4].replicated = true;
        m.d[4].rep_ordinal = 0;
        ds.group_noise_key = 0x5eed5eed5eedull;
        ds.group_step = 7;
        assert_int_equal(g_cuda->ops->run_norms(g_cuda, &ds, n2, NULL, &e), 0);
        float *mem[2][6];
        for (int k = 0; k < 2; k++) { /* member k */
            ds.noise_key = 0xabcdef00ull + (uint64_t)k;
            assert_int_equal(dc_step_result_init(&part, m.B, m.L, false), 0);
            assert_int_equal(
                g_cuda->ops->run_clip(g_cuda, &ds, n2, tot, 0.0, NULL, NULL, &part, &e), 0);
            for (size_t l = 0; l < m.L; l++) mem[k][l] = dev_to_f32(&m.d[l].weight_grad_out);
            dc_step_result_free(&part);
        }
        assert_memory_equal(mem[0][4], mem[1][4],
                            (size_t)numel(&m.d[4].weight_grad_out) * sizeof(float));
        assert_true(rel_l2(mem[0][0], mem[1][0], numel(&m.d[0].weight_grad_out)) > 1e-3);
        for (int k = 0; k < 2; k++)
            for (size_t l = 0; l < m.L; l++) free(mem[k][l]);
        for (size_t l = 0; l < m.L; l++) free(out1[l]);
        dc_step_result_free(&whole);
        multi_free(&m);
    }
}

int main(void) {
    if (cuda_test_skip()) return DC_TEST_SKIP;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_events),          cmocka_unit_test(test_host_step_refused),
        cmocka_unit_test(test_staged_fallback), cmocka_unit_test(test_whole_steps),
        cmocka_unit_test(test_failures),        cmocka_unit_test(test_index_flip),
        cmocka_unit_test(test_extreme_range),   cmocka_unit_test(test_phases),
        cmocka_unit_test(test_padded_layers),
    };
    return cmocka_run_group_tests(tests, cuda_test_setup_gpu_bounds, cuda_test_teardown);
}
