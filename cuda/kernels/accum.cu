/* Gradient accumulation on the device: a logical step's micro-batches add
 * their clipped sums into accumulators the daemon holds (dcc_out.acc), and
 * its commit folds them into its own sums before the noise (clip.cu's
 * dcc_finalize), so that a logical batch is noised once, as one step.
 * Both passes run over the staged f32 sums of every output, one block row
 * per output, but those of kept layers without staging (dcc_out.unstaged),
 * whose sums go to their accumulators themselves (sgrad.cu).
 * Plain f32 adds: each micro-batch's sum is rounded once into the
 * accumulator, as the trainer's own .grad accumulation would round it. */
#include "dcc.h"
#include "dcc_util.cuh"

namespace {

constexpr int ACC_NT = 256;

/* acc = staging (first micro-batch) or acc += staging, per output. */
__global__ void acc_store_kernel(const dcc_out *__restrict__ outs,
                                 const float *__restrict__ staging, int add) {
    const dcc_out o = outs[blockIdx.y];
    if (!o.acc || o.unstaged) return; /* the kept sum's own (sgrad.cu) */
    const float *v = staging + o.off;
    for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < o.n;
         i += (uint64_t)gridDim.x * blockDim.x)
        o.acc[i] = add ? __fadd_rn(o.acc[i], v[i]) : v[i];
}

/* staging += acc, per output (the commit, before its noise). */
__global__ void acc_fold_kernel(const dcc_out *__restrict__ outs, float *__restrict__ staging) {
    const dcc_out o = outs[blockIdx.y];
    if (!o.acc || o.unstaged) return;
    float *v = staging + o.off;
    for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < o.n;
         i += (uint64_t)gridDim.x * blockDim.x)
        v[i] = __fadd_rn(v[i], o.acc[i]);
}

dim3 acc_grid(uint64_t max_n, int n_out) {
    uint64_t b = (max_n + ACC_NT - 1) / ACC_NT;
    if (b < 1) b = 1;
    if (b > 4096) b = 4096;
    return dim3((unsigned)b, (unsigned)n_out);
}

} // namespace

extern "C" cudaError_t dcc_acc_store(const dcc_out *outs, int n_out, uint64_t max_n,
                                     const float *staging, int add, cudaStream_t st) {
    if (n_out <= 0) return cudaSuccess;
    if (n_out > 65535) return cudaErrorInvalidValue;
    acc_store_kernel<<<acc_grid(max_n, n_out), ACC_NT, 0, st>>>(outs, staging, add);
    return cudaGetLastError();
}

extern "C" cudaError_t dcc_acc_fold(const dcc_out *outs, int n_out, uint64_t max_n, float *staging,
                                    cudaStream_t st) {
    if (n_out <= 0) return cudaSuccess;
    if (n_out > 65535) return cudaErrorInvalidValue;
    acc_fold_kernel<<<acc_grid(max_n, n_out), ACC_NT, 0, st>>>(outs, staging);
    return cudaGetLastError();
}
