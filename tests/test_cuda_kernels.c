/* The CUDA kernels (norms of every layer kind, clipped sums, the grouped
 * launches) against the naive double-precision reference
 * (tests/support/ref.h) and the CPU backend (itself checked against the
 * reference in test_cpu_*.c).
 *
 * Error bounds, stated per input dtype (inputs are already rounded to their
 * dtype, so only accumulation order and f32 rounding differ):
 *   squared norms vs the double reference: relative 1e-4 (f32 on the exact
 *     kernels, DPCLIP_CUDA_TF32=0), TF32_RTOL = 5e-3 (f32 on TF32 tensor
 *     cores, the default: operands truncated to 10-bit mantissas, 2^-8 at
 *     most), 1e-3 (bf16, f16) = dc_test_rtol; and 1e-4 against the
 *     reference of the TF32 truncations themselves (test_tf32_truncation);
 *   clipped sums vs the CPU backend, as ||got - want|| / ||want|| over the
 *     tensor: 1e-4 in f32 outputs; 2e-3 in bf16/f16 outputs, where a one-ulp
 *     rounding flip of a single element is allowed; LINEAR weights and biases
 *     from f32 inputs on TF32 add TF32_RTOL (one truncation of each operand);
 *   noise vs daemon/compute/noise.c: 2e-6 absolute per N(0,1) draw in double
 *     (DPCLIP_CUDA_NOISE=exact, libm ulps); 6e-7 * r + 1e-7 for the default
 *     f32 draws, r = sqrt(-2 ln u1) the pair's radius (f32 transcendentals
 *     of 1 ulp; a host emulation with 1-ulp perturbations reached half of it).
 *   The transform alone is also held to these bounds on chosen Philox words
 *   (u1 near 0 and 1, octant borders), which random counters rarely reach.
 * (Whole steps are tested in test_cuda_backend.c.)
 * Without a CUDA device the test prints "SKIP: no CUDA device" and exits
 * DC_TEST_SKIP (77), which ctest reports as skipped. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <cuda_runtime_api.h>

#include "cpu.h"
#include "cuda_test.h"
#include "dcc_path.h"
#include "noise.h"

static void test_linear_norms(void **state) {
    (void)state;
    static const struct {
        uint32_t B;
        int64_t T, d, p;
        dcc_path path16; /* expected tensor-core path for bf16/f16 inputs */
    } cases[] = {
        {3, 19, 100, 37, DCC_PATH_MMA_ELEM},   /* odd sizes: element loads, ragged tiles */
        {2, 77, 136, 264, DCC_PATH_MMA_VEC},   /* 16-byte rows, not multiples of the tiles */
        {4, 0, 200, 120, DCC_PATH_MMA_VEC},    /* 2D input: T = 1 */
        {5, 1, 64, 48, DCC_PATH_MMA_VEC},      /* [B,1,d] */
        {1, 16384, 64, 40, DCC_PATH_MMA_VEC},  /* long sequence, B = 1 */
        {64, 33, 48, 24, DCC_PATH_MMA_VEC},    /* B = 64 */
        {1, 1000, 520, 648, DCC_PATH_MMA_VEC}, /* several full tiles both ways */
    };
    static const dc_algo algos[3] = {DC_ALGO_AUTO, DC_ALGO_DIRECT, DC_ALGO_GHOST};
    dc_test_rng r;
    dc_test_rng_seed(&r, 101);
    for (int pass = 0; pass < 2; pass++) { /* TF32 on; then f32 again, exact */
        set_switches(pass == 0, 1);
        for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
            for (int di = pass == 0 ? 0 : 2; di < 3; di++) {
                dc_test_layer_spec sp = {DC_LAYER_LINEAR,
                                         cases[c].B,
                                         cases[c].T,
                                         cases[c].d,
                                         cases[c].p,
                                         kDtypes[di],
                                         (int)((c + (size_t)di) & 1),
                                         DC_ALGO_AUTO,
                                         0,
                                         0};
                dc_layer h;
                double *ref = calloc(cases[c].B, sizeof *ref);
                assert_non_null(ref);
                dc_test_layer_make(&h, &sp, &r);
                dc_ref_layer_sqnorms(&h, cases[c].B, 1.0, ref);
                dcc_linear x = {h.input.data,    h.grad.data, h.input.dtype, h.grad.dtype,
                                (int)cases[c].B, (int)h.T,    (int)h.d,      (int)h.p,
                                h.has_bias,      g_tf32 != 0, &g_opts,       NULL};
                /* the path is decided on alignment; host pointers from malloc are
             * 16-byte aligned like cudaMalloc's */
                int path = dcc_linear_path(&x);
                /* mma.sync with 16-byte loads becomes wgmma where wgmma runs */
                assert_int_equal(path == DCC_PATH_WGMMA ? DCC_PATH_MMA_VEC : path,
                                 kDtypes[di] == DC_F32 ? (g_tf32 ? DCC_PATH_TF32 : DCC_PATH_SIMT)
                                                       : cases[c].path16);
                assert_true(path != DCC_PATH_WGMMA || dcc_wgmma_available(&g_opts));
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

/* The same layer many times, each form and each tensor-core dtype, against
 * one reference: a norm that came out wrong once in a run of the whole
 * suite on one H100 (f16 with bias, several full tiles both ways, relative
 * error 1.0) did not come back in later runs, so a race must be caught in
 * the act. A wrong norm is a privacy bug (a sample clipped too little). */
static void test_linear_repeat(void **state) {
    (void)state;
    static const dc_algo algos[2] = {DC_ALGO_DIRECT, DC_ALGO_GHOST};
    dc_test_rng r;
    dc_test_rng_seed(&r, 109);
    for (int di = 0; di < 2; di++) {
        dc_test_layer_spec sp = {DC_LAYER_LINEAR, 1, 1000,         520, 648,
                                 kDtypes[di],     1, DC_ALGO_AUTO, 0,   0};
        dc_layer h;
        double ref[1], worst = 0.0;
        dc_test_layer_make(&h, &sp, &r);
        dc_ref_layer_sqnorms(&h, 1, 1.0, ref);
        for (int k = 0; k < 200; k++) {
            h.algo = algos[k & 1];
            double e = layer_err(&h, 1, ref);
            if (!(e <= norm_rtol(kDtypes[di])))
                fail_msg("%s %s, run %d: relative error %.3g", dc_dtype_name(kDtypes[di]),
                         (k & 1) ? "ghost" : "direct", k, e);
            if (e > worst) worst = e;
        }
        printf("repeat %s: 200 runs, worst rel err %.2e\n", dc_dtype_name(kDtypes[di]), worst);
        dc_test_layer_free(&h);
    }
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
        {DC_LAYER_LAYERNORM, 3, 17, 100, 0, 1, 0},   {DC_LAYER_LAYERNORM, 2, 0, 64, 0, 0, 0},
        {DC_LAYER_LAYERNORM, 2, 100, 300, 0, 1, 0},  {DC_LAYER_RMSNORM, 3, 17, 100, 0, 0, 0},
        {DC_LAYER_RMSNORM, 1, 70, 520, 0, 0, 0},
    };
    dc_test_rng r;
    dc_test_rng_seed(&r, 303);
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        for (int di = 0; di < 3; di++) {
            for (int seed = 0; seed < 2; seed++) { /* index dtype / padding vary by draw */
                dc_test_layer_spec sp = {cases[c].kind,    cases[c].B,   cases[c].T,
                                         cases[c].d,       cases[c].p,   kDtypes[di],
                                         cases[c].bias,    DC_ALGO_AUTO, 0,
                                         cases[c].distinct};
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

/* x as the TF32 tensor cores read it: its top 19 bits. */
static void tf32_truncate(dc_tensor *t) {
    uint32_t *w = t->data;
    for (int64_t i = 0; i < numel(t); i++) w[i] &= 0xffffe000u;
}

/* f32 on TF32: the GPU's norms (both forms; the ghost form on wgmma where it
 * runs) and clipped sums, weight and bias, are those of the operands' TF32
 * truncations to f32 accumulation (1e-4), so that each sample's sum is
 * clipped by the norm of exactly the values it adds. The untruncated
 * reference must be further off than that, or this could not tell
 * truncation from rounding. */
static void test_tf32_truncation(void **state) {
    (void)state;
    static const struct {
        uint32_t B;
        int64_t T, d, p;
    } cases[] = {
        {3, 200, 36, 20},   /* rows of 16 bytes; a ragged feature tile (TMA's zero fill) */
        {2, 300, 520, 648}, /* several tiles both ways */
        {4, 65, 256, 128},    {3, 19, 100, 37}, /* rows not on 16 bytes: the mma.sync ghost form */
        {3, 40, 3072, 1536},  /* 144 clipped-sum tiles: on an H100 a CTA takes every
                                sample, rescaling between them (Horner) */
        {6, 200, 512, 256},   /* 4 tiles of 42 stages in chunks of 1-2 that start and
                                end inside samples or cross from one to the next */
        {2, 520, 1536, 1024}, /* 48 tiles in chunks of 17 stages: the clipped sum's
                                 copy and transpose rings wrap several times */
    };
    set_switches(1, 1);
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        const uint32_t B = cases[c].B;
        dc_test_layer_spec sp = {
            DC_LAYER_LINEAR, B, cases[c].T, cases[c].d, cases[c].p, DC_F32, (int)(c & 1) ^ 1,
            DC_ALGO_AUTO,    1, 0};
        dc_test_rng r, r2;
        dc_layer h, ht, d;
        dc_test_rng_seed(&r, 1301 + c);
        r2 = r;
        dc_test_layer_make(&h, &sp, &r);
        dc_test_layer_make(&ht, &sp, &r2); /* the same values, then truncated */
        tf32_truncate(&ht.input);
        tf32_truncate(&ht.grad);
        double *ref = calloc(B, sizeof *ref), *ref_t = calloc(B, sizeof *ref_t);
        assert_non_null(ref);
        assert_non_null(ref_t);
        dc_ref_layer_sqnorms(&h, B, 1.0, ref);
        dc_ref_layer_sqnorms(&ht, B, 1.0, ref_t);
        double apart = 0.0;
        for (uint32_t b = 0; b < B; b++) apart = fmax(apart, fabs(ref[b] - ref_t[b]) / ref[b]);
        assert_true(apart > 1e-4);
        static const dc_algo algos[2] = {DC_ALGO_DIRECT, DC_ALGO_GHOST};
        for (int ai = 0; ai < 2; ai++) {
            h.algo = algos[ai];
            double e = layer_err(&h, B, ref_t);
            printf("tf32 B=%u T=%lld d=%lld p=%lld bias=%d %s: vs truncated %.2e "
                   "(full f32 %.2e)\n",
                   B, (long long)h.T, (long long)h.d, (long long)h.p, (int)h.has_bias,
                   ai ? "ghost" : "direct", e, apart);
            assert_true(e <= 1e-4);
        }
        h.algo = DC_ALGO_AUTO;
        d = dev_layer(&h);
        /* the ghost form on wgmma itself, where it runs */
        dcc_linear x = {d.input.data, d.grad.data, DC_F32,     DC_F32, (int)B,  (int)h.T,
                        (int)h.d,     (int)h.p,    h.has_bias, true,   &g_opts, NULL};
        if (dcc_wgmma_available(&g_opts) && h.d % 4 == 0 && h.p % 4 == 0) {
            float *n2;
            float got[4];
            CUDA_OK(cudaMalloc((void **)&n2, B * sizeof *n2));
            CUDA_OK(cudaMemset(n2, 0, B * sizeof *n2));
            CUDA_OK(dcc_linear_ghost_wgmma_tf32(&x, 1.0f, n2, 0));
            CUDA_OK(cudaMemcpy(got, n2, B * sizeof *n2, cudaMemcpyDeviceToHost));
            for (uint32_t b = 0; b < B; b++)
                assert_true(fabs(got[b] - ref_t[b]) / ref_t[b] <= 1e-4);
            CUDA_OK(cudaFree(n2));
        }
        /* clipped sums: the CPU backend's of the truncated values */
        dc_step hs, ds;
        dc_step_result rh, rd;
        dc_err eh, ed;
        step_init(&hs, &ht, 1, B, -1);
        step_init(&ds, &d, 1, B, 0);
        hs.max_grad_norm = ds.max_grad_norm = 0.5f;
        assert_int_equal(run(g_cpu, &hs, &rh, &eh), 0);
        assert_int_equal(run(g_cuda, &ds, &rd, &ed), 0);
        for (int k = 0; k < 1 + (int)h.has_bias; k++) {
            const dc_tensor *o = k ? &d.bias_grad_out : &d.weight_grad_out;
            float *got = dev_to_f32(o),
                  *want = host_to_f32(k ? &ht.bias_grad_out : &ht.weight_grad_out);
            double e = rel_l2(got, want, numel(o));
            printf("  clipped %s vs truncated: %.2e\n", k ? "bias" : "weight", e);
            assert_true(e <= 1e-4);
            free(got);
            free(want);
        }
        dc_step_result_free(&rh);
        dc_step_result_free(&rd);
        dev_layer_free(&d);
        free(ref);
        free(ref_t);
        dc_test_layer_free(&h);
        dc_test_layer_free(&ht);
    }
}

/* --- whole steps vs the CPU backend ---------------------------------------- */

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
            dc_test_layer_spec sp = {
                DC_LAYER_LINEAR, cases[c].B, cases[c].T,   cases[c].d, cases[c].p,
                cases[c].dt,     1,          DC_ALGO_AUTO, 1,          0};
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
                   dc_dtype_name(cases[c].dt), cases[c].dt == DC_F32 && g_tf32 ? " (tf32)" : "", ew,
                   eb);
            assert_true(ew <= (cases[c].dt == DC_F32 && g_tf32 ? TF32_RTOL : 1e-4));
            assert_true(eb <= (cases[c].dt == DC_F32 && g_tf32 ? TF32_RTOL : 1e-4));
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
 * launches take the qualifying ones (a launch per 80 layers at most, so
 * 110 layers split, or per DPCLIP_CUDA_GROUPED_LAYERS = 7, and splits where
 * the dtype changes), the others (T < 64 for the book-keeping, widths
 * not multiples of 8, the ghost form for the norms, bias-only outputs) go
 * per layer. Layer norms and every output against the CPU backend, with the
 * grouped launches and without. */
static void test_grouped_many(void **state) {
    (void)state;
    enum { NL = 110 };
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
    for (int grouped = 2; grouped >= 0; grouped--) { /* 2: 7 layers a launch */
        dc_step hs, ds;
        dc_step_result rh, rd;
        dc_err eh, ed;
        set_switches(1, 1);
        g_opts.grouped = grouped != 0;
        if (grouped == 2) g_opts.grouped_layers = 7;
        apply_switches();
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
        printf("grouped=%d: %d layers, %d of %u samples clipped, worst rel l2 err %.2e\n", grouped,
               NL, clipped, B, worst);
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

/* A draw's error bound (see the top) for a pair of radius r. */
static double noise_bound(int mode, double r) {
    return mode == DCC_NOISE_EXACT ? 2e-6 : 6e-7 * r + 1e-7;
}

/* The noise kernel against daemon/compute/noise.c (the bounds above). */
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
                double bound = noise_bound(mode, rr);
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

/* Philox words (a, b: the 53-bit uniforms' integers) for the transform. */
static void put_words(uint32_t *w, uint64_t a, uint64_t b, dc_test_rng *r) {
    uint64_t x = dc_test_next(r); /* the 11 bits below each uniform */
    w[0] = (uint32_t)(a >> 21);
    w[1] = (uint32_t)((a & 0x1fffff) << 11) | (uint32_t)(x & 0x7ff);
    w[2] = (uint32_t)(b >> 21);
    w[3] = (uint32_t)((b & 0x1fffff) << 11) | (uint32_t)((x >> 11) & 0x7ff);
}

/* The Box-Muller step alone on chosen words, against the double formula
 * of daemon/compute/noise.c: u1 at 0 and next to 1, both sides of the f32
 * path's split (u1 = 2^-12) and of its rounding ties, every power of two;
 * angles at every octant border; then random and log-uniform u1. */
static void test_box_muller_edges(void **state) {
    (void)state;
    const uint64_t top = (uint64_t)1 << 53;
    uint64_t as[600], bs[64];
    size_t na = 0, nb = 0;
    for (int k = 0; k <= 53; k++) {
        uint64_t p2 = (uint64_t)1 << k;
        as[na++] = p2 - 1;
        if (p2 < top) as[na++] = p2;
        if (k >= 1 && p2 + 1 < top) as[na++] = p2 + 1;
    }
    for (uint64_t k = 0; k < 200; k++) as[na++] = top - 1 - k; /* u1 next to 1 */
    for (int j = -3; j <= 3; j++) {
        as[na++] = ((uint64_t)1 << 41) - 1 + (uint64_t)j;       /* the split */
        as[na++] = top - ((uint64_t)1 << 29) - 1 + (uint64_t)j; /* hi's last step below 1 */
        as[na++] = ((uint64_t)12345 << 29) + ((uint64_t)1 << 28) - 1 + (uint64_t)j; /* ties */
        as[na++] = top - ((uint64_t)1 << 28) - 1 + (uint64_t)j;
    }
    for (uint64_t o = 0; o < 8; o++) {
        uint64_t base = o << 50;
        bs[nb++] = base;
        bs[nb++] = base + 1;
        bs[nb++] = base + ((uint64_t)1 << 49);
        bs[nb++] = base + ((uint64_t)1 << 50) - 1;
        bs[nb++] = base + ((uint64_t)1 << 50) - ((uint64_t)1 << 21);
    }
    dc_test_rng r;
    dc_test_rng_seed(&r, 77);
    const uint64_t nrand = 1 << 20;
    const uint64_t npairs = na * nb + nrand;
    uint32_t *w = malloc(npairs * 4 * sizeof *w);
    uint64_t *pa = malloc(npairs * sizeof *pa), *pb = malloc(npairs * sizeof *pb);
    float *got = malloc(npairs * 2 * sizeof *got);
    assert_non_null(w);
    assert_non_null(pa);
    assert_non_null(pb);
    assert_non_null(got);
    uint64_t n = 0;
    for (size_t i = 0; i < na; i++)
        for (size_t j = 0; j < nb; j++, n++) {
            pa[n] = as[i];
            pb[n] = bs[j];
        }
    for (uint64_t i = 0; i < nrand; i++, n++) {
        pa[n] = dc_test_next(&r) >> 11;
        if (i & 1) pa[n] >>= dc_test_range(&r, 0, 52); /* log-uniform u1 */
        pb[n] = dc_test_next(&r) >> 11;
    }
    for (uint64_t i = 0; i < npairs; i++) put_words(w + 4 * i, pa[i], pb[i], &r);
    uint32_t *dw;
    float *dz;
    CUDA_OK(cudaMalloc((void **)&dw, npairs * 4 * sizeof *dw));
    CUDA_OK(cudaMalloc((void **)&dz, npairs * 2 * sizeof *dz));
    CUDA_OK(cudaMemcpy(dw, w, npairs * 4 * sizeof *w, cudaMemcpyHostToDevice));
    for (int mode = 0; mode < 2; mode++) { /* DCC_NOISE_FAST, DCC_NOISE_EXACT */
        CUDA_OK(dcc_noise_box_muller(dw, dz, npairs, mode, 0));
        CUDA_OK(cudaMemcpy(got, dz, npairs * 2 * sizeof *got, cudaMemcpyDeviceToHost));
        double worst_ratio = 0.0;
        uint64_t worst_a = 0;
        for (uint64_t i = 0; i < npairs; i++) {
            double u1 = ((double)pa[i] + 1.0) / 9007199254740992.0;
            double u2 = (double)pb[i] / 9007199254740992.0;
            double rr = sqrt(-2.0 * log(u1)), t = 6.283185307179586476925 * u2;
            double want[2] = {rr * cos(t), rr * sin(t)};
            double bound = noise_bound(mode, rr);
            for (int k = 0; k < 2; k++) {
                double e = fabs((double)got[2 * i + k] - want[k]);
                double ratio = isnan(e) ? INFINITY : e / bound;
                if (ratio > worst_ratio) {
                    worst_ratio = ratio;
                    worst_a = pa[i];
                }
            }
        }
        printf("box-muller %s: %llu pairs (%zu x %zu edges), worst %.2f of the bound "
               "(at a = %llu)\n",
               mode == DCC_NOISE_EXACT ? "exact" : "fast", (unsigned long long)npairs, na, nb,
               worst_ratio, (unsigned long long)worst_a);
        assert_true(worst_ratio <= 1.0);
    }
    CUDA_OK(cudaFree(dw));
    CUDA_OK(cudaFree(dz));
    free(w);
    free(pa);
    free(pb);
    free(got);
}

/* The output pass's division (its reciprocal made once) against __fdiv_rn,
 * bit for bit: every float bit pattern class (zeros, subnormals, the edges
 * of the fast range, huge, infinite, NaN) and typical gradient values, over
 * divisors from batch sizes to ones outside the fast range. */
static void test_division_exact(void **state) {
    (void)state;
    /* powers of two take a multiply (exact) where their reciprocal is a
     * normal float: 2^-126 .. 2^126, either sign; 2^127 and 2^-149 do not */
    static const float divisors[] = {8.0f,     3.0f,     1.0f / 3.0f, 7.5f,    1e-3f,    1e5f,
                                     0.1f,     255.9f,   0x1p-60f,    0x1p60f, 0x1p-70f, 0x1p70f,
                                     1e-38f,   3e38f,    -12.0f,      1e-45f,  -8.0f,    0x1p-126f,
                                     0x1p126f, 0x1p127f, 1.0f,        -0x1p-3f};
    const uint64_t n = 1 << 20;
    float *x = malloc(n * sizeof *x), *got = malloc(2 * n * sizeof *got), *dx, *dout;
    assert_non_null(x);
    assert_non_null(got);
    dc_test_rng r;
    dc_test_rng_seed(&r, 5);
    for (uint64_t i = 0; i < n; i++) {
        uint32_t bits = (uint32_t)dc_test_next(&r);
        switch (i % 4) {
        case 0: break; /* any pattern */
        case 1: x[i] = (float)dc_test_normal(&r); continue;
        case 2: /* exponents at the fast range's edges */
            bits = (bits & 0x807fffffu) | (uint32_t)(127 + dc_test_range(&r, -62, -58)) << 23;
            if (i & 4)
                bits = (bits & 0x807fffffu) | (uint32_t)(127 + dc_test_range(&r, 58, 62)) << 23;
            break;
        default: bits &= 0x80ffffffu; break; /* subnormal and tiny */
        }
        memcpy(&x[i], &bits, sizeof bits);
    }
    x[0] = 0.0f;
    x[1] = -0.0f;
    x[2] = INFINITY;
    x[3] = NAN;
    CUDA_OK(cudaMalloc((void **)&dx, n * sizeof *dx));
    CUDA_OK(cudaMalloc((void **)&dout, 2 * n * sizeof *dout));
    CUDA_OK(cudaMemcpy(dx, x, n * sizeof *x, cudaMemcpyHostToDevice));
    for (size_t k = 0; k < sizeof divisors / sizeof divisors[0]; k++) {
        CUDA_OK(dcc_test_fdiv(dx, dout, n, divisors[k], 0));
        CUDA_OK(cudaMemcpy(got, dout, 2 * n * sizeof *got, cudaMemcpyDeviceToHost));
        uint64_t differ = 0, first = 0;
        for (uint64_t i = 0; i < n; i++) {
            uint32_t a, b;
            memcpy(&a, &got[2 * i], sizeof a);
            memcpy(&b, &got[2 * i + 1], sizeof b);
            bool same = a == b || (isnan(got[2 * i]) && isnan(got[2 * i + 1]));
            /* and both as the host rounds x / d */
            float host = x[i] / divisors[k];
            uint32_t h;
            memcpy(&h, &host, sizeof h);
            same = same && (h == b || (isnan(host) && isnan(got[2 * i + 1])));
            if (!same && differ++ == 0) first = i;
        }
        if (differ)
            printf("division by %g: %llu of %llu differ, first x = %a: %a vs %a\n",
                   (double)divisors[k], (unsigned long long)differ, (unsigned long long)n,
                   (double)x[first], (double)got[2 * first], (double)got[2 * first + 1]);
        assert_int_equal(differ, 0);
    }
    printf("division: %zu divisors x %llu values bit-identical to __fdiv_rn and the host\n",
           sizeof divisors / sizeof divisors[0], (unsigned long long)n);
    CUDA_OK(cudaFree(dx));
    CUDA_OK(cudaFree(dout));
    free(x);
    free(got);
}

int main(void) {
    if (cuda_test_skip()) return DC_TEST_SKIP;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_linear_norms),     cmocka_unit_test(test_linear_repeat),
        cmocka_unit_test(test_linear_mixed),     cmocka_unit_test(test_other_norms),
        cmocka_unit_test(test_linear_clipped),   cmocka_unit_test(test_tf32_truncation),
        cmocka_unit_test(test_grouped_many),     cmocka_unit_test(test_noise_matches_cpu),
        cmocka_unit_test(test_box_muller_edges), cmocka_unit_test(test_division_exact),
    };
    return cmocka_run_group_tests(tests, cuda_test_setup_gpu_bounds, cuda_test_teardown);
}
