/* The CUDA backend's logical steps (cuda/kernels/accum.cu, backend_accum.cu) and its
 * keyed checksum (cuda/kernels/hash.cu): a logical step of M micro-batches run with
 * DC_ACC_FIRST / ADD / COMMIT into device accumulators gives what the CPU
 * backend gives with host accumulators (the same noise, bit for bit from the
 * same key), with both the modern and the staged switches, and with noise
 * off the f64 reference's sum of the micro-batches' clipped sums; nothing
 * is written before the commit. The checksum of device bytes is the host's
 * (dc_hash_bytes), aligned or not, any length. Skips without a GPU. */
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
#include "dc_hash.h"
#include "dcc.h"

#define M 3 /* micro-batches */
#define L 4
#define MB 5 /* samples a micro-batch */

typedef struct micro {
    dc_layer h[L], d[L];
} micro;

/* M micro-batches of four layers of every kind, dtype dt; the outputs are
 * micro-batch 0's tensors (host and device), which every micro-batch
 * names. */
static void make(micro *mb, dc_dtype dt, uint64_t seed) {
    static const dc_test_layer_spec specs[L] = {
        {DC_LAYER_LINEAR, MB, 40, 48, 32, DC_F32, 1, DC_ALGO_DIRECT, 1, 0},
        {DC_LAYER_LINEAR, MB, 9, 30, 20, DC_F32, 0, DC_ALGO_GHOST, 1, 0},
        {DC_LAYER_EMBEDDING, MB, 12, 16, 25, DC_F32, 0, DC_ALGO_AUTO, 1, 0},
        {DC_LAYER_LAYERNORM, MB, 40, 48, 0, DC_F32, 1, DC_ALGO_AUTO, 1, 0},
    };
    dc_test_rng r;
    dc_test_rng_seed(&r, seed);
    for (int k = 0; k < M; k++)
        for (int l = 0; l < L; l++) {
            dc_test_layer_spec sp = specs[l];
            sp.dtype = dt;
            dc_test_layer_make(&mb[k].h[l], &sp, &r);
            mb[k].d[l] = dev_layer(&mb[k].h[l]);
            if (k) { /* the outputs are micro-batch 0's */
                dc_test_tensor_free(&mb[k].h[l].weight_grad_out);
                dc_test_tensor_free(&mb[k].h[l].bias_grad_out);
                dev_free(&mb[k].d[l].weight_grad_out);
                dev_free(&mb[k].d[l].bias_grad_out);
                mb[k].h[l].weight_grad_out = mb[0].h[l].weight_grad_out;
                mb[k].h[l].bias_grad_out = mb[0].h[l].bias_grad_out;
                mb[k].d[l].weight_grad_out = mb[0].d[l].weight_grad_out;
                mb[k].d[l].bias_grad_out = mb[0].d[l].bias_grad_out;
            }
        }
}

static void release(micro *mb) {
    for (int k = M - 1; k >= 0; k--)
        for (int l = 0; l < L; l++) {
            if (k) {
                mb[k].h[l].weight_grad_out.data = mb[k].h[l].bias_grad_out.data = NULL;
                mb[k].d[l].weight_grad_out.data = mb[k].d[l].bias_grad_out.data = NULL;
            }
            dc_test_layer_free(&mb[k].h[l]);
            dev_layer_free(&mb[k].d[l]);
        }
}

/* Accumulators for micro-batch 0's outputs on a backend, set into every
 * micro-batch's layers (h or d); freed by acc_free. */
static void accumulators(dc_backend *be, micro *mb, int dev, float *acc[L][2]) {
    for (int l = 0; l < L; l++)
        for (int w = 0; w < 2; w++) {
            const dc_tensor *t = w ? &mb[0].h[l].bias_grad_out : &mb[0].h[l].weight_grad_out;
            acc[l][w] = t->data ? be->ops->acc_alloc(be, (size_t)numel(t)) : NULL;
            if (t->data) assert_non_null(acc[l][w]);
            for (int k = 0; k < M; k++) {
                dc_layer *ly = dev ? &mb[k].d[l] : &mb[k].h[l];
                if (w) ly->acc_b = acc[l][w];
                else ly->acc_w = acc[l][w];
            }
        }
}

static void acc_release(dc_backend *be, float *acc[L][2]) {
    for (int l = 0; l < L; l++)
        for (int w = 0; w < 2; w++)
            if (acc[l][w]) be->ops->acc_free(be, acc[l][w]);
}

