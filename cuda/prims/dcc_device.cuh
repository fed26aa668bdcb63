/* Device-side helpers shared by the kernels: element loads for the three
 * float dtypes, block reductions, and the sm_80+ instructions the tensor-core
 * kernels are built from (cp.async, ldmatrix, mma.sync). */
#ifndef DC_DCC_DEVICE_CUH
#define DC_DCC_DEVICE_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include <type_traits>

#include <cuda_runtime_api.h>

#include "dcc_types.h"

/* Storage types: bf16 and f16 are carried as raw 16-bit words, tagged so that
 * templates can pick the conversion and the mma variant. */
struct dcc_bf16 {
    uint16_t v;
};
struct dcc_f16 {
    uint16_t v;
};

__device__ __forceinline__ float dcc_ld(const float *p, int64_t i) { return p[i]; }
__device__ __forceinline__ float dcc_ld(const dcc_bf16 *p, int64_t i) {
    return __uint_as_float((uint32_t)p[i].v << 16);
}
__device__ __forceinline__ float dcc_ld(const dcc_f16 *p, int64_t i) {
    return __half2float(__ushort_as_half(p[i].v));
}

/* x as the TF32 tensor cores read it: its top 19 bits (norms_tf32.cu). */
constexpr uint32_t DCC_TF32_MASK = 0xffffe000u;
__device__ __forceinline__ float dcc_tf32_trunc(float x) {
    return __uint_as_float(__float_as_uint(x) & DCC_TF32_MASK);
}

/* Raw bits of a float dtype are non-finite when the exponent is all ones. */
__device__ __forceinline__ bool dcc_isfinite(float x) {
    return (__float_as_uint(x) & 0x7f800000u) != 0x7f800000u;
}

/* |x| as ordered bits: NaN sorts above +Inf, so a NaN anywhere wins a max
 * (the output check's amax). */
__device__ __forceinline__ unsigned dcc_abs_bits(float x) {
    return __float_as_uint(x) & 0x7fffffffu;
}

