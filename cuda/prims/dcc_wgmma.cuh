/* Hopper warpgroup MMA helpers of the TMA-fed kernels (norms_tma.cu,
 * grouped_tma.cu): the m64n128 instructions (k16 for 16-bit inputs, k8 for
 * TF32), shared-memory matrix descriptors for 128B-swizzled tiles, the wgmma
 * fences, and the MMAs of one pipeline stage. Tiles are 64 rows of 128 bytes
 * (8 KiB, 1024-byte aligned: [64][64] 16-bit or [64][32] f32 values), 16-byte
 * chunks swizzled by chunk ^ (row % 8). Only
 * usable in code compiled for sm_90a (guard with DCC_WG_EMPTY). */
#ifndef DC_DCC_WGMMA_CUH
#define DC_DCC_WGMMA_CUH

#include "dcc_device.cuh"

#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define DCC_WG_EMPTY 1 /* device pass for a target without wgmma */
#endif

constexpr int WBK = 64;           /* k per stage (16-bit inputs) */
constexpr int HALF = 64 * 64 * 2; /* one block of 64 rows of 128 bytes: 8 KiB */
/* Elements of TI in a stage's 128-byte rows: the k per stage. */
template <typename TI> __host__ __device__ constexpr int stage_k() { return 128 / (int)sizeof(TI); }

/* Bytes of one stage: A is 2*MI [64][64] blocks (DIRECT: 128*MI features x
 * 64 k; GHOST, MI = 1: 128 rows x 64 k), then B, 2 blocks. */
template <int MI> __host__ __device__ constexpr int stage_bytes() { return (2 * MI + 2) * HALF; }

#ifndef DCC_WG_EMPTY
/* The accumulator operands of the wgmma instructions below: registers
 * %0.. as one string, d[b..b+63] as "+f" outputs. */
#define DCC_WG_R64A                                                                                \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "        \
    "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, "        \
    "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, "        \
    "%53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define DCC_WG_R64B                                                                                \
    "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, "        \
    "%81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, "        \
    "%98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, "     \
    "%113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
#define DCC_WG_D8(b)                                                                               \
    "+f"(d[(b)]), "+f"(d[(b) + 1]), "+f"(d[(b) + 2]), "+f"(d[(b) + 3]), "+f"(d[(b) + 4]),          \
        "+f"(d[(b) + 5]), "+f"(d[(b) + 6]), "+f"(d[(b) + 7])
#define DCC_WG_D64(b)                                                                              \
    DCC_WG_D8(b), DCC_WG_D8((b) + 8), DCC_WG_D8((b) + 16), DCC_WG_D8((b) + 24),                    \
        DCC_WG_D8((b) + 32), DCC_WG_D8((b) + 40), DCC_WG_D8((b) + 48), DCC_WG_D8((b) + 56)

/* One m64n128 wgmma over one 32-byte k step (k16 for 16-bit inputs, k8 for
 * TF32) into d (f32), A and B of element type T (PTX name PTX) described by
 * da/db; TA/TB: transpose flags, which TF32 does not have (its operands are
 * K-major only: TRANS is empty and TA, TB must be 0). f32 operands go to the
 * instruction as they are in shared memory: the tensor cores use the top 19
 * bits of each (TF32, truncated). The overloads come from this one
 * definition so that their operand lists cannot drift apart. */
#define DCC_WGMMA_M64N128(T, PTX, K, TRANS)                                                        \
    template <int TA, int TB>                                                                      \
    __device__ __forceinline__ void wgmma_m64n128(const T *, float(&d)[64], uint64_t da,           \
                                                  uint64_t db) {                                   \
        static_assert(K == 16 || (TA == 0 && TB == 0), "TF32 operands are K-major");               \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %68, 0;\n"                                  \
                     "wgmma.mma_async.sync.aligned.m64n128k" #K ".f32." PTX "." PTX                \
                     " {" DCC_WG_R64A "}, %64, %65, p, 1, 1" TRANS ";\n}\n"                        \
                     : DCC_WG_D64(0)                                                               \
                     : "l"(da), "l"(db), "n"(TA), "n"(TB), "r"(1));                                \
    }
