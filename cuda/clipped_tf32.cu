/* The TF32 clipped sum on Hopper's warpgroup MMA (sm_90a): w[p][d] = sum_b
 * cs[b] g_b^T a_b for f32 inputs, the operands' TF32 truncations multiplied
 * (as every TF32 kernel does, norms_tf32.cu), on 128x256 output tiles, two
 * warpgroups of m64n256k8.
 *
 * TF32 wgmma reads K-major operands only, and both of these are stored with
 * K (= T) outermost: the direct form's layout, which the 16-bit kernels
 * transpose in the instruction. Neither TMA nor 16-byte copies can
 * transpose 4-byte elements, so every element is its own 4-byte cp.async,
 * straight into the K-major tile the descriptors name (128-byte rows of 32
 * k per feature, 16-byte chunks swizzled by chunk ^ (row % 8), the TMA
 * kernels' layout): a warp's instruction takes 8 consecutive features x 4
 * consecutive rows of T, 32-byte global segments, and lands on 32 distinct
 * banks through the swizzle. Warp w copies chunk w (rows 4w .. 4w+3 of the
 * stage) of all 384 features, 48 instructions a stage, no shared-memory
 * round trip; four stages, two in flight ahead of the MMAs. (A first form
 * copied stages as stored and transposed them in shared memory: 400
 * instructions a warp a stage left the tensor cores 30% busy.)
 *
 * The samples of a CTA's group run in ascending coefficient order and the
 * accumulator is rescaled between them (Horner, as grouped_tma.cu), so one
 * register tile holds the weighted total. Layers whose rows are not on 16
 * bytes go to the mma.sync kernel (norms_tf32.cu), which calls this one. */
#include "dcc_tma.cuh"
#include "dcc_util.cuh"

namespace {

constexpr int XT = 256;                    /* two warpgroups */
constexpr int XM = 128, XN = 256, XK = 32; /* the CTA's tile; k per stage */
constexpr int KMJ = (XM + XN) * 128;       /* bytes of a stage: g's rows, then a's */
constexpr int XST = 4;                     /* stages */
constexpr int X_SMEM = XST * KMJ + 1024;

#ifndef DCC_WG_EMPTY

__device__ __forceinline__ void cp_async4(uint32_t dst, const void *src, int src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src),
                 "r"(src_bytes)
                 : "memory");
}

/* One m64n256k8 TF32 wgmma: A read once for the tile's 256 columns. */
__device__ __forceinline__ void wgmma_m64n256k8_tf32(float (&d)[128], uint64_t da, uint64_t db) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k8.f32.tf32.tf32 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
        "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
        "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
        "}, %128, %129, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
          "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
          "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
          "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
          "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
          "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
          "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
          "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
          "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "l"(da), "l"(db), "r"(1));
}

