/* The TMA-fed, warp-specialised wgmma pipeline shared by norms_tma.cu
 * (per-layer kernels) and grouped_tma.cu (persistent kernels over many
 * layers): a CTA is two consumer warpgroups (warps 0-7, the MMAs) and one
 * producer warp (warp 8) whose lane 0 issues cp.async.bulk.tensor copies.
 * Each stage has two mbarriers: `full` (the producer arms it with the
 * stage's byte count; TMA completes it) and `empty` (each consumer warp
 * arrives once the MMAs that read the stage are done).
 *
 * Tensor maps view an operand as [B][T][width] (innermost first) with 128B
 * swizzle, so a box lands in shared memory in exactly the layout the wgmma
 * descriptors expect; rows past T and features past the width are
 * zero-filled. Everything here is file-local to each includer (an unnamed
 * namespace). Only usable in code compiled for sm_90a (DCC_WG_EMPTY guards
 * the device parts). */
#ifndef DC_DCC_TMA_CUH
#define DC_DCC_TMA_CUH

#include <cudaTypedefs.h>

#include "dcc_wgmma.cuh"

namespace {

constexpr int CT = 288; /* 8 consumer warps + 1 producer warp */
/* 8 consumer warps + a producer warpgroup, for kernels that move registers
 * from the producer to the consumers (setmaxnreg works by warpgroup) */
constexpr int CT_WIDE = 384;

template <int MI> __host__ __device__ constexpr int tma_direct_stages() { return MI == 1 ? 6 : 4; }
constexpr int TG_ST = 6;
template <int MI> __host__ __device__ constexpr int tma_direct_smem() {
    return tma_direct_stages<MI>() * stage_bytes<MI>() + 1024;
}
constexpr int TG_SMEM = TG_ST * stage_bytes<1>() + 1024;

#ifndef DCC_WG_EMPTY

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
    asm volatile("{\n.reg .pred P1;\nLAB_WAIT:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n"
                 "@P1 bra DONE;\nbra LAB_WAIT;\nDONE:\n}\n" ::"r"(bar),
                 "r"(parity)
                 : "memory");
}
__device__ __forceinline__ void tma_load3(uint32_t dst, const CUtensorMap *map, uint32_t bar,
                                          int c0, int c1, int c2) {
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%3, %4, %5}], [%2];\n" ::"r"(dst),
                 "l"((uint64_t)map), "r"(bar), "r"(c0), "r"(c1), "r"(c2)
                 : "memory");
}

__device__ __forceinline__ float4 ld_cluster4(uint32_t addr) {
    float4 v;
    asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "r"(addr)
                 : "memory");
    return v;
}
__device__ __forceinline__ float ld_cluster(uint32_t addr) {
    float v;
    asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(addr) : "memory");
    return v;
}

/* The end of a tail launch made with programmatic stream serialization
 * (launch_direct): it waits for the unsplit launch before it, so that work
 * queued after it is ordered after both (a no-op in other launches). */
__device__ __forceinline__ void grid_dep_wait() {
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
}

/* One stage of a direct tile (K = T), armed with its bytes: 128 MI features
 * of g from m0 and 128 of a from n0, rows [kr, kr + 64) of sample b, in the
 * layout stage_mma reads (g's 64-feature blocks, then a's). */
template <int MI>
__device__ __forceinline__ void load_direct_stage(uint32_t st, const CUtensorMap *tg,
                                                  const CUtensorMap *ta, uint32_t full, int m0,
                                                  int n0, int kr, int b) {
    mbar_expect_tx(full, stage_bytes<MI>());
#pragma unroll
    for (int h = 0; h < 2 * MI; h++)
        tma_load3(st + (uint32_t)(h * HALF), tg, full, m0 + 64 * h, kr, b);
#pragma unroll
    for (int h = 0; h < 2; h++)
        tma_load3(st + (uint32_t)((2 * MI + h) * HALF), ta, full, n0 + 64 * h, kr, b);
}

/* Stage barriers live in static shared memory: full[s] at bars + 8s,
 * empty[s] at bars + 8(ST + s). */