DCC_WGMMA_M64N128(dcc_bf16, "bf16", 16, ", %66, %67")
DCC_WGMMA_M64N128(dcc_f16, "f16", 16, ", %66, %67")
DCC_WGMMA_M64N128(float, "tf32", 8, "")
#undef DCC_WGMMA_M64N128

/* The same with N = 256 (d: 128 f32): A read once for 256 columns. The
 * 16-bit kernels' wide form (stage_mma) computes a 256 x 128 direct tile
 * transposed (its 128 columns as M, 64 a warpgroup; its 256 rows as N):
 * each instruction reads 320 operand rows where two m64n128 read 384, less
 * shared-memory traffic per MMA; clipped_tf32.cu's 128 x 256 tiles. */
#define DCC_WGMMA_M64N256(T, PTX, K, TRANS)                                                        \
    template <int TA, int TB>                                                                      \
    __device__ __forceinline__ void wgmma_m64n256(const T *, float(&d)[128], uint64_t da,          \
                                                  uint64_t db) {                                   \
        static_assert(K == 16 || (TA == 0 && TB == 0), "TF32 operands are K-major");               \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %132, 0;\n"                                 \
                     "wgmma.mma_async.sync.aligned.m64n256k" #K ".f32." PTX "." PTX                \
                     " {" DCC_WG_R64A ", " DCC_WG_R64B "}, %128, %129, p, 1, 1" TRANS ";\n}\n"     \
                     : DCC_WG_D64(0), DCC_WG_D64(64)                                               \
                     : "l"(da), "l"(db), "n"(TA), "n"(TB), "r"(1));                                \
    }
DCC_WGMMA_M64N256(dcc_bf16, "bf16", 16, ", %130, %131")
DCC_WGMMA_M64N256(dcc_f16, "f16", 16, ", %130, %131")
DCC_WGMMA_M64N256(float, "tf32", 8, "")
#undef DCC_WGMMA_M64N256

/* m64n256k8 TF32 with A from registers: a, this thread's fragment of the
 * warpgroup's 64 x 8 A (its warp's 16 rows: row lane/4 in a[0] and a[2],
 * lane/4 + 8 in a[1] and a[3]; k lane%4 in a[0..1], lane%4 + 4 in a[2..3],
 * as mma.sync m16n8k8), f32 bits the tensor cores truncate to TF32. The
 * registers must keep their values until the MMA is waited for. */
__device__ __forceinline__ void wgmma_m64n256_tf32_ra(float (&d)[128], const uint32_t (&a)[4],
                                                      uint64_t db) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n256k8.f32.tf32.tf32 {" DCC_WG_R64A
                 ", " DCC_WG_R64B "}, {%128, %129, %130, %131}, %132, p, 1, 1;\n}\n"
                 : DCC_WG_D64(0), DCC_WG_D64(64)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}
#undef DCC_WG_D64
#undef DCC_WG_D8
#undef DCC_WG_R64B
#undef DCC_WG_R64A

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
template <int MI> __device__ __forceinline__ void acc_fence(float (&d)[MI][64]) {
#pragma unroll
    for (int j = 0; j < MI; j++)
#pragma unroll
        for (int i = 0; i < 64; i++) asm volatile("" : "+f"(d[j][i])::"memory");
}

/* The MMAs of one stage for warpgroup wg: rows [wg*64*MI, +64*MI) of A.
 * WIDE (MI = 2, 16-bit): B's rows [64 wg, +64) as M against A's 256 rows
 * as N, in m64n256 instructions: for DIRECT the tile transposed (acc's
 * registers then hold that layout); for the ghost form (K-major) the Gram
 * block of B's 128 rows against A's 256, acc[h] its columns [128 h, +128)
 * in the m64n128 accumulator's layout. */
