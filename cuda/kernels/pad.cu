/* Padded copies of 16-bit LINEAR layers whose widths are not multiples of 8.
 *
 * The fast kernels (wgmma over TMA, 16-byte cp.async, cuBLAS's tensor-core
 * GEMMs) need rows that start on 16 bytes. A vocabulary of 50257 (GPT-2's
 * lm_head) makes every row of the output gradient start anywhere, and the
 * layer falls to element loads: on the H100 its per-sample norms took 9 ms
 * of a 22 ms step. A copy of a few samples at a time into rows padded with
 * zeros to a multiple of 8 costs one pass over the data, and the padding
 * changes nothing: a zero column of g (or a) adds a zero row (column) to
 * every per-sample gradient and to the clipped sum, which the clipped sum's
 * GEMM does not even compute (its leading dimension is the padded width,
 * its extent the real one). */
#include <cuda_runtime.h>

#include "dcc.h"

namespace {

constexpr int PAD_THREADS = 256;

/* dst[r][c] = c < w ? src[r][c] : 0, 16-bit elements, dst rows w8 wide. */
__global__ void pad_rows_kernel(const unsigned short *__restrict__ src, int64_t rows, int w, int w8,
                                unsigned short *__restrict__ dst) {
    int64_t n = rows * (int64_t)w8;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        int64_t r = i / w8;
        int c = (int)(i - r * w8);
        dst[i] = c < w ? src[r * w + c] : (unsigned short)0;
    }
}

inline int round8(int x) { return (x + 7) & ~7; }

} // namespace

extern "C" bool dcc_pad_wanted(const dcc_linear *L) {
    if (L->ta != L->tg || (L->ta != DC_BF16 && L->ta != DC_F16)) return false;
    if (L->d % 8 == 0 && L->p % 8 == 0) return false;
    /* a small layer's element loads cost less than a copy's launch */
    return (int64_t)L->B * L->T * ((int64_t)L->d + L->p) >= ((int64_t)1 << 20);
}

extern "C" size_t dcc_pad_sample_bytes(const dcc_linear *L) {
    size_t row = (L->d % 8 ? (size_t)round8(L->d) : 0) + (size_t)round8(L->p);
    return (size_t)L->T * row * 2 + 512; /* two regions, each aligned */
}

extern "C" int dcc_pad_samples(const dcc_linear *L, size_t cap) {
    size_t one = dcc_pad_sample_bytes(L);
    size_t n = cap / one;
    if (n < 1) n = 1;
    return n < (size_t)L->B ? (int)n : L->B;
}

extern "C" cudaError_t dcc_pad_chunk(const dcc_linear *L, int b0, int n, void *ws, dcc_linear *out,
                                     cudaStream_t st) {
    const int d8 = L->d % 8 ? round8(L->d) : L->d, p8 = round8(L->p);
    const int64_t rows = (int64_t)n * L->T;
    char *base = (char *)(((uintptr_t)ws + 255) & ~(uintptr_t)255);
    unsigned short *gp = (unsigned short *)base;
    char *after = (char *)(gp + rows * p8);
    unsigned short *ap = (unsigned short *)(((uintptr_t)after + 255) & ~(uintptr_t)255);
    const int blocks = (int)((rows * p8 + PAD_THREADS - 1) / PAD_THREADS < 4096
                                 ? (rows * p8 + PAD_THREADS - 1) / PAD_THREADS
                                 : 4096);
    *out = *L;
    out->B = n;
    out->p = p8;
    out->g = gp;
    out->a = (const char *)L->a + (size_t)b0 * L->T * L->d * 2;
    pad_rows_kernel<<<blocks, PAD_THREADS, 0, st>>>(
        (const unsigned short *)L->g + (size_t)b0 * L->T * L->p, rows, L->p, p8, gp);
    if (d8 != L->d) {
        out->d = d8;
        out->a = ap;
        pad_rows_kernel<<<blocks, PAD_THREADS, 0, st>>>(
            (const unsigned short *)L->a + (size_t)b0 * L->T * L->d, rows, L->d, d8, ap);
    }
    return cudaGetLastError();
}