template <int ST> __device__ __forceinline__ uint32_t init_bars(uint64_t *bars) {
    uint32_t b0 = dcc_smem(bars);
    if (threadIdx.x == 0) {
        for (int s = 0; s < ST; s++) {
            mbar_init(b0 + 8u * (uint32_t)s, 1);        /* the producer's arrive */
            mbar_init(b0 + 8u * (uint32_t)(ST + s), 8); /* one per consumer warp */
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    return b0;
}

/* --- clusters ------------------------------------------------------------ */

__device__ __forceinline__ void cluster_sync() {
    asm volatile(
        "barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::
            : "memory");
}
/* The address of the same shared-memory location in CTA `rank` of the cluster. */
__device__ __forceinline__ uint32_t map_rank(uint32_t addr, uint32_t rank) {
    uint32_t r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(addr), "r"(rank));
    return r;
}

/* A split tile's exchange (KS CTAs of a cluster, each with 1/KS of its K
 * range): a consumer thread's 64 accumulators of block j, written
 * thread-major (float4 i of thread t at j * 4096 + i * 256 + t) into x, the
 * CTA's pipeline memory once every stage is consumed, so that the reads
 * are contiguous. */
__device__ __forceinline__ void split_stash(float4 *x, const float (&acc)[64], int j) {
    const int t = (int)threadIdx.x;
#pragma unroll
    for (int i = 0; i < 16; i++)
        x[j * 4096 + i * 256 + t] = make_float4(acc[4 * i], acc[4 * i + 1], acc[4 * i + 2],
                                                acc[4 * i + 3]);
}
/* ... and, after the cluster's barrier, float4 f of the stash summed over
 * the KS ranks (peer[q]: the stash's address in rank q, map_rank). */
template <int KS> __device__ __forceinline__ float4 split_sum4(const uint32_t (&peer)[KS], int f) {
    float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
    for (int q = 0; q < KS; q++) {
        const float4 w = ld_cluster4(peer[q] + (uint32_t)f * 16u);
        v.x += w.x;
        v.y += w.y;
        v.z += w.z;
        v.w += w.w;
    }
    return v;
}
template <int KS> __device__ __forceinline__ void split_peers(uint32_t x, uint32_t (&peer)[KS]) {
#pragma unroll
    for (int q = 0; q < KS; q++) peer[q] = map_rank(x, (uint32_t)q);
}

/* The bias's column sums of a direct tile (128 MI columns) in colsum
 * [4 / MI][2 CW] (CW = 64 MI): a consumer thread's two columns 2 (t % CW),
 * +1 over its row group t / CW (bs0, bs1 as stage_issue leaves them), and,
 * once every consumer thread has put its own, column c's total. */
template <int MI> __device__ __forceinline__ void colsum_put(float *colsum, float bs0, float bs1) {
    constexpr int CW = 64 * MI;
    const int m = ((int)threadIdx.x % CW) * 2, rq = (int)threadIdx.x / CW;
    colsum[rq * 2 * CW + m] = bs0;
    colsum[rq * 2 * CW + m + 1] = bs1;
}
template <int MI> __device__ __forceinline__ float colsum_col(const float *colsum, int c) {
    constexpr int CW = 64 * MI;
    float x = colsum[c];
#pragma unroll
    for (int q = 1; q < 4 / MI; q++) x += colsum[q * 2 * CW + c];
    return x;
}

/* The sum of squares of a consumer thread's accumulators, in four
 * independent chains: a tile's epilogue holds up the tensor cores, and one
 * chain of 64 MI dependent FMAs would cost it their latency each. */
template <int MI> __device__ __forceinline__ float acc_sq(const float (&acc)[MI][64]) {
    float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int j = 0; j < MI; j++)
#pragma unroll
        for (int i = 0; i < 64; i++) s[i & 3] = fmaf(acc[j][i], acc[j][i], s[i & 3]);
    return (s[0] + s[1]) + (s[2] + s[3]);
}

/* lo and hi rounded to bf16 (nearest even) in one word, lo in its low half:
 * one cvt, which bf16 pairs' loads and stores take as is. */
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
    uint32_t w;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(w) : "f"(hi), "f"(lo));
    return w;
}

/* Consumer side: MMAs over k-tiles [u0, u1) of the CTA's stream into acc;
 * each tile's stage is released once its MMAs are known complete. DIRECT
 * with colsum: the bias column sums (stage_issue), of the k-tiles whose
 * index (kbase + u - u0) is crem modulo cmod only. keep: accumulate onto
 * acc as it is. SB: the ring's stage size, when its stages are larger than
 * these MMAs read (the ghost form's wide ring). */