template <typename TI, bool DIRECT, int MI, bool WIDE = false>
__device__ __forceinline__ void stage_mma(float (&acc)[MI][64], uint32_t sA, uint32_t sB, int wg) {
    if constexpr (WIDE) {
        static_assert(MI == 2 && sizeof(TI) == 2, "the wide form: 16-bit inputs");
        float(&all)[128] = *reinterpret_cast<float(*)[128]>(&acc[0][0]);
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {
            if constexpr (DIRECT) {
                uint64_t da = wg_desc(sB + (uint32_t)(wg * HALF + kk * 2048), HALF, 1024);
                uint64_t db = wg_desc(sA + (uint32_t)(kk * 2048), HALF, 1024);
                wgmma_m64n256<1, 1>((const TI *)nullptr, all, da, db);
            } else {
                uint64_t da = wg_desc(sB + (uint32_t)(wg * HALF + kk * 32), 16, 1024);
                uint64_t db = wg_desc(sA + (uint32_t)(kk * 32), 16, 1024);
                wgmma_m64n256<0, 0>((const TI *)nullptr, all, da, db);
            }
        }
    } else {
#pragma unroll
        for (int kk = 0; kk < 4; kk++) { /* a 128-byte row is four 32-byte k steps */
#pragma unroll
            for (int i = 0; i < MI; i++) {
                if constexpr (DIRECT) {
                    uint64_t da = wg_desc(sA + (uint32_t)((wg * MI + i) * HALF + kk * 2048), HALF,
                                          1024);
                    uint64_t db = wg_desc(sB + (uint32_t)(kk * 2048), HALF, 1024);
                    wgmma_m64n128<1, 1>((const TI *)nullptr, acc[i], da, db);
                } else {
                    uint64_t da = wg_desc(sA + (uint32_t)((wg * MI + i) * HALF + kk * 32), 16,
                                          1024);
                    uint64_t db = wg_desc(sB + (uint32_t)(kk * 32), 16, 1024);
                    wgmma_m64n128<0, 0>((const TI *)nullptr, acc[i], da, db);
                }
            }
        }
    }
}

/* One stage issued: fences, the stage's MMAs committed as a group onto acc;
 * with DIRECT and colsum, while they run, this thread's share of the stage's
 * bias column sums (columns 2*(tid % (64*MI)), +1 over a 1/(4/MI) share of
 * the stage's rows) added to bs0/bs1. The caller waits for the group. */
template <typename TI, bool DIRECT, int MI, bool WIDE = false>
__device__ __forceinline__ void stage_issue(float (&acc)[MI][64], uint32_t sA, uint32_t sB, int wg,
                                            bool colsum, float &bs0, float &bs1) {
    constexpr int CW = 64 * MI, RG = WBK / (4 / MI);
    acc_fence<MI>(acc);
    wg_fence();
    stage_mma<TI, DIRECT, MI, WIDE>(acc, sA, sB, wg);
    wg_commit();
    acc_fence<MI>(acc);
    if constexpr (DIRECT) {
        if (!colsum) return;
        int m = ((int)threadIdx.x % CW) * 2, rq = ((int)threadIdx.x / CW) * RG;
        uint32_t base = sA + (uint32_t)((m >> 6) * HALF);
        int ml = m & 63;
#pragma unroll
        for (int r = rq; r < rq + RG; r++) {
            uint32_t w = dcc_lds32(base + (uint32_t)(r * 128) +
                                   (uint32_t)((((ml >> 3) ^ (r & 7))) << 4) +
                                   (uint32_t)((ml & 7) * 2));
            bs0 += dcc_lo((const TI *)nullptr, w);
            bs1 += dcc_hi((const TI *)nullptr, w);
        }
    }
}

#endif /* DCC_WG_EMPTY */

#endif
