/* Embedding, LayerNorm and RMSNorm per-sample squared norms, and their
 * clipped sums. These layers are memory-bound: each kernel reads its inputs
 * once with coalesced loads, and checks every value it reads for finiteness
 * (padding rows included, which the norm itself never touches).
 *
 * Embedding: ||sum_t e_{i_t} g_t^T||^2 = sum over distinct indices v of
 * ||sum_{t: i_t = v} g_t||^2. Rows are sorted by the key (b, index) with a
 * radix sort (stable, so positions stay ascending within a run); a warp per
 * run start then sums the run's rows and squares. Padding and out-of-range
 * rows get the key (b, vocab) and are skipped; out-of-range ones raise
 * DCC_FLAG_INDEX. Memory: O(B*T) keys, never O(T^2) or O(vocab).
 *
 * LayerNorm / RMSNorm: per-row statistics (in double, as the CPU backend),
 * then per-sample weight grads sum_t g_t * x_hat_t and bias grads sum_t g_t
 * accumulated over chunks of rows into [B,d] buffers, then squared. The
 * [B,d] buffers are kept for the clipped sum. */
#include <cub/device/device_radix_sort.cuh>

#include "dcc.h"
#include "dcc_device.cuh"

namespace {

constexpr int NT = 256;

/* --- embedding ------------------------------------------------------------ */

template <typename TI, typename TG>
__global__ void emb_keys(const TI *__restrict__ idx, const TG *__restrict__ g, int64_t rows, int T,
                         int d, int64_t vocab, int64_t pad, unsigned long long *__restrict__ keys,
                         uint32_t *__restrict__ vals, uint32_t *__restrict__ flags) {
    int64_t row = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = (int)threadIdx.x & 31;
    if (row >= rows) return;
    int b = (int)(row / T);
    int64_t v = (int64_t)idx[row];
    bool valid = v >= 0 && v < vocab;
    bool skip = !valid || v == pad;
    if (lane == 0) {
        keys[row] = (unsigned long long)b * (unsigned long long)(vocab + 1) +
                    (unsigned long long)(skip ? vocab : v);
        vals[row] = (uint32_t)row;
        if (!valid) atomicOr(flags + b, DCC_FLAG_INDEX);
    }
    if (skip) { /* the run kernel will not read this row: check it here */
        bool bad = false;
        for (int j = lane; j < d; j += 32) bad |= !dcc_isfinite(dcc_ld(g, row * d + j));
        if (__any_sync(0xffffffffu, bad) && lane == 0) atomicOr(flags + b, DCC_FLAG_NONFINITE);
    }
}

template <typename TG>
__global__ void emb_runs(const unsigned long long *__restrict__ keys,
                         const uint32_t *__restrict__ vals, int64_t n, const TG *__restrict__ g,
                         int T, int d, int64_t vocab, float s2, float *__restrict__ n2,
                         uint32_t *__restrict__ flags) {
    int64_t pos = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = (int)threadIdx.x & 31;
    if (pos >= n) return;
    unsigned long long key = keys[pos];
    if (pos > 0 && keys[pos - 1] == key) return; /* not the start of a run */
    int b = (int)(vals[pos] / (uint32_t)T);
    if ((int64_t)(key - (unsigned long long)b * (unsigned long long)(vocab + 1)) == vocab)
        return; /* padding or invalid rows */
    int64_t end = pos + 1;
    while (end < n && keys[end] == key) end++;
    float sq = 0.0f;
    bool bad = false;
    for (int j = lane; j < d; j += 32) {
        float s = 0.0f;
        for (int64_t q = pos; q < end; q++) s += dcc_ld(g, (int64_t)vals[q] * d + j);
        bad |= !dcc_isfinite(s);
        sq += s * s;
    }
    sq = dcc_warp_sum(sq);
    bool anybad = __any_sync(0xffffffffu, bad);
    if (lane == 0) {
        atomicAdd(n2 + b, sq * s2);
        if (anybad) atomicOr(flags + b, DCC_FLAG_NONFINITE);
    }
}

template <typename TI, typename TG>
__global__ void emb_clipped(const TI *__restrict__ idx, const TG *__restrict__ g, int64_t rows,
                            int T, int d, int64_t vocab, int64_t pad, const float *__restrict__ cs,
                            float *__restrict__ w) {
    int64_t row = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = (int)threadIdx.x & 31;
    if (row >= rows) return;
    int64_t v = (int64_t)idx[row];
    if (v < 0 || v >= vocab || v == pad) return;
    float c = cs[row / T];
    for (int j = lane; j < d; j += 32) atomicAdd(w + v * d + j, c * dcc_ld(g, row * d + j));
}

int key_bits(unsigned long long maxkey) {
    int bits = 1;
    while (bits < 64 && (maxkey >> bits) != 0) bits++;
    return bits;
}

size_t align256(size_t x) { return (x + 255) & ~(size_t)255; }

template <typename Fn> cudaError_t with_index(dc_dtype t, Fn &&fn) {
    switch (t) {
    case DC_I32: return fn((const int32_t *)nullptr);
    case DC_I64: return fn((const int64_t *)nullptr);
    default: return cudaErrorInvalidValue;
    }
}

size_t sort_temp_bytes(int64_t n) {
    size_t tb = 0;
    cub::DeviceRadixSort::SortPairs(nullptr, tb, (const unsigned long long *)nullptr,
                                    (unsigned long long *)nullptr, (const uint32_t *)nullptr,
                                    (uint32_t *)nullptr, n, 0, 64);
    return tb;
}

/* --- LayerNorm / RMSNorm ---------------------------------------------------- */

/* Warp per row: (mean, rstd) in double like the CPU backend, stored as f32. */
template <typename TX>
__global__ void norm_stats(const TX *__restrict__ x, int64_t rows, int d, int rms, float eps,
                           float2 *__restrict__ stats) {
    int64_t row = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = (int)threadIdx.x & 31;
    if (row >= rows) return;
    const TX *xr = x + row * d;
    double mean = 0.0, var = 0.0;
    if (!rms) {
        for (int j = lane; j < d; j += 32) mean += (double)dcc_ld(xr, j);
        mean = dcc_warp_sum(mean);
        mean /= (double)d;
    }
    for (int j = lane; j < d; j += 32) {
        double v = (double)dcc_ld(xr, j) - mean;
        var += v * v;
    }
    var = dcc_warp_sum(var);
    var /= (double)d;
    if (lane == 0) stats[row] = make_float2((float)mean, (float)(1.0 / sqrt(var + (double)eps)));
}

constexpr int NORM_ROWS = 32; /* rows of one sample per block */

/* grid (d/NT, B, T/NORM_ROWS): wg[b,j] += sum_t g * x_hat, bg[b,j] += sum_t g. */
template <typename TX, typename TG>
__global__ void norm_accum(const TX *__restrict__ x, const TG *__restrict__ g,
                           const float2 *__restrict__ stats, int T, int d, int has_bias,
                           float *__restrict__ wg, float *__restrict__ bg,
                           uint32_t *__restrict__ flags) {
    int j = (int)(blockIdx.x * blockDim.x + threadIdx.x);
    int b = (int)blockIdx.y;
    int t0 = (int)blockIdx.z * NORM_ROWS, t1 = min(T, t0 + NORM_ROWS);
    bool bad = false;
    if (j < d) {
        float w = 0.0f, s = 0.0f;
        for (int t = t0; t < t1; t++) {
            int64_t row = (int64_t)b * T + t;
            float2 st = stats[row];
            float xv = dcc_ld(x, row * d + j), gv = dcc_ld(g, row * d + j);
            bad |= !dcc_isfinite(xv) || !dcc_isfinite(gv);
            w += gv * ((xv - st.x) * st.y);
            s += gv;
        }
        atomicAdd(wg + (int64_t)b * d + j, w);
        if (has_bias) atomicAdd(bg + (int64_t)b * d + j, s);
    }
    if (__syncthreads_or(bad) && threadIdx.x == 0) atomicOr(flags + b, DCC_FLAG_NONFINITE);
}

__global__ void norm_square(const float *__restrict__ wg, const float *__restrict__ bg, int d,
                            int has_bias, float s2, float *__restrict__ n2) {
    int b = (int)blockIdx.x;
    float s = 0.0f;
    for (int j = (int)threadIdx.x; j < d; j += NT) {
        float w = wg[(int64_t)b * d + j];
        s += w * w;
        if (has_bias) {
            float v = bg[(int64_t)b * d + j];
            s += v * v;
        }
    }
    s = dcc_block_sum(s);
    if (threadIdx.x == 0) atomicAdd(n2 + b, s * s2);
}

__global__ void norm_clipped(const float *__restrict__ wg, const float *__restrict__ bg, int B,
                             int d, const float *__restrict__ cs, float *__restrict__ w,
                             float *__restrict__ bias) {
    int j = (int)(blockIdx.x * blockDim.x + threadIdx.x);
    if (j >= d) return;
    float sw = 0.0f, sb = 0.0f;
    for (int b = 0; b < B; b++) {
        sw += cs[b] * wg[(int64_t)b * d + j];
        if (bias) sb += cs[b] * bg[(int64_t)b * d + j];
    }
    w[j] = sw;
    if (bias) bias[j] = sb;
}

unsigned warp_blocks(int64_t warps) { return (unsigned)((warps * 32 + NT - 1) / NT); }

} // namespace