template <typename TI, bool DIRECT, int MI, int ST, bool WIDE = false, int SB = stage_bytes<MI>()>
__device__ __forceinline__ void consume(float (&acc)[MI][64], uint32_t sbase, uint32_t bars, int u0,
                                        int u1, bool same_b, bool colsum, float &bs0, float &bs1,
                                        bool keep = false, int cmod = 1, int crem = 0,
                                        int kbase = 0) {
    const int wg = (int)threadIdx.x >> 7, lane = (int)threadIdx.x & 31;
    if (!keep)
#pragma unroll
        for (int j = 0; j < MI; j++)
#pragma unroll
            for (int i = 0; i < 64; i++) acc[j][i] = 0.0f;
    int c = cmod > 1 ? kbase % cmod : 0; /* the k-tile's index modulo cmod */
    for (int u = u0; u < u1; u++) {
        const int s = u % ST;
        const bool cs = colsum && c == crem;
        if (++c == cmod) c = 0;
        mbar_wait(bars + 8u * (uint32_t)s, (uint32_t)((u / ST) & 1));
        const uint32_t sA = sbase + (uint32_t)(s * SB);
        const uint32_t sB = same_b ? sA : sA + 2 * MI * HALF;
        stage_issue<TI, DIRECT, MI, WIDE>(acc, sA, sB, wg, cs, bs0, bs1);
        wg_wait<1>();
        acc_fence<MI>(acc);
        __syncwarp();
        if (u > u0 && lane == 0) mbar_arrive(bars + 8u * (uint32_t)(ST + (u - 1) % ST));
    }
    wg_wait<0>();
    acc_fence<MI>(acc);
    __syncwarp();
    if (u1 > u0 && lane == 0) mbar_arrive(bars + 8u * (uint32_t)(ST + (u1 - 1) % ST));
}

#endif /* DCC_WG_EMPTY */

PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
    /* resolved once through the runtime, so nothing links libcuda */
    static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
        void *p = nullptr;
        cudaDriverEntryPointQueryResult q;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault,
                                             &q) != cudaSuccess ||
            q != cudaDriverEntryPointSuccess) {
            (void)cudaGetLastError();
            p = nullptr;
        }
        return (PFN_cuTensorMapEncodeTiled_v12000)p;
    }();
    return fn;
}

/* [B][T][w] tensor of 16-bit or f32 values, boxes of 128 bytes of features
 * (64 16-bit, 32 f32) x rows. */
bool make_map(CUtensorMap *m, const void *base, dc_dtype t, int B, int T, int w, int rows) {
    PFN_cuTensorMapEncodeTiled_v12000 fn = encode_fn();
    if (!fn) return false;
    const cuuint64_t esz = t == DC_F32 ? 4 : 2;
    cuuint64_t dims[3] = {(cuuint64_t)w, (cuuint64_t)T, (cuuint64_t)B};
    cuuint64_t strides[2] = {(cuuint64_t)w * esz, (cuuint64_t)w * (cuuint64_t)T * esz};
    cuuint32_t box[3] = {(cuuint32_t)(128 / esz), (cuuint32_t)rows, 1};
    cuuint32_t es[3] = {1, 1, 1};
    CUtensorMapDataType ty = t == DC_F32    ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32
                             : t == DC_BF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                            : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
    return fn(m, ty, 3, (void *)base, dims, strides, box, es, CU_TENSOR_MAP_INTERLEAVE_NONE,
              CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
              CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

/* The launch of `ctas` CTAs of `kernel` with `smem` bytes of dynamic shared
 * memory in clusters of ks (attr[0] holds the cluster shape; the caller may
 * add attributes after cfg.numAttrs), that shared memory allowed first. */
template <typename K>
cudaError_t tma_config(K kernel, int smem, int ks, cudaLaunchConfig_t &cfg,
                       cudaLaunchAttribute *attr, unsigned ctas, cudaStream_t st,
                       int threads = CT) {
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess) return e;
    cfg = {};
    cfg.gridDim = dim3(ctas);
    cfg.blockDim = dim3((unsigned)threads);
    cfg.dynamicSmemBytes = (size_t)smem;
    cfg.stream = st;
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = (unsigned)ks;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = ks > 1 ? 1 : 0;
    return cudaSuccess;
}

/* A split tail's launch may start as the unsplit launch before it frees
 * SMs, not after its last CTA (its kernel's griddepcontrol.wait keeps the
 * order for the work after it). */
inline void allow_overlap(const dcc_linear *L, cudaLaunchConfig_t &cfg, cudaLaunchAttribute *attr) {
    if (!dcc_pdl_on(L->opt)) return;
    attr[cfg.numAttrs].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[cfg.numAttrs].val.programmaticStreamSerializationAllowed = 1;
    cfg.numAttrs++;
}

/* f(std::integral_constant<int, KS>()) for KS = ks, one of the tail
 * cluster sizes direct_plan.cu plans (DIRECT_KS), else for KS = 1. */
template <typename F> auto with_ks(int ks, F f) {
    switch (ks) {
    case 6: return f(std::integral_constant<int, 6>());
    case 4: return f(std::integral_constant<int, 4>());
    case 3: return f(std::integral_constant<int, 3>());
    case 2: return f(std::integral_constant<int, 2>());
    default: return f(std::integral_constant<int, 1>());
    }
}

} // namespace

#endif
