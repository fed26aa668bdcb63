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
#include <string.h>

#include "dcc_util.cuh"
#include "dcc_wgmma.cuh"

namespace {

constexpr int WT = 256; /* two warpgroups */

#ifndef DCC_WG_EMPTY

/* One operand pair view: DIRECT loads rows k of g (A) and a (B) at feature
 * offsets m0 / n0; GHOST loads rows t0 / s0 of x at column k. */
struct wg_src {
    const uint16_t *xa, *xb; /* A and B sources (same matrix for ghost) */
    int lda, ldb;            /* leading dimensions = widths */
    int ra, rb;              /* DIRECT: feature offsets m0, n0; GHOST: row offsets t0, s0 */
    int T;
};

template <bool DIRECT, int MI>
__device__ __forceinline__ void stage_load(uint32_t s, const wg_src &v, int kt) {
    const uint32_t sB = s + (uint32_t)(2 * MI * HALF);
    if (DIRECT) {
        int k0 = kt * WBK;
#pragma unroll
        for (int h = 0; h < 2 * MI; h++)
            dcc_load_tile<64, 64, true, WT>(s + (uint32_t)(h * HALF), v.xa, v.lda, k0, v.T,
                                            v.ra + 64 * h, v.lda);
        dcc_load_tile<64, 64, true, WT>(sB, v.xb, v.ldb, k0, v.T, v.rb, v.ldb);
        dcc_load_tile<64, 64, true, WT>(sB + HALF, v.xb, v.ldb, k0, v.T, v.rb + 64, v.ldb);
    } else {
        int c0 = kt * WBK;
        dcc_load_tile<128, 64, true, WT>(s, v.xa, v.lda, v.ra, v.T, c0, v.lda);
        if (v.ra != v.rb) /* a diagonal tile reads one block of rows as both */
            dcc_load_tile<128, 64, true, WT>(sB, v.xb, v.ldb, v.rb, v.T, c0, v.ldb);
    }
}

/* acc = the (128*MI)x128 tile over K (= T for DIRECT, the width for GHOST).
 * DIRECT with colsum: also the column sums of A (the bias gradient); a thread
 * owns columns 2*(tid % (64*MI)), +1 over a 1/(4/MI) share of each stage's
 * rows. */
template <typename TI, bool DIRECT, int MI, int ST>
__device__ __forceinline__ void wg_loop(float (&acc)[MI][64], uint32_t sbase, const wg_src &v,
                                        int K, bool colsum, float &bs0, float &bs1) {
    constexpr int P = ST - 2, SB = stage_bytes<MI>();
    const int wg = (int)threadIdx.x >> 7;
    const int ktn = (K + WBK - 1) / WBK;
#pragma unroll
    for (int j = 0; j < MI; j++)
#pragma unroll
        for (int i = 0; i < 64; i++) acc[j][i] = 0.0f;
#pragma unroll
    for (int s = 0; s < P; s++) {
        if (s < ktn) stage_load<DIRECT, MI>(sbase + (uint32_t)(s * SB), v, s);
        dcc_cp_commit();
    }
    for (int kt = 0; kt < ktn; kt++) {
        dcc_cp_wait<P - 1>();
        fence_proxy_async();
        __syncthreads();
        {
            int kn = kt + P;
            if (kn < ktn) stage_load<DIRECT, MI>(sbase + (uint32_t)((kn % ST) * SB), v, kn);
            dcc_cp_commit();
        }
        const uint32_t sA = sbase + (uint32_t)((kt % ST) * SB);
        const uint32_t sB = (!DIRECT && v.ra == v.rb) ? sA : sA + 2 * MI * HALF;
        stage_issue<TI, DIRECT, MI>(acc, sA, sB, wg, colsum, bs0, bs1);
        wg_wait<1>();
        acc_fence<MI>(acc);
    }
    wg_wait<0>();
    acc_fence<MI>(acc);
    dcc_cp_wait<0>();
    __syncthreads();
}

/* DIRECT, MI = 1: 128x128 tiles, 5 stages (160 KiB); MI = 2: 256x128 tiles
 * (twice the arithmetic per byte loaded), 4 stages (192 KiB). */
template <int MI> __host__ __device__ constexpr int direct_stages() { return MI == 1 ? 5 : 4; }
template <int MI> __host__ __device__ constexpr int direct_smem() { return direct_stages<MI>() * stage_bytes<MI>() + 1024; }

template <typename TI, int MI>
__global__ void __launch_bounds__(WT, 1)
wg_direct(const uint16_t *__restrict__ a, const uint16_t *__restrict__ g, int T, int d, int p,
          int tiles_n, int has_bias, float s2, float *__restrict__ n2) {
    extern __shared__ unsigned char smem[];
    __shared__ float colsum[512];
    constexpr int CW = 64 * MI;
    const uint32_t sbase = (dcc_smem(smem) + 1023u) & ~1023u;
    const int b = blockIdx.y;
    const int tm = (int)blockIdx.x / tiles_n, tn = (int)blockIdx.x % tiles_n;
    const bool do_bias = has_bias && tn == 0;
    wg_src v;
    v.xa = g + (int64_t)b * T * p;
    v.xb = a + (int64_t)b * T * d;
    v.lda = p;
    v.ldb = d;
    v.ra = tm * 128 * MI;
    v.rb = tn * 128;
    v.T = T;
    float acc[MI][64];
    float bs0 = 0.0f, bs1 = 0.0f;
    wg_loop<TI, true, MI, direct_stages<MI>()>(acc, sbase, v, T, do_bias, bs0, bs1);
    float sq = 0.0f;
#pragma unroll
    for (int j = 0; j < MI; j++)
#pragma unroll
        for (int i = 0; i < 64; i++) sq += acc[j][i] * acc[j][i];
    if (do_bias) {
        /* 4/MI row groups of 128*MI columns */
        int m = ((int)threadIdx.x % CW) * 2, rq = (int)threadIdx.x / CW;
        colsum[rq * 2 * CW + m] = bs0;
        colsum[rq * 2 * CW + m + 1] = bs1;
        __syncthreads();
        if ((int)threadIdx.x < 2 * CW) {
            float x = 0.0f;
#pragma unroll
            for (int q = 0; q < 4 / MI; q++) x += colsum[q * 2 * CW + (int)threadIdx.x];
            sq += x * x;
        }
    }
    float tot = dcc_block_sum(sq);
    if (threadIdx.x == 0) atomicAdd(n2 + b, tot * s2);
}

constexpr int G_ST = 4, G_SMEM = G_ST * 4 * HALF + 1024;

template <typename TI>
__global__ void __launch_bounds__(WT, 1)
wg_ghost(const uint16_t *__restrict__ a, const uint16_t *__restrict__ g, int T, int d, int p,
         int has_bias, float s2, float *__restrict__ n2) {
    extern __shared__ unsigned char smem[];
    const uint32_t sbase = (dcc_smem(smem) + 1023u) & ~1023u;
    const int b = blockIdx.y, idx = (int)blockIdx.x;
    int ti, si;
    dcc_tri_pair(idx, &ti, &si);
    float ga[1][64], gg[1][64], unused0 = 0.0f, unused1 = 0.0f;
    wg_src v;
    v.xa = v.xb = a + (int64_t)b * T * d;
    v.lda = v.ldb = d;
    v.ra = ti * 128;
    v.rb = si * 128;
    v.T = T;
    wg_loop<TI, false, 1, G_ST>(ga, sbase, v, d, false, unused0, unused1);
    v.xa = v.xb = g + (int64_t)b * T * p;
    v.lda = v.ldb = p;
    wg_loop<TI, false, 1, G_ST>(gg, sbase, v, p, false, unused0, unused1);
    float part = 0.0f, gsum = 0.0f;
#pragma unroll
    for (int i = 0; i < 64; i++) {
        part += ga[0][i] * gg[0][i];
        gsum += gg[0][i];
    }
    if (has_bias) part += gsum;
    float tot = dcc_block_sum(part);
    if (threadIdx.x == 0) atomicAdd(n2 + b, tot * s2 * (ti == si ? 1.0f : 2.0f));
}

#else /* no wgmma on this target: empty kernels keep the host code identical */

template <int MI> __host__ __device__ constexpr int direct_smem() { return 1024; }
constexpr int G_SMEM = 1024;
template <typename TI, int MI>
__global__ void wg_direct(const uint16_t *, const uint16_t *, int, int, int, int, int, float,
                          float *) {}
template <typename TI>
__global__ void wg_ghost(const uint16_t *, const uint16_t *, int, int, int, int, float, float *) {}

#endif

template <typename TI, int MI>
cudaError_t launch_direct(const dcc_linear *L, float s2, float *n2, cudaStream_t st) {
    int tiles_m = (L->p + 128 * MI - 1) / (128 * MI), tiles_n = (L->d + 127) / 128;
    if ((int64_t)tiles_m * tiles_n > INT32_MAX) return cudaErrorInvalidConfiguration;
    cudaError_t e = cudaFuncSetAttribute(wg_direct<TI, MI>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         direct_smem<MI>());
    if (e != cudaSuccess) return e;
    dim3 grid((unsigned)(tiles_m * tiles_n), (unsigned)L->B);
    wg_direct<TI, MI><<<grid, WT, direct_smem<MI>(), st>>>(
        (const uint16_t *)L->a, (const uint16_t *)L->g, L->T, L->d, L->p, tiles_n, L->has_bias,
        s2, n2);
    return cudaGetLastError();
}

template <typename TI>
cudaError_t launch_wg(const dcc_linear *L, dc_algo algo, float s2, float *n2, cudaStream_t st) {
    if (algo == DC_ALGO_DIRECT)
        return dcc_direct_tile_rows(L) == 256 ? launch_direct<TI, 2>(L, s2, n2, st)
                                              : launch_direct<TI, 1>(L, s2, n2, st);
    int64_t nt = (L->T + 127) / 128, pairs = nt * (nt + 1) / 2;
    if (pairs > INT32_MAX / 2) return cudaErrorInvalidConfiguration;
    cudaError_t e = cudaFuncSetAttribute(wg_ghost<TI>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         G_SMEM);
    if (e != cudaSuccess) return e;
    dim3 grid((unsigned)pairs, (unsigned)L->B);
    wg_ghost<TI><<<grid, WT, G_SMEM, st>>>((const uint16_t *)L->a, (const uint16_t *)L->g, L->T,
                                           L->d, L->p, L->has_bias, s2, n2);
    return cudaGetLastError();
}

} // namespace

