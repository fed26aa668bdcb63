/* The TF32 clipped sum on Hopper's warpgroup MMA (sm_90a): w[p][d] = sum_b
 * cs[b] g_b^T a_b for f32 inputs, the operands' TF32 truncations multiplied
 * (as every TF32 kernel does, norms_tf32.cu), on 128x256 output tiles.
 *
 * TF32 wgmma reads K-major operands only, and both of these are stored with
 * K (= T) outermost: the direct form's layout, which the 16-bit kernels
 * transpose in the instruction; neither TMA nor 16-byte copies can
 * transpose 4-byte elements. So a producer warpgroup copies each stage (32
 * rows of T) into shared memory as stored (cp.async, one stage ahead), and
 * every thread of the CTA transposes its row of it (one of the tile's 384
 * features) into one of two K-major buffers in the layout the descriptors
 * name (128-byte rows of 32 k per feature, 16-byte chunks swizzled by chunk
 * ^ (row % 8), the TMA kernels' layout): a lane reads four rows of one
 * column (conflict-free: a warp's lanes take consecutive columns) and
 * writes them as one 16-byte chunk (conflict-free through the swizzle). The
 * two consumer warpgroups transpose stage u + 1 while the tensor cores run
 * their m64n256k8 MMAs on stage u; mbarriers hand the stages round
 * (landed, taken, ready, empty).
 *
 * Each tile's stage sequence (its samples in ascending coefficient order,
 * each ceil(T/32) stages) is cut into the number of chunks, one CTA each,
 * whose whole waves finish first (tf32_chunks; chunks start and end inside
 * samples), summed with atomics. Within a chunk the accumulator is rescaled
 * between samples (Horner, as grouped_tma.cu), so one register tile holds
 * the weighted total.
 *
 * Measured on an H100 (GPT-2-small's 72 layers, B=8, T=1024; the TF32 cuBLAS
 * GEMMs take 12.6 ms): this form 17.0 ms; the producer warpgroup alone
 * transposing (the consumers only issuing MMAs) 17.8-17.9, and 19.4 with
 * its rows also prefetched into the L2 three stages ahead; whole samples
 * per CTA and no producer warpgroup 20.9-21.3; 128x128 tiles with three
 * copies in flight 21.6; every element its own 4-byte cp.async straight
 * into place, no transpose 23.2; mma.sync (norms_tf32.cu) 23.5. Layers whose rows
 * are not on 16 bytes go to the mma.sync kernel, which calls this one. */
#include "dcc_tma.cuh"
#include "dcc_util.cuh"

