/* The TF32 clipped sum on Hopper's warpgroup MMA (sm_90a): w[p][d] = sum_b
 * cs[b] g_b^T a_b for f32 inputs, the operands' TF32 truncations multiplied
 * (as every TF32 kernel does, norms_tf32.cu), on 128x256 output tiles.
 *
 * TF32 wgmma reads K-major operands only from shared memory, and both of
 * these are stored with K (= T) outermost: the direct form's layout, which
 * the 16-bit kernels transpose in the instruction; neither TMA nor 16-byte
 * copies can transpose 4-byte elements. So a producer warpgroup copies each
 * stage (32 rows of T) into shared memory as stored (cp.async, two stages
 * ahead), and then:
 *   - A (g's 128 features) goes to the MMAs from registers: each consumer
 *     thread loads its fragments straight from the rows as stored (rows
 *     padded to 136 floats: conflict-free), nothing transposed;
 *   - B (a's 256 features) is transposed, each consumer thread one feature,
 *     into a K-major buffer in the layout the descriptors name (128-byte
 *     rows of 32 k, 16-byte chunks swizzled by chunk ^ (row % 8), the TMA
 *     kernels' layout): a lane reads four rows of one column (conflict-free:
 *     a warp's lanes take consecutive columns) and writes them as one
 *     16-byte chunk (conflict-free through the swizzle).
 * The consumers prepare stage u + 1 (B transposed, A's fragments loaded)
 * while the tensor cores run their m64n256k8 MMAs on stage u; mbarriers
 * hand the stages round (landed, taken, ready, empty).
 *
 * Each tile's stage sequence (its samples in ascending coefficient order,
 * each ceil(T/32) stages) is cut into the number of chunks, one CTA each,
 * whose whole waves finish first (tf32_chunks; chunks start and end inside
 * samples), summed with atomics. Within a chunk the accumulator is rescaled
 * between samples (Horner, as grouped_tma.cu), so one register tile holds
 * the weighted total.
 *
 * Measured on an H100 (GPT-2-small's 72 layers, B=8, T=1024; the TF32 cuBLAS
 * GEMMs take 12.5 ms): this form 14.2 ms (15.3 with the chunks costed at 3
 * stages, tf32_chunks, as the figures after it were; three transposed
 * buffers and two stored, the transposition no longer waiting for the MMAs
 * two stages back, 15.5; the producer warpgroup transposing 3 of each
 * row's 8 chunks beside its copies, 16.6 at 16-stage chunks); A transposed
 * as well (every
 * thread of the CTA one row of 384, one copy in flight) 17.0; the producer
 * warpgroup alone transposing 17.8-17.9, and 19.4 with its rows also
 * prefetched into the L2 three stages ahead; whole samples per CTA and no
 * producer warpgroup 20.9-21.3; 128x128 tiles with three copies in flight
 * 21.6; every element its own 4-byte cp.async straight into place, no
 * transpose 23.2; mma.sync (norms_tf32.cu) 23.5. Layers whose rows are not
 * on 16 bytes go to the mma.sync kernel, which calls this one. */
#include "dcc.h"
#include "dcc_tma.cuh"
#include "dcc_util.cuh"

namespace {

constexpr int XT = 384;                    /* two consumer warpgroups, one producer */
constexpr int XC = 256, XP = XT - XC;      /* consumer and producer threads */
constexpr int XM = 128, XN = 256, XK = 32; /* the CTA's tile; k per stage */
constexpr int XLA = XM + 8;                /* floats per stored row of g (see A_frag) */
constexpr int NAT = XK * (XLA + XN);       /* floats of a stage as stored */
constexpr int NST = 3;                     /* stages as stored: two copies in flight */
constexpr int KST = 2;                     /* stages of a's rows transposed */
constexpr int KMJ = XN * 128;              /* bytes of a transposed stage */
constexpr int X_SMEM = NST * NAT * 4 + KST * KMJ + 1024;
/* setmaxnreg: the producer's copies need few registers, the consumers hold
 * the 128 accumulators and two stages' A fragments (128 x 40 + 256 x 232 <=
 * 64 Ki, the CTA's 384 x 168) */
constexpr int PRODUCER_REGS = 40, CONSUMER_REGS = 232;
static_assert(XN == XC, "each consumer thread transposes one of a's rows");
static_assert(XP == 128 && XM == 128,
              "the producer's copy pattern: 128 threads, 128 of g's columns");

#ifndef DCC_WG_EMPTY

template <int N> __device__ __forceinline__ void regs_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N> __device__ __forceinline__ void regs_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}