extern "C" size_t dcc_embedding_ws_bytes(int B, int T) {
    int64_t n = (int64_t)B * T;
    return 2 * align256((size_t)n * 8) + 2 * align256((size_t)n * 4) + align256(sort_temp_bytes(n));
}

extern "C" cudaError_t dcc_embedding_sqnorms(const dcc_embedding *E, float s2, float *n2,
                                             uint32_t *flags, void *ws, size_t ws_bytes,
                                             cudaStream_t st) {
    int64_t n = (int64_t)E->B * E->T;
    if (n <= 0 || n > (int64_t)UINT32_MAX || E->vocab <= 0) return cudaErrorInvalidValue;
    if (ws_bytes < dcc_embedding_ws_bytes(E->B, E->T)) return cudaErrorInvalidValue;
    char *p = (char *)ws;
    unsigned long long *k0 = (unsigned long long *)p, *k1;
    p += align256((size_t)n * 8);
    k1 = (unsigned long long *)p;
    p += align256((size_t)n * 8);
    uint32_t *v0 = (uint32_t *)p, *v1;
    p += align256((size_t)n * 4);
    v1 = (uint32_t *)p;
    p += align256((size_t)n * 4);
    size_t tb = (size_t)(((char *)ws + ws_bytes) - p);
    int64_t pad = E->padding_idx;
    return with_index(E->tidx, [&](auto ti) {
        return dcc_with_float(E->tg, [&](auto tg) {
            using TI =
                typename std::remove_const<typename std::remove_pointer<decltype(ti)>::type>::type;
            using TG = DCC_TYPE_OF(tg);
            emb_keys<TI, TG><<<warp_blocks(n), NT, 0, st>>>((const TI *)E->idx, (const TG *)E->g, n,
                                                            E->T, E->d, E->vocab, pad, k0, v0,
                                                            flags);
            cudaError_t e = cudaGetLastError();
            if (e != cudaSuccess) return e;
            unsigned long long maxkey = (unsigned long long)E->B *
                                        (unsigned long long)(E->vocab + 1);
            e = cub::DeviceRadixSort::SortPairs(p, tb, k0, k1, v0, v1, n, 0, key_bits(maxkey), st);
            if (e != cudaSuccess) return e;
            emb_runs<TG><<<warp_blocks(n), NT, 0, st>>>(k1, v1, n, (const TG *)E->g, E->T, E->d,
                                                        E->vocab, s2, n2, flags);
            return cudaGetLastError();
        });
    });
}