/* Tile shape of the wgmma direct form, by a wave-aware cost model. With one
 * CTA per SM a launch costs about ceil(CTAs / SMs) times one CTA's work:
 *   - 256 rows of p instead of 128 halve the bytes loaded per flop but also
 *     the CTAs; the 256-row tile runs TALL_GAIN times faster per flop
 *     (measured on an H100 with the TMA feed: 1.14-1.36);
 *   - split KS (TMA feed only, T >= SPLIT_MIN_T) runs each tile's K range
 *     on a KS-CTA cluster: KS times the CTAs, each with 1/KS of the k-tiles
 *     plus a fixed cost (pipeline fill, epilogue; for a split CTA also the
 *     exchange), FILL_TILES / SPLIT_TILES k-tiles' worth, fitted on an H100
 *     to the (8,2048,768,3072) and (2,8192,768,3072) shapes.
 * Clusters of 4 measured far slower than this model says (cluster placement
 * on 132 SMs), and clusters of 3 no better than 2 (on (2,8192,768,3072), the
 * one benchmark shape where the model would pick 3: 1.46x the GEMM against
 * 1.46x for 2 in one run, 1.56-1.58x against 1.46-1.51x across H100s), so
 * the model's split is at most 2; 3 can be forced.
 * DPCLIP_CUDA_DIRECT_TILE=128|256 and DPCLIP_CUDA_DIRECT_SPLIT=1|2|3 force
 * the choices (tests, benchmark). */
