/* LINEAR per-sample squared norms on Hopper's warpgroup MMA (wgmma, sm_90a):
 * the same two forms as norms_linear.cu, with the tensor cores fed straight
 * from shared memory through matrix descriptors instead of mma.sync's
 * register fragments (about twice the rate on an H100).
 *
 * A CTA is two warpgroups (256 threads); each computes a 64x128 half of the
 * CTA's 128x128 f32 tile with m64n128k16 instructions. Operands arrive by
 * 16-byte cp.async into 128-byte-row tiles with the 128B swizzle (chunk ^
 * row % 8, tiles 1024-byte aligned), the layout the descriptors name:
 *   direct: K = T rows; A = g_b^T and B = a_b are both stored MN-major,
 *     [64 k][64 features] blocks (LBO = 8 KiB between 64-wide blocks,
 *     SBO = 1 KiB between 8-row groups), transposed in the instruction;
 *   ghost: K = features; A and B are 128 rows of a_b (then g_b), K-major
 *     [128 rows][64 k] (SBO = 1 KiB).
 * Pipeline: stages of 64 k, ST-2 tiles in flight; each k-tile's wgmmas are
 * committed as one group and the loop waits for the previous group only, so
 * loads, MMAs and the next tile's issue overlap. A stage is refilled only
 * after a barrier that every warpgroup reaches after its wait on the MMAs
 * that read it.
 *
 * Built only for sm_90a (the instructions do not exist elsewhere); on other
 * targets the kernels compile empty and dcc_linear_wgmma reports
 * cudaErrorNotSupported, so the dispatcher uses the mma.sync kernels. */
#include <stdlib.h>

#include "dcc_device.cuh"

#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define DCC_WG_EMPTY 1 /* device pass for a target without wgmma */
#endif