__global__ void __launch_bounds__(XT, 1)
tf32_wg_clipped(const float *__restrict__ a, const float *__restrict__ g, int B, int T, int d,
                int p, int tiles_n, int per_group, const int *__restrict__ perm,
                const float *__restrict__ fac, const float *__restrict__ cs,
                float *__restrict__ w) {
    extern __shared__ __align__(16) unsigned char smem[];
    const uint32_t kmj = (dcc_smem(smem) + 1023u) & ~1023u;
    const int tm = (int)blockIdx.x / tiles_n, tn = (int)blockIdx.x % tiles_n;
    const int m0 = tm * XM, n0 = tn * XN;
    const int k0 = (int)blockIdx.y * per_group, k1 = min(B, k0 + per_group);
    if (k0 >= k1) return; /* uniform per CTA, before any barrier */
    const int ktn = (T + XK - 1) / XK, U = (k1 - k0) * ktn;
    const int tid = (int)threadIdx.x, wg = tid >> 7, warp = tid >> 5, lane = tid & 31;
    const bool whole = m0 + XM <= p && n0 + XN <= d; /* no ragged feature edge */
    float acc[2][64]; /* the m64n256 accumulator, as the helpers take it in halves */
    float(&acc_all)[128] = *reinterpret_cast<float(*)[128]>(&acc[0][0]);
#pragma unroll
    for (int i = 0; i < 128; i++) acc_all[i] = 0.0f;

    /* this lane's element of each 8 x 4 block: feature f8 of 8, row warp*4 + r4
     * of the stage, at column 4 r4 of chunk warp ^ f8 in its feature's row */
    const int f8 = lane & 7, r4 = lane >> 3;
    const uint32_t lane_off = (uint32_t)(f8 * 128 + ((warp ^ f8) << 4) + r4 * 4);
    /* stage u = sample kb of the group, k-tile kt */
    auto load = [&](int u, int kb, int kt) {
        const int t = kt * XK + warp * 4 + r4, b = perm[k0 + kb];
        const bool rok = t < T;
        const float *gr = g + ((int64_t)b * T + t) * p + m0 + f8;
        const float *ar = a + ((int64_t)b * T + t) * d + n0 + f8;
        const uint32_t st = kmj + (uint32_t)((u % XST) * KMJ) + lane_off;
        if (whole && rok) { /* the common case: no test an element */
#pragma unroll
            for (int j = 0; j < XM / 8; j++) cp_async4(st + (uint32_t)(j * 1024), gr + 8 * j, 4);
#pragma unroll
            for (int j = 0; j < XN / 8; j++)
                cp_async4(st + (uint32_t)(XM * 128 + j * 1024), ar + 8 * j, 4);
            return;
        }
#pragma unroll
        for (int j = 0; j < XM / 8; j++) {
            const bool ok = rok && m0 + 8 * j + f8 < p;
            cp_async4(st + (uint32_t)(j * 1024), ok ? gr + 8 * j : g, ok ? 4 : 0);
        }
#pragma unroll
        for (int j = 0; j < XN / 8; j++) {
            const bool ok = rok && n0 + 8 * j + f8 < d;
            cp_async4(st + (uint32_t)(XM * 128 + j * 1024), ok ? ar + 8 * j : a, ok ? 4 : 0);
        }
    };

    int lb = 0, lt = 0; /* the next stage to load */
#pragma unroll
    for (int s = 0; s < XST - 2; s++) {
        if (s < U) load(s, lb, lt);
        if (++lt == ktn) lt = 0, lb++;
        dcc_cp_commit();
    }
    for (int u = 0, cb = 0, ct = 0; u < U; u++) {
        /* stage u has landed (for this thread; the barrier makes it all of
         * them), and every thread has waited out the MMAs of u - 2, whose
         * stage the next copy refills */
        dcc_cp_wait<XST - 3>();
        fence_proxy_async(); /* the copies, visible to the tensor cores */
        __syncthreads();
        if (u + XST - 2 < U) load(u + XST - 2, lb, lt);
        if (++lt == ktn) lt = 0, lb++;
        dcc_cp_commit();
        if (ct == ktn) ct = 0, cb++;
        if (ct++ == 0 && cb > 0) { /* the next sample: rescale to its coefficient */
            wg_wait<0>();
            acc_fence<2>(acc);
            const float f = fac[k0 + cb];
#pragma unroll
            for (int i = 0; i < 128; i++) acc_all[i] *= f;
        }
        const uint32_t kb = kmj + (uint32_t)((u % XST) * KMJ);
        acc_fence<2>(acc);
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < 4; kk++)
            wgmma_m64n256k8_tf32(acc_all, wg_desc(kb + (uint32_t)(wg * 64 * 128 + kk * 32), 16, 1024),
                                 wg_desc(kb + (uint32_t)(XM * 128 + kk * 32), 16, 1024));
        wg_commit();
        acc_fence<2>(acc);
        wg_wait<1>();
    }
    wg_wait<0>();
    acc_fence<2>(acc);

    /* accumulator: warp wq of the warpgroup holds rows 16 wq .. +15; register
     * i is row lane/4 (+8 when i%4 >= 2), column 8 (i/4) + 2 (lane%4) + i%2 */
    const float cl = cs[perm[k1 - 1]];
    const int wq = warp & 3;
    const bool atomic = gridDim.y > 1;
#pragma unroll
    for (int i = 0; i < 128; i++) {
        const int m = m0 + wg * 64 + wq * 16 + (lane >> 2) + ((i & 2) ? 8 : 0);
        const int n = n0 + (i >> 2) * 8 + (lane & 3) * 2 + (i & 1);
        if (m < p && n < d) {
            const float v = cl * acc_all[i];
            if (atomic) atomicAdd(w + (int64_t)m * d + n, v);
            else w[(int64_t)m * d + n] = v;
        }
    }
}

#else

__global__ void tf32_wg_clipped(const float *, const float *, int, int, int, int, int, int,
                                const int *, const float *, const float *, float *) {}

#endif

} // namespace

extern "C" cudaError_t dcc_tf32_clipped_wgmma(const dcc_linear *L, const float *cs,
                                              const int *perm, const float *fac, float *w,
                                              int per_group, int groups, cudaStream_t st) {
#ifdef DCC_WGMMA_BUILT
    if (L->ta != DC_F32 || L->tg != DC_F32 || !dcc_wgmma_available(L->opt) || L->d % 4 ||
        L->p % 4 || ((uintptr_t)L->a & 15u) || ((uintptr_t)L->g & 15u))
        return cudaErrorNotSupported;
    const int tiles_m = (L->p + XM - 1) / XM, tiles_n = (L->d + XN - 1) / XN;
    cudaError_t e =
        cudaFuncSetAttribute(tf32_wg_clipped, cudaFuncAttributeMaxDynamicSharedMemorySize, X_SMEM);
    if (e != cudaSuccess) return e;
    dim3 grid((unsigned)(tiles_m * tiles_n), (unsigned)groups);
    tf32_wg_clipped<<<grid, XT, X_SMEM, st>>>((const float *)L->a, (const float *)L->g, L->B,
                                              L->T, L->d, L->p, tiles_n, per_group, perm, fac,
                                              cs, w);
    return cudaGetLastError();
#else
    (void)L;
    (void)cs;
    (void)perm;
    (void)fac;
    (void)w;
    (void)per_group;
    (void)groups;
    (void)st;
    return cudaErrorNotSupported;
#endif
}