static const double TALL_GAIN = 1.3, FILL_TILES = 4.0, SPLIT_TILES = 12.0;
/* The hybrid's second launch and its tail's fill cost about 25 k-tiles on
 * top of the model: fitted on an H100 to (2,8192,768,3072), where the
 * hybrid ran 1.37x the GEMM against 1.56x for a split of every tile, and
 * (8,2048,768,3072), where a 2-way tail ran 1.22x against 1.11x unsplit. */
static const double HYBRID_TILES = 25.0;
static const int SPLIT_MIN_T = 2048;

static double direct_cost(const dcc_linear *L, int rows, int split, int sms) {
    int64_t ctas = (int64_t)((L->p + rows - 1) / rows) * ((L->d + 127) / 128) * L->B * split;
    double waves = (double)((ctas + sms - 1) / sms);
    double ktn = (double)((L->T + 63) / 64);
    return waves * (rows == 256 ? 2.0 / TALL_GAIN : 1.0) *
           (ktn / split + (split > 1 ? SPLIT_TILES : FILL_TILES));
}

static int max_split(const dcc_linear *L) {
    return dcc_tma_available(L->opt) && L->T >= SPLIT_MIN_T ? 2 : 1;
}

static int64_t direct_tiles(const dcc_linear *L, int rows) {
    return (int64_t)((L->p + rows - 1) / rows) * ((L->d + 127) / 128) * L->B;
}