/* The logical step on a backend; C the median of micro-batch 0's norms. */
static void run_logical(dc_backend *be, micro *mb, int dev, float C, float sigma, int commit) {
    for (int k = 0; k < M; k++) {
        dc_step s;
        dc_step_result res;
        dc_err err;
        step_init(&s, dev ? mb[k].d : mb[k].h, L, MB, dev ? 0 : -1);
        s.max_grad_norm = C;
        s.noise_multiplier = sigma;
        s.reduction = DC_REDUCTION_MEAN;
        s.expected_batch = 12;
        s.noise_step = 100;
        s.acc = k == 0 ? DC_ACC_FIRST : k < M - 1 || !commit ? DC_ACC_ADD : DC_ACC_COMMIT;
        int rc = run(be, &s, &res, &err);
        if (rc) fprintf(stderr, "%s: %s: %s\n", be->ops->name, err.field, err.msg);
        assert_int_equal(rc, 0);
        dc_step_result_free(&res);
    }
}

static void compare(const char *what, micro *mb, double rtol, int reference, float C) {
    for (int l = 0; l < L; l++)
        for (int w = 0; w < 2; w++) {
            dc_tensor *d = w ? &mb[0].d[l].bias_grad_out : &mb[0].d[l].weight_grad_out;
            dc_tensor *h = w ? &mb[0].h[l].bias_grad_out : &mb[0].h[l].weight_grad_out;
            if (!d->data) continue;
            float *got = dev_to_f32(d), *want = host_to_f32(h);
            int64_t n = numel(d);
            if (reference) {
                /* the sum over the micro-batches of their clipped sums, / 12 */
                const dc_layer *o = &mb[0].h[l];
                int64_t nw = numel(&o->weight_grad_out);
                int64_t nb = o->bias_grad_out.data ? numel(&o->bias_grad_out) : 0;
                double *ref = calloc((size_t)n, sizeof *ref);
                double *ws = malloc((size_t)nw * sizeof *ws), *bs = malloc((size_t)(nb + 1) * 8);
                assert_non_null(ref);
                assert_non_null(ws);
                assert_non_null(bs);
                for (int k = 0; k < M; k++) {
                    double n2[MB], coef[MB], tot[MB] = {0};
                    for (int q = 0; q < L; q++) {
                        dc_ref_layer_sqnorms(&mb[k].h[q], MB, (double)MB, n2);
                        for (int b = 0; b < MB; b++) tot[b] += n2[b];
                    }
                    for (int b = 0; b < MB; b++)
                        coef[b] = fmin(1.0, C / (sqrt(tot[b]) * (1.0 + 1e-2) + 1e-6));
                    dc_ref_layer_clipped_sum(&mb[k].h[l], MB, (double)MB, coef, ws, nb ? bs : NULL);
                    for (int64_t i = 0; i < n; i++) ref[i] += (w ? bs[i] : ws[i]) / 12.0;
                }
                for (int64_t i = 0; i < n; i++) want[i] = (float)ref[i];
                free(ref);
                free(ws);
                free(bs);
            }
            double e = rel_l2(got, want, n);
            printf("  %s %s.%s: rel l2 %.2e\n", what, mb[0].h[l].name, w ? "bias" : "weight", e);
            assert_true(e <= rtol);
            free(got);
            free(want);
        }
}

static float median_c(micro *mb) {
    double n2[MB], tot[MB] = {0}, v[MB];
    for (int q = 0; q < L; q++) {
        dc_ref_layer_sqnorms(&mb[0].h[q], MB, (double)MB, n2);
        for (int b = 0; b < MB; b++) tot[b] += n2[b];
    }
    for (int b = 0; b < MB; b++) v[b] = sqrt(tot[b]);
    for (int i = 0; i < MB; i++)
        for (int j = i + 1; j < MB; j++)
            if (v[j] < v[i]) {
                double t = v[i];
                v[i] = v[j];
                v[j] = t;
            }
    return (float)v[MB / 2];
}

/* GPU against CPU (the same noise), both switch sets; and before the commit
 * no output is written on either. */
