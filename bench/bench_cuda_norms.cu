/* bench_cuda_norms: per-sample gradient norms of one bf16 Linear layer (with
 * bias) on the GPU, against the layer's own weight-gradient GEMM.
 *
 * For each shape (B, T, d_in, d_out) it prints one JSON line with, all timed
 * in this run with CUDA events (median of reps, after warm-up):
 *   auto_ms / direct_ms / ghost_ms  our norm kernels (cost-model choice,
 *                                   each form forced), n2 zeroing included;
 *   gemm_ms                         cuBLAS dW = g^T a over all B*T rows
 *                                   (bf16 in and out, f32 accumulation);
 *   limit_ms                        min(2BTdp, 2BT^2(d+p)) flops at the bf16
 *                                   GEMM peak measured first (8192^3);
 *   *_over_gemm                     the ratios;
 *   step_ms, extra_bytes            a whole one-layer ClipStep through the
 *                                   CUDA backend (norms only; host clock,
 *                                   synchronisation included) and the device
 *                                   workspace it holds;
 *   bk_step_ms, bk_extra_bytes      the same with the clipped, noised weight
 *                                   and bias sums written (f32 outputs);
 *   direct_vs_ghost                 max relative difference of the two forms'
 *                                   squared norms (a sanity check);
 *   direct128_ms, direct256_ms      the direct form with each wgmma tile
 *                                   height forced, and *_split_ms with a
 *                                   2-CTA cluster splitting K (the cost
 *                                   model's inputs); direct_tile and
 *                                   direct_split: the model's choice;
 *   path                            kernel family (dcc_linear_path).
 * A last line gives the geometric means and the targets (geomean <= 1.0x
 * the GEMM, no shape above 1.5x, extra memory <= 64 MiB per layer).
 *
 * Usage: bench_cuda_norms [reps]   (default 20) */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <algorithm>
#include <vector>

#include <cublas_v2.h>
#include <cuda_bf16.h>

#include "dc_cuda.h"
#include "dcc.h"

#define CK(x)                                                                                \
    do {                                                                                     \
        cudaError_t e_ = (x);                                                                \
        if (e_ != cudaSuccess) {                                                             \
            fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_));      \
            exit(1);                                                                         \
        }                                                                                    \
    } while (0)
#define CKB(x)                                                                               \
    do {                                                                                     \
        cublasStatus_t s_ = (x);                                                             \
        if (s_ != CUBLAS_STATUS_SUCCESS) {                                                   \
            fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cublasGetStatusString(s_));   \
            exit(1);                                                                         \
        }                                                                                    \
    } while (0)

/* Approximately N(0, scale^2) bf16 values from a hash of (seed, i). */
__global__ void fill_bf16(__nv_bfloat16 *x, size_t n, uint32_t seed, float scale) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        uint32_t h = (uint32_t)i * 0x9E3779B1u ^ seed;
        float s = 0.0f;
        for (int k = 0; k < 4; k++) {
            h ^= h >> 15;
            h *= 0x2C1B3C6Du;
            h ^= h >> 12;
            h *= 0x297A2D39u;
            h ^= h >> 15;
            s += (float)(h >> 8) * (1.0f / 16777216.0f);
        }
        x[i] = __float2bfloat16((s - 2.0f) * 1.7320508f * scale); /* var of sum = 1/3 */
    }
}

static double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e3 + (double)t.tv_nsec * 1e-6;
}

template <typename F> static double time_ms(F f, cudaStream_t st, int reps) {
    cudaEvent_t a, b;
    std::vector<float> v;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    for (int i = 0; i < 3; i++) f();
    CK(cudaStreamSynchronize(st));
    for (int i = 0; i < reps; i++) {
        float ms;
        CK(cudaEventRecord(a, st));
        f();
        CK(cudaEventRecord(b, st));
        CK(cudaEventSynchronize(b));
        CK(cudaEventElapsedTime(&ms, a, b));
        v.push_back(ms);
    }
    CK(cudaEventDestroy(a));
    CK(cudaEventDestroy(b));
    std::sort(v.begin(), v.end());
    return (double)v[v.size() / 2];
}