namespace {

constexpr int WT = 256;             /* two warpgroups */
constexpr int WBK = 64;             /* k per stage */
constexpr int HALF = 64 * 64 * 2;   /* one [64][64] 16-bit block: 8 KiB */
constexpr int STAGE = 4 * HALF;     /* A and B, 128 x 64 each */
constexpr int D_ST = 5, G_ST = 4;
constexpr int D_SMEM = D_ST * STAGE + 1024, G_SMEM = G_ST * STAGE + 1024;

#ifndef DCC_WG_EMPTY
template <int TA, int TB>
__device__ __forceinline__ void wgmma_m64n128k16(const dcc_bf16 *, float (&d)[64], uint64_t da,
                                                 uint64_t db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %68, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "%64, %65, p, 1, 1, %66, %67;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
          "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
          "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),
          "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
          "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),
          "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
          "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]),
          "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]),
          "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(da), "l"(db), "n"(TA), "n"(TB), "r"(1));
}

template <int TA, int TB>
__device__ __forceinline__ void wgmma_m64n128k16(const dcc_f16 *, float (&d)[64], uint64_t da,
                                                 uint64_t db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %68, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "%64, %65, p, 1, 1, %66, %67;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
          "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
          "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),
          "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
          "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),
          "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
          "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]),
          "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]),
          "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(da), "l"(db), "n"(TA), "n"(TB), "r"(1));
}

__device__ __forceinline__ uint64_t wg_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
    return (uint64_t)((addr & 0x3FFFFu) >> 4) | ((uint64_t)((lbo & 0x3FFFFu) >> 4) << 16) |
           ((uint64_t)((sbo & 0x3FFFFu) >> 4) << 32) | (1ull << 62); /* 128B swizzle */
}
__device__ __forceinline__ void wg_fence() {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wg_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N> __device__ __forceinline__ void wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
/* Keeps the compiler from moving accumulator accesses across async MMAs. */
__device__ __forceinline__ void acc_fence(float (&d)[64]) {
#pragma unroll
    for (int i = 0; i < 64; i++) asm volatile("" : "+f"(d[i])::"memory");
}

/* The MMAs of one stage for this warpgroup (wg = 0, 1: its 64-row half). */
template <typename TI, bool DIRECT>
__device__ __forceinline__ void stage_mma(float (&acc)[64], uint32_t sA, uint32_t sB, int wg) {
#pragma unroll
    for (int kk = 0; kk < WBK / 16; kk++) {
        if (DIRECT) {
            uint64_t da = wg_desc(sA + (uint32_t)(wg * HALF + kk * 2048), HALF, 1024);
            uint64_t db = wg_desc(sB + (uint32_t)(kk * 2048), HALF, 1024);
            wgmma_m64n128k16<1, 1>((const TI *)nullptr, acc, da, db);
        } else {
            uint64_t da = wg_desc(sA + (uint32_t)(wg * HALF + kk * 32), 16, 1024);
            uint64_t db = wg_desc(sB + (uint32_t)(kk * 32), 16, 1024);
            wgmma_m64n128k16<0, 0>((const TI *)nullptr, acc, da, db);
        }
    }
}

/* One operand pair view: DIRECT loads rows k of g (A) and a (B) at feature
 * offsets m0 / n0; GHOST loads rows t0 / s0 of x at column k. */
struct wg_src {
    const uint16_t *xa, *xb; /* A and B sources (same matrix for ghost) */
    int lda, ldb;            /* leading dimensions = widths */
    int ra, rb;              /* DIRECT: feature offsets m0, n0; GHOST: row offsets t0, s0 */
    int T;
};

template <bool DIRECT>
__device__ __forceinline__ void stage_load(uint32_t s, const wg_src &v, int kt) {
    if (DIRECT) {
        int k0 = kt * WBK;
        dcc_load_tile<64, 64, true, WT>(s, v.xa, v.lda, k0, v.T, v.ra, v.lda);
        dcc_load_tile<64, 64, true, WT>(s + HALF, v.xa, v.lda, k0, v.T, v.ra + 64, v.lda);
        dcc_load_tile<64, 64, true, WT>(s + 2 * HALF, v.xb, v.ldb, k0, v.T, v.rb, v.ldb);
        dcc_load_tile<64, 64, true, WT>(s + 3 * HALF, v.xb, v.ldb, k0, v.T, v.rb + 64, v.ldb);
    } else {
        int c0 = kt * WBK;
        dcc_load_tile<128, 64, true, WT>(s, v.xa, v.lda, v.ra, v.T, c0, v.lda);
        dcc_load_tile<128, 64, true, WT>(s + 2 * HALF, v.xb, v.ldb, v.rb, v.T, c0, v.ldb);
    }
}

/* acc = the 128x128 tile over K (= T for DIRECT, the width for GHOST).
 * DIRECT with colsum: also the column sums of A (bias), thread-owned
 * columns 2*(tid%64), +1 over a quarter of each stage's rows. */
template <typename TI, bool DIRECT, int ST>
__device__ __forceinline__ void wg_loop(float (&acc)[64], uint32_t sbase, const wg_src &v, int K,
                                        bool colsum, float &bs0, float &bs1) {
    constexpr int P = ST - 2;
    const int wg = (int)threadIdx.x >> 7;
    const int ktn = (K + WBK - 1) / WBK;
#pragma unroll
    for (int i = 0; i < 64; i++) acc[i] = 0.0f;
#pragma unroll
    for (int s = 0; s < P; s++) {
        if (s < ktn) stage_load<DIRECT>(sbase + (uint32_t)(s * STAGE), v, s);
        dcc_cp_commit();
    }
    for (int kt = 0; kt < ktn; kt++) {
        dcc_cp_wait<P - 1>();
        fence_proxy_async();
        __syncthreads();
        {
            int kn = kt + P;
            if (kn < ktn) stage_load<DIRECT>(sbase + (uint32_t)((kn % ST) * STAGE), v, kn);
            dcc_cp_commit();
        }
        const uint32_t sA = sbase + (uint32_t)((kt % ST) * STAGE), sB = sA + 2 * HALF;
        acc_fence(acc);
        wg_fence();
        stage_mma<TI, DIRECT>(acc, sA, sB, wg);
        wg_commit();
        acc_fence(acc);
        if (DIRECT && colsum) {
            int m = ((int)threadIdx.x & 63) * 2, rq = ((int)threadIdx.x >> 6) * (WBK / 4);
            uint32_t base = sA + (uint32_t)((m >> 6) * HALF);
            int ml = m & 63;
#pragma unroll
            for (int r = rq; r < rq + WBK / 4; r++) {
                uint32_t w = dcc_lds32(base + (uint32_t)(r * 128) +
                                       (uint32_t)((((ml >> 3) ^ (r & 7))) << 4) +
                                       (uint32_t)((ml & 7) * 2));
                bs0 += dcc_lo((const TI *)nullptr, w);
                bs1 += dcc_hi((const TI *)nullptr, w);
            }
        }
        wg_wait<1>();
        acc_fence(acc);
    }
    wg_wait<0>();
    acc_fence(acc);
    dcc_cp_wait<0>();
    __syncthreads();
}

template <typename TI>
__global__ void __launch_bounds__(WT, 1)
wg_direct(const uint16_t *__restrict__ a, const uint16_t *__restrict__ g, int T, int d, int p,
          int tiles_n, int has_bias, float s2, float *__restrict__ n2) {
    extern __shared__ unsigned char smem[];
    __shared__ float colsum[4][128];
    const uint32_t sbase = (dcc_smem(smem) + 1023u) & ~1023u;
    const int b = blockIdx.y;
    const int tm = (int)blockIdx.x / tiles_n, tn = (int)blockIdx.x % tiles_n;
    const bool do_bias = has_bias && tn == 0;
    wg_src v;
    v.xa = g + (int64_t)b * T * p;
    v.xb = a + (int64_t)b * T * d;
    v.lda = p;
    v.ldb = d;
    v.ra = tm * 128;
    v.rb = tn * 128;
    v.T = T;
    float acc[64];
    float bs0 = 0.0f, bs1 = 0.0f;
    wg_loop<TI, true, D_ST>(acc, sbase, v, T, do_bias, bs0, bs1);
    float sq = 0.0f;
#pragma unroll
    for (int i = 0; i < 64; i++) sq += acc[i] * acc[i];
    if (do_bias) {
        int m = ((int)threadIdx.x & 63) * 2, rq = (int)threadIdx.x >> 6;
        colsum[rq][m] = bs0;
        colsum[rq][m + 1] = bs1;
        __syncthreads();
        if (threadIdx.x < 128) {
            int c = (int)threadIdx.x;
            float x = colsum[0][c] + colsum[1][c] + colsum[2][c] + colsum[3][c];
            sq += x * x;
        }
    }
    float tot = dcc_block_sum(sq);
    if (threadIdx.x == 0) atomicAdd(n2 + b, tot * s2);
}

template <typename TI>
__global__ void __launch_bounds__(WT, 1)
wg_ghost(const uint16_t *__restrict__ a, const uint16_t *__restrict__ g, int T, int d, int p,
         int has_bias, float s2, float *__restrict__ n2) {
    extern __shared__ unsigned char smem[];
    const uint32_t sbase = (dcc_smem(smem) + 1023u) & ~1023u;
    const int b = blockIdx.y, idx = (int)blockIdx.x;
    int ti = (int)((sqrtf(8.0f * (float)idx + 1.0f) - 1.0f) * 0.5f);
    while (ti * (ti + 1) / 2 > idx) ti--;
    while ((ti + 1) * (ti + 2) / 2 <= idx) ti++;
    const int si = idx - ti * (ti + 1) / 2;
    float ga[64], gg[64], unused0 = 0.0f, unused1 = 0.0f;
    wg_src v;
    v.xa = v.xb = a + (int64_t)b * T * d;
    v.lda = v.ldb = d;
    v.ra = ti * 128;
    v.rb = si * 128;
    v.T = T;
    wg_loop<TI, false, G_ST>(ga, sbase, v, d, false, unused0, unused1);
    v.xa = v.xb = g + (int64_t)b * T * p;
    v.lda = v.ldb = p;
    wg_loop<TI, false, G_ST>(gg, sbase, v, p, false, unused0, unused1);
    float part = 0.0f, gsum = 0.0f;
#pragma unroll
    for (int i = 0; i < 64; i++) {
        part += ga[i] * gg[i];
        gsum += gg[i];
    }
    if (has_bias) part += gsum;
    float tot = dcc_block_sum(part);
    if (threadIdx.x == 0) atomicAdd(n2 + b, tot * s2 * (ti == si ? 1.0f : 2.0f));
}

#else /* no wgmma on this target: empty kernels keep the host code identical */

template <typename TI>
__global__ void wg_direct(const uint16_t *, const uint16_t *, int, int, int, int, int, float,
                          float *) {}
template <typename TI>
__global__ void wg_ghost(const uint16_t *, const uint16_t *, int, int, int, int, float, float *) {}

#endif

template <typename TI>
cudaError_t launch_wg(const dcc_linear *L, dc_algo algo, float s2, float *n2, cudaStream_t st) {
    const uint16_t *a = (const uint16_t *)L->a, *g = (const uint16_t *)L->g;
    cudaError_t e;
    if (algo == DC_ALGO_DIRECT) {
        int tiles_m = (L->p + 127) / 128, tiles_n = (L->d + 127) / 128;
        if ((int64_t)tiles_m * tiles_n > INT32_MAX) return cudaErrorInvalidConfiguration;
        e = cudaFuncSetAttribute(wg_direct<TI>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 D_SMEM);
        if (e != cudaSuccess) return e;
        dim3 grid((unsigned)(tiles_m * tiles_n), (unsigned)L->B);
        wg_direct<TI><<<grid, WT, D_SMEM, st>>>(a, g, L->T, L->d, L->p, tiles_n, L->has_bias, s2,
                                                n2);
    } else {
        int64_t nt = (L->T + 127) / 128, pairs = nt * (nt + 1) / 2;
        if (pairs > INT32_MAX / 2) return cudaErrorInvalidConfiguration;
        e = cudaFuncSetAttribute(wg_ghost<TI>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 G_SMEM);
        if (e != cudaSuccess) return e;
        dim3 grid((unsigned)pairs, (unsigned)L->B);
        wg_ghost<TI><<<grid, WT, G_SMEM, st>>>(a, g, L->T, L->d, L->p, L->has_bias, s2, n2);
    }
    return cudaGetLastError();
}

} // namespace

extern "C" int dcc_wgmma_available(void) {
#ifdef DCC_WGMMA_BUILT
    static int env = -1;
    int dev, major = 0, minor = 0;
    if (env < 0) { /* DPCLIP_CUDA_WGMMA=0 selects the mma.sync kernels (A/B checks) */
        const char *s = getenv("DPCLIP_CUDA_WGMMA");
        env = !(s && s[0] == '0');
    }
    if (!env || cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess)
        return 0;
    return major == 9 && minor == 0;
#else
    return 0;
#endif
}

extern "C" cudaError_t dcc_linear_wgmma(const dcc_linear *L, dc_algo algo, float s2, float *n2,
                                        cudaStream_t st) {
#ifdef DCC_WGMMA_BUILT
    if (L->ta == DC_BF16) return launch_wg<dcc_bf16>(L, algo, s2, n2, st);
    if (L->ta == DC_F16) return launch_wg<dcc_f16>(L, algo, s2, n2, st);
    return cudaErrorInvalidValue;
#else
    (void)L;
    (void)algo;
    (void)s2;
    (void)n2;
    (void)st;
    return cudaErrorNotSupported;
#endif
}