static void test_gpu_matches_cpu(void **state) {
    (void)state;
    for (int modern = 0; modern < 2; modern++) {
        micro mb[M];
        float *ha[L][2], *da[L][2];
        make(mb, DC_BF16, 40 + (uint64_t)modern);
        set_switches(1, modern);
        const float C = median_c(mb);
        accumulators(g_cpu, mb, 0, ha);
        accumulators(g_cuda, mb, 1, da);
        outputs_fill(mb[0].d, L, 7.0f);
        for (int l = 0; l < L; l++) {
            dc_tensor *o[2] = {&mb[0].h[l].weight_grad_out, &mb[0].h[l].bias_grad_out};
            for (int w = 0; w < 2; w++)
                if (o[w]->data)
                    for (int64_t i = 0; i < numel(o[w]); i++)
                        dc_store_f32(o[w]->data, o[w]->dtype, (size_t)i, 7.0f);
        }
        run_logical(g_cuda, mb, 1, C, 1.0f, 0); /* every micro-batch, no commit */
        assert_outputs_hold(mb[0].d, L, 7.0f);
        run_logical(g_cuda, mb, 1, C, 1.0f, 1);
        run_logical(g_cpu, mb, 0, C, 1.0f, 1);
        compare(modern ? "modern" : "staged", mb, 2e-3, 0, C);
        acc_release(g_cpu, ha);
        acc_release(g_cuda, da);
        release(mb);
    }
}

/* Noise off: the f64 reference's sum of the micro-batches' clipped sums
 * (the coefficients with the GPU's bounds' margin, 1e-2, a loose upper
 * bound on e: the tolerance covers the difference). */
static void test_reference_without_noise(void **state) {
    micro mb[M];
    float *da[L][2];
    (void)state;
    make(mb, DC_F32, 50);
    set_switches(0, 1);
    const float C = median_c(mb);
    accumulators(g_cuda, mb, 1, da);
    run_logical(g_cuda, mb, 1, C, 0.0f, 1);
    compare("reference", mb, 2e-2, 1, C);
    acc_release(g_cuda, da);
    release(mb);
}

/* The device checksum is the host's: lengths 0..67 bytes at offsets 0..7,
 * and a large one. */
static void test_hash_matches_host(void **state) {
    unsigned char host[1 << 16];
    void *dev;
    dc_test_rng r;
    dc_err err;
    (void)state;
    dc_test_rng_seed(&r, 9);
    for (size_t i = 0; i < sizeof host; i++) host[i] = (unsigned char)dc_test_next(&r);
    CUDA_OK(cudaMalloc(&dev, sizeof host));
    h2d(dev, host, sizeof host);
    for (int off = 0; off < 8; off++)
        for (int n = 0; n < 68; n++) {
            dc_tensor t = {(char *)dev + off, DC_I32, 1, {0}};
            uint64_t got = 0, key = 0x1234 + (uint64_t)n;
            t.dtype = n % 2 ? DC_BF16 : DC_I32;
            t.shape[0] = n / (int)dc_dtype_size(t.dtype);
            size_t bytes = (size_t)t.shape[0] * dc_dtype_size(t.dtype);
            const dc_tensor *one = &t;
            assert_int_equal(g_cuda->ops->tensors_hash(g_cuda, &one, 1, key, &got, &err), 0);
            assert_true(got == dc_hash_bytes(host + off, bytes, key));
        }
    {
        dc_tensor t = {dev, DC_F32, 1, {(int64_t)sizeof host / 4}};
        uint64_t got = 0;
        const dc_tensor *one = &t;
        assert_int_equal(g_cuda->ops->tensors_hash(g_cuda, &one, 1, 77, &got, &err), 0);
        assert_true(got == dc_hash_bytes(host, sizeof host, 77));
        host[12345] ^= 1; /* one bit: another checksum */
        assert_true(got != dc_hash_bytes(host, sizeof host, 77));
        host[12345] ^= 1;
    }
    { /* several at once, with one wait: each its own, as alone */
        dc_tensor t[3] = {{dev, DC_F32, 1, {1000}},
                          {(char *)dev + 4001, DC_BF16, 1, {777}},
                          {(char *)dev + 9000, DC_I32, 1, {3}}};
        const dc_tensor *ts[3] = {&t[0], &t[1], &t[2]};
        uint64_t got[3] = {0};
        assert_int_equal(g_cuda->ops->tensors_hash(g_cuda, ts, 3, 91, got, &err), 0);
        assert_true(got[0] == dc_hash_bytes(host, 4000, 91));
        assert_true(got[1] == dc_hash_bytes(host + 4001, 1554, 91));
        assert_true(got[2] == dc_hash_bytes(host + 9000, 12, 91));
    }
    CUDA_OK(cudaFree(dev));
}

int main(void) {
    if (cuda_test_skip()) return DC_TEST_SKIP;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_hash_matches_host),
        cmocka_unit_test(test_gpu_matches_cpu),
        cmocka_unit_test(test_reference_without_noise),
    };
    return cmocka_run_group_tests(tests, cuda_test_setup_gpu_bounds, cuda_test_teardown);
}