namespace {

constexpr int XT = 384;                    /* two consumer warpgroups, one producer */
constexpr int XM = 128, XN = 256, XK = 32; /* the CTA's tile; k per stage */
constexpr int XR = XM + XN;                /* transposed rows: g's features, then a's */
constexpr int NAT = XK * XR;               /* floats of a stage as stored */
constexpr int NST = 2;                     /* stages as stored */
constexpr int KST = 2;                     /* stages transposed */
constexpr int KMJ = XR * 128;              /* bytes of a transposed stage */
constexpr int X_SMEM = NST * NAT * 4 + KST * KMJ + 1024;
static_assert(XR == XT, "every thread transposes one row of a stage");

#ifndef DCC_WG_EMPTY

__global__ void __launch_bounds__(XT, 1)
tf32_wg_clipped(const float *__restrict__ a, const float *__restrict__ g, int B, int T, int d,
                int p, int tiles_n, int chunks, const int *__restrict__ perm,
                const float *__restrict__ fac, const float *__restrict__ cs,
                float *__restrict__ w) {
    extern __shared__ __align__(16) unsigned char smem[];
    /* per slot s (stages v with v % 2 == s): landed (the producer's copies
     * of v are in nat), taken (every thread has read them: nat is free),
     * ready (every thread has transposed its row of v into kmj), empty (the
     * MMAs on kmj are done: the 8 consumer warps) */
    __shared__ __align__(8) uint64_t bar_mem[4 * KST];
    const uint32_t kmj = (dcc_smem(smem) + 1023u) & ~1023u; /* KST transposed stages */
    float *nat = (float *)(smem + (kmj - dcc_smem(smem)) + KST * KMJ); /* NST as stored */
    const int tm = (int)blockIdx.x / tiles_n, tn = (int)blockIdx.x % tiles_n;
    const int m0 = tm * XM, n0 = tn * XN;
    /* this CTA's chunk of the tile's stage sequence (sample-major over the
     * samples in coefficient order, then k-tiles): stages [u0, u0 + U) */
    const int ktn = (T + XK - 1) / XK;
    const int64_t S = (int64_t)B * ktn;
    const int64_t u0 = S * blockIdx.y / chunks;
    const int U = (int)(S * (blockIdx.y + 1) / chunks - u0);
    if (U <= 0) return; /* uniform per CTA, before any barrier */
    const int k0 = (int)(u0 / ktn), kt0 = (int)(u0 - (int64_t)k0 * ktn);
    const int tid = (int)threadIdx.x;
    const uint32_t bars = dcc_smem(bar_mem);
    const uint32_t landed = bars, taken = bars + 8u * KST, ready = bars + 16u * KST,
                   empty = bars + 24u * KST;
    if (tid == 0) {
        for (int s = 0; s < KST; s++) {
            mbar_init(landed + 8u * (uint32_t)s, 128);
            mbar_init(taken + 8u * (uint32_t)s, XT);
            mbar_init(ready + 8u * (uint32_t)s, XT);
            mbar_init(empty + 8u * (uint32_t)s, 8);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    /* the parity of stage v's completion of its slot's barriers (slot v %
     * KST, completed once per KST stages) */
    auto par = [](int v) { return ((uint32_t)v / KST) & 1u; };

    /* Stage v, as stored, into transposed buffer v % KST, by every thread of
     * the CTA: its row r = tid (g's feature r, then a's r - 128); chunk c of
     * a row holds k = 4c .. 4c + 3 and sits at 16 (c ^ (r % 8)) in the row;
     * a warp's lanes take consecutive rows (columns as stored). It waits
     * for the copies and for the buffer's last MMAs (stage v - 2), and
     * hands the buffer over (ready) and the copy back (taken). */
    auto transpose = [&](int v) {
        const int sl = v % KST;
        mbar_wait(landed + 8u * (uint32_t)sl, par(v));
        if (v >= KST) mbar_wait(empty + 8u * (uint32_t)sl, par(v - KST));
        const float *st = nat + (v % NST) * NAT;
        const uint32_t kb = kmj + (uint32_t)(sl * KMJ) + (uint32_t)(tid * 128);
        const uint32_t sw = (uint32_t)(tid & 7);
        const float *x0 = tid < XM ? st + tid : st + XK * XM + (tid - XM);
        const int W = tid < XM ? XM : XN;
#pragma unroll
        for (int c = 0; c < 8; c++) {
            const float *x = x0 + 4 * c * W;
            dcc_sts128(kb + ((c ^ sw) << 4), __float_as_uint(x[0]), __float_as_uint(x[W]),
                       __float_as_uint(x[2 * W]), __float_as_uint(x[3 * W]));
        }
        fence_proxy_async(); /* the stores, visible to the tensor cores */
        mbar_arrive(ready + 8u * (uint32_t)sl);
        mbar_arrive(taken + 8u * (uint32_t)sl);
    };

    if (tid >= 256) { /* the producer warpgroup: copies, and its rows */
        const int q = tid - 256;
        /* stage u as stored: [32 rows of T][128 of g's features], then [32][256
         * of a's]; zero past T and past the widths (multiples of 4: whole
         * chunks). This thread's chunks: g rows q/32 + 4j (j < 8), a rows q/64
         * + 2j (j < 16), at fixed columns: only the row test changes with u. */
        const int gc = (q & 31) * 4, ac = (q & 63) * 4, gr = q >> 5, ar = q >> 6;
        const bool g_in = m0 + gc < p, a_in = n0 + ac < d;
        const int64_t gstep = (int64_t)4 * p, astep = (int64_t)2 * d;
        auto load = [&](int u, int kb, int kt) { /* stage u: sample kb, k-tile kt */
            const int t0 = kt * XK, b = perm[k0 + kb];
            float *s = nat + (u % NST) * NAT;
            const float *gs = g + ((int64_t)b * T + t0 + gr) * p + m0 + gc;
            const float *as = a + ((int64_t)b * T + t0 + ar) * d + n0 + ac;
            const int grem = g_in ? T - t0 - gr : 0, arem = a_in ? T - t0 - ar : 0;
            const uint32_t gd = dcc_smem(s + gr * XM + gc);
            const uint32_t ad = dcc_smem(s + XK * XM + ar * XN + ac);
#pragma unroll
            for (int j = 0; j < 8; j++, gs += gstep) {
                const bool ok = 4 * j < grem;
                dcc_cp_async16(gd + (uint32_t)(j * 4 * XM * 4), ok ? gs : g, ok ? 16 : 0);
            }
#pragma unroll
            for (int j = 0; j < 16; j++, as += astep) {
                const bool ok = 2 * j < arem;
                dcc_cp_async16(ad + (uint32_t)(j * 2 * XN * 4), ok ? as : a, ok ? 16 : 0);
            }
        };
        int lb = 0, lt = kt0; /* the next stage to copy */
        load(0, lb, lt);
        if (++lt == ktn) lt = 0, lb++;
        dcc_cp_commit();
        for (int v = 0; v < U; v++) {
            dcc_cp_wait<0>(); /* this thread's copies of v */
            mbar_arrive(landed + 8u * (uint32_t)(v % KST));
            /* the next copy, once every thread has read the stage it
             * replaces (v - 1) */
            if (v + 1 < U) {
                if (v >= 1) mbar_wait(taken + 8u * (uint32_t)((v + 1) % KST), par(v - 1));
                load(v + 1, lb, lt);
            }
            if (++lt == ktn) lt = 0, lb++;
            dcc_cp_commit();
            transpose(v);
        }
        return;
    }

    /* the two consumer warpgroups: their rows of each stage, then the MMAs,
     * under which the next stage's rows are transposed */
    const int wg = tid >> 7, lane = tid & 31;
    float acc[2][64]; /* the m64n256 accumulator, as the helpers take it in halves */
    float(&acc_all)[128] = *reinterpret_cast<float(*)[128]>(&acc[0][0]);
#pragma unroll
    for (int i = 0; i < 128; i++) acc_all[i] = 0.0f;
    transpose(0);
    for (int u = 0, ct = kt0, cb = 0; u < U; u++) {
        mbar_wait(ready + 8u * (uint32_t)(u % KST), par(u));
        if (ct == ktn) ct = 0, cb++;
        if (ct++ == 0 && u > 0) { /* the next sample: rescale to its coefficient */
            wg_wait<0>();
            acc_fence<2>(acc);
            const float f = fac[k0 + cb];
#pragma unroll
            for (int i = 0; i < 128; i++) acc_all[i] *= f;
        }
        const uint32_t kb = kmj + (uint32_t)((u % KST) * KMJ);
        acc_fence<2>(acc);
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {
            const uint32_t ka = kb + (uint32_t)(wg * 64 * 128 + kk * 32);
            const uint32_t kn = kb + (uint32_t)(XM * 128 + kk * 32);
            wgmma_m64n256<0, 0>((const float *)nullptr, acc_all, wg_desc(ka, 16, 1024),
                                wg_desc(kn, 16, 1024));
        }
        wg_commit();
        acc_fence<2>(acc);
        wg_wait<1>(); /* the MMAs of u - 1 are done: their buffer goes back */
        acc_fence<2>(acc);
        __syncwarp();
        if (u > 0 && lane == 0) mbar_arrive(empty + 8u * (uint32_t)((u - 1) % KST));
        if (u + 1 < U) transpose(u + 1);
    }
    wg_wait<0>();
    acc_fence<2>(acc);

    /* accumulator: warp wq of the warpgroup holds rows 16 wq .. +15; register
     * i is row lane/4 (+8 when i%4 >= 2), column 8 (i/4) + 2 (lane%4) + i%2 */
    const float cl = cs[perm[k0 + (kt0 + U - 1) / ktn]]; /* the last sample's */
    const int wq = (tid >> 5) & 3;
    const bool atomic = chunks > 1;
#pragma unroll
    for (int h = 0; h < 2; h++)
#pragma unroll
        for (int i = 0; i < 64; i++) {
            const int m = m0 + wg * 64 + wq * 16 + (lane >> 2) + ((i & 2) ? 8 : 0);
            const int n = n0 + h * 128 + (i >> 2) * 8 + (lane & 3) * 2 + (i & 1);
            if (m < p && n < d) {
                const float v = cl * acc[h][i];
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

/* Chunks of each tile's B * ceil(T/32) stages, one CTA each (one CTA fits
 * an SM): the count whose whole waves, each chunk paying ~3 stages of
 * pipeline fill, finish first. Whole samples per CTA left GPT-2's
 * 768x768 layers (18 tiles) 144 CTAs on 132 SMs: two rounds for 1.1 of
 * work. */
static int tf32_chunks(int tiles, int64_t stages, int sms) {
    int best = 1;
    double best_t = 1e300;
    const int cap = stages < 256 ? (int)stages : 256;
    for (int c = 1; c <= cap; c++) {
        const int64_t rounds = ((int64_t)tiles * c + sms - 1) / sms;
        const double t = (double)rounds * ((double)stages / c + 3.0);
        if (t < best_t * 0.999) best_t = t, best = c;
    }
    return best;
}

extern "C" cudaError_t dcc_tf32_clipped_wgmma(const dcc_linear *L, const float *cs,
                                              const int *perm, const float *fac, float *w,
                                              cudaStream_t st) {
#ifdef DCC_WGMMA_BUILT
    if (L->ta != DC_F32 || L->tg != DC_F32 || !dcc_wgmma_available(L->opt) || L->d % 4 ||
        L->p % 4 || ((uintptr_t)L->a & 15u) || ((uintptr_t)L->g & 15u))
        return cudaErrorNotSupported;
    const int tiles_m = (L->p + XM - 1) / XM, tiles_n = (L->d + XN - 1) / XN;
    if ((int64_t)tiles_m * tiles_n > INT32_MAX / 256) return cudaErrorInvalidConfiguration;
    int sms;
    cudaError_t e = dcc_sm_count(&sms);
    if (e != cudaSuccess) return e;
    const int chunks =
        tf32_chunks(tiles_m * tiles_n, (int64_t)L->B * ((L->T + XK - 1) / XK), sms);
    if (chunks > 1 && (e = cudaMemsetAsync(w, 0, (size_t)L->p * L->d * sizeof(float), st)))
        return e;
    e = cudaFuncSetAttribute(tf32_wg_clipped, cudaFuncAttributeMaxDynamicSharedMemorySize, X_SMEM);
    if (e != cudaSuccess) return e;
    dim3 grid((unsigned)(tiles_m * tiles_n), (unsigned)chunks);
    tf32_wg_clipped<<<grid, XT, X_SMEM, st>>>((const float *)L->a, (const float *)L->g, L->B,
                                              L->T, L->d, L->p, tiles_n, chunks, perm, fac,
                                              cs, w);
    return cudaGetLastError();
#else
    (void)L;
    (void)cs;
    (void)perm;
    (void)fac;
    (void)w;
    (void)st;
    return cudaErrorNotSupported;
#endif
}