static __nv_bfloat16 *rand_bf16(size_t n, uint32_t seed, float scale) {
    __nv_bfloat16 *p;
    CK(cudaMalloc(&p, n * sizeof *p));
    fill_bf16<<<4096, 256>>>(p, n, seed, scale);
    CK(cudaGetLastError());
    return p;
}

static void gemm_bf16(cublasHandle_t h, int m, int n, int k, const void *A, int lda,
                      cublasOperation_t opb, const void *Bm, int ldb, void *C, int ldc) {
    const float one = 1.0f, zero = 0.0f;
    CKB(cublasGemmEx(h, CUBLAS_OP_N, opb, m, n, k, &one, A, CUDA_R_16BF, lda, Bm, CUDA_R_16BF,
                     ldb, &zero, C, CUDA_R_16BF, ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

/* Median host time of a whole one-layer step through the backend. */
static double step_ms(dc_backend *be, const dc_step *s, int reps, size_t *ws_bytes) {
    std::vector<double> v;
    dc_step_result r;
    dc_err err;
    if (dc_step_result_init(&r, s->batch, s->n_layers, false)) exit(1);
    for (int i = 0; i < reps + 2; i++) {
        double t0 = now_ms();
        if (dc_backend_run_step(be, s, &r, &err)) {
            fprintf(stderr, "run_step: %s: %s\n", err.field, err.msg);
            exit(1);
        }
        if (i >= 2) v.push_back(now_ms() - t0);
    }
    dc_step_result_free(&r);
    *ws_bytes = dc_cuda_backend_workspace_bytes(be);
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

static dc_tensor tensor(void *p, dc_dtype t, int nd, int64_t s0, int64_t s1, int64_t s2) {
    dc_tensor x;
    memset(&x, 0, sizeof x);
    x.data = p;
    x.dtype = t;
    x.ndim = nd;
    x.shape[0] = s0;
    x.shape[1] = s1;
    x.shape[2] = s2;
    return x;
}

int main(int argc, char **argv) {
    static const int shapes[7][4] = {
        {32, 512, 768, 768},   {32, 512, 768, 3072},  {8, 2048, 768, 3072},
        {2, 8192, 768, 3072},  {8, 1024, 2048, 8192}, {2, 4096, 2048, 8192},
        {1, 16384, 2048, 2048},
    };
    int reps = argc > 1 ? atoi(argv[1]) : 20;
    if (reps < 1) reps = 1;
    if (dc_cuda_device_count() == 0) {
        printf("{\"bench\":\"cuda_norms\",\"skipped\":\"no CUDA device\"}\n");
        return 0;
    }
    cudaStream_t st;
    cublasHandle_t h;
    cudaDeviceProp prop;
    CK(cudaSetDevice(0));
    CK(cudaGetDeviceProperties(&prop, 0));
    CK(cudaStreamCreate(&st));
    CKB(cublasCreate(&h));
    CKB(cublasSetStream(h, st));

    /* the bf16 GEMM peak */
    double peak;
    {
        const int n = 8192;
        __nv_bfloat16 *A = rand_bf16((size_t)n * n, 1, 1.0f), *Bm = rand_bf16((size_t)n * n, 2, 1.0f),
                      *C = rand_bf16((size_t)n * n, 3, 1.0f);
        double ms = time_ms([&] { gemm_bf16(h, n, n, n, A, n, CUBLAS_OP_N, Bm, n, C, n); }, st,
                            10);
        peak = 2.0 * n * (double)n * n / (ms * 1e-3);
        CK(cudaFree(A));
        CK(cudaFree(Bm));
        CK(cudaFree(C));
        printf("{\"bench\":\"cuda_gemm_peak\",\"device\":\"%s\",\"m\":%d,\"n\":%d,\"k\":%d,"
               "\"ms\":%.4f,\"tflops\":%.1f}\n",
               prop.name, n, n, n, ms, peak * 1e-12);
        fflush(stdout);
    }

    double lg_auto = 0.0, lg_limit = 0.0, lg_direct = 0.0, lg_ghost = 0.0, worst = 0.0;
    size_t worst_extra = 0;
    for (int si = 0; si < 7; si++) {
        const int B = shapes[si][0], T = shapes[si][1], d = shapes[si][2], p = shapes[si][3];
        const size_t rows = (size_t)B * T;
        __nv_bfloat16 *a = rand_bf16(rows * d, 11 + si, 1.0f), *g = rand_bf16(rows * p, 23 + si, 0.1f);
        __nv_bfloat16 *W;
        float *n2, *w32, *b32;
        CK(cudaMalloc(&W, (size_t)p * d * sizeof *W));
        CK(cudaMalloc(&n2, 3 * (size_t)B * sizeof *n2));
        CK(cudaMalloc(&w32, (size_t)p * d * sizeof *w32));
        CK(cudaMalloc(&b32, (size_t)p * sizeof *b32));
        dcc_linear L = {a, g, DC_BF16, DC_BF16, B, T, d, p, true};
        dc_algo pick = dcc_linear_pick(T, d, p, DC_ALGO_AUTO);

        double gemm = time_ms([&] { gemm_bf16(h, d, p, (int)rows, a, d, CUBLAS_OP_T, g, p, W, d); },
                              st, reps);
        double t[3];
        for (int k = 0; k < 3; k++) {
            dc_algo algo = (dc_algo)k;
            t[k] = time_ms(
                [&] {
                    CK(cudaMemsetAsync(n2 + k * B, 0, B * sizeof *n2, st));
                    CK(dcc_linear_sqnorms(&L, algo, 1.0f, n2 + k * B, st));
                },
                st, reps);
        }
        /* the direct form with each tile height forced, then split forced */
        const int auto_rows = dcc_direct_tile_rows(&L), auto_split = dcc_direct_split(&L);
        double th[4];
        for (int k = 0; k < 4; k++) {
            setenv("DPCLIP_CUDA_DIRECT_TILE", k & 1 ? "256" : "128", 1);
            setenv("DPCLIP_CUDA_DIRECT_SPLIT", k & 2 ? "2" : "1", 1);
            th[k] = time_ms(
                [&] {
                    CK(cudaMemsetAsync(n2 + B, 0, B * sizeof *n2, st));
                    CK(dcc_linear_sqnorms(&L, DC_ALGO_DIRECT, 1.0f, n2 + B, st));
                },
                st, reps);
        }
        unsetenv("DPCLIP_CUDA_DIRECT_TILE");
        unsetenv("DPCLIP_CUDA_DIRECT_SPLIT");
        std::vector<float> hn(3 * (size_t)B);
        CK(cudaMemcpy(hn.data(), n2, hn.size() * sizeof(float), cudaMemcpyDeviceToHost));
        double dvg = 0.0;
        for (int b = 0; b < B; b++)
            dvg = std::max(dvg, fabs((double)hn[B + b] - hn[2 * B + b]) / hn[B + b]);

        /* whole steps through the backend */
        dc_backend *be;
        dc_err err;
        size_t extra, bk_extra;
        if (dc_cuda_backend_create(0, &be, &err)) {
            fprintf(stderr, "backend: %s\n", err.msg);
            return 1;
        }
        dc_layer ly;
        memset(&ly, 0, sizeof ly);
        ly.kind = DC_LAYER_LINEAR;
        snprintf(ly.name, sizeof ly.name, "bench");
        ly.T = T;
        ly.d = d;
        ly.p = p;
        ly.input = tensor(a, DC_BF16, 3, B, T, d);
        ly.grad = tensor(g, DC_BF16, 3, B, T, p);
        ly.has_bias = true;
        ly.max_grad_norm = 1.0f;
        dc_step s;
        memset(&s, 0, sizeof s);
        s.batch = (uint32_t)B;
        s.n_layers = 1;
        s.layers = &ly;
        s.max_grad_norm = 1.0f;
        s.reduction = DC_REDUCTION_SUM;
        s.expected_batch = (uint32_t)B;
        s.noise_multiplier = 1.0f;
        s.noise_key = 42;
        s.device = 0;
        double sms = step_ms(be, &s, reps, &extra);
        dc_backend_destroy(be);
        if (dc_cuda_backend_create(0, &be, &err)) return 1;
        ly.weight_grad_out = tensor(w32, DC_F32, 2, p, d, 0);
        ly.bias_grad_out = tensor(b32, DC_F32, 1, p, 0, 0);
        double bms = step_ms(be, &s, reps, &bk_extra);
        dc_backend_destroy(be);

        double fl_direct = 2.0 * rows * (double)d * p;
        double fl_ghost = 2.0 * rows * (double)T * (double)(d + p);
        double limit = std::min(fl_direct, fl_ghost) / peak * 1e3;
        double r_auto = t[0] / gemm;
        lg_auto += log(r_auto);
        lg_direct += log(t[1] / gemm);
        lg_ghost += log(t[2] / gemm);
        lg_limit += log(limit / gemm);
        worst = std::max(worst, r_auto);
        worst_extra = std::max(worst_extra, extra);
        printf("{\"bench\":\"cuda_norms\",\"B\":%d,\"T\":%d,\"d\":%d,\"p\":%d,\"dtype\":\"bf16\","
               "\"bias\":true,\"auto_algo\":\"%s\",\"auto_ms\":%.4f,\"direct_ms\":%.4f,"
               "\"ghost_ms\":%.4f,\"gemm_ms\":%.4f,\"limit_ms\":%.4f,\"auto_over_gemm\":%.3f,"
               "\"direct_over_gemm\":%.3f,\"ghost_over_gemm\":%.3f,\"limit_over_gemm\":%.3f,"
               "\"gemm_tflops\":%.1f,\"auto_tflops_equiv\":%.1f,\"direct_vs_ghost\":%.2e,"
               "\"step_ms\":%.4f,\"extra_bytes\":%zu,\"bk_step_ms\":%.4f,"
               "\"bk_extra_bytes\":%zu,\"direct128_ms\":%.4f,\"direct256_ms\":%.4f,"
               "\"direct128_split_ms\":%.4f,\"direct256_split_ms\":%.4f,\"direct_tile\":%d,"
               "\"direct_split\":%d,\"path\":%d}\n",
               B, T, d, p, pick == DC_ALGO_DIRECT ? "direct" : "ghost", t[0], t[1], t[2], gemm,
               limit, r_auto, t[1] / gemm, t[2] / gemm, limit / gemm,
               fl_direct / (gemm * 1e-3) * 1e-12, std::min(fl_direct, fl_ghost) / (t[0] * 1e-3) * 1e-12,
               dvg, sms, extra, bms, bk_extra, th[0], th[1], th[2], th[3], auto_rows, auto_split,
               dcc_linear_path(&L));
        fflush(stdout);
        CK(cudaFree(a));
        CK(cudaFree(g));
        CK(cudaFree(W));
        CK(cudaFree(n2));
        CK(cudaFree(w32));
        CK(cudaFree(b32));
    }
    double gm = exp(lg_auto / 7.0);
    printf("{\"bench\":\"cuda_norms_summary\",\"shapes\":7,\"geomean_auto_over_gemm\":%.3f,"
           "\"geomean_direct_over_gemm\":%.3f,\"geomean_ghost_over_gemm\":%.3f,"
           "\"geomean_limit_over_gemm\":%.3f,\"max_auto_over_gemm\":%.3f,"
           "\"max_extra_bytes\":%zu,\"target_geomean_le_1\":%s,\"target_max_le_1_5\":%s,"
           "\"target_extra_le_64MiB\":%s}\n",
           gm, exp(lg_direct / 7.0), exp(lg_ghost / 7.0), exp(lg_limit / 7.0), worst,
           worst_extra, gm <= 1.0 ? "true" : "false", worst <= 1.5 ? "true" : "false",
           worst_extra <= ((size_t)64 << 20) ? "true" : "false");
    cublasDestroy(h);
    cudaStreamDestroy(st);
    return 0;
}
