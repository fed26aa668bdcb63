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
 * the GEMM, no shape above 1.5x, extra memory <= 64 MiB per layer; issue
 * 14's second round: geomean <= 0.85x, no shape above 1.25x).
 *
 * Then the whole GPT-2-small ClipStep in this process (72 Linear layers: 12
 * blocks of qkv 768->2304, proj 768->768, up 768->3072, down 3072->768;
 * B=8, T=1024, with bias, f32 weight and bias outputs, sigma=1, MEAN)
 * through dc_cuda_backend_create / run_step, with the backend's phase timing
 * on (dc_cuda_backend_profile). One line per configuration of the backend's
 * switches (backend_cuda.cu), bf16 and f32 inputs:
 *   step_ms           host time of run_step (median; synchronisation
 *                     included), gpu_ms the sum of the phases (mean);
 *   phases            GPU ms per phase (mean over reps);
 *   gemm_sum_ms       the 72 layers' cuBLAS dW GEMMs g^T a over all B*T rows
 *                     (f32 output; bf16 inputs, or f32 inputs with TF32 and
 *                     with exact f32 math), back to back, in this run;
 *   *_over_gemm       step, norms and book-keeping against that sum;
 *   gemm_after_step_ms the same GEMMs timed between the steps (median):
 *                     under the clocks and power state the step ran in
 *                     (an H100 lowers its clocks under a sustained tensor
 *                     load), so *_over_gemm_after compares like with like;
 *   rel_diff_vs_first the outputs of two layers (first qkv, last down)
 *                     against the first configuration of the same dtype,
 *                     as ||x - x0|| / ||x0|| (noise included: a sanity
 *                     check that the paths agree);
 *   amax_found        outputs whose max |.| the grouped clipped sum's
 *                     epilogue found (the output check does not read them).
 *   kept_layers       layers whose per-sample gradients the norms kept
 *                     (cuda/kernels/sgrad.cu): their clipped sum is a pass over them,
 *                     timed as the phase "kept" (after "check"), which
 *                     clipped_over_gemm counts with "clipped"; kept_direct:
 *                     that pass wrote the outputs itself (with their noise
 *                     and division), so "noise" did not touch them.
 * "old" is the previous backend (per-layer norms and book-keeping, staged
 * outputs, double-precision noise, exact f32); "new" the defaults; the
 * "new_but_*" lines turn one switch back each (the GEMM clipped sum with no
 * kept gradients, per-layer launches, staged outputs, double noise, exact
 * f32); "new_keep_16g" (Llama) keeps up to 16 GiB instead of the default 8.
 *
 * Usage: bench_cuda_norms [reps]      (default 20): everything
 *        bench_cuda_norms step [reps] (default 10): the GPT-2 step only
 *        bench_cuda_norms llama [reps]: the Llama-1B-like step, bf16 ("old"
 *                                       and "new")
 * DPCLIP_BENCH_ONLY=<config> runs that configuration alone (for profilers;
 * rel_diff_vs_first is then 0); DPCLIP_BENCH_SHAPE=<0-6> the single-layer
 * summary's one shape (its geomean is then not the summary's). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <algorithm>
#include <string>
#include <vector>

#include <cublas_v2.h>
#include <cuda_bf16.h>

#include "dc_cuda.h"
#include "dcc.h"

#define CK(x)                                                                                      \
    do {                                                                                           \
        cudaError_t e_ = (x);                                                                      \
        if (e_ != cudaSuccess) {                                                                   \
            fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_));            \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)