/* The max over the warp, in every lane. */
__device__ __forceinline__ unsigned dcc_warp_max(unsigned v) {
    for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

/* A warp's max of am into *amax (one atomic a warp): an output's max |.|
 * as bits, found by the kernel that writes it. */
__device__ __forceinline__ void dcc_warp_amax(unsigned *amax, unsigned am) {
    am = dcc_warp_max(am);
    if ((threadIdx.x & 31) == 0) atomicMax(amax, am);
}

/* The wide form's accumulator (dcc_wgmma.cuh, stage_mma's WIDE: a 256 x 128
 * direct tile computed transposed): consumer thread threadIdx.x's register
 * i (0-127) of the tile at (m0, n0) is row m of g's features and column n
 * of a's. For one i a warp's registers fill four 32-byte sectors of a
 * [p][d] row-major output (eight n of four m). The grouped clipped sum's
 * epilogue stores through it; the kept per-sample gradients are stored in
 * register order and summed back through it (sgrad.cu). */
__device__ __forceinline__ void dcc_wide_at(int i, int m0, int n0, int &m, int &n) {
    const int tid = (int)threadIdx.x, lane = tid & 31;
    n = n0 + (tid >> 7) * 64 + ((tid >> 5) & 3) * 16 + (lane >> 2) + ((i & 2) ? 8 : 0);
    m = m0 + (i >> 2) * 8 + (lane & 3) * 2 + (i & 1);
}

/* The last of n entries whose first work item first(i) (ascending, first(0)
 * = 0) is at most `item`: which layer of a persistent launch's parameters
 * an item belongs to. */
template <typename K, typename First>
__device__ __forceinline__ int dcc_entry_of(int n, K item, First first) {
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) >> 1;
        if (first(mid) <= item) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

/* Sum over the warp, valid in every lane. */
template <typename T> __device__ __forceinline__ T dcc_warp_sum(T v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* Sum over the block (blockDim.x a multiple of 32, at most 1024); the result
 * is valid in thread 0. Uses a 32-float shared array. */
__device__ __forceinline__ float dcc_block_sum(float v) {
    __shared__ float part[32];
    v = dcc_warp_sum(v);
    int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    __syncthreads(); /* part may still be read by a previous call */
    if (lane == 0) part[w] = v;
    __syncthreads();
    v = 0.0f;
    if (w == 0) {
        int nw = (int)(blockDim.x >> 5);
        v = lane < nw ? part[lane] : 0.0f;
        v = dcc_warp_sum(v);
    }
    return v;
}

__device__ __forceinline__ double dcc_block_sum_d(double v) {
    __shared__ double partd[32];
    v = dcc_warp_sum(v);
    int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    __syncthreads();
    if (lane == 0) partd[w] = v;
    __syncthreads();
    v = 0.0;
    if (w == 0) {
        int nw = (int)(blockDim.x >> 5);
        v = lane < nw ? partd[lane] : 0.0;
        v = dcc_warp_sum(v);
    }
    return v;
}

/* --- tensor-core building blocks ----------------------------------------- */

__device__ __forceinline__ uint32_t dcc_smem(const void *p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}

/* 16 bytes global -> shared, bypassing L1; src_bytes 0 writes zeros. */
__device__ __forceinline__ void dcc_cp_async16(uint32_t dst, const void *src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                 "r"(src_bytes)
                 : "memory");
}
__device__ __forceinline__ void dcc_cp_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N> __device__ __forceinline__ void dcc_cp_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

/* The K loop of the mma.sync kernels (16-bit and TF32): ST shared stages,
 * ST-1 k-tiles in flight. load(u) issues k-tile u's cp.async copies into
 * stage u % ST; step(u) computes on it once it has landed. A stage is
 * refilled only after the barrier that every thread reaches once done with
 * it. Returns with every copy landed (the caller syncs before reusing the
 * stages). */
template <int ST, typename Load, typename Step>
__device__ __forceinline__ void dcc_cp_pipeline(int n, const Load &load, const Step &step) {
    static_assert(ST >= 2, "a pipeline needs two stages");
#pragma unroll
    for (int s = 0; s < ST - 1; s++) {
        if (s < n) load(s);
        dcc_cp_commit();
    }
    for (int u = 0; u < n; u++) {
        dcc_cp_wait<ST - 2>();
        __syncthreads();
        if (u + ST - 1 < n) load(u + ST - 1);
        dcc_cp_commit();
        step(u);
    }
    dcc_cp_wait<0>();
}

/* A warp's accumulator in the mma.sync kernels: 4 x NI m16n8 fragments of
 * four f32 each (a 64 x 8*NI warp tile; NI = 4 but for the TF32 clipped
 * sum's 64 x 64). */
template <int NI> __device__ __forceinline__ void dcc_acc_zero(float (&acc)[4][NI][4]) {
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < NI; j++)
#pragma unroll
            for (int k = 0; k < 4; k++) acc[i][j][k] = 0.0f;
}
__device__ __forceinline__ float dcc_acc_sumsq(const float (&acc)[4][4][4]) {
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int k = 0; k < 4; k++) s += acc[i][j][k] * acc[i][j][k];
    return s;
}
/* acc[mi][ni] += A fragment mi x B fragment ni, by mma(c, a, b0, b1). */
template <int NI, typename Mma>
__device__ __forceinline__ void dcc_warp_mma(float (&acc)[4][NI][4], const uint32_t (&af)[4][4],
                                             const uint32_t (&bf)[NI][2], const Mma &mma) {
#pragma unroll
    for (int mi = 0; mi < 4; mi++)
#pragma unroll
        for (int ni = 0; ni < NI; ni++) mma(acc[mi][ni], af[mi], bf[ni][0], bf[ni][1]);
}

__device__ __forceinline__ void dcc_sts128(uint32_t dst, uint32_t a, uint32_t b, uint32_t c,
                                           uint32_t d) {
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(dst), "r"(a), "r"(b), "r"(c),
                 "r"(d)
                 : "memory");
}
__device__ __forceinline__ uint32_t dcc_lds32(uint32_t src) {
    uint32_t v;
    asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(src));
    return v;
}