extern "C" cudaError_t dcc_embedding_clipped_sum(const dcc_embedding *E, const float *cs, float *w,
                                                 cudaStream_t st) {
    int64_t n = (int64_t)E->B * E->T;
    return with_index(E->tidx, [&](auto ti) {
        return dcc_with_float(E->tg, [&](auto tg) {
            using TI =
                typename std::remove_const<typename std::remove_pointer<decltype(ti)>::type>::type;
            using TG = DCC_TYPE_OF(tg);
            emb_clipped<TI, TG><<<warp_blocks(n), NT, 0, st>>>((const TI *)E->idx, (const TG *)E->g,
                                                               n, E->T, E->d, E->vocab,
                                                               E->padding_idx, cs, w);
            return cudaGetLastError();
        });
    });
}

extern "C" cudaError_t dcc_norm_sqnorms(const dcc_norm *N, float s2, float *n2, uint32_t *flags,
                                        float *row_stats, float *per_sample, cudaStream_t st) {
    int64_t rows = (int64_t)N->B * N->T;
    float *wg = per_sample, *bg = per_sample + (int64_t)N->B * N->d;
    int bias = !N->rms && N->has_bias;
    cudaError_t e = cudaMemsetAsync(per_sample, 0, 2 * (size_t)N->B * N->d * sizeof(float), st);
    if (e != cudaSuccess) return e;
    e = dcc_with_float(N->tx, [&](auto tx) {
        using TX = DCC_TYPE_OF(tx);
        norm_stats<TX><<<warp_blocks(rows), NT, 0, st>>>((const TX *)N->x, rows, N->d, N->rms,
                                                         N->eps, (float2 *)row_stats);
        cudaError_t e2 = cudaGetLastError();
        if (e2 != cudaSuccess) return e2;
        return dcc_with_float(N->tg, [&](auto tg) {
            using TG = DCC_TYPE_OF(tg);
            dim3 grid((unsigned)((N->d + NT - 1) / NT), (unsigned)N->B,
                      (unsigned)((N->T + NORM_ROWS - 1) / NORM_ROWS));
            norm_accum<TX, TG><<<grid, NT, 0, st>>>((const TX *)N->x, (const TG *)N->g,
                                                    (const float2 *)row_stats, N->T, N->d, bias, wg,
                                                    bg, flags);
            return cudaGetLastError();
        });
    });
    if (e != cudaSuccess) return e;
    norm_square<<<(unsigned)N->B, NT, 0, st>>>(wg, bg, N->d, bias, s2, n2);
    return cudaGetLastError();
}

extern "C" cudaError_t dcc_norm_clipped_sum(const dcc_norm *N, const float *per_sample,
                                            const float *cs, float *w, float *bias,
                                            cudaStream_t st) {
    const float *wg = per_sample, *bg = per_sample + (int64_t)N->B * N->d;
    norm_clipped<<<(unsigned)((N->d + NT - 1) / NT), NT, 0, st>>>(wg, bg, N->B, N->d, cs, w, bias);
    return cudaGetLastError();
}