#define CKB(x)                                                                                     \
    do {                                                                                           \
        cublasStatus_t s_ = (x);                                                                   \
        if (s_ != CUBLAS_STATUS_SUCCESS) {                                                         \
            fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cublasGetStatusString(s_));         \
            exit(1);                                                                               \
        }                                                                                          \
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
    CKB(cublasGemmEx(h, CUBLAS_OP_N, opb, m, n, k, &one, A, CUDA_R_16BF, lda, Bm, CUDA_R_16BF, ldb,
                     &zero, C, CUDA_R_16BF, ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
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

/* --- the GPT-2-small step ------------------------------------------------- */

__global__ void to_f32(const __nv_bfloat16 *x, float *y, size_t n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        y[i] = __bfloat162float(x[i]);
}

/* A model's LINEAR layers: GPT-2-small-like (72 layers: 18 blocks of qkv,
 * proj, up, down; B=8, T=1024) or Llama-1B-like (16 blocks of q, k, v, o,
 * gate, up, down and the 32000-word head; B=4, T=2048). */
struct stack {
    const char *name;
    int NL, B, T;
    bool bias;
    std::vector<int> d, p;
    std::vector<std::string> kind;
    std::vector<void *> a, g; /* current dtype */
    std::vector<float *> w, b;
    std::vector<dc_layer> layers;
};

static void stack_shapes(stack &m, bool llama) {
    struct shape {
        const char *kind;
        int d, p;
    };
    static const shape gpt[4] = {
        {"qkv", 768, 2304}, {"proj", 768, 768}, {"up", 768, 3072}, {"down", 3072, 768}};
    static const shape lla[7] = {{"q", 2048, 2048},   {"k", 2048, 2048},    {"v", 2048, 2048},
                                 {"o", 2048, 2048},   {"gate", 2048, 8192}, {"up", 2048, 8192},
                                 {"down", 8192, 2048}};
    const shape *sh = llama ? lla : gpt;
    const int per = llama ? 7 : 4, blocks = llama ? 16 : 18;
    m.name = llama ? "llama1b-linear" : "gpt2-small-linear";
    m.B = llama ? 4 : 8;
    m.T = llama ? 2048 : 1024;
    m.bias = !llama;
    for (int l = 0; l < per * blocks; l++) {
        m.d.push_back(sh[l % per].d);
        m.p.push_back(sh[l % per].p);
        m.kind.push_back("h." + std::to_string(l / per) + "." + sh[l % per].kind);
    }
    if (llama) {
        m.d.push_back(2048);
        m.p.push_back(32000);
        m.kind.push_back("lm_head");
    }
    m.NL = (int)m.d.size();
    m.a.assign(m.NL, nullptr);
    m.g.assign(m.NL, nullptr);
    m.w.assign(m.NL, nullptr);
    m.b.assign(m.NL, nullptr);
}

/* Layers over the tensors of m in dtype dt. */
static void stack_layers(stack &m, dc_dtype dt) {
    m.layers.assign(m.NL, dc_layer());
    for (int l = 0; l < m.NL; l++) {
        dc_layer &ly = m.layers[l];
        memset(&ly, 0, sizeof ly);
        ly.kind = DC_LAYER_LINEAR;
        snprintf(ly.name, sizeof ly.name, "%s", m.kind[l].c_str());
        ly.T = m.T;
        ly.d = m.d[l];
        ly.p = m.p[l];
        ly.input = tensor(m.a[l], dt, 3, m.B, m.T, m.d[l]);
        ly.grad = tensor(m.g[l], dt, 3, m.B, m.T, m.p[l]);
        ly.has_bias = m.bias;
        ly.max_grad_norm = 1.0f;
        ly.weight_grad_out = tensor(m.w[l], DC_F32, 2, m.p[l], m.d[l], 0);
        if (m.bias) ly.bias_grad_out = tensor(m.b[l], DC_F32, 1, m.p[l], 0, 0);
    }
}

/* The layers' dW GEMMs back to back (f32 out), enqueued. */
static void stack_gemm_pass(cublasHandle_t h, stack &m, dc_dtype dt, cublasComputeType_t ct) {
    const float one = 1.0f, zero = 0.0f;
    cudaDataType_t ty = dt == DC_BF16 ? CUDA_R_16BF : CUDA_R_32F;
    CKB(cublasSetPointerMode(h, CUBLAS_POINTER_MODE_HOST));
    for (int l = 0; l < m.NL; l++)
        CKB(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_T, m.d[l], m.p[l], m.B * m.T, &one, m.a[l], ty,
                         m.d[l], m.g[l], ty, m.p[l], &zero, m.w[l], CUDA_R_32F, m.d[l], ct,
                         CUBLAS_GEMM_DEFAULT));
}

/* The same, ms: median of reps. */
static double stack_gemms(cublasHandle_t h, cudaStream_t st, stack &m, dc_dtype dt,
                          cublasComputeType_t ct, int reps) {
    return time_ms([&] { stack_gemm_pass(h, m, dt, ct); }, st, reps);
}

/* A configuration of the backend's switches (dcc_options). */
struct step_cfg {
    const char *name;
    bool tf32, grouped, one_pass, exact_noise;
    long long keep; /* per-sample gradients kept: -1 none (DPCLIP_CUDA_SGRAD=0), 0 up to
                       the default gpu.sample_grads_max, else up to that many bytes */
};

static double rel_diff(const float *x, const float *x0, size_t n) {
    double e = 0.0, w = 0.0;
    for (size_t i = 0; i < n; i++) {
        double dd = (double)x[i] - x0[i];
        e += dd * dd;
        w += (double)x0[i] * x0[i];
    }
    return w > 0.0 ? sqrt(e / w) : sqrt(e);
}

static void stack_run(cublasHandle_t h, cudaStream_t st, stack &m, dc_dtype dt,
                      const step_cfg *cfgs, int ncfg, double gemm_ms, double gemm_exact_ms,
                      cublasComputeType_t ct, int reps) {
    stack_layers(m, dt);
    dc_step s;
    memset(&s, 0, sizeof s);
    s.batch = (uint32_t)m.B;
    s.n_layers = (size_t)m.NL;
    s.layers = m.layers.data();
    s.max_grad_norm = 1.0f;
    s.reduction = DC_REDUCTION_MEAN;
    s.expected_batch = (uint32_t)m.B;
    s.noise_multiplier = 1.0f;
    s.noise_key = 42;
    s.noise_step = 1;
    s.device = 0;
    const int watch[2] = {0, m.NL - 1};
    std::vector<float> ref[2];
    const char *only = getenv("DPCLIP_BENCH_ONLY"); /* one configuration, for profilers */
    for (int c = 0; c < ncfg; c++) {
        if (only && strcmp(only, cfgs[c].name) != 0) continue;
        dc_backend *be;
        dc_err err;
        if (dc_cuda_backend_create(0, &be, &err) || dc_cuda_backend_profile(be, 1)) {
            fprintf(stderr, "backend: %s\n", err.msg);
            exit(1);
        }
        dcc_options opt;
        dc_cuda_backend_get_options(be, &opt);
        opt.tf32 = cfgs[c].tf32;
        opt.grouped = cfgs[c].grouped;
        opt.one_pass = cfgs[c].one_pass;
        opt.noise = cfgs[c].exact_noise ? DCC_NOISE_EXACT : DCC_NOISE_FAST;
        opt.sgrad = cfgs[c].keep >= 0 ? DCC_SGRAD_AUTO : DCC_SGRAD_OFF;
        dc_cuda_backend_set_options(be, &opt);
        if (cfgs[c].keep > 0) dc_cuda_backend_set_sample_grads(be, (size_t)cfgs[c].keep);
        dc_step_result r;
        if (dc_step_result_init(&r, s.batch, s.n_layers, false)) exit(1);
        std::vector<double> host, hot;
        double ph[DC_CUDA_PHASES] = {0};
        cudaEvent_t ga, gb;
        CK(cudaEventCreate(&ga));
        CK(cudaEventCreate(&gb));
        for (int i = 0; i < reps + 2; i++) {
            if (i >= 2) { /* the GEMMs between two steps, in the clocks the last one left
                             (into w, which the next step overwrites) */
                float gms;
                CK(cudaEventRecord(ga, st));
                stack_gemm_pass(h, m, dt, ct);
                CK(cudaEventRecord(gb, st));
                CK(cudaEventSynchronize(gb));
                CK(cudaEventElapsedTime(&gms, ga, gb));
                hot.push_back(gms);
            }
            double t0 = now_ms();
            if (dc_backend_run_step(be, &s, &r, &err)) {
                fprintf(stderr, "run_step: %s: %s\n", err.field, err.msg);
                exit(1);
            }
            double t1 = now_ms();
            float ms[DC_CUDA_PHASES];
            if (i < 2) continue; /* warm-up: workspace, first launches */
            host.push_back(t1 - t0);
            if (dc_cuda_backend_phase_ms(be, ms)) exit(1);
            for (int k = 0; k < DC_CUDA_PHASES; k++) ph[k] += ms[k] / reps;
        }
        CK(cudaEventDestroy(ga));
        CK(cudaEventDestroy(gb));
        std::sort(host.begin(), host.end());
        std::sort(hot.begin(), hot.end());
        const double gemm_hot = hot[hot.size() / 2];
        double gpu = 0.0;
        for (int k = 0; k < DC_CUDA_PHASES; k++) gpu += ph[k];
        double diff = 0.0;
        for (int k = 0; k < 2; k++) {
            int l = watch[k];
            size_t n = (size_t)m.p[l] * m.d[l];
            std::vector<float> x(n);
            CK(cudaMemcpy(x.data(), m.w[l], n * sizeof(float), cudaMemcpyDeviceToHost));
            if (ref[k].empty()) ref[k] = x; /* the first configuration run */
            else diff = std::max(diff, rel_diff(x.data(), ref[k].data(), n));
        }
        const double clipped = ph[3] + ph[5]; /* the GEMM-path sums and the kept ones */
        char phases[512];
        int o = 0;
        for (int k = 0; k < DC_CUDA_PHASES; k++)
            o += snprintf(phases + o, sizeof phases - (size_t)o, "%s\"%s\":%.4f", k ? "," : "",
                          dc_cuda_phase_name(k), ph[k]);
        printf("{\"bench\":\"cuda_step_phases\",\"model\":\"%s\",\"layers\":%d,"
               "\"B\":%d,\"T\":%d,\"dtype\":\"%s\",\"config\":\"%s\",\"tf32\":%s,"
               "\"grouped\":%s,\"one_pass\":%s,\"noise\":\"%s\",\"step_ms\":%.3f,"
               "\"gpu_ms\":%.3f,\"phases\":{%s},\"gemm_sum_ms\":%.3f,"
               "\"gemm_exact_f32_sum_ms\":%.3f,\"step_over_gemm\":%.3f,"
               "\"norms_over_gemm\":%.3f,\"clipped_over_gemm\":%.3f,"
               "\"gemm_after_step_ms\":%.3f,\"step_over_gemm_after\":%.3f,"
               "\"norms_over_gemm_after\":%.3f,\"clipped_over_gemm_after\":%.3f,"
               "\"rel_diff_vs_first\":%.2e,\"workspace_bytes\":%zu,\"amax_found\":%d,"
               "\"kept_layers\":%d,\"kept_direct\":%s}\n",
               m.name, m.NL, m.B, m.T, dc_dtype_name(dt), cfgs[c].name,
               cfgs[c].tf32 ? "true" : "false", cfgs[c].grouped ? "true" : "false",
               cfgs[c].one_pass ? "true" : "false", cfgs[c].exact_noise ? "exact" : "fast",
               host[host.size() / 2], gpu, phases, gemm_ms, gemm_exact_ms,
               host[host.size() / 2] / gemm_ms, ph[1] / gemm_ms, clipped / gemm_ms, gemm_hot,
               host[host.size() / 2] / gemm_hot, ph[1] / gemm_hot, clipped / gemm_hot, diff,
               dc_cuda_backend_workspace_bytes(be), dc_cuda_backend_amax_found(be),
               dc_cuda_backend_kept_layers(be), dc_cuda_backend_kept_direct(be) ? "true" : "false");
        fflush(stdout);
        dc_step_result_free(&r);
        dc_backend_destroy(be);
    }
}

/* The same step on f32 copies of m's bf16 values (replacing them in m). */
static void stack_f32(cublasHandle_t h, cudaStream_t st, stack &m, int reps) {
    for (int l = 0; l < m.NL; l++) {
        size_t rows = (size_t)m.B * m.T;
        float *af, *gf;
        CK(cudaMalloc(&af, rows * m.d[l] * sizeof(float)));
        CK(cudaMalloc(&gf, rows * m.p[l] * sizeof(float)));
        to_f32<<<4096, 256>>>((const __nv_bfloat16 *)m.a[l], af, rows * m.d[l]);
        to_f32<<<4096, 256>>>((const __nv_bfloat16 *)m.g[l], gf, rows * m.p[l]);
        CK(cudaGetLastError());
        CK(cudaFree(m.a[l]));
        CK(cudaFree(m.g[l]));
        m.a[l] = af;
        m.g[l] = gf;
    }
    CK(cudaDeviceSynchronize());
    static const step_cfg f_cfgs[] = {
        {"old", false, false, false, true, -1},
        {"new", true, true, true, false, 0},
        {"new_but_exact_f32", false, true, true, false, 0},
    };
    double g_tf32 = stack_gemms(h, st, m, DC_F32, CUBLAS_COMPUTE_32F_FAST_TF32, reps);
    double g_f32 = stack_gemms(h, st, m, DC_F32, CUBLAS_COMPUTE_32F, std::max(1, reps / 4));
    stack_run(h, st, m, DC_F32, f_cfgs, 3, g_tf32, g_f32, CUBLAS_COMPUTE_32F_FAST_TF32,
              std::max(2, reps / 3));
}

/* The step of a model's layers in bf16, then (GPT-2 only: Llama's f32 copies
 * would take 26 GB) in f32. */
static void stack_bench(cublasHandle_t h, cudaStream_t st, int reps, bool llama) {
    stack m;
    stack_shapes(m, llama);
    for (int l = 0; l < m.NL; l++) {
        size_t rows = (size_t)m.B * m.T;
        m.a[l] = rand_bf16(rows * m.d[l], 100 + l, 1.0f);
        m.g[l] = rand_bf16(rows * m.p[l], 300 + l, 0.002f);
        CK(cudaMalloc(&m.w[l], (size_t)m.p[l] * m.d[l] * sizeof(float)));
        if (m.bias) CK(cudaMalloc(&m.b[l], (size_t)m.p[l] * sizeof(float)));
    }
    CK(cudaDeviceSynchronize());
    static const step_cfg bf_cfgs[] = {
        {"old", false, false, false, true, -1},
        {"new", true, true, true, false, 0},
        {"new_but_gemm_sum", true, true, true, false, -1},
        {"new_keep_16g", true, true, true, false, 16LL << 30},
        {"new_but_per_layer", true, false, true, false, -1},
        {"new_but_staged_out", true, true, false, false, 0},
        {"new_but_exact_noise", true, true, true, true, 0},
    };
    double gemm = stack_gemms(h, st, m, DC_BF16, CUBLAS_COMPUTE_32F, reps);
    /* GPT-2's kept gradients (2 GB) fit the default budget: its 16 GiB line
       is the same step, skipped */
    std::vector<step_cfg> run;
    for (int c = 0; c < (int)(sizeof bf_cfgs / sizeof bf_cfgs[0]); c++)
        if (llama ? c < 4 : c != 3) run.push_back(bf_cfgs[c]);
    stack_run(h, st, m, DC_BF16, run.data(), (int)run.size(), gemm, gemm, CUBLAS_COMPUTE_32F, reps);
    if (!llama) stack_f32(h, st, m, reps);
    for (int l = 0; l < m.NL; l++) {
        CK(cudaFree(m.a[l]));
        CK(cudaFree(m.g[l]));
        CK(cudaFree(m.w[l]));
        CK(cudaFree(m.b[l]));
    }
}

int main(int argc, char **argv) {
    static const int shapes[7][4] = {
        {32, 512, 768, 768},   {32, 512, 768, 3072},  {8, 2048, 768, 3072},   {2, 8192, 768, 3072},
        {8, 1024, 2048, 8192}, {2, 4096, 2048, 8192}, {1, 16384, 2048, 2048},
    };
    const bool llama = argc > 1 && strcmp(argv[1], "llama") == 0;
    const bool step_only = argc > 1 && (strcmp(argv[1], "step") == 0 || llama);
    int reps = argc > 1 + step_only ? atoi(argv[1 + step_only]) : step_only ? 10 : 20;
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
    if (step_only) {
        stack_bench(h, st, reps, llama);
        cublasDestroy(h);
        cudaStreamDestroy(st);
        return 0;
    }

    /* the bf16 GEMM peak */
    double peak;
    {
        const int n = 8192;
        __nv_bfloat16 *A = rand_bf16((size_t)n * n, 1, 1.0f),
                      *Bm = rand_bf16((size_t)n * n, 2, 1.0f),
                      *C = rand_bf16((size_t)n * n, 3, 1.0f);
        double ms = time_ms([&] { gemm_bf16(h, n, n, n, A, n, CUBLAS_OP_N, Bm, n, C, n); }, st, 10);
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
    const char *one = getenv("DPCLIP_BENCH_SHAPE"); /* one shape, for profilers */
    for (int si = 0; si < 7; si++) {
        if (one && atoi(one) != si) continue;
        const int B = shapes[si][0], T = shapes[si][1], d = shapes[si][2], p = shapes[si][3];
        const size_t rows = (size_t)B * T;
        __nv_bfloat16 *a = rand_bf16(rows * d, 11 + si, 1.0f),
                      *g = rand_bf16(rows * p, 23 + si, 0.1f);
        __nv_bfloat16 *W;
        float *n2, *w32, *b32;
        CK(cudaMalloc(&W, (size_t)p * d * sizeof *W));
        CK(cudaMalloc(&n2, 3 * (size_t)B * sizeof *n2));
        CK(cudaMalloc(&w32, (size_t)p * d * sizeof *w32));
        CK(cudaMalloc(&b32, (size_t)p * sizeof *b32));
        /* the DPCLIP_CUDA_* switches apply here as in the daemon (A/B runs) */
        dcc_options env;
        dcc_options_from_env(&env);
        dcc_linear L = {a, g, DC_BF16, DC_BF16, B, T, d, p, true, false, &env, NULL};
        /* the bias sums' scratch, as the backend's workspace gives it */
        void *bws;
        CK(cudaMalloc(&bws, dcc_linear_bias_ws_bytes(&L)));
        L.bias_ws = bws;
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
        dcc_direct_plan auto_plan;
        dcc_direct_plan_get(&L, &auto_plan);
        dcc_ghost_plan ghost_plan;
        dcc_ghost_plan_get(&L, &ghost_plan);
        double th[4];
        dcc_options forced;
        dcc_options_default(&forced);
        L.opt = &forced;
        for (int k = 0; k < 4; k++) {
            forced.direct_tile = k & 1 ? 256 : 128;
            forced.direct_split = k & 2 ? 2 : 1;
            th[k] = time_ms(
                [&] {
                    CK(cudaMemsetAsync(n2 + B, 0, B * sizeof *n2, st));
                    CK(dcc_linear_sqnorms(&L, DC_ALGO_DIRECT, 1.0f, n2 + B, st));
                },
                st, reps);
        }
        L.opt = &env; /* the model's choices again */
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
               "\"direct_split\":%d,\"direct_tail_split\":%d,\"direct_persist\":%d,"
               "\"direct_unsplit_tiles\":%lld,"
               "\"ghost_wide_items\":%lld,\"ghost_tail_split\":%d,\"ghost_unsplit_pairs\":%lld,"
               "\"path\":%d}\n",
               B, T, d, p, pick == DC_ALGO_DIRECT ? "direct" : "ghost", t[0], t[1], t[2], gemm,
               limit, r_auto, t[1] / gemm, t[2] / gemm, limit / gemm,
               fl_direct / (gemm * 1e-3) * 1e-12,
               std::min(fl_direct, fl_ghost) / (t[0] * 1e-3) * 1e-12, dvg, sms, extra, bms,
               bk_extra, th[0], th[1], th[2], th[3], auto_rows, auto_split, auto_plan.tail_ks,
               (int)auto_plan.persist, auto_plan.tail_ks ? auto_plan.full : 0LL, ghost_plan.wide,
               ghost_plan.tail_ks, ghost_plan.tail_ks ? ghost_plan.full : 0LL, dcc_linear_path(&L));
        fflush(stdout);
        CK(cudaFree(a));
        CK(cudaFree(g));
        CK(cudaFree(W));
        CK(cudaFree(n2));
        CK(cudaFree(w32));
        CK(cudaFree(b32));
        CK(cudaFree(bws));
    }
    double gm = exp(lg_auto / 7.0);
    printf("{\"bench\":\"cuda_norms_summary\",\"shapes\":7,\"geomean_auto_over_gemm\":%.3f,"
           "\"geomean_direct_over_gemm\":%.3f,\"geomean_ghost_over_gemm\":%.3f,"
           "\"geomean_limit_over_gemm\":%.3f,\"max_auto_over_gemm\":%.3f,"
           "\"max_extra_bytes\":%zu,\"target_geomean_le_1\":%s,\"target_max_le_1_5\":%s,"
           "\"target_extra_le_64MiB\":%s,\"target_geomean_le_0_85\":%s,"
           "\"target_max_le_1_25\":%s}\n",
           gm, exp(lg_direct / 7.0), exp(lg_ghost / 7.0), exp(lg_limit / 7.0), worst, worst_extra,
           gm <= 1.0 ? "true" : "false", worst <= 1.5 ? "true" : "false",
           worst_extra <= ((size_t)64 << 20) ? "true" : "false", gm <= 0.85 ? "true" : "false",
           worst <= 1.25 ? "true" : "false");
    stack_bench(h, st, std::max(2, reps / 2), false);
    cublasDestroy(h);
    cudaStreamDestroy(st);
    return 0;
}