__device__ __forceinline__ void dcc_ldsm4(uint32_t addr, uint32_t (&r)[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void dcc_ldsm4_t(uint32_t addr, uint32_t (&r)[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

/* D += A * B for one m16n8k16 tile, f32 accumulators. */
__device__ __forceinline__ void dcc_mma(const dcc_bf16 *, float (&c)[4], const uint32_t (&a)[4],
                                        uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
                 "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void dcc_mma(const dcc_f16 *, float (&c)[4], const uint32_t (&a)[4],
                                        uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
                 "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
/* dcc_mma for elements TI, as a dcc_warp_mma step. */
template <typename TI> struct dcc_mma16 {
    __device__ __forceinline__ void operator()(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                               uint32_t b1) const {
        dcc_mma((const TI *)nullptr, c, a, b0, b1);
    }
};

/* Low / high 16-bit element of a packed pair as f32. */
__device__ __forceinline__ float dcc_lo(const dcc_bf16 *, uint32_t w) {
    return __uint_as_float(w << 16);
}
__device__ __forceinline__ float dcc_hi(const dcc_bf16 *, uint32_t w) {
    return __uint_as_float(w & 0xffff0000u);
}
__device__ __forceinline__ float dcc_lo(const dcc_f16 *, uint32_t w) {
    return __half2float(__ushort_as_half((unsigned short)(w & 0xffffu)));
}
__device__ __forceinline__ float dcc_hi(const dcc_f16 *, uint32_t w) {
    return __half2float(__ushort_as_half((unsigned short)(w >> 16)));
}

/* Loads rows [row0, row0+ROWS) x cols [col0, col0+COLS) of a row-major
 * matrix of 16-bit words (nrows x ncols, leading dimension ld) into a shared
 * tile of COLS*2-byte rows whose 16-byte chunks are swizzled by
 * chunk ^ (row % 8) (for 128-byte rows this is the wgmma 128B swizzle); zero
 * outside the matrix. VEC: 16-byte cp.async, needs ld, col0 and ncols
 * multiples of 8 and an aligned base; else guarded element loads. */
template <int ROWS, int COLS, bool VEC, int NTHREADS>
__device__ __forceinline__ void dcc_load_tile(uint32_t sm, const uint16_t *base, int64_t ld,
                                              int row0, int nrows, int col0, int ncols) {
    constexpr int CPR = COLS / 8;
    constexpr int ITERS = ROWS * CPR / NTHREADS;
    static_assert(ITERS * NTHREADS == ROWS * CPR, "tile not a multiple of the block");
#pragma unroll
    for (int it = 0; it < ITERS; it++) {
        int i = (int)threadIdx.x + it * NTHREADS;
        int r = i / CPR, c = i % CPR;
        int gr = row0 + r, gc = col0 + c * 8;
        uint32_t dst = sm + (uint32_t)(r * COLS * 2) + (uint32_t)((c ^ (r & 7)) << 4);
        if (VEC) {
            bool ok = gr < nrows && gc < ncols;
            const uint16_t *src = ok ? base + (int64_t)gr * ld + gc : base;
            dcc_cp_async16(dst, src, ok ? 16 : 0);
        } else {
            uint32_t w[4] = {0u, 0u, 0u, 0u};
            if (gr < nrows) {
                const uint16_t *src = base + (int64_t)gr * ld;
#pragma unroll
                for (int j = 0; j < 8; j++)
                    if (gc + j < ncols) w[j >> 1] |= (uint32_t)src[gc + j] << ((j & 1) * 16);
            }
            dcc_sts128(dst, w[0], w[1], w[2], w[3]);
        }
    }
}

/* Calls fn with a null pointer of the storage type of float dtype t, so a
 * generic lambda can instantiate a kernel for it. */
template <typename Fn> static inline cudaError_t dcc_with_float(dc_dtype t, Fn &&fn) {
    switch (t) {
    case DC_F32: return fn((const float *)nullptr);
    case DC_BF16: return fn((const dcc_bf16 *)nullptr);
    case DC_F16: return fn((const dcc_f16 *)nullptr);
    default: return cudaErrorInvalidValue;
    }
}
#define DCC_TYPE_OF(tag)                                                                           \
    typename std::remove_const<typename std::remove_pointer<decltype(tag)>::type>::type

#endif