/* The cheapest plan, for the given tile height (0: either). Besides a split
 * of every tile, the hybrid: whole waves unsplit, then the last partial wave
 * split KS = 2-4 ways so that it fills more SMs for a fraction of a wave's
 * time. Clusters of 3-4 lose to placement when they fill the GPU; a tail
 * leaves most SMs to them. */
static void direct_shape(const dcc_linear *L, int rows_only, dcc_direct_plan *pl) {
    int sms, ms = max_split(L);
    double bc = 1e300, ktn = (double)((L->T + 63) / 64);
    pl->rows = rows_only ? rows_only : 128;
    pl->split = 1;
    pl->tail_ks = 0;
    pl->full = 0;
    /* a device that cannot be asked gets the plain plan; its launch then
     * reports the error */
    if (dcc_sm_count(&sms) != cudaSuccess) return;
    for (int rows = 128; rows <= 256; rows *= 2) {
        if (rows_only && rows != rows_only) continue;
        for (int split = 1; split <= ms; split++) {
            double c = direct_cost(L, rows, split, sms);
            if (c < bc * 0.999) {
                bc = c;
                *pl = (dcc_direct_plan){rows, split, 0, 0};
            }
        }
        int64_t ctas = direct_tiles(L, rows), waves = ctas / sms, tail = ctas % sms;
        if (ms < 2 || waves < 1 || tail == 0) continue;
        double w = rows == 256 ? 2.0 / TALL_GAIN : 1.0;
        for (int ks = 2; ks <= 4 && tail * ks <= sms; ks++) {
            double c = (double)waves * w * (ktn + FILL_TILES) +
                       w * (ktn / ks + SPLIT_TILES + HYBRID_TILES);
            if (c < bc * 0.999) {
                bc = c;
                *pl = (dcc_direct_plan){rows, 1, ks, (long long)(waves * sms)};
            }
        }
    }
}

/* The forced tile height (dcc_options.direct_tile), or 0. */
static int forced_rows(const dcc_linear *L) { return L->opt ? L->opt->direct_tile : 0; }

extern "C" int dcc_direct_tile_rows(const dcc_linear *L) {
    dcc_direct_plan pl;
    if (int rows = forced_rows(L)) return rows;
    direct_shape(L, 0, &pl);
    return pl.rows;
}

/* The split of every tile; 1 when the plan splits only the tail. */
extern "C" int dcc_direct_split(const dcc_linear *L) {
    if (int k = L->opt ? L->opt->direct_split : 0)
        return k >= 3 ? (dcc_tma_available(L->opt) ? 3 : 2) : k;
    dcc_direct_plan pl;
    direct_shape(L, forced_rows(L), &pl);
    return pl.split;
}

/* dcc_options.direct_split forces a split of every tile (no hybrid);
 * tail_k forces the hybrid: a K-way tail (2-4) after tail_after unsplit
 * tiles (-1: the whole waves). */
extern "C" void dcc_direct_plan_get(const dcc_linear *L, dcc_direct_plan *pl) {
    const dcc_options *o = L->opt;
    if (o && o->tail_k && dcc_tma_available(o)) {
        int rows = dcc_direct_tile_rows(L);
        int64_t total = direct_tiles(L, rows);
        int sms;
        long long n = 0; /* default: the whole waves; none if the device cannot be asked */
        if (o->tail_after >= 0) n = o->tail_after;
        else if (dcc_sm_count(&sms) == cudaSuccess) n = (long long)(total / sms * sms);
        *pl = (dcc_direct_plan){rows, 1, o->tail_k, n > total ? (long long)total : n};
    } else if (o && o->direct_split) {
        *pl = (dcc_direct_plan){dcc_direct_tile_rows(L), dcc_direct_split(L), 0, 0};
    } else {
        direct_shape(L, forced_rows(L), pl); /* the model's plan, in one search */
    }
}

extern "C" int dcc_wgmma_available(const dcc_options *o) {
#ifdef DCC_WGMMA_BUILT
    int dev, major = 0, minor = 0;
    /* o->wgmma false selects the mma.sync kernels (A/B checks) */
    if ((o && !o->wgmma) || cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess)
        return 0;
    return major == 9 && minor == 0;
#else
    (void)o;
    return 0;
#endif
}

extern "C" cudaError_t dcc_linear_wgmma(const dcc_linear *L, dc_algo algo, float s2, float *n2,
                                        cudaStream_t st) {
#ifdef DCC_WGMMA_BUILT
    if (dcc_tma_available(L->opt)) {
        cudaError_t e = dcc_linear_tma(L, algo, s2, n2, st);
        if (e != cudaErrorNotSupported) return e;
    }
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