/* The A fragments of one stage for a consumer thread (wgmma_m64n256_tf32_ra:
 * four k8 steps), straight from g's rows as stored, [k][XLA floats]: lanes
 * read (k = lane % 4, feature = lane / 4); a row stride of 8 mod 32 floats
 * puts the 32 lanes on 32 banks. */
__device__ __forceinline__ void A_frag(uint32_t (&a)[4][4], const float *sg, int r0, int lane) {
    const float *p = sg + (lane & 3) * XLA + r0 + (lane >> 2);
#pragma unroll
    for (int kk = 0; kk < 4; kk++) {
        const float *q = p + 8 * kk * XLA;
        a[kk][0] = __float_as_uint(q[0]);
        a[kk][1] = __float_as_uint(q[8]);
        a[kk][2] = __float_as_uint(q[4 * XLA]);
        a[kk][3] = __float_as_uint(q[4 * XLA + 8]);
    }
}

__global__ void __launch_bounds__(XT, 1)
    tf32_wg_clipped(const float *__restrict__ a, const float *__restrict__ g, int B, int T, int d,
                    int p, int tiles_n, int chunks, const int *__restrict__ perm,
                    const float *__restrict__ fac, const float *__restrict__ cs,
                    float *__restrict__ w) {
    extern __shared__ __align__(16) unsigned char smem[];
    /* landed[NST] (the producer's copies of a stage are in nat), taken[NST]
     * (the consumers have read that stage: its slot is free), ready[KST]
     * (the consumers have transposed a's rows of a stage into kmj), empty[KST]
     * (the MMAs on a kmj slot are done: the 8 consumer warps) */
    __shared__ __align__(8) uint64_t bar_mem[2 * NST + 2 * KST];
    const uint32_t kmj = (dcc_smem(smem) + 1023u) & ~1023u;            /* KST transposed stages */
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
    const uint32_t landed = bars, taken = bars + 8u * NST, ready = bars + 16u * NST,
                   empty = bars + 16u * NST + 8u * KST;
    if (tid == 0) {
        for (int s = 0; s < NST; s++) {
            mbar_init(landed + 8u * (uint32_t)s, XP);
            mbar_init(taken + 8u * (uint32_t)s, XC);
        }
        for (int s = 0; s < KST; s++) {
            mbar_init(ready + 8u * (uint32_t)s, XC);
            mbar_init(empty + 8u * (uint32_t)s, 8);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    /* the parity of stage v's completion of its slot's barriers (a slot of
     * N is completed once per N stages) */
    auto par = [](int v, int N) { return ((uint32_t)v / (uint32_t)N) & 1u; };

    if (tid >= XC) { /* the producer warpgroup: the copies */
        regs_dec<PRODUCER_REGS>();
        const int q = tid - XC;
        /* stage u as stored: [32 rows of T][XLA: g's 128 features], then
         * [32][256 of a's]; zero past T and past the widths (multiples of 4:
         * whole chunks). This thread's chunks: g rows q/32 + 4j (j < 8), a
         * rows q/64 + 2j (j < 16), at fixed columns: only the row test
         * changes with u. */
        const int gc = (q & 31) * 4, ac = (q & 63) * 4, gr = q >> 5, ar = q >> 6;
        const bool g_in = m0 + gc < p, a_in = n0 + ac < d;
        const int64_t gstep = (int64_t)4 * p, astep = (int64_t)2 * d;
        int lb = 0, lt = kt0; /* the next stage to copy: its sample and k-tile */
        auto load = [&](int u) {
            const int t0 = lt * XK, b = perm[k0 + lb];
            float *s = nat + (u % NST) * NAT;
            const float *gs = g + ((int64_t)b * T + t0 + gr) * p + m0 + gc;
            const float *as = a + ((int64_t)b * T + t0 + ar) * d + n0 + ac;
            const int grem = g_in ? T - t0 - gr : 0, arem = a_in ? T - t0 - ar : 0;
            const uint32_t gd = dcc_smem(s + gr * XLA + gc);
            const uint32_t ad = dcc_smem(s + XK * XLA + ar * XN + ac);
#pragma unroll
            for (int j = 0; j < 8; j++, gs += gstep) {
                const bool ok = 4 * j < grem;
                dcc_cp_async16(gd + (uint32_t)(j * 4 * XLA * 4), ok ? gs : g, ok ? 16 : 0);
            }
#pragma unroll
            for (int j = 0; j < 16; j++, as += astep) {
                const bool ok = 2 * j < arem;
                dcc_cp_async16(ad + (uint32_t)(j * 2 * XN * 4), ok ? as : a, ok ? 16 : 0);
            }
            if (++lt == ktn) lt = 0, lb++;
        };
        load(0);
        dcc_cp_commit();
        if (U > 1) load(1);
        dcc_cp_commit();
        for (int v = 0; v < U; v++) {
            dcc_cp_wait<1>(); /* this thread's copies of v (v + 1's may fly on) */
            mbar_arrive(landed + 8u * (uint32_t)(v % NST));
            /* stage v + 2 into the slot of v - 1, once the consumers are
             * done with it */
            if (v + 2 < U) {
                if (v >= 1) mbar_wait(taken + 8u * (uint32_t)((v + 2) % NST), par(v - 1, NST));
                load(v + 2);
            }
            dcc_cp_commit();
        }
        return;
    }

    /* the two consumer warpgroups */
    regs_inc<CONSUMER_REGS>();
    const int lane = tid & 31;
    /* this warp's 16 rows of g's 128: consumer warpgroup k = tid / 128
     * takes rows 64 k .. 64 k + 63 (its MMAs' M), each of its warps 16 */
    const int r0 = (tid >> 5) * 16;
    float acc[2][64]; /* the m64n256 accumulator, as the helpers take it in halves */
    float(&acc_all)[128] = *reinterpret_cast<float(*)[128]>(&acc[0][0]);
#pragma unroll
    for (int i = 0; i < 128; i++) acc_all[i] = 0.0f;
    uint32_t af[2][4][4]; /* two stages' A fragments: the MMAs of one read its set */

    /* Stage v's a rows into kmj slot v % KST, row tid (a's feature n0 +
     * tid): chunk c of the row holds k = 4c .. 4c + 3 and sits at 16 (c ^
     * (tid % 8)) in it, the TMA kernels' 128-byte swizzle; a warp's lanes
     * take consecutive columns as stored (conflict-free reads), the swizzle
     * spreads the 16-byte writes. Then this thread's A fragments of v, and
     * the slot as stored goes back (taken). */
    auto prepare = [&](int v, uint32_t(&fr)[4][4]) {
        const int sl = v % KST;
        mbar_wait(landed + 8u * (uint32_t)(v % NST), par(v, NST));
        if (v >= KST) mbar_wait(empty + 8u * (uint32_t)sl, par(v - KST, KST));
        const float *st = nat + (v % NST) * NAT;
        const uint32_t kb = kmj + (uint32_t)(sl * KMJ) + (uint32_t)(tid * 128);
        const uint32_t sw = (uint32_t)(tid & 7);
        const float *x = st + XK * XLA + tid;
#pragma unroll
        for (int c = 0; c < 8; c++, x += 4 * XN)
            dcc_sts128(kb + ((c ^ sw) << 4), __float_as_uint(x[0]), __float_as_uint(x[XN]),
                       __float_as_uint(x[2 * XN]), __float_as_uint(x[3 * XN]));
        fence_proxy_async(); /* the stores, visible to the tensor cores */
        mbar_arrive(ready + 8u * (uint32_t)sl);
        A_frag(fr, st, r0, lane);
        mbar_arrive(taken + 8u * (uint32_t)(v % NST));
    };

    /* Stage u's MMAs (A from fr), under which stage u + 1 is prepared into
     * the other set of fragments. ct/cb: the k-tile and sample stage u is
     * in (samples start with ct == 0). */
    int ct = kt0, cb = 0;
    auto step = [&](int u, uint32_t(&fr)[4][4], uint32_t(&next)[4][4]) {
        mbar_wait(ready + 8u * (uint32_t)(u % KST), par(u, KST));
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
        for (int kk = 0; kk < 4; kk++)
            wgmma_m64n256_tf32_ra(acc_all, fr[kk], wg_desc(kb + (uint32_t)(kk * 32), 16, 1024));
        wg_commit();
        acc_fence<2>(acc);
        wg_wait<1>(); /* the MMAs of u - 1 are done: their slot and fragments are free */
        acc_fence<2>(acc);
        __syncwarp();
        if (u > 0 && lane == 0) mbar_arrive(empty + 8u * (uint32_t)((u - 1) % KST));
        if (u + 1 < U) prepare(u + 1, next);
    };
    prepare(0, af[0]);
    /* two stages a round, so that each set of fragments has a fixed name */
    for (int u = 0; u < U; u += 2) {
        step(u, af[0], af[1]);
        if (u + 1 < U) step(u + 1, af[1], af[0]);
    }
    wg_wait<0>();
    acc_fence<2>(acc);

    /* accumulator: this warp's rows are r0 .. r0 + 15 (as its A fragments);
     * register i is row r0 + lane/4 (+8 when i%4 >= 2), column 8 (i/4) +
     * 2 (lane%4) + i%2 */
    const float cl = cs[perm[k0 + (kt0 + U - 1) / ktn]]; /* the last sample's */
    const bool atomic = chunks > 1;
#pragma unroll
    for (int h = 0; h < 2; h++)
#pragma unroll
        for (int i = 0; i < 64; i++) {
            const int m = m0 + r0 + (lane >> 2) + ((i & 2) ? 8 : 0);
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
 * an SM): the count whose whole waves, each chunk paying a fixed cost of
 * CHUNK_STAGES stages (pipeline fill, its atomic epilogue, the output's
 * zeroing shared out), finish first. Whole samples per CTA left GPT-2's
 * 768x768 layers (18 tiles) 144 CTAs on 132 SMs: two rounds for 1.1 of
 * work. Measured on an H100 (GPT-2-small's 72 layers, f32): a fixed cost of
 * 3 stages cut the layers into many short chunks, 15.3 ms; 8: 14.5; 12 to
 * 30: 14.2-14.3; one chunk a tile: 16.7. */
static const double CHUNK_STAGES = 16.0;

static int tf32_chunks(int tiles, int64_t stages, int sms) {
    int best = 1;
    double best_t = 1e300;
    const int cap = stages < 256 ? (int)stages : 256;
    for (int c = 1; c <= cap; c++) {
        const int64_t rounds = ((int64_t)tiles * c + sms - 1) / sms;
        const double t = (double)rounds * ((double)stages / c + CHUNK_STAGES);
        if (t < best_t * 0.999) best_t = t, best = c;
    }
    return best;
}

extern "C" cudaError_t dcc_tf32_clipped_wgmma(const dcc_linear *L, const float *cs, const int *perm,
                                              const float *fac, float *w, cudaStream_t st) {
#ifdef DCC_WGMMA_BUILT
    if (L->ta != DC_F32 || L->tg != DC_F32 || !dcc_wgmma_available(L->opt) || L->d % 4 ||
        L->p % 4 || ((uintptr_t)L->a & 15u) || ((uintptr_t)L->g & 15u))
        return cudaErrorNotSupported;
    const int tiles_m = (L->p + XM - 1) / XM, tiles_n = (L->d + XN - 1) / XN;
    if ((int64_t)tiles_m * tiles_n > INT32_MAX / 256) return cudaErrorInvalidConfiguration;
    int sms;
    cudaError_t e = dcc_sm_count(&sms);
    if (e != cudaSuccess) return e;
    const int chunks = tf32_chunks(tiles_m * tiles_n, (int64_t)L->B * ((L->T + XK - 1) / XK), sms);
    if (chunks > 1 && (e = cudaMemsetAsync(w, 0, (size_t)L->p * L->d * sizeof(float), st)))
        return e;
    e = cudaFuncSetAttribute(tf32_wg_clipped, cudaFuncAttributeMaxDynamicSharedMemorySize, X_SMEM);
    if (e != cudaSuccess) return e;
    dim3 grid((unsigned)(tiles_m * tiles_n), (unsigned)chunks);
    tf32_wg_clipped<<<grid, XT, X_SMEM, st>>>((const float *)L->a, (const float *)L->g, L->B, L->T,
                                              L->d, L->p, tiles_n, chunks, perm, fac, cs, w);
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
